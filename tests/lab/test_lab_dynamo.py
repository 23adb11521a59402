"""Dynamo turns (``nvext``) through the lab's kvproxy: the server's Dynamo layer over
lab engines, on the virtual clock (streaming-session slots, bind timeouts, speculative
prefills)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvlab.lab.engines import LabEngine
from kvlab.lab.proxy import LabProxy
from kvlab.lab.router import Placement
from kvlab.lab.runner import LabTuning, proxy_config
from kvlab.lab.vloop import run_virtual
from kvlab.sim.presets import scheduler_config
from kvlab.sim.scheduler import SimRequest
from kvproxy.dynamo import control as dynamo
from kvproxy.dynamo import streaming as st

URLS = ("http://127.0.0.1:30001", "http://127.0.0.1:30002")


def _lab(mode: str) -> tuple[LabProxy, dict[str, LabEngine]]:
    cfg = scheduler_config("qwen3-8b-h100", 16, mode=mode)
    engines = [LabEngine(u, cfg) for u in URLS]
    proxy = LabProxy(
        proxy_config("lifecycle", LabTuning(), 16),
        engines,
        Placement("consistent_hashing", URLS),
    )
    return proxy, {e.url: e for e in engines}


def _headers(sid: str) -> dict[str, str]:
    return {"X-Session-ID": sid, "X-SMG-Routing-Key": sid}


def _body(rid: int, ids: list[int], nvext: dict[str, Any]) -> dict[str, Any]:
    return {
        "rid": f"{rid:032x}",
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
        "nvext": nvext,
    }


def _control(action: str, **more: Any) -> dict[str, Any]:
    return {"session_control": {"session_id": "s1", "action": action, **more}}


def _context(req: SimRequest, prompt: list[int]) -> list[int]:
    assert req.out is not None
    return [*prompt, *req.out.ids(req.generated)]


def test_an_opened_session_is_served_from_its_slot_until_it_closes() -> None:
    async def main() -> dict[str, Any]:
        proxy, engines = _lab("streaming")
        async with proxy.running():
            assert proxy.dynamo is not None
            owner = engines[proxy.placement.pick(_headers("s1"))]
            first = list(range(1000, 1200))
            req1, _ = await proxy.generate(_headers("s1"), _body(1, first, _control("open")))
            slot = proxy.dynamo.slots.get("s1")
            opened = "s1" in owner.sched.streaming_sessions
            second = [*_context(req1, first), *range(2000, 2030)]
            req2, _ = await proxy.generate(_headers("s1"), _body(2, second, _control("bind")))
            held = proxy.dynamo.slots.get("s1")
            third = [*_context(req2, second), *range(3000, 3010)]
            req3, _ = await proxy.generate(_headers("s1"), _body(3, third, _control("close")))
            await asyncio.sleep(1.0)  # the close reaches every engine
            counters = dict(proxy.dynamo.counters.window_items())
            return {
                "opened": opened,
                "slot": None if slot is None else len(slot.context),
                "held": None if held is None else len(held.context),
                "prompts": [r.prompt_tokens for r in (req1, req2, req3)],
                "cached": [r.cached_tokens for r in (req1, req2, req3)],
                "lengths": [len(first), len(second), len(third)],
                "open_after": "s1" in owner.sched.streaming_sessions,
                "slots_after": len(proxy.dynamo.slots),
                "opened_n": counters[dynamo.STREAM_OPENED],
                "extended_n": counters[dynamo.STREAM_EXTENDED],
                "fallbacks": {k: v for k, v in counters.items() if "fallback" in k and v},
            }

    out = run_virtual(main())
    assert out["opened"] is True  # /open_session reached the ring owner
    assert out["slot"] == 200 + 16 and out["held"] == out["lengths"][1] + 16
    # The engine's prompt is the whole context each turn (the slot's plus the new ids),
    # and the later turns find the session's KV pinned in its slot.
    assert out["prompts"] == out["lengths"]
    # (All but the last output token, which the engine has not run through the model.)
    assert out["cached"][0] == 0
    assert out["cached"][1] >= out["slot"] - 1 and out["cached"][2] >= out["held"] - 1
    assert out["opened_n"] == 1 and out["extended_n"] == 2
    assert out["fallbacks"] == {}
    assert out["open_after"] is False and out["slots_after"] == 0  # the close freed it


def test_engines_without_streaming_sessions_serve_open_as_ordinary_requests() -> None:
    async def main() -> dict[str, Any]:
        proxy, engines = _lab("session-radix")
        async with proxy.running():
            assert proxy.dynamo is not None
            owner = proxy.placement.pick(_headers("s1"))
            req, _ = await proxy.generate(
                _headers("s1"), _body(1, list(range(1000, 1100)), _control("open"))
            )
            again, _ = await proxy.generate(
                _headers("s1"), _body(2, list(range(1000, 1150)), _control("bind"))
            )
            counters = dict(proxy.dynamo.counters.window_items())
            return {
                "finish": [req.finish_reason, again.finish_reason],
                "refused": sorted(proxy.dynamo.no_streaming),
                "owner": owner,
                "open_failed": counters[dynamo.STREAM_FALLBACK + st.R_OPEN_FAILED],
                "slots": len(proxy.dynamo.slots),
                "served": {u: e.sched.stats.num_requests_total for u, e in engines.items()},
            }

    out = run_virtual(main())
    assert [f["type"] for f in out["finish"]] == ["length", "length"]
    assert out["refused"] == [out["owner"]] and out["open_failed"] == 1
    assert out["slots"] == 0
    assert out["served"][out["owner"]] == 2  # bound sessions route stickily


def test_a_bound_session_closes_after_its_idle_timeout() -> None:
    async def main() -> dict[str, Any]:
        proxy, _ = _lab("session-radix")
        async with proxy.running():
            assert proxy.dynamo is not None and proxy.sessions is not None
            ids = list(range(1000, 1100))
            await proxy.generate(_headers("s1"), _body(1, ids, _control("bind", timeout=3)))
            state_before = proxy.sessions.state("s1")
            await asyncio.sleep(10.0)
            return {
                "before": state_before,
                "after": proxy.sessions.state("s1"),
                "closed": dict(proxy.dynamo.counters.window_items())[dynamo.BIND_CLOSED],
            }

    out = run_virtual(main())
    assert out == {"before": "open", "after": "closed", "closed": 1}


def test_a_speculative_prefill_warms_the_next_turn_on_the_same_engine() -> None:
    async def main() -> dict[str, Any]:
        proxy, engines = _lab("session-radix")
        async with proxy.running():
            assert proxy.dynamo is not None
            owner = engines[proxy.placement.pick(_headers("s1"))]
            hints = {"agent_hints": {"speculative_prefill": True}}
            ids = list(range(1000, 1300))
            req, _ = await proxy.generate(_headers("s1"), _body(1, ids, hints))
            await asyncio.sleep(2.0)  # the prefill runs in the background
            served = owner.sched.stats.num_requests_total
            nxt = [*_context(req, ids), *range(5000, 5020)]
            later, _ = await proxy.generate(_headers("s1"), _body(2, nxt, {}))
            return {
                "served": served,
                "sent": dict(proxy.dynamo.counters.window_items())[dynamo.PREFILL_SENT],
                "cached": later.cached_tokens,
                "context": len(nxt) - 20,
            }

    out = run_virtual(main())
    assert out["served"] == 2 and out["sent"] == 1  # the turn, then its prefill
    # The next turn finds the whole previous context (prompt and answer) cached.
    assert out["cached"] >= out["context"] - 16
