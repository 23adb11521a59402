"""The command line's first-hour behaviour: --version, --help, and errors naming the fix."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvproxy import __version__
from kvproxy.cli import SUBCOMMANDS, main
from kvproxy.fleet.registry import reachability_message
from kvproxy.serve import bind_error


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvproxy {__version__}"


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_command_help_has_an_example(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    example = out.split("example:\n", 1)[1].strip()
    assert example.startswith(f"kvproxy {command} ")


def test_top_level_help_lists_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "--version" in out
    assert "kvproxy doctor --router-url" in out


@pytest.mark.parametrize(
    ("command", "needles"),
    [
        (
            "serve",
            ["(server.port; default 8100)", "default http://127.0.0.1:30000", "(default 0.9)"],
        ),
        ("sim-engine", ["(default: 127.0.0.1)", "repeats gauges per tp_rank (default: 1)"]),
        ("doctor", ["(default: 5.0)", "(default: off)"]),
    ],
)
def test_help_shows_defaults(
    command: str, needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for needle in needles:
        assert needle in out, needle


def test_a_flag_error_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--agentic-program-admission", "--agentic-admission-max-wait-s", "-1"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "kvproxy: invalid configuration: --agentic-admission-max-wait-s: must be >= 0 "
        "(got -1.0) (sets admission.max_wait_s)"
    )


def test_a_busy_port_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = tmp_path / "k.yaml"
        # A router that is not there: the start-up warning is expected, no traceback.
        cfg.write_text("router:\n  url: http://127.0.0.1:9\n  connect_timeout_s: 0.5\n")
        proc = subprocess.run(
            [sys.executable, "-m", "kvproxy", "serve", "--config", str(cfg), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kvproxy: ")]
    assert errors == [
        f"kvproxy: port {port} on 127.0.0.1 is already in use: stop what listens there, "
        "or pass another --port (server.port)"
    ]
    assert "Traceback" not in proc.stderr
    assert "listening on" not in proc.stderr  # the start-up line comes only once bound


@pytest.mark.parametrize(
    ("code", "needle"),
    [
        (errno.EADDRINUSE, "port 80 on h is already in use"),
        (errno.EACCES, "no permission to listen on port 80: use a port >= 1024 (--port)"),
        (errno.EADDRNOTAVAIL, "cannot listen on h: not an address of this host (--host"),
        (errno.ENOENT, "cannot listen on h:80: "),
    ],
)
def test_bind_error_messages(code: int, needle: str) -> None:
    assert needle in bind_error("h", 80, OSError(code, "x"))


@pytest.mark.parametrize(
    ("previous", "reachable", "expected"),
    [
        (None, False, "router http://r:1 is not reachable (E): requests get 502"),
        (True, False, "router http://r:1 is not reachable (E)"),
        (False, False, None),  # still down: said once already
        (False, True, "router http://r:1 is reachable now"),
        (None, True, None),  # reachable at start: nothing to say
        (True, True, None),
    ],
)
def test_reachability_messages(
    previous: bool | None, reachable: bool, expected: str | None
) -> None:
    message = reachability_message("http://r:1", previous, reachable, "E")
    if expected is None:
        assert message is None
    else:
        assert message is not None and message.startswith(expected)
