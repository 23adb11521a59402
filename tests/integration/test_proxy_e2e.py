"""The proxy core through the real router (smg) and simulated engines."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvlab import stack
from kvproxy.config import RouterConfig
from kvproxy.fleet.discovery import RouterFlavor
from kvproxy.fleet.registry import Fleet
from kvproxy.keys import ADMISSION, CONFIG, FLEET, SESSIONS, SHUTDOWN
from kvproxy.proxy.pipeline import PARTS_MIN_BYTES
from kvproxy.sessions import lifecycle as lc
from tests.helpers import new_marker

from .conftest import MakeProxy, recorded, set_faults, sim_state, wait_until

pytestmark = pytest.mark.usefixtures("router")


async def test_request_bodies_reach_the_engine_byte_identical_with_features_off(
    make_proxy: MakeProxy,
    router: stack.ManagedProcess,
    http: aiohttp.ClientSession,
    engine_urls: list[str],
) -> None:
    proxy = await make_proxy()
    for path, make_body in (
        (
            "/generate",
            lambda m: {"text": f"hello {m}", "rid": m, "sampling_params": {"max_new_tokens": 3}},
        ),
        (
            "/v1/completions",
            lambda m: {
                "model": "kvproxy/sim-model",
                "prompt": f"p {m}",
                "rid": m,
                "max_tokens": 3,
                "my_extension": {"k": [1, 2]},
            },
        ),
    ):
        seen: list[str] = []
        for base in (router.url, proxy.url):
            marker = new_marker()
            raw = orjson.dumps(make_body(marker))
            async with http.post(
                base + path, data=raw, headers={"Content-Type": "application/json"}
            ) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            got = [r for r in await recorded(http, engine_urls, path=path) if marker in r["body"]]
            assert len(got) == 1
            seen.append(got[0]["body"].replace(marker, "<m>"))
        direct, through_proxy = seen
        # What the engine receives is exactly what it receives without kvproxy.
        assert through_proxy == direct


async def test_non_json_bodies_are_forwarded_and_answered_by_the_router(
    make_proxy: MakeProxy, router: stack.ManagedProcess, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True}, admission={"enabled": True})
    answers = []
    for base in (router.url, proxy.url):
        async with http.post(
            base + "/generate", data=b"[1, 2", headers={"Content-Type": "application/json"}
        ) as resp:
            answers.append((resp.status, await resp.read()))
    assert answers[0] == answers[1]
    assert answers[0][0] >= 400


async def test_a_token_array_that_is_not_json_is_refused_as_without_kvproxy(
    make_proxy: MakeProxy, router: stack.ManagedProcess, http: aiohttp.ClientSession
) -> None:
    """The lifecycle alone does not look inside ``input_ids`` (it only locates the
    array): a body whose array is not JSON is tagged and forwarded, and the router
    refuses it as it refuses the client's own bytes; nothing stays in flight."""
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    raw = b'{"input_ids":[abc,' + b",".join([b"7"] * 300) + b'],"max_new_tokens":2}'
    statuses = []
    for base in (router.url, proxy.url):
        async with http.post(
            base + "/generate",
            data=raw,
            headers={"Content-Type": "application/json", "X-Session-ID": "bad-ids"},
        ) as resp:
            await resp.read()
            statuses.append(resp.status)
    assert statuses[0] >= 400 and statuses[1] == statuses[0]
    sessions = proxy.app[SESSIONS]
    assert sessions.state("bad-ids") == "open"  # tracked, as any request of a session
    stats = sessions.stats()
    assert stats[lc.INJECTED] == 1.0 and stats[lc.FORWARDED_REQUESTS] == 0.0


