#!/usr/bin/env python3
"""The dependency audit CI runs: pip-audit over what the checkout's .venv has installed.

    python3 scripts/audit_deps.py [--python .venv/bin/python] [--pip-audit PATH]

- pip-audit is found at ``--pip-audit`` (default: ``$AUDIT_VENV/bin/pip-audit``,
  ``AUDIT_VENV`` defaulting to ``.audit-venv``), or installed there in a virtualenv of
  its own (never into the tested environment).
- The installed distributions (``pip freeze``, kvproxy itself excluded) are audited
  against the OSV and PyPI vulnerability services (``KVPROXY_AUDIT_SERVICE``, default
  ``osv``), each pinned version as it is.
- A known vulnerability fails (exit 1), naming the package, the version, the advisory
  and the fixed versions. ``KVPROXY_AUDIT_IGNORE`` (space separated advisory ids) lists
  the ones a maintainer has judged (say why in the commit that adds one).
- A service that cannot be reached (an offline machine: no answer, or every package
  skipped) is said in one line and does not fail (exit 0): the audit could not run,
  nothing was found.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_TIMEOUT_S = 300


@dataclass(frozen=True)
class Verdict:
    exit_code: int
    lines: tuple[str, ...]


def judge(report: Mapping[str, Any] | None, error: str = "") -> Verdict:
    """The audit's outcome from pip-audit's JSON report (None: it gave none)."""
    if report is None:
        why = error.strip().splitlines()[-1][:200] if error.strip() else "no report"
        return Verdict(
            0, (f"dependency audit: not run, vulnerability service unreachable ({why})",)
        )
    deps = report.get("dependencies", [])
    audited = [d for d in deps if "skip_reason" not in d]
    found = [(d, v) for d in audited for v in d.get("vulns", [])]
    if found:
        lines = [f"dependency audit: {len(found)} known vulnerabilit(ies):"]
        for dep, vuln in found:
            fixed = ", ".join(vuln.get("fix_versions", [])) or "no fixed version"
            lines.append(f"  {dep['name']} {dep['version']}: {vuln.get('id')} (fixed in {fixed})")
        return Verdict(1, tuple(lines))
    if deps and not audited:
        return Verdict(
            0,
            (
                f"dependency audit: not run, vulnerability service unreachable "
                f"(none of {len(deps)} packages could be looked up)",
            ),
        )
    return Verdict(0, (f"dependency audit: {len(audited)} packages, no known vulnerabilities",))


def _pip_audit(path: str | None) -> Path | None:
    if path:
        return Path(path)
    venv = Path(os.environ.get("AUDIT_VENV", REPO / ".audit-venv"))
    exe = venv / "bin" / "pip-audit"
    if exe.exists():
        return exe
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=_TIMEOUT_S)
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "pip-audit"],
            check=True,
            timeout=_TIMEOUT_S,
            capture_output=True,
        )
    except (subprocess.SubprocessError, OSError):
        return None
    return exe if exe.exists() else None


def _frozen(python: str) -> str:
    out = subprocess.run(
        [python, "-m", "pip", "freeze", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    ).stdout
    return "".join(
        line + "\n"
        for line in out.splitlines()
        if "==" in line and not line.lower().startswith("kvproxy==")
    )


def audit(python: str, pip_audit: Path, service: str, ignore: Sequence[str]) -> Verdict:
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(_frozen(python))
        report = Path(tmp) / "report.json"
        cmd = [
            str(pip_audit),
            "--requirement",
            str(requirements),
            "--no-deps",
            "--disable-pip",
            "--vulnerability-service",
            service,
            "--format",
            "json",
            "--output",
            str(report),
            "--progress-spinner",
            "off",
        ]
        for vuln in ignore:
            cmd += ["--ignore-vuln", vuln]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return judge(None, f"no answer in {_TIMEOUT_S} s")
        try:
            doc = json.loads(report.read_text())
        except (OSError, ValueError):
            return judge(None, proc.stderr)
        return judge(doc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"))
    parser.add_argument("--pip-audit", default=None)
    args = parser.parse_args(argv)
    exe = _pip_audit(args.pip_audit)
    if exe is None:
        print("dependency audit: not run, pip-audit could not be installed")
        return 0
    service = os.environ.get("KVPROXY_AUDIT_SERVICE", "osv")
    ignore = os.environ.get("KVPROXY_AUDIT_IGNORE", "").split()
    verdict = audit(args.python, exe, service, ignore)
    print("\n".join(verdict.lines))
    return verdict.exit_code


if __name__ == "__main__":
    sys.exit(main())
