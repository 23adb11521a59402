"""The dependency audit's verdict (scripts/audit_deps.py): a known vulnerability fails
CI, an unreachable vulnerability service is said in one line and does not."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "audit_deps.py"


@pytest.fixture(scope="module")
def audit_deps() -> ModuleType:
    spec = importlib.util.spec_from_file_location("audit_deps", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["audit_deps"] = module
    spec.loader.exec_module(module)
    return module


VULNERABLE = {
    "dependencies": [
        {"name": "aiohttp", "version": "3.10.0", "vulns": [
            {"id": "PYSEC-2026-1", "fix_versions": ["3.14.3"], "aliases": ["CVE-2026-69244"]},
        ]},
        {"name": "orjson", "version": "3.11.6", "vulns": []},
        {"name": "local-pkg", "version": "1.0", "skip_reason": "not on PyPI"},
    ],
    "fixes": [],
}  # fmt: skip


def test_a_known_vulnerability_fails(audit_deps: ModuleType) -> None:
    verdict = audit_deps.judge(VULNERABLE)
    assert verdict.exit_code == 1
    assert "aiohttp 3.10.0: PYSEC-2026-1 (fixed in 3.14.3)" in "\n".join(verdict.lines)


def test_clean_and_unreachable_pass_with_one_line(audit_deps: ModuleType) -> None:
    clean = audit_deps.judge(
        {"dependencies": [{"name": "orjson", "version": "3.13.0", "vulns": []}]}
    )
    assert clean.exit_code == 0 and clean.lines == (
        "dependency audit: 1 packages, no known vulnerabilities",
    )
    skipped = {"dependencies": [{"name": "a", "version": "1", "skip_reason": "x"}] * 3}
    for verdict in (
        audit_deps.judge(skipped),
        audit_deps.judge(None, "Traceback ...\nConnectionError: Failed to resolve 'api.osv.dev'"),
    ):
        assert verdict.exit_code == 0
        (line,) = verdict.lines
        assert line.startswith("dependency audit: not run, vulnerability service unreachable")


def test_the_script_fails_ci_on_what_pip_audit_reports(
    audit_deps: ModuleType, tmp_path: Path
) -> None:
    # A stand-in pip-audit that writes the report above where --output says.
    fake = tmp_path / "pip-audit"
    report = json.dumps(VULNERABLE)
    fake.write_text(
        f"#!{sys.executable}\nimport sys\n"
        "out = sys.argv[sys.argv.index('--output') + 1]\n"
        f"open(out, 'w').write({report!r})\nsys.exit(1)\n"
    )
    fake.chmod(0o755)
    assert audit_deps.main(["--python", sys.executable, "--pip-audit", str(fake)]) == 1
    broken = tmp_path / "broken"
    broken.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('no network')\n")
    broken.chmod(0o755)
    assert audit_deps.main(["--python", sys.executable, "--pip-audit", str(broken)]) == 0