async def test_streaming_chunks_arrive_incrementally(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy()
    body = {
        "input_ids": list(range(20)),
        "sampling_params": {"max_new_tokens": 200},
        "stream": True,
    }
    arrivals: list[float] = []
    events = 0
    async with http.post(proxy.url + "/generate", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        buf = b""
        async for chunk in resp.content.iter_any():
            arrivals.append(time.monotonic())
            buf += chunk
        events = buf.count(b"data: ")
    assert buf.endswith(b"data: [DONE]\n\n")
    assert events == 201  # 200 cumulative chunks + [DONE]
    # Relayed as produced, not buffered until the end: many separate reads spread in time
    # (200 decode steps take about 0.12 s of wall time at the engines' time scale).
    assert len(arrivals) >= 20
    assert arrivals[-1] - arrivals[0] > 0.05


async def test_client_disconnect_aborts_the_upstream_request(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy()
    rid = new_marker()
    body = {
        "input_ids": list(range(30)),
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000},
    }

    async def running_anywhere() -> bool:
        for url in engine_urls:
            state = await sim_state(http, url)
            if any(
                rid in r.get("running", []) or rid in r.get("queued", []) for r in state["ranks"]
            ):
                return True
        return False

    resp = await http.post(proxy.url + "/generate", json=body)
    assert resp.status == 200
    first = await resp.content.readany()
    assert first.startswith(b"data: ")
    assert await running_anywhere()
    resp.close()  # the client goes away mid-stream

    async def gone() -> bool:
        return not await running_anywhere()

    # 2000 tokens would take many seconds; the request must be gone long before.
    await wait_until(gone, timeout_s=5, what="the engine to drop the aborted request")


async def test_router_unreachable_is_502_json(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(
        router={"url": f"http://127.0.0.1:{stack.free_port()}", "connect_timeout_s": 1}
    )
    async with http.post(proxy.url + "/generate", json={"text": "x"}) as resp:
        assert resp.status == 502
        doc = await resp.json()
    assert doc["error"]["type"] == "router_unreachable"
    assert "cannot reach the router" in doc["error"]["message"]


async def test_router_timeout_is_504_json(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(router={"request_timeout_s": 0.5})
    await set_faults(http, engine_urls, latency_s=3.0)
    started = time.monotonic()
    async with http.post(
        proxy.url + "/generate", json={"text": "slow", "sampling_params": {"max_new_tokens": 2}}
    ) as resp:
        assert resp.status == 504
        doc = await resp.json()
    assert doc["error"]["type"] == "router_timeout"
    # Before the engine's own answer (3 s): the 0.5 s bound cut it, whatever the host's pace.
    assert time.monotonic() - started < 3.0


async def test_body_over_the_limit_is_413_json(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(server={"max_body_bytes": 2048})
    big = orjson.dumps({"input_ids": list(range(2000))})
    for path in ("/generate", "/v1/embeddings"):
        async with http.post(
            proxy.url + path, data=big, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["type"] == "body_too_large"


async def test_every_response_is_counted_once_refusals_included(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    # Counted by the path after /sessions/{id}; a request refused before that prefix
    # is read is counted by the path as received (label "other").
    proxy = await make_proxy(session_lifecycle={"enabled": True}, server={"max_body_bytes": 2048})
    sid = new_marker()
    ok = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    async with http.post(f"{proxy.url}/sessions/{sid}/generate", json=ok) as resp:
        assert resp.status == 200
        await resp.read()
    big = orjson.dumps({"input_ids": list(range(2000))})
    async with http.post(
        proxy.url + "/generate", data=big, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 413
    async with http.post(proxy.url + "/sessions/%zz/generate", json=ok) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "invalid_session_id"
    async with http.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    assert 'kvproxy_requests_total{path="/generate",status="200"} 1.0' in text
    assert 'kvproxy_requests_total{path="/generate",status="413"} 1.0' in text
    assert 'kvproxy_requests_total{path="other",status="400"} 1.0' in text
    # The operator's close route answers its refusals too (not counted: not proxied).
    async with http.post(proxy.url + "/kvproxy/sessions/bad%20id/close") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "invalid_session_id"


async def test_data_plane_paths_pass_through_with_query_strings(
    make_proxy: MakeProxy, router: stack.ManagedProcess, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy()
    for path in ("/readiness", "/v1/models", "/v1/models?x=1%202", "/get_model_info"):
        results = []
        for base in (router.url, proxy.url):
            async with http.get(base + path) as resp:
                results.append((resp.status, await resp.read()))
        assert results[0] == results[1], path
    # The router's control plane and unknown paths are not forwarded: kvproxy's 404.
    for method, path in (("GET", "/workers"), ("GET", "/nope?x=1"), ("POST", "/flush_cache")):
        async with http.request(method, proxy.url + path) as resp:
            assert resp.status == 404, path
            assert (await resp.json())["error"]["type"] == "not_found"


async def test_health_stats_and_metrics_endpoints(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(
        session_lifecycle={"enabled": True}, admission={"enabled": True, "poll_interval_s": 0.5}
    )
    async with http.post(
        proxy.url + "/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
        headers={"X-Session-ID": new_marker()},
    ) as resp:
        assert resp.status == 200
        await resp.read()
    async with http.get(proxy.url + "/kvproxy/health") as resp:
        health = await resp.json()
    assert health["status"] == "ok"
    assert health["router_reachable"] is True
    assert health["engines_known"] == 2 and health["engines_healthy"] == 2
    assert set(health["fleet"]["engines"]["healthy"]) == set(engine_urls)
    assert health["features"] == {"session_lifecycle": True, "admission": True}
    async with http.get(proxy.url + "/kvproxy/stats") as resp:
        stats = await resp.json()
    assert stats["agentic_kv/session/lifecycle_enabled"] == 1.0
    assert stats["agentic_kv/admission/admit"] == 1.0
    async with http.get(proxy.url + "/kvproxy/stats?reset=true") as resp:
        assert (await resp.json())["agentic_kv/admission/admit"] == 1.0
    async with http.get(proxy.url + "/kvproxy/stats") as resp:
        assert (await resp.json())["agentic_kv/admission/admit"] == 0.0
    async with http.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    assert 'kvproxy_requests_total{path="/generate",status="200"} 1.0' in text
    assert "kvproxy_added_latency_seconds_bucket" in text
    assert "agentic_kv_admission_admit_total 1.0" in text  # cumulative: not reset
    assert "agentic_kv_session_lifecycle_enabled" in text
    async with http.get(proxy.url + "/kvproxy/dashboard") as resp:
        assert resp.status == 200 and "kvproxy" in await resp.text()


async def test_discovery_reads_the_real_router(
    router: stack.ManagedProcess, engine_urls: list[str]
) -> None:
    async with aiohttp.ClientSession() as session:
        fleet = Fleet(RouterConfig(url=router.url), session)
        found = await fleet.refresh()
    assert found.flavor is RouterFlavor.SMG
    assert set(found.healthy) == set(engine_urls) and found.unhealthy == ()


LEGACY_WORKERS = {
    "workers": [
        {
            "id": "a",
            "url": "http://127.0.0.1:9@0",
            "metadata": {"dp_size": "2"},
            "is_healthy": True,
        },
        {
            "id": "b",
            "url": "http://127.0.0.1:9@1",
            "metadata": {"dp_size": "2"},
            "is_healthy": True,
        },
        {"id": "c", "url": "http://127.0.0.1:8", "metadata": {}, "is_healthy": False},
    ],
    "total": 3,
}


@pytest.mark.parametrize(
    ("routes", "flavor", "healthy", "unhealthy"),
    [
        (
            {"/workers": LEGACY_WORKERS},
            RouterFlavor.LEGACY_WORKERS,
            ["http://127.0.0.1:9"],
            ["http://127.0.0.1:8"],
        ),
        (
            {"/list_workers": {"urls": ["http://127.0.0.1:7", "http://127.0.0.1:7"]}},
            RouterFlavor.LEGACY_LIST,
            ["http://127.0.0.1:7"],
            [],
        ),
    ],
)
async def test_discovery_of_legacy_routers_and_the_warning(
    routes: dict,
    flavor: RouterFlavor,
    healthy: list[str],
    unhealthy: list[str],
    make_proxy: MakeProxy,
    http: aiohttp.ClientSession,
) -> None:
    legacy = web.Application()
    for path, doc in routes.items():

        async def answer(_request: web.Request, doc: dict = doc) -> web.Response:
            return web.json_response(doc)

        legacy.router.add_get(path, answer)
    server = TestServer(legacy, host="127.0.0.1")
    await server.start_server()
    try:
        proxy = await make_proxy(
            router={"url": str(server.make_url("")).rstrip("/")},
            session_lifecycle={"enabled": True, "check_engines": False},
        )
        found = proxy.app[FLEET].engines
        assert found.flavor is flavor
        assert list(found.healthy) == healthy and list(found.unhealthy) == unhealthy
        async with http.get(proxy.url + "/kvproxy/health") as resp:
            warnings = (await resp.json())["warnings"]
        assert any("drops a top-level session_id" in w for w in warnings)
    finally:
        await server.close()


async def test_static_engines_override_discovery(
    make_proxy: MakeProxy, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(router={"engines": [engine_urls[0]]})
    assert proxy.app[FLEET].all_engines() == (engine_urls[0],)


async def test_reload_applies_and_an_invalid_file_is_refused(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, tmp_path: Path, router: stack.ManagedProcess
) -> None:
    cfg = tmp_path / "kvproxy.yaml"
    cfg.write_text(f"router:\n  url: {router.url}\n")
    proxy = await make_proxy(source=str(cfg))
    assert not proxy.app[CONFIG].config.admission.enabled

    cfg.write_text(f"router:\n  url: {router.url}\nadmission:\n  enabled: true\n  headroom: 0.5\n")
    async with http.post(proxy.url + "/kvproxy/config/reload") as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert "admission.enabled" in doc["applied"] and "admission.headroom" in doc["applied"]
    assert proxy.app[CONFIG].config.admission.enabled
    async with http.get(proxy.url + "/kvproxy/health") as resp:
        assert (await resp.json())["features"]["admission"] is True

    cfg.write_text(f"router:\n  url: {router.url}\nadmission:\n  enabled: true\n  headroom: 3\n")
    async with http.post(proxy.url + "/kvproxy/config/reload") as resp:
        assert resp.status == 400
        doc = await resp.json()
    assert doc["error"]["type"] == "invalid_config"
    assert "admission.headroom" in doc["error"]["message"]
    assert proxy.app[CONFIG].config.admission.headroom == 0.5  # the running config stays

    cfg.write_text(f"router:\n  url: {router.url}\nserver:\n  port: 1234\n")
    async with http.post(proxy.url + "/kvproxy/config/reload") as resp:
        doc = await resp.json()
    assert doc["restart_required"] == ["server.port"]
    assert not proxy.app[CONFIG].config.admission.enabled

    # Restart-only keys set at start-up keep their running values in the live config.
    running = proxy.app[CONFIG].config.server
    cfg.write_text(
        f"router:\n  url: {router.url}\nserver:\n  gc_threshold: 700\n  malloc_retain_bytes: 0\n"
    )
    async with http.post(proxy.url + "/kvproxy/config/reload") as resp:
        doc = await resp.json()
    assert doc["restart_required"] == ["server.gc_threshold", "server.malloc_retain_bytes"]
    live = proxy.app[CONFIG].config.server
    assert (live.gc_threshold, live.malloc_retain_bytes) == (
        running.gc_threshold,
        running.malloc_retain_bytes,
    )


def test_sighup_reloads_a_running_server(tmp_path: Path, router: stack.ManagedProcess) -> None:
    cfg = tmp_path / "kvproxy.yaml"
    cfg.write_text("admission:\n  enabled: false\n")
    proc = stack.start_kvproxy(config_path=cfg, router_url=router.url, log_dir=tmp_path)
    try:

        def features() -> dict:
            with stack_get(proc.url + "/kvproxy/health") as doc:
                return doc["features"]

        assert features()["admission"] is False
        cfg.write_text("admission:\n  enabled: true\n")
        proc.popen.send_signal(__import__("signal").SIGHUP)
        deadline = time.monotonic() + 10
        while features()["admission"] is not True:
            assert time.monotonic() < deadline, "SIGHUP did not reload"
            time.sleep(0.05)
        cfg.write_text("admission:\n  enabled: true\n  headroom: 9\n")
        proc.popen.send_signal(__import__("signal").SIGHUP)
        deadline = time.monotonic() + 10
        while "reload rejected" not in proc.log_tail():
            assert time.monotonic() < deadline, "invalid reload was not reported"
            time.sleep(0.05)
        assert features()["admission"] is True and proc.alive()
    finally:
        proc.stop()


class stack_get:
    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.url, timeout=5) as resp:
            return orjson.loads(resp.read())

    def __exit__(self, *exc: object) -> None:
        return None


async def test_shutting_down_answers_503(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy()
    proxy.app[SHUTDOWN].started = True
    async with http.post(proxy.url + "/generate", json={"text": "x"}) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["type"] == "shutting_down"


async def test_concurrent_mixed_traffic_all_succeeds(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(
        session_lifecycle={"enabled": True}, admission={"enabled": True, "poll_interval_s": 0.5}
    )

    async def one(i: int) -> int:
        body = {
            "input_ids": list(range(i, i + 40)),
            "sampling_params": {"max_new_tokens": 4},
            "stream": i % 2 == 0,
        }
        async with http.post(
            proxy.url + "/generate", json=body, headers={"X-Session-ID": f"mix-{i % 5}"}
        ) as resp:
            await resp.read()
            return resp.status

    statuses = await asyncio.gather(*(one(i) for i in range(40)))
    assert statuses == [200] * 40
    await wait_until(
        lambda: _true(proxy.app[ADMISSION].stats()["agentic_kv/budget/lease_count"] == 0),
        timeout_s=5,
        what="leases to drain",
    )


async def _true(value: bool) -> bool:
    return value


async def test_an_upstream_stream_that_breaks_is_cut_for_the_client_too(
    make_proxy: MakeProxy,
    http: aiohttp.ClientSession,
    engine_urls: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # smg 1.13 turns a broken engine stream into an error event plus [DONE]; older
    # routers cut the client's stream. Put kvproxy straight in front of an engine to see
    # a cut upstream stream.
    proxy = await make_proxy(router={"url": engine_urls[0]})
    await set_faults(http, engine_urls, drop_stream_after_chunks=2)
    body = {"input_ids": list(range(10)), "stream": True, "sampling_params": {"max_new_tokens": 50}}
    buf = b""
    async with http.post(proxy.url + "/generate", json=body) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in resp.content.iter_any():
                buf += chunk
    # What arrived is what the engine sent before it dropped: no [DONE], no made-up ending.
    assert buf.count(b"data: ") == 2 and b"[DONE]" not in buf
    text = await (await http.get(proxy.url + "/metrics")).text()
    assert 'kvproxy_upstream_errors_total{type="midstream"} 1.0' in text
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def _arrived_at_the_engine(
    url: str, http: aiohttp.ClientSession, engine_urls: list[str], raw: bytes, headers: dict
) -> tuple[dict, dict]:
    """POST ``raw`` to ``url`` + /generate; (the answer, the body the engine recorded with
    the answer's marker). The router re-encodes what it forwards, adding its defaults."""
    marker = orjson.loads(raw)["tag"]
    async with http.post(url + "/generate", data=raw, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        answer = orjson.loads(await resp.read())
    (got,) = [r for r in await recorded(http, engine_urls, path="/generate") if marker in r["body"]]
    return answer, orjson.loads(got["body"])


@pytest.mark.parametrize("ids", [100, 30_000])  # a body sent joined, and one sent in parts
async def test_a_spliced_body_reaches_the_engine_as_the_clients_bytes_with_the_fields_ahead(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str], ids: int
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    marker = new_marker()
    body = {
        "input_ids": [1000 + i % 30_000 for i in range(ids)],
        "sampling_params": {"max_new_tokens": 2},
        "tag": marker,
    }
    raw = orjson.dumps(body)
    headers = {"Content-Type": "application/json", "X-Session-ID": f"s-{marker}"}
    answer, arrived = await _arrived_at_the_engine(proxy.url, http, engine_urls, raw, headers)
    assert answer["meta_info"]["prompt_tokens"] == ids
    # What arrives holds the client's members as sent, and the two fields kvproxy
    # spliced in.
    assert {k: arrived[k] for k in body} == body
    assert arrived["session_id"] == f"s-{marker}"
    assert isinstance(arrived["rid"], str) and len(arrived["rid"]) == 32
    assert (len(raw) >= PARTS_MIN_BYTES) == (ids > 1000)


@pytest.mark.parametrize("ids", [100, 30_000])  # forwarded joined with its head, and apart
async def test_a_body_forwarded_as_received_reaches_the_engine_whole(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str], ids: int
) -> None:
    proxy = await make_proxy()  # both features off: the client's bytes go as they came
    body = {"input_ids": [1000 + i % 30_000 for i in range(ids)], "tag": new_marker()}
    raw = orjson.dumps(body)
    headers = {"Content-Type": "application/json"}
    answer, arrived = await _arrived_at_the_engine(proxy.url, http, engine_urls, raw, headers)
    assert answer["meta_info"]["prompt_tokens"] == ids
    assert {k: arrived[k] for k in body} == body and "session_id" not in arrived
    assert (len(raw) >= PARTS_MIN_BYTES) == (ids > 1000)
