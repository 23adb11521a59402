"""The set-up scripts: the two commands, Chromium for the browser tests, packaging."""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENSURE = REPO / "scripts" / "ensure_chromium.sh"
BASH = "/bin/bash"


def _stub(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)
    return path


def _ensure(path_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # PATH holds only the stubs: no real chromium, sudo or apt-get can be found.
    return subprocess.run(
        [BASH, str(ENSURE)],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": str(path_dir), "HOME": str(path_dir), **env},
    )


def test_no_chromium_and_no_root_says_what_to_install_in_one_line(tmp_path: Path) -> None:
    _stub(tmp_path, "id", "echo 1000")
    proc = _ensure(tmp_path)
    assert proc.returncode == 0
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert "sudo apt-get install chromium" in line
    assert "KVPROXY_CHROMIUM" in line


def test_kvproxy_chromium_wins(tmp_path: Path) -> None:
    _stub(tmp_path, "id", "echo 1000")
    proc = _ensure(tmp_path, KVPROXY_CHROMIUM="/opt/my/chrome")
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "/opt/my/chrome", "")


def test_another_chromium_name_on_path_is_found(tmp_path: Path) -> None:
    _stub(tmp_path, "id", "echo 1000")
    browser = _stub(tmp_path, "chromium-browser", "exit 0")
    proc = _ensure(tmp_path)
    assert (proc.returncode, proc.stdout.strip()) == (0, str(browser))


def test_as_root_it_installs_debians_chromium(tmp_path: Path) -> None:
    log = tmp_path / "apt.log"
    _stub(tmp_path, "id", "echo 0")
    # The stub apt-get records its arguments and "installs" chromium into PATH.
    _stub(
        tmp_path,
        "apt-get",
        f'echo "$*" >> {log}\n'
        f'if [ "$1" = install ]; then printf "#!{BASH}\\n" > {tmp_path}/chromium; '
        f"/bin/chmod +x {tmp_path}/chromium; fi",
    )
    proc = _ensure(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "chromium")
    assert log.read_text().splitlines() == [
        "update -q",
        "install -y -q --no-install-recommends chromium",
    ]


def test_a_failing_install_falls_back_to_the_one_line(tmp_path: Path) -> None:
    _stub(tmp_path, "id", "echo 0")
    _stub(tmp_path, "apt-get", "exit 100")
    proc = _ensure(tmp_path)
    assert proc.returncode == 0
    assert proc.stdout == ""
    assert proc.stderr.splitlines()[-1].startswith("no Chromium for the dashboard's browser tests")


def test_ci_runs_the_test_command() -> None:
    lines = [
        ln.strip()
        for ln in (REPO / ".ci" / "run").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert lines[-1] == "exec bash scripts/test.sh"
    assert not any("apt-get" in ln for ln in lines)  # the install logic lives in test.sh


def test_the_test_command_installs_chromium_and_checks_the_wheel() -> None:
    text = (REPO / "scripts" / "test.sh").read_text()
    assert "bash scripts/ensure_chromium.sh" in text
    assert "bash scripts/check_wheel.sh" in text
    assert "pip install --quiet -c constraints.txt -e '.[test]'" in text
    assert "scripts/audit_deps.py" in text  # the dependency audit runs in CI


def test_the_constraints_pin_the_dependency_floors_or_above() -> None:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = tuple(int(p) for p in version.split(".")[:3])
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    for dep in meta["project"]["dependencies"]:
        name, _, floor = dep.split(";")[0].partition(">=")
        assert name.lower() in pins, name
        assert pins[name.lower()] >= tuple(int(p) for p in floor.split(".")), dep
    assert pins["aiohttp"] >= (3, 14, 3) and pins["orjson"] >= (3, 11, 6)
    for script in ("test.sh", "check_wheel.sh", "ensure_chromium.sh", "demo.sh"):
        assert os.access(REPO / "scripts" / script, os.X_OK), script


# The page whose first code block is the two set-up commands (README.md once it shows them).
FIRST_SCREENS = ["README.md", "docs/quickstart.md"]


@pytest.mark.parametrize("page", FIRST_SCREENS)
def test_the_first_screen_shows_exactly_the_two_setup_commands(page: str) -> None:
    text = (REPO / page).read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [ln.split("#", 1)[0].strip() for ln in block.splitlines() if ln.strip()]
    assert commands == ["scripts/demo.sh", "scripts/test.sh"]
    # ... and the test command is the one CI runs.
    ci = (REPO / ".ci" / "run").read_text()
    assert f"exec bash {commands[1]}" in ci


def test_licence_is_an_spdx_string_with_a_setuptools_that_reads_it() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    requires = meta["build-system"]["requires"]
    assert "setuptools>=77" in requires  # the first setuptools with PEP 639 licence strings
    assert not any(c.startswith("License ::") for c in meta["project"].get("classifiers", []))
    assert meta["tool"]["setuptools"]["package-data"]["kvproxy.admin"] == ["static/*"]


@pytest.mark.parametrize(
    "name", ["dashboard.html", "dashboard.js", "dashboard.css", "sign-in.html"]
)
def test_static_files_are_in_the_package_tree(name: str) -> None:
    assert (REPO / "kvproxy" / "admin" / "static" / name).is_file()
