"""Admission end to end: kvproxy in front of the real router (smg) and simulated engines.

Pressure is pushed with the simulator's ``token_usage`` fault (the reported
``sglang:token_usage``, without filling the pool); staleness with its ``metrics``
fault. Every test synchronises by polling (``wait_until``), never by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDictProxy
from prometheus_client.parser import text_string_to_metric_families

from kvproxy import keys
from kvproxy.admission.catalogue import PROGRAM_STATS_KEYS

from .conftest import ENGINE_TOKENS, MakeProxy, Proxy, recorded, set_faults, wait_until

pytestmark = pytest.mark.usefixtures("router")

ADMISSION = "X-KVProxy-Admission"
WAIT_MS = "X-KVProxy-Admission-Wait-Ms"
A = "agentic_kv/admission/"
B = "agentic_kv/budget/"
# Small polls so readings (and their absence) are noticed quickly.
POLL = {"enabled": True, "poll_interval_s": 0.1}
FLEET_TOKENS = 2 * ENGINE_TOKENS


def _rid() -> str:
    return uuid.uuid4().hex


def _body(rid: str, *, prompt: int = 16, new: int = 2, stream: bool = False) -> dict[str, Any]:
    """A /generate body whose reservation is exactly ``prompt + new`` tokens."""
    return {
        "input_ids": [(i * 7 + 3) % 30_000 for i in range(prompt)],
        "rid": rid,
        "sampling_params": {"max_new_tokens": new},
        "stream": stream,
    }


def holds(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def predicate() -> bool:
        return check()

    return predicate


def stats(proxy: Proxy) -> dict[str, float]:
    return proxy.app[keys.ADMISSION].stats()


async def send(
    http: aiohttp.ClientSession,
    proxy: Proxy,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    *,
    timeout_s: float = 10.0,
) -> tuple[int, CIMultiDictProxy[str], bytes]:
    """POST /generate; a request held longer than ``timeout_s`` fails the test quickly."""
    async with (
        asyncio.timeout(timeout_s),
        http.post(proxy.url + "/generate", json=body, headers=headers) as resp,
    ):
        return resp.status, resp.headers, await resp.read()


async def push_usage(
    http: aiohttp.ClientSession, engine_urls: list[str], proxy: Proxy, usage: float | None
) -> None:
    """Set the engines' reported token_usage and wait until the proxy has read it."""
    await set_faults(http, engine_urls, token_usage=usage)
    ctl = proxy.app[keys.ADMISSION]
    threshold = ctl.config.pressure_threshold
    if usage is None:
        check = holds(lambda: ctl.health().pressure < threshold)
    else:
        check = holds(lambda: ctl.health().pressure == pytest.approx(usage))
    await wait_until(check, timeout_s=5, what=f"the proxy to read token_usage={usage}")


async def recorded_rids(http: aiohttp.ClientSession, engine_urls: list[str]) -> list[str]:
    """The rids of the /generate requests the engines recorded, oldest first per engine."""
    out = []
    for entry in await recorded(http, engine_urls, path="/generate"):
        with contextlib.suppress(orjson.JSONDecodeError):
            doc = orjson.loads(entry["body"])
            if isinstance(doc, dict) and isinstance(doc.get("rid"), str):
                out.append(doc["rid"])
    return out


async def rids_recorded(http: aiohttp.ClientSession, engine_urls: list[str]) -> set[str]:
    return set(await recorded_rids(http, engine_urls))


async def enqueue(
    proxy: Proxy, start: Callable[[], Awaitable[Any]], count: int
) -> asyncio.Task[Any]:
    """Start one request and wait until it is the ``count``-th waiter (known order)."""
    task = asyncio.ensure_future(start())
    ctl = proxy.app[keys.ADMISSION]
    await wait_until(holds(lambda: ctl.waiting == count), timeout_s=5, what=f"{count} waiters")
    assert not task.done()
    return task


