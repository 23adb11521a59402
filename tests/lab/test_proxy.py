"""The lab's in-process kvproxy: the server's session close (abort, fan-out) and
admission over lab engines, on the virtual clock."""

from __future__ import annotations

import asyncio
from typing import Any

from kvlab.lab.engines import LabEngine
from kvlab.lab.proxy import LabProxy
from kvlab.lab.router import Placement
from kvlab.lab.runner import LabTuning, proxy_config
from kvlab.lab.vloop import run_virtual
from kvlab.sim.presets import scheduler_config

URLS = ("http://127.0.0.1:30001", "http://127.0.0.1:30002")


def _lab(policy: str, **admission: Any) -> tuple[LabProxy, list[LabEngine]]:
    cfg = scheduler_config(
        "qwen3-8b-h100",
        16,
        mode="session-radix",
        eviction_policy="priority",
        enable_priority_scheduling=True,
    )
    engines = [LabEngine(u, cfg) for u in URLS]
    proxy = LabProxy(
        proxy_config(policy, LabTuning(), 16, admission),
        engines,
        Placement("consistent_hashing", URLS),
    )
    return proxy, engines


def _body(rid: int, n_in: int, n_out: int) -> dict[str, Any]:
    return {
        "rid": f"{rid:032x}",
        "input_ids": list(range(1000, 1000 + n_in)),
        "sampling_params": {"max_new_tokens": n_out, "ignore_eos": True},
    }


def _headers(sid: str) -> dict[str, str]:
    return {"X-Session-ID": sid, "X-SMG-Routing-Key": sid}


def test_closing_a_session_aborts_its_request_and_tells_every_engine() -> None:
    async def main() -> dict[str, Any]:
        proxy, engines = _lab("lifecycle")
        async with proxy.running():
            turn = asyncio.create_task(proxy.generate(_headers("s1"), _body(1, 200, 200)))
            await asyncio.sleep(2.0)  # the request is decoding on its engine
            assert not turn.done()
            await proxy.close_session("s1")
            req, wait = await turn
            closed = [e.sched.sessions.radix_closed("s1") for e in engines]
            assert proxy.sessions is not None
            return {
                "finish": req.finish_reason,
                "generated": req.generated,
                "wait": wait,
                "closed": closed,
                "posts": proxy.http.posts,
                "state": proxy.sessions.state("s1"),
                "session_id": req.session_id,
            }

    out = run_virtual(main())
    assert out["finish"]["type"] == "abort"
    assert 0 < out["generated"] < 200
    assert out["wait"] is None  # admission is off
    assert out["closed"] == [True, True]  # both engines hold the close tombstone
    # One /abort_request and one /close_session per engine.
    assert out["posts"] == 2 * len(URLS)
    assert out["state"] == "closed"
    assert out["session_id"] == "s1"  # the lifecycle injected the session id


def test_admission_scrapes_the_engines_and_a_close_ends_residency() -> None:
    async def main() -> dict[str, Any]:
        proxy, engines = _lab("admission", priority_steering=True)
        async with proxy.running():
            assert proxy.admission is not None
            req, wait = await proxy.generate(_headers("s2"), _body(2, 100, 10))
            session = proxy.admission.program.ledger.get("s2")
            await proxy.close_session("s2")
            await asyncio.sleep(1.0)  # a few polls
            return {
                "finish": req.finish_reason,
                "wait": wait,
                "program_active": proxy.admission.program_active,
                "engine": None if session is None else session.engine,
                "served": [e.url for e in engines if e.sched.stats.num_requests_total],
                "owner": proxy.placement.pick(_headers("s2")),
                "priority": req.priority,
                "after_close": proxy.admission.program.ledger.get("s2"),
                "scrapes": [e.scrapes for e in engines],
                "decisions": dict(proxy.decisions),
                "session_id": req.session_id,
            }

    out = run_virtual(main())
    assert out["finish"]["type"] == "length"
    assert out["wait"] == 0.0
    # Program admission runs: the ring is mirrored, the session is attributed to the
    # engine that served it, and its priority (eviction steering) reached the engine.
    assert out["program_active"] is True
    assert out["decisions"] == {"admit:new_admitted": 1}
    assert out["served"] == [out["owner"]] and out["engine"] == out["owner"]
    assert out["priority"] == 0
    assert out["after_close"] is None
    assert all(n >= 4 for n in out["scrapes"])  # start + every 0.25 s
    assert out["session_id"] is None  # admission alone injects nothing
