"""The proxy benchmark's nginx upstream (scripts/benchproxy/targets.py,
``--upstream-server nginx``) through a real ``nginx``: it answers what the Python
upstream answers, byte for byte, to POSTed bodies on one keep-alive connection, and
stops by PID."""

from __future__ import annotations

import http.client
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def bp() -> Iterator[tuple[ModuleType, ModuleType]]:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from benchproxy import common, targets

        yield common, targets
    finally:
        sys.path.remove(str(SCRIPTS))


def test_nginx_answers_as_the_python_upstream(
    bp: tuple[ModuleType, ModuleType], tmp_path: Path
) -> None:
    common, targets = bp
    proc = targets.start_nginx_upstream(tmp_path)
    try:
        host, port = proc.url.removeprefix("http://").split(":")
        replies = targets.upstream_replies(proc.url)
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        body = common.make_body(4096)
        seen = []
        for method, path, key in (
            ("POST", "/generate", "generate"),
            ("POST", "/generate", "generate"),  # the same connection, kept alive
            ("POST", "/v1/chat/completions", "openai"),
            ("GET", "/metrics", "metrics"),
            ("GET", "/workers", "workers"),
            ("GET", "/server_info", "server_info"),
        ):
            headers = {"Content-Type": "application/json", "X-Session-ID": "s-1"}
            conn.request(method, path, body=body if method == "POST" else None, headers=headers)
            resp = conn.getresponse()
            assert (path, resp.status, resp.read()) == (path, 200, replies[key])
            seen.append(resp.getheader("Connection"))
        conn.close()
        assert seen == ["keep-alive"] * len(seen)
        assert b'"url":"' + proc.url.encode() + b'"' in replies["workers"]
    finally:
        proc.stop()
    assert proc.popen.returncode is not None
    assert targets.child_pids(proc.pid) == []