async def leases_drained(proxy: Proxy) -> None:
    ctl = proxy.app[keys.ADMISSION]
    await wait_until(
        holds(lambda: ctl.waiting == 0 and ctl.ledger.lease_count == 0),
        timeout_s=5,
        what="every waiter and lease to be gone",
    )
    assert ctl.ledger.reserved == 0


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ------------------------------------------------------------------------------ pressure
async def test_pressure_holds_requests_in_arrival_order_until_usage_drops(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    # Ceiling int(120,000 x 0.01) = 1,200 tokens: one 700-token reservation at a time,
    # so once the pressure drops the grants are serialised and their order is visible.
    proxy = await make_proxy(admission={**POLL, "headroom": 0.01})
    ctl = proxy.app[keys.ADMISSION]
    assert ctl.ledger.ceiling == int(FLEET_TOKENS * 0.01)
    await push_usage(http, engine_urls, proxy, 0.99)

    rids = [_rid() for _ in range(4)]
    completed: list[str] = []

    async def one(rid: str) -> tuple[int, CIMultiDictProxy[str]]:
        status, headers, _ = await send(http, proxy, _body(rid, prompt=690, new=10))
        completed.append(rid)
        return status, headers

    tasks = []
    for i, rid in enumerate(rids):
        tasks.append(await enqueue(proxy, lambda rid=rid: one(rid), i + 1))
    # The pressure guard holds even the first one, though the ledger has room for it.
    assert ctl.ledger.lease_count == 0
    assert stats(proxy)[A + "wait"] == 4
    assert not await rids_recorded(http, engine_urls) & set(rids)  # none forwarded yet

    await push_usage(http, engine_urls, proxy, None)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert completed == rids  # granted (and so served) strictly in arrival order
    for status, headers in results:
        assert status == 200
        assert headers[ADMISSION] == "admit"
        assert float(headers[WAIT_MS]) > 0.0
    # Each engine saw its share in arrival order too.
    for url in engine_urls:
        seen = [r for r in await recorded_rids(http, [url]) if r in rids]
        assert seen == [r for r in rids if r in seen]
    assert set(rids) <= await rids_recorded(http, engine_urls)
    s = stats(proxy)
    assert s[A + "admit"] == 4 and s[A + "bypass"] == 0 and s[A + "wait_seconds_mean"] > 0
    await leases_drained(proxy)


# ------------------------------------------------------------------------ stale metrics
@pytest.mark.parametrize("fault", ["error", "garbage"])
async def test_stale_metrics_release_waiters_and_every_request_bypasses_degraded(
    fault: str, make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(admission={**POLL, "staleness_s": 0.3})
    ctl = proxy.app[keys.ADMISSION]
    await push_usage(http, engine_urls, proxy, 0.99)
    waiters = [await enqueue(proxy, lambda: send(http, proxy, _body(_rid())), n) for n in (1, 2)]

    await set_faults(http, engine_urls, metrics=fault)
    # Nothing hangs: the waiters leave as soon as the last readings age out.
    for status, headers, _ in await asyncio.wait_for(asyncio.gather(*waiters), 5):
        assert status == 200
        assert headers[ADMISSION] == "bypass; reason=degraded"
    async with http.get(proxy.url + "/kvproxy/health") as resp:
        health = await resp.json()
    assert health["status"] == "degraded"
    assert health["admission"]["engines_fresh"] == 0
    assert health["admission"]["engines_stale"] == 2

    # New requests, concurrent, bypass at once without a lease.
    burst = await asyncio.wait_for(
        asyncio.gather(*(send(http, proxy, _body(_rid())) for _ in range(5))), 5
    )
    for status, headers, _ in burst:
        assert status == 200
        assert (headers[ADMISSION], headers[WAIT_MS]) == ("bypass; reason=degraded", "0.0")
    s = stats(proxy)
    assert s[A + "bypass_degraded"] == 7 and s[A + "bypass"] == 7 and s[A + "admit"] == 0
    assert s[A + "degraded_rate"] == pytest.approx(7 / 9)  # 2 waits + 7 bypasses
    assert s[B + "degraded"] == 1.0 and s[B + "scrape_failure"] >= 2
    assert ctl.waiting == 0 and ctl.ledger.lease_count == 0


async def test_one_engine_failing_metrics_keeps_admitting_on_the_other(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(admission={**POLL, "staleness_s": 0.3})
    ctl = proxy.app[keys.ADMISSION]
    assert ctl.ledger.ceiling == int(FLEET_TOKENS * 0.9) and ctl.ledger.epoch == 1
    failing, fine = engine_urls
    await set_faults(http, [failing], metrics="error")
    await wait_until(
        holds(lambda: stats(proxy)[B + "engines_stale"] == 1), timeout_s=5, what="one stale engine"
    )
    s = stats(proxy)
    assert s[B + "ceiling"] == int(ENGINE_TOKENS * 0.9)  # from the fresh engine only
    assert s[B + "engines_fresh"] == 1 and s[B + "degraded"] == 0.0 and s[B + "epoch"] == 2
    async with http.get(proxy.url + "/kvproxy/health") as resp:
        health = await resp.json()
    assert health["status"] == "ok"
    assert {e["url"]: e["fresh"] for e in health["admission"]["engines"]} == {
        failing: False,
        fine: True,
    }
    status, headers, _ = await send(http, proxy, _body(_rid()))
    assert (status, headers[ADMISSION], headers[WAIT_MS]) == (200, "admit", "0.0")
    async with http.get(proxy.url + "/metrics") as resp:
        samples = metric_samples(await resp.text())
    assert samples[("agentic_kv_budget_engines_stale", ())] == 1.0
    assert samples[("agentic_kv_budget_ceiling", ())] == int(ENGINE_TOKENS * 0.9)
    assert samples[("agentic_kv_budget_scrape_failure_total", ())] >= 1

    await set_faults(http, [failing], metrics="ok")  # it comes back: a new epoch
    await wait_until(
        holds(lambda: ctl.ledger.ceiling == int(FLEET_TOKENS * 0.9)),
        timeout_s=5,
        what="the engine to come back",
    )
    assert ctl.ledger.epoch == 3


# --------------------------------------------------------------------- disconnects
@pytest.mark.parametrize("lifecycle", [False, True], ids=["plain", "session-tracked"])
async def test_client_disconnecting_while_waiting_is_removed_at_once(
    lifecycle: bool, make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    # Usage is read at start-up and no poll follows until the test drives one, so the
    # waiter must leave when its client goes, not lazily at the next poll.
    await set_faults(http, engine_urls, token_usage=0.99)
    proxy = await make_proxy(
        admission={"enabled": True, "poll_interval_s": 30.0},
        session_lifecycle={"enabled": lifecycle},
    )
    ctl = proxy.app[keys.ADMISSION]
    assert ctl.health().pressure == pytest.approx(0.99)
    head_rid, gone_rid, tail_rid = _rid(), _rid(), _rid()
    session = {"X-Session-ID": f"adm-{_rid()}"}

    async with aiohttp.ClientSession() as other:

        async def leaving() -> None:
            async with other.post(
                proxy.url + "/generate", json=_body(gone_rid), headers=session
            ) as resp:
                await resp.read()

        head = await enqueue(proxy, lambda: send(http, proxy, _body(head_rid), session), 1)
        gone = await enqueue(proxy, leaving, 2)
        tail = await enqueue(proxy, lambda: send(http, proxy, _body(tail_rid), session), 3)
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
    # The connection is closed: the proxy drops that waiter from mid-queue at once.
    await wait_until(
        holds(lambda: ctl.waiting == 2 and stats(proxy)[A + "cancelled"] == 1),
        timeout_s=5,
        what="the disconnected waiter to leave the FIFO",
    )
    assert not head.done() and not tail.done()

    await set_faults(http, engine_urls, token_usage=None)
    await ctl.poll_once()
    for status, headers, _ in await asyncio.wait_for(asyncio.gather(head, tail), 5):
        assert (status, headers[ADMISSION]) == (200, "admit")
    seen = await rids_recorded(http, engine_urls)
    assert {head_rid, tail_rid} <= seen and gone_rid not in seen  # never forwarded
    s = stats(proxy)
    assert s[A + "wait"] == 3 and s[A + "admit"] == 2 and s[A + "bypass"] == 0
    await leases_drained(proxy)


async def test_leases_return_to_zero_after_a_burst_with_errors_disconnects_and_timeouts(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    # Ceiling 6,000 tokens: the 1,520-token requests fill it, so part of the burst waits.
    proxy = await make_proxy(
        router={"request_timeout_s": 0.3}, admission={**POLL, "headroom": 0.05}
    )
    long = {"prompt": 20, "new": 1500}

    async def ok() -> str:
        status, _, _ = await send(http, proxy, _body(_rid(), new=4))
        return f"ok:{status}"

    async def ok_stream() -> str:
        status, _, body = await send(http, proxy, _body(_rid(), new=8, stream=True))
        return f"ok:{status}" if body.endswith(b"data: [DONE]\n\n") else "ok:truncated"

    async def engine_error() -> str:
        body = _body(_rid())
        body["sampling_params"]["stop_token_ids"] = "not a list"
        status, _, _ = await send(http, proxy, body)
        return f"error:{status}"

    async def timeout_before_headers() -> str:
        status, _, _ = await send(http, proxy, _body(_rid(), **long))
        return f"timeout:{status}"

    async def timeout_midstream() -> str:
        try:
            status, _, body = await send(http, proxy, _body(_rid(), **long, stream=True))
        except aiohttp.ClientError:
            return "midstream:cut"
        return "midstream:cut" if not body.endswith(b"[DONE]\n\n") else f"midstream:{status}"

    async def disconnect_midstream() -> str:
        async with aiohttp.ClientSession() as own:
            resp = await own.post(proxy.url + "/generate", json=_body(_rid(), **long, stream=True))
            first = await resp.content.readany()
            resp.close()
        return "disconnect:streamed" if first.startswith(b"data: ") else f"disconnect:{first!r}"

    async def disconnect_early() -> str:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.1)) as own:
            try:
                await send(own, proxy, _body(_rid(), **long))
            except TimeoutError:
                return "gone"
        return "gone:answered"

    kinds = [
        ok,
        ok_stream,
        engine_error,
        timeout_before_headers,
        timeout_midstream,
        disconnect_midstream,
        disconnect_early,
    ]
    outcomes = await asyncio.wait_for(asyncio.gather(*(k() for k in kinds * 3)), 20)
    assert sorted(set(outcomes)) == sorted(
        {
            "ok:200",
            "error:422",
            "timeout:504",
            "midstream:cut",
            "disconnect:streamed",
            "gone",
        }
    ), outcomes
    await leases_drained(proxy)
    s = stats(proxy)
    assert s[A + "wait"] > 0  # part of the burst really queued
    assert s[A + "bypass"] == 0
    # Every request was decided, or cancelled while waiting (a client gone early).
    assert 18 <= s[A + "admit"] + s[A + "cancelled"] <= 21
    async with http.get(proxy.url + "/metrics") as resp:
        samples = metric_samples(await resp.text())
    timeouts = samples[("kvproxy_upstream_errors_total", (("type", "timeout"),))]
    midstream = samples[("kvproxy_upstream_errors_total", (("type", "midstream"),))]
    assert timeouts >= 3 and timeouts + midstream >= 6  # the upstream attempts that failed
    # Still fully usable afterwards.
    status, headers, _ = await send(http, proxy, _body(_rid()))
    assert (status, headers[ADMISSION], headers[WAIT_MS]) == (200, "admit", "0.0")
    await leases_drained(proxy)


# ------------------------------------------------------------------------ bypasses
async def test_oversized_and_protected_bypass_at_once_while_others_wait(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    # Client bypass headers honoured (admission.trust_client_headers); ceiling 1,200.
    proxy = await make_proxy(admission={**POLL, "headroom": 0.01, "trust_client_headers": True})
    ctl = proxy.app[keys.ADMISSION]
    await push_usage(http, engine_urls, proxy, 0.99)
    waiter_rid, big_rid, vip_rid = _rid(), _rid(), _rid()
    waiter = await enqueue(proxy, lambda: send(http, proxy, _body(waiter_rid)), 1)

    status, headers, _ = await send(http, proxy, _body(big_rid, prompt=1300, new=2), timeout_s=3)
    assert (status, headers[ADMISSION], headers[WAIT_MS]) == (
        200,
        "bypass; reason=oversized",
        "0.0",
    )
    status, headers, _ = await send(
        http, proxy, _body(vip_rid), headers={"X-KVProxy-Protected": "true"}, timeout_s=3
    )
    assert (status, headers[ADMISSION], headers[WAIT_MS]) == (
        200,
        "bypass; reason=protected",
        "0.0",
    )
    seen = await rids_recorded(http, engine_urls)
    assert {big_rid, vip_rid} <= seen and waiter_rid not in seen
    assert ctl.waiting == 1 and not waiter.done()
    assert ctl.ledger.reserved == 0  # neither took a lease
    s = stats(proxy)
    assert s[A + "bypass_oversized"] == 1 and s[A + "bypass_protected"] == 1
    assert s[A + "bypass"] == 2

    await push_usage(http, engine_urls, proxy, None)
    status, headers, _ = await asyncio.wait_for(waiter, 5)
    assert (status, headers[ADMISSION]) == (200, "admit")
    await leases_drained(proxy)


async def test_eval_traffic_is_out_of_scope_untouched_and_uncounted(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(admission={**POLL, "scope": "train", "trust_client_headers": True})
    await push_usage(http, engine_urls, proxy, 0.99)
    waiter = await enqueue(proxy, lambda: send(http, proxy, _body(_rid())), 1)
    before = stats(proxy)

    # What the engine receives is exactly what it receives from the router directly.
    seen = []
    for base in (proxy.app[keys.CONFIG].router_base, proxy.url):
        rid = _rid()
        raw = b'{"rid": "%s",  "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}'
        async with (
            asyncio.timeout(3),
            http.post(
                base + "/generate",
                data=raw % rid.encode(),
                headers={"Content-Type": "application/json", "X-KVProxy-Mode": "eval"},
            ) as resp,
        ):
            assert resp.status == 200
            await resp.read()
            assert ADMISSION not in resp.headers and WAIT_MS not in resp.headers
        got = [r for r in await recorded(http, engine_urls, path="/generate") if rid in r["body"]]
        assert len(got) == 1
        seen.append(got[0]["body"].replace(rid, "<rid>"))
    assert seen[0] == seen[1]
    after = stats(proxy)
    for key in ("admit", "bypass", "wait", "waiting", "cancelled"):
        assert after[A + key] == before[A + key], key
    assert not waiter.done()

    await push_usage(http, engine_urls, proxy, None)
    status, headers, _ = await asyncio.wait_for(waiter, 5)
    assert (status, headers[ADMISSION]) == (200, "admit")


async def test_waiters_age_out_as_bypass_aged_on_time(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    # Usage is read once at start-up; no poll follows during the test, so only the
    # aging timer can release the waiters.
    await set_faults(http, engine_urls, token_usage=0.99)
    max_wait = 0.3
    proxy = await make_proxy(
        admission={"enabled": True, "poll_interval_s": 30.0, "max_wait_s": max_wait}
    )
    ctl = proxy.app[keys.ADMISSION]
    assert ctl.health().pressure == pytest.approx(0.99)

    async def timed() -> tuple[float, CIMultiDictProxy[str]]:
        started = time.monotonic()
        status, headers, _ = await send(http, proxy, _body(_rid()))
        assert status == 200
        return time.monotonic() - started, headers

    first = await enqueue(proxy, timed, 1)
    second = await enqueue(proxy, timed, 2)  # the timer re-arms for the next head
    for elapsed, headers in await asyncio.wait_for(asyncio.gather(first, second), 5):
        assert headers[ADMISSION] == "bypass; reason=aged"
        waited = float(headers[WAIT_MS]) / 1000
        assert max_wait <= waited < max_wait + 0.1
        assert elapsed >= max_wait
    s = stats(proxy)
    assert s[A + "bypass_aged"] == 2 and s[A + "wait"] == 2 and s[A + "admit"] == 0
    assert ctl.ledger.lease_count == 0 and ctl.waiting == 0


# ---------------------------------------------------------------- stats and metrics
ADMISSION_KEYS = {
    A + k
    for k in (
        "enabled",
        "admit",
        "bypass",
        "bypass_protected",
        "bypass_degraded",
        "bypass_aged",
        "bypass_oversized",
        "bypass_queue_full",
        "bypass_disabled",
        "wait",
        "waiting",
        "cancelled",
        "wait_new_session",
        "wait_continuing",
        "waiting_continuing",
        "waiting_new",
        "defer_rate",
        "degraded_rate",
        "wait_seconds_mean",
    )
}
BUDGET_KEYS = {
    B + k
    for k in (
        "ceiling",
        "reserved",
        "available_tokens",
        "reserved_utilization",
        "lease_count",
        "kv_token_usage_mean",
        "kv_token_usage_max",
        "epoch",
        "degraded",
        "engines_fresh",
        "engines_stale",
        "scrape_failure",
        "poll_error",
        "resident",
        "resident_sessions",
        "committed",
        "residency_expired",
        "residency_evicted",
        "session_ended",
    )
}


async def test_headers_stats_window_and_prometheus_series(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(admission={**POLL, "trust_client_headers": True})

    # Admitted at once (plain and streaming): the headers say so, with no wait.
    for stream in (False, True):
        status, headers, body = await send(http, proxy, _body(_rid(), stream=stream))
        assert status == 200 and body
        assert (headers[ADMISSION], headers[WAIT_MS]) == ("admit", "0.0")
    status, headers, _ = await send(http, proxy, _body(_rid()), {"X-KVProxy-Protected": "1"})
    assert headers[ADMISSION] == "bypass; reason=protected"
    # One request waits under pressure, then is admitted.
    await push_usage(http, engine_urls, proxy, 0.99)
    waiter = await enqueue(proxy, lambda: send(http, proxy, _body(_rid())), 1)
    await push_usage(http, engine_urls, proxy, None)
    status, headers, _ = await asyncio.wait_for(waiter, 5)
    assert headers[ADMISSION] == "admit"
    waited_ms = float(headers[WAIT_MS])
    assert waited_ms > 0
    await leases_drained(proxy)

    async with http.get(proxy.url + "/kvproxy/stats") as resp:
        s = await resp.json()
    assert {k for k in s if k.startswith((A, B))} == ADMISSION_KEYS | BUDGET_KEYS | (
        PROGRAM_STATS_KEYS
    )
    assert (s[A + "admit"], s[A + "wait"], s[A + "bypass"]) == (3, 1, 1)
    assert s[A + "bypass_protected"] == 1 and s[A + "waiting"] == 0
    assert s[A + "defer_rate"] == pytest.approx(1 / 5)
    assert s[A + "wait_seconds_mean"] == pytest.approx(waited_ms / 1000, abs=0.002)
    assert s[B + "ceiling"] == int(FLEET_TOKENS * 0.9) and s[B + "engines_fresh"] == 2
    assert s[B + "lease_count"] == 0 and s[B + "reserved_utilization"] == 0.0
    assert s[B + "kv_token_usage_max"] == pytest.approx(0.99)  # the window's peak

    # ?reset=true answers the closing window, then a new one starts.
    async with http.get(proxy.url + "/kvproxy/stats?reset=true") as resp:
        closing = await resp.json()
    assert closing[A + "admit"] == 3 and closing[A + "wait"] == 1
    async with http.get(proxy.url + "/kvproxy/stats") as resp:
        fresh = await resp.json()
    assert fresh[A + "admit"] == 0 and fresh[A + "wait"] == 0 and fresh[A + "bypass"] == 0
    assert A + "defer_rate" not in fresh and A + "wait_seconds_mean" not in fresh
    assert fresh[B + "kv_token_usage_max"] < 0.5  # restarted at the current level
    assert fresh[B + "ceiling"] == s[B + "ceiling"]  # gauges are not windowed

    # /metrics is cumulative: the window reset does not touch it.
    async with http.get(proxy.url + "/metrics") as resp:
        assert resp.status == 200
        samples = metric_samples(await resp.text())
    assert samples[("agentic_kv_admission_admit_total", ())] == 3
    assert samples[("agentic_kv_admission_wait_total", ())] == 1
    assert samples[("agentic_kv_admission_bypass_protected_total", ())] == 1
    assert samples[("agentic_kv_admission_waiting", ())] == 0
    assert samples[("agentic_kv_budget_ceiling", ())] == int(FLEET_TOKENS * 0.9)
    hist = "agentic_kv_admission_wait_seconds"
    assert samples[(hist + "_count", ())] == 1
    assert samples[(hist + "_sum", ())] == pytest.approx(waited_ms / 1000, abs=0.002)
    assert samples[(hist + "_bucket", (("le", "+Inf"),))] == 1
    assert samples[(hist + "_bucket", (("le", "0.005"),))] == 0
    assert samples[("kvproxy_requests_total", (("path", "/generate"), ("status", "200")))] == 4
