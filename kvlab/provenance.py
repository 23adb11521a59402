"""Provenance of a measurement: the commit of the checkout it ran from."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_revision() -> str | None:
    """The checkout's commit ("+dirty" when tracked files differ), for provenance; None
    outside a git checkout. The one provenance helper of the demo and the benchmarks."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")
