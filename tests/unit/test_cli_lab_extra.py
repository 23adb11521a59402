"""The tools' commands without the tools: ``kvproxy sim-engine | workload | lab | demo``
(and ``python -m kvproxy.workload``) say in one line which extra to install and exit
non-zero when kvlab or a module of the ``lab`` extra is missing; the proxy's commands
do not need it.

A missing package is simulated in a fresh interpreter by ``sys.modules[name] = None``
(Python then raises ModuleNotFoundError for it, as for a package that is not there)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvproxy import cli

REPO = Path(__file__).resolve().parents[2]
LINE = "the tools need the lab extra: pip install 'kvproxy[lab]'"


def _without(module: str, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where ``module`` cannot be imported."""
    prelude = f"import sys\nsys.modules[{module!r}] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["sim-engine", "--port", "1", "--max-total-tokens", "1000"],
        ["workload", "--base-url", "http://127.0.0.1:9"],
        ["lab", "--workload", "swe", "--engines", "1", "--policy", "off"],
        ["demo", "--quick"],
        ["demo", "--help"],
    ],
)
def test_a_tool_without_kvlab_names_the_extra_in_one_line(argv: list[str]) -> None:
    out = _without("kvlab", f"from kvproxy.cli import main\nsys.exit(main({argv!r}))")
    assert out.returncode != 0
    assert out.stdout == ""
    assert out.stderr == f"kvproxy {argv[0]}: 'kvlab' is not installed; {LINE}\n"


def test_python_dash_m_kvproxy_workload_without_kvlab_names_the_extra() -> None:
    code = "import runpy\nrunpy.run_module('kvproxy.workload', run_name='__main__')"
    out = _without("kvlab", code)
    assert out.returncode != 0
    assert out.stderr == f"kvproxy workload: 'kvlab' is not installed; {LINE}\n"


def test_the_proxy_commands_do_not_need_kvlab() -> None:
    code = (
        "from kvproxy.cli import main\n"
        "try:\n"
        "    main(['serve', '--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "main(['--help'])\n"
    )
    out = _without("kvlab", code)
    assert out.returncode == 0, out.stderr
    assert "--router-url" in out.stdout and "sim-engine" in out.stdout


def test_a_missing_module_of_the_extra_while_a_tool_runs_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvlab.lab.cli

    def run(args: object) -> int:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib.pyplot")

    monkeypatch.setattr(kvlab.lab.cli, "run", run)
    with pytest.raises(SystemExit) as info:
        cli.main(["lab", "--policy", "off"])
    assert info.value.code == f"kvproxy lab: 'matplotlib' is not installed; {LINE}"


def test_any_other_missing_module_is_raised_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvlab.lab.cli

    def run(args: object) -> int:
        raise ModuleNotFoundError("No module named 'numpy'", name="numpy")

    monkeypatch.setattr(kvlab.lab.cli, "run", run)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["lab", "--policy", "off"])


@pytest.mark.parametrize(
    ("name", "missing"),
    [
        ("kvlab", "kvlab"),
        ("kvlab.sim.cli", "kvlab"),
        ("matplotlib.pyplot", "matplotlib"),
        ("smg", "smg"),
        ("numpy", None),
        (None, None),
    ],
)
def test_which_missing_modules_belong_to_the_lab_extra(
    name: str | None, missing: str | None
) -> None:
    exc = ModuleNotFoundError(f"No module named {name!r}", name=name)
    assert cli.lab_module_missing(exc) == missing
