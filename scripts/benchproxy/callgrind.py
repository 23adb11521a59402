"""Instructions of one program run, counted by ``valgrind --tool=callgrind``.

Shared by ``count_request_instructions.py`` (whole requests) and
``count_step_instructions.py`` (the pure steps): both run a program twice at two sizes
and difference the totals.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

_TOTAL = re.compile(rb"^totals:\s+(\d+)", re.MULTILINE)


def count_instructions(argv: Sequence[str], out: Path, label: str) -> int:
    """Instructions of ``argv`` under callgrind (its data file at ``out``; ``label``
    names the run in an error). The hash seed is fixed, so a rerun counts the same."""
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(cmd, env=env, capture_output=True, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
        raise RuntimeError(f"{label} failed ({done.returncode}):\n{tail}")
    found = _TOTAL.search(out.read_bytes())
    if found is None:
        raise RuntimeError(f"{out}: no totals line")
    return int(found.group(1))
