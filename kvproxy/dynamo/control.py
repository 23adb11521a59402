"""Dynamo (``nvext`` agent hints and session control): the asyncio shell (docs/dynamo.md).

The decisions are pure (:mod:`nvext`, :mod:`streaming`, :mod:`binding`,
:mod:`prefill`); this module does the I/O: the bind reaper, ``/open_session`` and
``/close_session`` on the session's engine, translated streaming-session turns, and
background speculative prefills. Owned by the application (``app[DYNAMO]``, :mod:`kvproxy.keys`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import aiohttp
import orjson
from prometheus_client.core import Metric

from kvproxy.config import Config
from kvproxy.dynamo import streaming as st
from kvproxy.dynamo.binding import BindTimers
from kvproxy.dynamo.nvext import Nvext
from kvproxy.dynamo.prefill import StreamAnswer, prefill_body
from kvproxy.fleet.client import EngineResponse
from kvproxy.fleet.engine_metrics import parse_engine_metrics
from kvproxy.fleet.placement import Placement
from kvproxy.observability import WindowedCounters, counter_families, gauge_families
from kvproxy.sessions.identity import ROUTING_KEY_HEADER, new_rid

log = logging.getLogger(__name__)

# Bound on one control-plane call (/close_session, /metrics) awaited on a turn's path.
_CONTROL_TIMEOUT_S = 5.0

_P = "agentic_kv/dynamo/"
PREFILL_SENT = _P + "speculative_prefill_sent"
PREFILL_FAILED = _P + "speculative_prefill_failed"
PREFILL_SKIPPED = _P + "speculative_prefill_skipped_"  # + reason
BIND_CLOSED = _P + "bind_timeout_closed"
STREAM_OPENED = _P + "streaming_opened"
STREAM_EXTENDED = _P + "streaming_turns_extended"
STREAM_FALLBACK = _P + "streaming_fallback_"  # + reason
HINT_PRIORITY = _P + "hint_priority_forwarded"
HELP = {
    PREFILL_SENT: "Speculative prefills sent to the router.",
    PREFILL_FAILED: "Speculative prefills that failed (never seen by the client).",
    BIND_CLOSED: "Bound sessions closed by their inactivity timeout.",
    STREAM_OPENED: "Streaming sessions opened on an engine.",
    STREAM_EXTENDED: "Turns sent in streaming-session form (only the new tokens).",
    HINT_PRIORITY: "Requests whose agent_hints.priority became the top-level priority.",
}
G_STREAMING = _P + "streaming_sessions"
G_STREAMING_HELD = _P + "streaming_held_tokens_estimate"
G_PREFILL_IN_FLIGHT = _P + "speculative_prefill_in_flight"
G_BOUND = _P + "bound_sessions"
GAUGE_HELP = {
    G_STREAMING: "Streaming sessions kvproxy holds open on engines.",
    G_STREAMING_HELD: "Tokens those sessions hold (kvproxy's view: prompt + output).",
    G_PREFILL_IN_FLIGHT: "Speculative prefills in flight.",
    G_BOUND: "Sessions with a bind timeout.",
}


_S = TypeVar("_S")  # the relay's response


@dataclass(frozen=True, slots=True)
class Translated(Generic[_S]):
    """What a turn sent in streaming-session form produced, as its relay saw it.

    ``response`` None: it failed before anything reached the client (the ordinary
    request is sent instead). ``complete`` False: it broke off mid-stream. A buffered
    (JSON) answer's ``body`` is kept; an event stream's is not (None)."""

    response: _S | None
    complete: bool = False
    output_ids: Any = None
    prompt_tokens: int | None = None
    aborted: bool = False
    body: bytes | None = None
    tail: bytes = b""  # the answer's last bytes: the engine's usage report


class AnsweredThenCancelled(asyncio.CancelledError):
    """A streamed translated turn's relay was cancelled (its client hung up) after the
    answer's ``[DONE]`` had been relayed, while the upstream still held the stream open:
    the answer is complete, and ``answer`` is what it produced. Raised in place of the
    cancellation, and handled as one once the turn is recorded."""

    def __init__(self, answer: Translated[Any]) -> None:
        super().__init__("the client hung up after the answer's [DONE]")
        self.answer = answer


class DynamoHttp(Protocol):
    """The part of ``aiohttp.ClientSession`` Dynamo calls (engine control, prefills):
    :class:`~kvproxy.fleet.client.EngineHttp`'s, and a JSON body posted as ``json``."""

    def post(
        self,
        url: str,
        *,
        data: Any = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> AbstractAsyncContextManager[EngineResponse]: ...

    def get(
        self, url: str, *, timeout: aiohttp.ClientTimeout | None = None
    ) -> AbstractAsyncContextManager[EngineResponse]: ...


@dataclass(slots=True)
class Turn:
    """One intercepted request of a session, as the Dynamo features see it."""

    session_id: str
    path: str
    nvext: Nvext
    close_after: bool
    bind_timeout_s: float | None = None
    plan: st.Plan | None = None
    # A streaming slot's /close_session, awaited before the ordinary request is sent.
    closing: asyncio.Task[None] | None = None
    response: bytes | None = None  # a buffered 200 body, for the speculative prefill
    # Why a streamed answer was not kept (StreamAnswer's skip reason), if it was not.
    response_skip: str | None = None
    answered: bool = False  # a streamed answer was kept (its prefill already decided)
    # session_lifecycle.speculative_prefill, as begin() found it.
    prefill_on: bool = True

    @property
    def wants_body(self) -> bool:
        """Only a turn asking for a speculative prefill, with the feature on, keeps its
        answer (a streamed one is accumulated only then)."""
        return self.prefill_on and self.nvext.hints.speculative_prefill

    def keep_body(self, data: bytes) -> None:
        self.response = data

    def keep_stream(self, answer: StreamAnswer) -> None:
        """A streamed answer, complete: kept in the buffered answer's shape."""
        self.response, self.response_skip = answer.body()
        self.answered = True


class Dynamo:
    """Bind timers, streaming sessions and speculative prefills of one application."""

    def __init__(
        self,
        config: Config,
        *,
        http: DynamoHttp,
        router_base: str,
        ring_workers: Callable[[], tuple[tuple[str, ...], tuple[str, ...]]],
        close_session: Callable[[str], Any],
        session_open: Callable[[str], bool],
        pressure: Callable[[str | None], bool],
        engine_kv: Callable[[str], tuple[int | None, int | None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._http = http
        self._router = router_base
        self._ring_workers = ring_workers
        self._close_session = close_session
        self._session_open = session_open
        self._pressure = pressure
        # (max_total_num_tokens, streaming held tokens) of an engine from admission's
        # scrape, when it runs; otherwise the capacity is read once from the engine.
        self._engine_kv = engine_kv
        self._capacity: dict[str, int] = {}
        self._clock = clock
        sl = config.session_lifecycle
        self.timers = BindTimers(sl.max_sessions)
        self.slots = st.SlotTable(sl.max_streaming_sessions)
        self.placement = Placement(config.router.policy)
        self.counters = WindowedCounters(HELP)
        self._prefills: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._reaper: asyncio.Task[None] | None = None
        # Engines that refused a streaming open (no --enable-streaming-session): their
        # sessions go as ordinary requests without asking again (bounded by the fleet).
        self.no_streaming: set[str] = set()

    # -- lifecycle -------------------------------------------------------------
    def reconfigure(self, config: Config) -> None:
        self.config = config
        self.placement = Placement(config.router.policy)

    async def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_loop(), name="kvproxy-bind-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        pending = [t for t in (*self._prefills, *self._background) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def _interval(self) -> float:
        # Checked every second (scaled like every other kvproxy timer).
        return self.config.server.time_scale * 1.0

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval())
            try:
                self.reap(self._clock())
            except Exception:
                log.exception("bind timeout sweep failed")

    def reap(self, now: float) -> list[str]:
        """Close every bound session idle past its timeout; returns their ids."""
        expired = self.timers.expired(now)
        for sid in expired:
            self.counters.inc(BIND_CLOSED)
            self._spawn(self._close_session(sid))
        return expired

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def session_closed(self, sid: str) -> None:
        """The lifecycle's close sequence finished (its /close_session reached every
        engine, so a streaming slot is freed too)."""
        self.timers.forget(sid)
        self.slots.pop(sid)

    # -- a turn ----------------------------------------------------------------
    def quiet(self, session_id: str, nvext: Nvext) -> bool:
        """Whether a turn of ``session_id`` would do nothing: no ``nvext``, no streaming
        slot held by any session and no bind timer for this one. :meth:`begin` would then
        add no header and start no timer, :meth:`involved` and ``wants_body`` would be
        false and :meth:`end` a no-op, so the request path opens no turn (the common
        case: a dozen calls fewer per request)."""
        return not nvext.present and not self.slots and self.timers.timeout_of(session_id) is None

    def begin(
        self, session_id: str, path: str, nvext: Nvext, close_after: bool
    ) -> tuple[Turn, dict[str, str]]:
        """A turn starts; returns it and the headers to add (the routing key for
        bound and opened sessions, even when sticky_routing is off)."""
        sl = self.config.session_lifecycle
        turn = Turn(session_id, path, nvext, close_after, prefill_on=sl.speculative_prefill)
        headers: dict[str, str] = {}
        action = nvext.control.action
        if (
            action in ("bind", "open")
            or self.slots.get(session_id) is not None
            or self.timers.timeout_of(session_id) is not None
        ):
            # Bound and opened sessions are routed stickily on every turn.
            headers[ROUTING_KEY_HEADER] = session_id
        if sl.bind_timeouts and not close_after:
            timeout = nvext.bind_timeout_s()
            if timeout is not None:
                timeout *= self.config.server.time_scale
            else:  # a later turn without nvext keeps the session's timer
                timeout = self.timers.timeout_of(session_id)
            if timeout is not None:
                turn.bind_timeout_s = timeout
                self.timers.started(session_id, timeout, self._clock())
        return turn, headers

    def end(self, turn: Turn) -> None:
        """The turn's response has been relayed (or failed)."""
        if turn.bind_timeout_s is not None:
            self.timers.ended(turn.session_id, self._clock())

    def note_priority(self, source: str) -> None:
        """Count what :func:`~kvproxy.dynamo.nvext.combine_priority` chose."""
        if source == "hint":
            self.counters.inc(HINT_PRIORITY)

    # -- streaming sessions -----------------------------------------------------
    def _owner(self, key: str) -> str | None:
        workers, available = self._ring_workers()
        self.placement.update(workers, available)
        return self.placement.owner(key)

    def involved(self, turn: Turn) -> bool:
        """Whether Dynamo has anything to do with ``turn`` before it is sent
        (:meth:`plan` and :meth:`settle`): a streaming slot held by any session, a
        slot's close pending, or an ``open`` with streaming sessions on. False on the
        request path's common case (no slots at all), where both would do nothing."""
        return (
            len(self.slots) > 0
            or turn.closing is not None
            or (
                self.config.session_lifecycle.streaming_sessions
                and turn.nvext.control.action == "open"
            )
        )

    def plan(self, turn: Turn, body: Mapping[str, Any], routing_key: str) -> st.Plan:
        if not self.config.session_lifecycle.streaming_sessions:
            return st.Plan(st.PLAIN)
        slot = self.slots.get(turn.session_id)
        opening = turn.nvext.control.action == "open"
        if slot is None and not opening:
            return st.Plan(st.PLAIN)
        ids, why = st.request_shape(turn.path, body)
        if slot is None and opening and turn.path != "/generate":
            return st.Plan(st.PLAIN)  # chat / completions: open behaves as bind
        engine = self._owner(routing_key)
        plan = st.plan_turn(slot, opening=opening, input_ids=ids, ineligible=why, engine=engine)
        if plan.kind == st.OPEN and engine in self.no_streaming:
            plan = st.Plan(st.FALLBACK, st.R_OPEN_FAILED)
        if plan.kind == st.FALLBACK:
            self.counters.inc(STREAM_FALLBACK + (plan.reason or "unknown"))
            if plan.close_engine is not None:
                self.slots.pop(turn.session_id)
                self._close_before_retry(turn, plan.close_engine)
        turn.plan = plan
        return plan

    def _close_before_retry(self, turn: Turn, engine: str) -> None:
        """Close the turn's slot on ``engine`` in the background; :meth:`settle` awaits it
        before the ordinary request is sent."""
        turn.closing = asyncio.ensure_future(self._close_on(engine, turn.session_id))
        self._background.add(turn.closing)
        turn.closing.add_done_callback(self._background.discard)

    async def settle(self, turn: Turn, body: Mapping[str, Any], routing_key: str) -> None:
        """Before a session's ordinary request: a fall-back's own slot is closed first,
        and idle slots on its engine are closed when their pinned KV would leave no room
        for it (:func:`~kvproxy.dynamo.streaming.slots_to_release`)."""
        if turn.closing is not None and not turn.closing.done():
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(turn.closing), _CONTROL_TIMEOUT_S)
        if len(self.slots) == 0:
            return
        engine = self._owner(routing_key)
        if engine is None:
            return
        release = st.slots_to_release(
            self.slots.items(),
            engine=engine,
            footprint=st.turn_footprint(body),
            capacity=self._known_capacity(engine),
        )
        for slot in release:
            self.counters.inc(STREAM_FALLBACK + st.R_RELEASED)
            self.slots.pop(slot.session_id)
        if release:
            await asyncio.gather(
                *(
                    asyncio.wait_for(self._close_on(s.engine, s.session_id), _CONTROL_TIMEOUT_S)
                    for s in release
                ),
                return_exceptions=True,
            )

    def _known_capacity(self, engine: str) -> int | None:
        cap = self._engine_kv(engine)[0] if self._engine_kv is not None else None
        return cap if cap is not None else self._capacity.get(engine)

    async def _pool_share(self, engine: str, sid: str, body: Mapping[str, Any]) -> str | None:
        """:func:`~kvproxy.dynamo.streaming.pool_share_check` for this turn."""
        cap, held = self._engine_kv(engine) if self._engine_kv is not None else (None, None)
        if cap is None:
            cap = self._capacity.get(engine)
        if cap is None and len(self._capacity) < 4096:
            cap, held2 = await self._read_engine_kv(engine)
            held = held if held is not None else held2
            if cap is not None:
                self._capacity[engine] = cap
        slot = self.slots.get(sid)
        return st.pool_share_check(
            footprint=st.turn_footprint(body),
            session_held=len(slot.context) if slot is not None else 0,
            own_held=self.slots.held_tokens(engine),
            reported_held=held,
            capacity=cap,
            share=self.config.session_lifecycle.streaming_max_pool_share,
        )

    async def _read_engine_kv(self, engine: str) -> tuple[int | None, int | None]:
        try:
            timeout = aiohttp.ClientTimeout(total=_CONTROL_TIMEOUT_S)
            async with self._http.get(engine + "/metrics", timeout=timeout) as resp:
                text = await resp.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("streaming sessions: /metrics of %s failed: %s", engine, exc)
            return None, None
        m = parse_engine_metrics(text)
        return m.max_total_num_tokens, m.streaming_session_held_tokens

    async def _close_on(self, engine: str, sid: str) -> None:
        try:
            async with self._http.post(engine + "/close_session", json={"session_id": sid}) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("streaming session %s: /close_session on %s failed: %s", sid, engine, exc)

    async def _open_on(self, engine: str, sid: str, timeout_s: float | None) -> bool:
        doc: dict[str, Any] = {
            "capacity_of_str_len": st.OPEN_CAPACITY,
            "session_id": sid,
            "streaming": True,
        }
        if timeout_s is not None:
            doc["timeout"] = timeout_s
        try:
            async with self._http.post(engine + "/open_session", json=doc) as resp:
                text = await resp.text()
                if resp.status == 200:
                    return True
                if "still open" in text:
                    # Left open by an earlier kvproxy run: close it and open afresh.
                    await self._close_on(engine, sid)
                    async with self._http.post(engine + "/open_session", json=doc) as again:
                        await again.read()
                        return again.status == 200
                if "disabled" in text and len(self.no_streaming) < 4096:
                    self.no_streaming.add(engine)
                log.warning("streaming session %s: /open_session on %s: %s", sid, engine, text)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("streaming session %s: /open_session on %s failed: %s", sid, engine, exc)
        return False

    # The translated turn itself is relayed by the proxy's transport (the Dynamo layer,
    # kvproxy.proxy.dynamo_layer), through these steps: claim the slot, build the body,
    # record the outcome (finish_turn, or the slot given up).
    async def claim_slot(self, turn: Turn, body: Mapping[str, Any]) -> st.Slot | None:
        """The turn's streaming slot, opened on its engine (OPEN) or the session's
        (EXTEND), marked in flight, within the engine's pool share; None: send the
        ordinary request instead (a slot refused is closed first)."""
        plan = turn.plan
        assert plan is not None and plan.engine is not None
        sid = turn.session_id
        denied = await self._pool_share(plan.engine, sid, body)
        if denied is not None:  # behaves as bind: the ordinary request, slot closed first
            found = self.slots.get(sid)
            if found is not None:
                await self._give_up_first(found, denied)
            else:
                self.counters.inc(STREAM_FALLBACK + denied)
            return None
        footprint = st.turn_footprint(body)
        if plan.kind == st.OPEN:
            engine_timeout = turn.nvext.control.timeout_s
            # Reserved while /open_session runs, so that concurrent opens see it.
            self._put(st.Slot(sid, plan.engine, (), None, True, engine_timeout, footprint))
            if not await self._open_on(plan.engine, sid, engine_timeout):
                self.slots.pop(sid)
                self.counters.inc(STREAM_FALLBACK + st.R_OPEN_FAILED)
                return None
            self.counters.inc(STREAM_OPENED)
            slot = st.Slot(sid, plan.engine, timeout_s=engine_timeout)
        else:
            found = self.slots.get(sid)
            if found is None:  # closed meanwhile
                return None
            slot = found
        self._put(
            st.Slot(
                sid, slot.engine, slot.context, slot.first_token, True, slot.timeout_s, footprint
            )
        )
        return slot

    def translated_body(
        self, turn: Turn, body: Mapping[str, Any], fields: Mapping[str, Any]
    ) -> bytes:
        """The turn in streaming-session form (only the new ids, the session's id)."""
        assert turn.plan is not None
        request_doc = st.session_body(body, fields, turn.plan.input_ids, turn.session_id)
        if turn.path in self.config.session_lifecycle.strip_nvext_paths:
            request_doc.pop("nvext", None)
        return orjson.dumps(request_doc)

    def finish_turn(
        self,
        turn: Turn,
        slot: st.Slot,
        prompt: Any,
        output_ids: Any,
        prompt_tokens: int | None,
        aborted: bool,
    ) -> bool:
        """Record what a translated turn produced; False: the slot was given up (the
        session stops being a streaming one)."""
        new_slot, why = (
            (None, st.R_ENGINE_ERROR)
            if aborted
            else st.after_turn(
                slot, prompt=prompt, output_ids=output_ids, prompt_tokens=prompt_tokens
            )
        )
        if new_slot is None:
            # When the ordinary request follows, settle() awaits this close first.
            self.counters.inc(STREAM_FALLBACK + (why or st.R_CONTEXT_CHECK))
            self.slots.pop(slot.session_id)
            self._close_before_retry(turn, slot.engine)
            return False
        if turn.close_after:
            self.slots.pop(turn.session_id)  # the lifecycle's close frees it on every engine
        else:
            self.slots.put(new_slot)
        # Sent in streaming-session form, the session's last turn included.
        if turn.plan is not None and turn.plan.kind == st.EXTEND:
            self.counters.inc(STREAM_EXTENDED)
        return True

    def give_up(self, slot: st.Slot, reason: str) -> None:
        """The slot is dropped and closed on its engine (counted by ``reason``)."""
        self._give_up(slot, reason)

    async def give_up_first(self, slot: st.Slot, reason: str) -> None:
        """:meth:`give_up`, the close awaited (bounded): the ordinary request follows."""
        await self._give_up_first(slot, reason)

    def _put(self, slot: st.Slot) -> None:
        for old in self.slots.put(slot):
            self._spawn(self._close_on(old.engine, old.session_id))

    def _give_up(self, slot: st.Slot, reason: str) -> None:
        self.counters.inc(STREAM_FALLBACK + reason)
        self.slots.pop(slot.session_id)
        self._spawn(self._close_on(slot.engine, slot.session_id))

    async def _give_up_first(self, slot: st.Slot, reason: str) -> None:
        """Like :meth:`_give_up`, awaiting the close (bounded): the ordinary request
        that follows must find the slot's pinned KV freed."""
        self.counters.inc(STREAM_FALLBACK + reason)
        self.slots.pop(slot.session_id)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._close_on(slot.engine, slot.session_id), _CONTROL_TIMEOUT_S)

    # -- speculative prefill ----------------------------------------------------
    def after_response(
        self, turn: Turn, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> str | None:
        """Start the turn's speculative prefill in the background; returns why it was
        skipped (None: started, or not asked for)."""
        sl = self.config.session_lifecycle
        if not (sl.speculative_prefill and turn.nvext.hints.speculative_prefill):
            return None
        key = headers.get(ROUTING_KEY_HEADER) or turn.session_id
        reason = self._prefill_skip(turn, key)
        doc: Any = None
        if reason is None and turn.response is not None:
            with contextlib.suppress(orjson.JSONDecodeError):
                doc = orjson.loads(turn.response)
        pbody = None
        if reason is None:
            pbody = prefill_body(turn.path, body, doc, session_id=turn.session_id, rid=new_rid())
            if pbody is None:
                reason = "unreadable"
        if reason is not None:
            self.counters.inc(PREFILL_SKIPPED + reason)
            return reason
        assert pbody is not None
        hdrs = {
            ROUTING_KEY_HEADER: key,
            "Content-Type": "application/json",
        }
        auth = headers.get("Authorization")
        if auth is not None:
            hdrs["Authorization"] = auth
        task = asyncio.ensure_future(self._prefill(turn.path, pbody, hdrs))
        self._prefills.add(task)
        task.add_done_callback(self._prefills.discard)
        return None

    def _prefill_skip(self, turn: Turn, key: str) -> str | None:
        if turn.close_after or not self._session_open(turn.session_id):
            return "session_end"
        if self.slots.get(turn.session_id) is not None:
            return "streaming_session"  # its KV is held in the slot already
        if turn.response is None:
            return turn.response_skip or "no_response_body"
        if len(self._prefills) >= self.config.session_lifecycle.speculative_prefill_max_in_flight:
            return "in_flight_cap"
        if self._pressure(self._owner(key)):
            return "pressure"
        return None

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        try:
            async with self._http.post(
                self._router + path, data=orjson.dumps(body), headers=headers
            ) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        self.counters.inc(PREFILL_SENT if ok else PREFILL_FAILED)

    # -- observability -----------------------------------------------------------
    def gauges(self) -> dict[str, float]:
        return {
            G_STREAMING: float(len(self.slots)),
            G_STREAMING_HELD: float(self.slots.held_tokens()),
            G_PREFILL_IN_FLIGHT: float(len(self._prefills)),
            G_BOUND: float(len(self.timers)),
        }

    def stats(self, *, reset: bool = False) -> dict[str, float]:
        out = dict(self.counters.window_items())
        out.update(self.gauges())
        if reset:
            self.counters.reset_window()
        return out

    def collect(self) -> Iterator[Metric]:
        yield from counter_families(self.counters, HELP)
        yield from gauge_families(self.gauges(), GAUGE_HELP)


__all__ = ["AnsweredThenCancelled", "Dynamo", "DynamoHttp", "Translated", "Turn"]
