"""The real router (``smg``) in front of two simulated engines, all subprocesses on
127.0.0.1 started by :mod:`kvlab.stack` and stopped by PID."""

from __future__ import annotations

import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvlab import stack

MODEL = "kvproxy/sim-model"


def _have_smg() -> bool:
    cmd = stack.smg_command()
    return Path(cmd[0]).exists() if len(cmd) == 1 else shutil.which("smg") is not None


pytestmark = pytest.mark.skipif(not _have_smg(), reason="smg (the router) is not installed")


def http(method: str, url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    data = orjson.dumps(body) if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Stack:
    def __init__(self, engines: list[stack.ManagedProcess], router: stack.ManagedProcess) -> None:
        self.engines = engines
        self.router = router


@pytest.fixture(scope="module")
def sim_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("stack-logs")
    procs: list[stack.ManagedProcess] = []
    try:
        for _ in range(2):
            procs.append(
                stack.start_sim_engine(
                    max_total_tokens=50_000,
                    mode="session-radix",
                    extra_args=["--time-scale", "0.01", "--model-name", MODEL],
                    log_dir=log_dir,
                )
            )
        router = stack.start_router([p.url for p in procs], log_dir=log_dir)
        procs.append(router)
        yield Stack(procs[:2], router)
    finally:
        for p in reversed(procs):
            p.stop()
        for p in procs:
            assert not p.alive()


def test_router_lists_both_engines_healthy(sim_stack: Stack) -> None:
    status, body = http("GET", f"{sim_stack.router.url}/workers")
    assert status == 200
    workers = orjson.loads(body)["workers"]
    urls = {w["url"]: w for w in workers}
    for e in sim_stack.engines:
        assert urls[e.url]["is_healthy"] is True
        assert urls[e.url]["model_id"] == MODEL
    status, body = http("GET", f"{sim_stack.router.url}/readiness")
    assert status == 200


def test_generate_through_router_non_streaming_and_streaming(sim_stack: Stack) -> None:
    url = f"{sim_stack.router.url}/generate"
    status, body = http(
        "POST",
        url,
        {"text": "hello router", "rid": "via-router-1", "sampling_params": {"max_new_tokens": 4}},
    )
    assert status == 200, body
    out = orjson.loads(body)
    assert out["meta_info"]["id"] == "via-router-1"
    assert out["meta_info"]["completion_tokens"] == 4 == len(out["output_ids"])
    status, body = http(
        "POST",
        url,
        {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 3}},
    )
    assert status == 200
    assert body.endswith(b"data: [DONE]\n\n")
    events = [e for e in body.split(b"\n\n") if e]
    final = orjson.loads(events[-2][len(b"data: ") :])
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_chat_through_router(sim_stack: Stack) -> None:
    url = f"{sim_stack.router.url}/v1/chat/completions"
    msg = [{"role": "user", "content": "hi"}]
    status, body = http(
        "POST", url, {"model": MODEL, "messages": msg, "max_tokens": 3, "rid": "chat-via-router"}
    )
    assert status == 200, body
    out = orjson.loads(body)
    assert out["id"] == "chat-via-router"
    assert out["usage"]["completion_tokens"] == 3
    assert "cached_tokens" in out["usage"]["prompt_tokens_details"]
    status, body = http(
        "POST", url, {"model": MODEL, "messages": msg, "max_tokens": 3, "stream": True}
    )
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    # smg >= 1.13 only routes chat for a model a worker serves.
    status, _ = http("POST", url, {"model": "not-served", "messages": msg, "max_tokens": 3})
    assert status == 404


def test_router_spreads_requests_and_forwards_session_id(sim_stack: Stack) -> None:
    for i in range(6):
        status, _ = http(
            "POST",
            f"{sim_stack.router.url}/generate",
            {
                "input_ids": [5, 6, i],
                "session_id": f"traj-{i}",
                "sampling_params": {"max_new_tokens": 1},
            },
        )
        assert status == 200
    opened: set[str] = set()
    for e in sim_stack.engines:
        status, body = http("GET", f"{e.url}/sim/state")
        rank = orjson.loads(body)["ranks"][0]
        assert rank["stats"]["num_requests_total"] > 0  # round robin reached both
        opened.update(rank["sessions"]["radix_open"])
    assert {f"traj-{i}" for i in range(6)} <= opened  # top-level session_id survived smg


def test_start_failure_reports_log_tail(tmp_path: Path) -> None:
    with pytest.raises(stack.StackError, match="exited with code 2") as exc:
        stack.start_sim_engine(
            max_total_tokens=1000, mode="no-such-mode", log_dir=tmp_path, ready_timeout_s=20
        )
    assert "invalid choice" in str(exc.value)


def test_managed_process_stop_is_idempotent(tmp_path: Path) -> None:
    import subprocess

    popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc = stack.ManagedProcess("sleeper", popen, "http://127.0.0.1:1", tmp_path / "x.log")
    with proc:
        assert proc.alive()
    # Ended by the SIGTERM, not by the SIGKILL that follows the 10 s grace.
    assert not proc.alive() and popen.returncode == -signal.SIGTERM
    proc.stop()
    assert stack.free_port() > 0


def _stdout(proc: stack.ManagedProcess) -> str:
    assert proc.popen.stdout is not None
    return str(proc.popen.stdout.read())


def test_stop_all_overlaps_the_shutdowns(tmp_path: Path) -> None:
    import subprocess

    # Each takes 2 s to exit after SIGTERM and says when it got it and when it left
    # (CLOCK_MONOTONIC, one clock for every process of the host).
    slow_exit = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    print('term', time.monotonic(), flush=True)\n"
        "    time.sleep(2)\n"
        "    print('exit', time.monotonic(), flush=True)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    procs = []
    for i in range(2):
        popen = subprocess.Popen(
            [sys.executable, "-c", slow_exit], stdout=subprocess.PIPE, text=True
        )
        assert popen.stdout is not None and popen.stdout.readline() == "ready\n"
        procs.append(
            stack.ManagedProcess(f"slow-{i}", popen, "http://127.0.0.1:1", tmp_path / "x.log")
        )
    stack.stop_all(procs)
    assert not any(p.alive() for p in procs)
    # Overlapped: every process got its SIGTERM before the first one finished exiting.
    said = [dict(ln.split() for ln in _stdout(p).splitlines()) for p in procs]
    assert max(float(s["term"]) for s in said) < min(float(s["exit"]) for s in said)
    stack.stop_all(procs)  # idempotent
    for p in procs:
        assert p.popen.stdout is not None
        p.popen.stdout.close()
