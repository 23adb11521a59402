import subprocess
import sys
from pathlib import Path

import pytest

from kvproxy.cli import build_parser, main
from kvproxy.serve import overrides_from_args


def test_only_the_chosen_command_is_loaded() -> None:
    args = build_parser("serve").parse_args(
        [
            "serve",
            "--config",
            "x.yaml",
            "--agentic-program-admission",
            "--agentic-admission-headroom",
            "0.5",
        ]
    )
    overrides = overrides_from_args(args)
    assert overrides["agentic_program_admission"] is True
    assert overrides["agentic_admission_headroom"] == 0.5
    assert overrides["agentic_session_lifecycle"] is None  # not given: the YAML decides


def test_invalid_config_exits_2_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("admission:\n  enabled: true\n  pressure_threshold: 1.7\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "admission.pressure_threshold: must be in (0, 1]" in capsys.readouterr().err


def test_cli_flag_is_validated_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["serve", "--agentic-program-admission", "--agentic-admission-max-wait-s", "-1"]) == 2
    )
    assert "admission.max_wait_s" in capsys.readouterr().err


def test_python_dash_m_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvproxy", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    for command in ("serve", "sim-engine", "demo"):
        assert command in out.stdout
