"""Session lifecycle: track each session's requests, close sessions on every engine.

The asyncio shell around :class:`~kvproxy.sessions.table.SessionTable`. The proxy
wraps each intercepted request of a session in :meth:`SessionManager.track` and calls
:meth:`SessionManager.close` when a session ends. The close sequence:

1. the session is marked closing: new requests of it get :class:`SessionClosed`;
2. requests still queued in the proxy get :class:`SessionClosed` (at once);
3. forwarded requests are aborted on every engine (``on_close: abort``) and then
   awaited, or awaited first and the leftovers aborted (``on_close: wait``);
4. ``POST /close_session {"session_id"}`` goes to every engine base URL in parallel,
   bounded by ``close_timeout_s``;
5. the session becomes a tombstone; a later request with the same id starts a new
   session.

One task per session runs the sequence; concurrent and repeated closes await that
task (shielded, so a caller that goes away does not cancel it). Engine failures are
counted and logged (rate-limited), never raised.

Pure parts: :mod:`~kvproxy.sessions.lifecycle_core`, :mod:`~kvproxy.sessions.lifecycle_metrics`
(importable from here too); the request handle: :mod:`~kvproxy.sessions.tracked`. With
``state.backend: redis`` the table is shared with other replicas (:mod:`kvproxy.state`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from prometheus_client.core import Metric

from kvproxy.config import SessionLifecycleConfig, StateConfig
from kvproxy.credentials import fingerprint
from kvproxy.fleet.client import EngineHttp
from kvproxy.fleet.engine_info import mode_warnings
from kvproxy.fleet.fanout import post_to_all
from kvproxy.observability import WindowedCounters, counter_families, gauge_families
from kvproxy.sessions.identity import SKIP_SESSION_PARAMS, InjectionPlan
from kvproxy.sessions.lifecycle_core import (
    CloseResult,
    SessionClosed,
    SessionForbidden,
    SessionsHealth,
    WarnThrottle,
    base_urls,
    reap_interval_s,
    reconfigure_plan,
    sessions_health,
    wants_checker,
    wants_reaper,
)
from kvproxy.sessions.lifecycle_metrics import (
    ABORT_FAILURE,
    ABORTED_REQUESTS,
    CLOSE,
    CLOSE_FAILURE,
    CLOSED_FINAL,
    CLOSED_IDLE,
    CLOSED_REMEMBERED,
    CLOSED_WITH_PARENT,
    CLOSING,
    COUNTER_HELP,
    DISCONNECT_ABORTS,
    EVICTED,
    FORWARDED_REQUESTS,
    GAUGE_HELP,
    INJECTED,
    INJECTION_SKIPPED,
    LIFECYCLE_ENABLED,
    LINK_COUNTERS,
    NOTE_COUNTERS,
    OPEN,
    QUEUED_REQUESTS,
    REJECTED_CLOSING,
    REJECTED_QUEUED,
    REOPENED,
    STARTED,
    table_gauges,
)
from kvproxy.sessions.listing import session_tree, sessions_page
from kvproxy.sessions.mode_check import EngineModeCheck
from kvproxy.sessions.replicas import shared_state
from kvproxy.sessions.table import CloseStatus, SessionState, SessionTable
from kvproxy.sessions.tracked import TrackedRequest, Tracking
from kvproxy.state.shared import SharedState, Store

# Names the proxy, the admin views and the tests import from here.
__all__ = [
    "ABORTED_REQUESTS",
    "ABORT_FAILURE",
    "CLOSE",
    "CLOSED_FINAL",
    "CLOSED_IDLE",
    "CLOSED_REMEMBERED",
    "CLOSE_FAILURE",
    "CLOSING",
    "COUNTER_HELP",
    "DISCONNECT_ABORTS",
    "EVICTED",
    "FORWARDED_REQUESTS",
    "GAUGE_HELP",
    "INJECTED",
    "INJECTION_SKIPPED",
    "LIFECYCLE_ENABLED",
    "OPEN",
    "QUEUED_REQUESTS",
    "REJECTED_CLOSING",
    "REJECTED_QUEUED",
    "REOPENED",
    "STARTED",
    "CloseResult",
    "SessionClosed",
    "SessionForbidden",
    "SessionManager",
    "SessionsHealth",
    "TrackedRequest",
]

log = logging.getLogger(__name__)

# At most one WARNING per (engine, operation) in this many seconds.
_WARN_INTERVAL_S = 30.0
_WARN_KEYS_MAX = 1024


class SessionManager:
    """Owns the session table, the close tasks and the engine session-mode check."""

    def __init__(
        self,
        cfg: SessionLifecycleConfig,
        *,
        all_engines: Callable[[], Sequence[str]],
        http: EngineHttp,
        clock: Callable[[], float] = time.monotonic,
        on_closed: Callable[[str], None] | None = None,
        store: Store | None = None,
        state: StateConfig | None = None,
    ) -> None:
        self._cfg = cfg
        # Told the id of every session whose close sequence has finished (admission
        # stops counting the session's KV as resident).
        self._on_closed = on_closed
        self._all_engines = all_engines
        self._http = http
        self._clock = clock
        self._table = SessionTable(
            max_sessions=cfg.max_sessions,
            closed_ttl_s=cfg.closed_ttl_s,
            idle_timeout_s=cfg.idle_timeout_s,
            max_children=cfg.max_children,
        )
        self._counters = WindowedCounters(COUNTER_HELP)
        self._requests: dict[int, TrackedRequest] = {}
        # Bounds the /abort_request and /close_session posts in flight, all together.
        self._fanout_limit = asyncio.Semaphore(cfg.fanout_concurrency)
        self._closes: dict[str, asyncio.Task[CloseResult]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._checker: asyncio.Task[None] | None = None
        self._started = False
        self._mode_check = EngineModeCheck(http, self._engines)
        self._warnings = WarnThrottle(_WARN_INTERVAL_S, _WARN_KEYS_MAX)
        self._shared: SharedState | None = None
        if store is not None:
            self._shared = shared_state(self, store, state or StateConfig(backend="redis"))

    # -- configuration and background tasks -----------------------------------

    @property
    def config(self) -> SessionLifecycleConfig:
        return self._cfg

    @property
    def enabled(self) -> bool:
        return self._cfg.enabled

    async def start(self) -> None:
        """Start the idle reaper (if idle_timeout_s) and schedule the engine check."""
        self._started = True
        if self._shared is not None and self._cfg.enabled:
            await self._shared.start()
        self._start_tasks(reaper=True, checker=True)

    async def stop(self) -> None:
        """Stop background tasks; let running closes finish, bounded, then cancel them."""
        self._started = False
        await self._stop_task("_reaper")
        await self._stop_task("_checker")
        pending = [t for t in (*self._closes.values(), *self._background) if not t.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=self._cfg.close_timeout_s + 1.0)
            for task in late:
                task.cancel()
            if late:
                await asyncio.gather(*late, return_exceptions=True)
        if self._shared is not None and self._shared.started:
            await self._shared.stop()

    async def reconfigure(self, cfg: SessionLifecycleConfig) -> None:
        """Apply a new configuration (table bounds, timeouts, background tasks)."""
        old, self._cfg = self._cfg, cfg
        self._table.configure(
            max_sessions=cfg.max_sessions,
            closed_ttl_s=cfg.closed_ttl_s,
            idle_timeout_s=cfg.idle_timeout_s,
        )
        if cfg.fanout_concurrency != old.fanout_concurrency:
            # Posts holding the old semaphore finish under it; new ones take this one.
            self._fanout_limit = asyncio.Semaphore(cfg.fanout_concurrency)
        if not self._started:
            return
        plan = reconfigure_plan(old, cfg)
        if plan.stop_reaper:
            await self._stop_task("_reaper")
        if plan.stop_checker:
            await self._stop_task("_checker")
        self._start_tasks(reaper=plan.start_reaper, checker=plan.start_checker)

    def _start_tasks(self, *, reaper: bool, checker: bool) -> None:
        cfg = self._cfg
        if reaper and wants_reaper(cfg) and self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_loop(), name="kvproxy-session-reaper")
        if checker and wants_checker(cfg) and self._checker is None:
            self._mode_check.state = "pending"
            self._checker = asyncio.create_task(
                self._mode_check.run(), name="kvproxy-session-engine-check"
            )

    async def _stop_task(self, attr: str) -> None:
        task: asyncio.Task[None] | None = getattr(self, attr)
        setattr(self, attr, None)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _engines(self) -> list[str]:
        try:
            return base_urls(self._all_engines())
        except Exception:
            log.exception("listing engines failed")
            return []

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- requests --------------------------------------------------------------

    def state(self, session_id: str) -> str | None:
        """``open``, ``closing``, ``closed`` (remembered) or None (unknown)."""
        st = self._table.state(session_id)
        return None if st is None else str(st)

    def note_injection(self, plan: InjectionPlan) -> None:
        """Count what :func:`~kvproxy.sessions.identity.injection_plan` decided."""
        if plan.skip_reason == SKIP_SESSION_PARAMS:  # plan.counts_as_skipped, inlined
            self._counters.inc(INJECTION_SKIPPED)
        elif "session_id" in plan.fields:  # plan.injects_session_id
            self._counters.inc(INJECTED)
        for note in plan.notes:  # the identity's (kvproxy.sessions.identity NOTE_*)
            self._counters.inc(NOTE_COUNTERS[note])

    def track(
        self,
        session_id: str,
        rid: str,
        *,
        close_after: bool,
        abort_rids: Sequence[str] | None = None,
    ) -> AbstractAsyncContextManager[TrackedRequest]:
        """Track one request of ``session_id`` while it is in the proxy.

        Entering registers it as queued; a session that is closing raises
        :class:`SessionClosed` at once, and a session whose close completed starts
        again as a new session. Leaving removes it. With ``close_after`` the session's
        close starts once the request has left (scheduled, not awaited).
        ``abort_rids`` (default ``(rid,)``) are the rids an abort must name.
        """
        rids = tuple(abort_rids) if abort_rids else (rid,)
        return Tracking(self, session_id, rid, rids, close_after)

    def enter(
        self,
        session_id: str,
        rid: str,
        rids: tuple[str, ...],
        close_after: bool,
        *,
        forwarded: bool = False,
        headers: Mapping[str, str] | None = None,
        parent: str | None = None,
    ) -> TrackedRequest:
        """:meth:`track` without the context manager, for the request path (no
        coroutine per step): the caller calls :meth:`leave` on every path after it.
        ``rids``: the rids an abort must name (at least ``rid``). ``forwarded``: the
        request goes upstream with nothing awaited before (no admission wait), so it
        is entered as forwarded (as if :meth:`TrackedRequest.forwarded` followed).
        ``headers``: the request's, whose data-plane credential a new session is bound
        to (``bind_credential``); a session bound to another raises
        :class:`SessionForbidden`. ``parent``: the session's parent, linked in the table
        (counted)."""
        owner = None
        if headers is not None and self._cfg.bind_credential:
            owner = fingerprint(headers)
        begin = self._table.begin(session_id, self._clock(), rids if forwarded else None, owner)
        if begin.token is None:
            if begin.forbidden:
                raise SessionForbidden(session_id)
            self._counters.inc(REJECTED_CLOSING)
            raise SessionClosed(session_id)
        if begin.created:
            self._counters.inc(STARTED)
        if begin.reopened:
            self._counters.inc(REOPENED)
        if begin.evicted:
            self._counters.inc(EVICTED, len(begin.evicted))
        if parent is not None:
            outcome = self._table.link(session_id, parent)
            counter = LINK_COUNTERS.get(outcome)  # none for a link already known
            if counter is not None:
                self._counters.inc(counter)
        req = TrackedRequest(self, session_id, begin.token, rid, rids, close_after)
        req._forwarded = forwarded
        self._requests[begin.token] = req
        if self._shared is not None:
            self._shared.begin(session_id, close_after, rids)
        return req

    def leave(self, req: TrackedRequest) -> None:
        """The request :meth:`enter` returned has left the proxy (any outcome)."""
        session_id = req.session_id
        self._requests.pop(req.token, None)
        self._table.end(session_id, req.token, self._clock())
        req._left = True
        if self._shared is not None:
            self._shared.end(session_id, req.abort_rids)
        finished = req._finished
        if finished is not None and not finished.done():
            finished.set_result(None)
        if (
            req.close_after
            and self._cfg.enabled
            and session_id not in self._closes
            and self._begin_close(session_id, "final_turn") is not None
        ):
            self._counters.inc(CLOSED_FINAL)

    def _mark_forwarded(self, req: TrackedRequest) -> None:
        self._table.forwarded(req.session_id, req.token, req.abort_rids, self._clock())

    def _abort_on_disconnect(self, req: TrackedRequest) -> None:
        self._counters.inc(DISCONNECT_ABORTS)
        self._counters.inc(ABORTED_REQUESTS)
        self._spawn(self._abort(req.abort_rids), name=f"kvproxy-abort-{req.rid}")

    def abort_in_background(self, rids: Sequence[str]) -> None:
        """Abort forwarded requests that belong to no session (e.g. client disconnect)."""
        if rids:
            self._counters.inc(DISCONNECT_ABORTS)
            self._counters.inc(ABORTED_REQUESTS)
            self._spawn(self._abort(tuple(rids)), name="kvproxy-abort")

    def abort_orphans(self, rids: Sequence[str]) -> None:
        """Abort the requests a replica gone had in flight (the shared sweep took them:
        no other replica aborts them), on every engine, in the background."""
        if rids:
            self._spawn(self._abort(tuple(rids)), name="kvproxy-orphan-abort")

    async def _abort(self, rids: Sequence[str]) -> bool:
        """POST /abort_request for every rid to every engine; True if all succeeded."""
        urls = self._engines()
        if not rids or not urls:
            return not rids
        timeout_s = self._cfg.close_timeout_s
        results = await asyncio.gather(
            *(
                post_to_all(
                    self._http,
                    urls,
                    "/abort_request",
                    {"rid": rid},
                    timeout_s=timeout_s,
                    limit=self._fanout_limit,
                )
                for rid in rids
            )
        )
        ok = True
        for res in results:
            for url, error in res.failed.items():
                ok = False
                self._warn_engine(url, "abort_request", error)
        if not ok:
            self._counters.inc(ABORT_FAILURE)
        return ok

    # -- close -----------------------------------------------------------------

    def may_close(self, session_id: str, headers: Mapping[str, str]) -> bool:
        """Whether a request with ``headers`` may close ``session_id``: always, unless
        the session is bound (``bind_credential``) to another data-plane credential.
        (The admin token's holder may close any session: the caller checks it.)"""
        if not self._cfg.bind_credential:
            return True
        owner = self._table.owner(session_id)
        if owner is None:
            return True
        mine = fingerprint(headers)
        return mine is not None and hmac.compare_digest(owner, mine)

    async def close(self, session_id: str, *, reason: str) -> CloseResult:
        """Close ``session_id`` (the close sequence); idempotent, never raises for engines.

        Concurrent callers await the same close. A session closed earlier (and still
        remembered) answers ``already_closed`` without contacting the engines. A
        session the proxy never saw is closed on the engines all the same.
        """
        if not self._cfg.enabled:
            return CloseResult(session_id, reason=reason, note="session lifecycle is disabled")
        task = self._closes.get(session_id) or self._begin_close(session_id, reason)
        if task is None:
            return CloseResult(session_id, reason=reason, already_closed=True)
        return await asyncio.shield(task)

    def _begin_close(
        self, session_id: str, reason: str, *, fan_out: bool = True
    ) -> asyncio.Task[CloseResult] | None:
        """Start the close (synchronously rejecting queued requests); None if closed."""
        task = self._closes.get(session_id)
        if task is not None:
            return task
        start = self._table.start_close(session_id, self._clock())
        if start.status is not CloseStatus.STARTED:
            # CLOSED: a tombstone. CLOSING without a task cannot happen: every close
            # goes through here and the task removes itself only after finish_close.
            return None
        rejected = 0
        for token in start.queued:
            req = self._requests.get(token)
            if req is not None:
                req._reject()
                rejected += 1
        if rejected:
            self._counters.inc(REJECTED_QUEUED, rejected)
        if self._cfg.close_children:
            self._close_children(session_id)
        task = asyncio.create_task(
            self._close_sequence(session_id, reason, rejected, start.forwarded, fan_out),
            name=f"kvproxy-close-{session_id}",
        )
        self._closes[session_id] = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if self._on_closed is not None:
            on_closed = self._on_closed
            task.add_done_callback(lambda _task: on_closed(session_id))
        return task

    def _close_children(self, session_id: str) -> None:
        """Close the session's children still open (session_lifecycle.close_children),
        each with its own close sequence (and so its own children, the tree bounded
        by the table's links and cycle check)."""
        for child in sorted(self._table.children(session_id)):
            if (
                self._table.state(child) is SessionState.OPEN
                and child not in self._closes
                and self._begin_close(child, "parent_closed") is not None
            ):
                self._counters.inc(CLOSED_WITH_PARENT)

    async def _close_sequence(
        self,
        session_id: str,
        reason: str,
        rejected: int,
        forwarded: tuple[tuple[int, tuple[str, ...]], ...],
        fan_out: bool = True,
    ) -> CloseResult:
        cfg = self._cfg
        result = CloseResult(session_id, rejected_queued=rejected, reason=reason)
        failed = True
        shared = self._shared
        if fan_out and shared is not None:
            # Exactly one replica fans the close out: the one whose claim wins (None:
            # the store is unavailable, and the close goes out unclaimed).
            fan_out = await shared.claim_close(session_id) is not False
        try:
            await self._settle_requests(result, forwarded)
            if not fan_out:
                result.note = "closed by another replica"
                failed = False
                return result
            urls = self._engines()
            fan = await post_to_all(
                self._http,
                urls,
                "/close_session",
                {"session_id": session_id},
                timeout_s=cfg.close_timeout_s,
                limit=self._fanout_limit,
            )
            result.engines_told = len(fan.ok)
            result.engines_failed = len(fan.failed)
            result.failures = fan.failed
            for url, error in fan.failed.items():
                self._warn_engine(url, "close_session", error)
            if not urls:
                result.note = "no engines known"
                self._warn_engine("-", "close_session", "no engines known; nothing was told")
            failed = bool(fan.failed) or not urls
        except Exception:
            log.exception("closing session %s failed", session_id)
            result.note = "internal error during close"
        finally:
            self._table.finish_close(session_id, self._clock())
            if self._closes.get(session_id) is asyncio.current_task():
                del self._closes[session_id]
            if fan_out:
                self._counters.inc(CLOSE)
                if shared is not None:
                    shared.finish_close(session_id)
            if failed:
                self._counters.inc(CLOSE_FAILURE)
        log.debug(
            "session %s closed (%s): told %d, failed %d, aborted %d, awaited %d, rejected %d",
            session_id,
            reason,
            result.engines_told,
            result.engines_failed,
            result.aborted,
            result.awaited,
            result.rejected_queued,
        )
        return result

    async def _settle_requests(
        self, result: CloseResult, forwarded: tuple[tuple[int, tuple[str, ...]], ...]
    ) -> None:
        """The close's forwarded requests: aborted then awaited (``on_close: abort``),
        or awaited and the leftovers aborted (``wait``)."""
        cfg = self._cfg
        tokens = [token for token, _ in forwarded]
        rids_of = dict(forwarded)
        if tokens and cfg.on_close == "wait":
            done = await self._wait_finished(tokens, cfg.wait_timeout_s)
            result.awaited = len(done)
            leftovers = [t for t in tokens if t not in done]
            if leftovers:
                await self._abort_for_close(leftovers, rids_of)
                result.aborted = len(leftovers)
                await self._wait_finished(leftovers, cfg.close_timeout_s)
        elif tokens:
            await self._abort_for_close(tokens, rids_of)
            result.aborted = len(tokens)
            await self._wait_finished(tokens, cfg.wait_timeout_s)

    async def _abort_for_close(
        self, tokens: list[int], rids_of: dict[int, tuple[str, ...]]
    ) -> None:
        rids: list[str] = []
        for token in tokens:
            req = self._requests.get(token)
            if req is not None:
                req._abort_sent = True
            rids.extend(rids_of.get(token, ()))
        self._counters.inc(ABORTED_REQUESTS, len(tokens))
        await self._abort(rids)

    async def _wait_finished(self, tokens: list[int], timeout_s: float) -> set[int]:
        """Wait up to ``timeout_s`` for these requests to leave the proxy; the ones that did."""
        waiting: dict[asyncio.Future[None], int] = {}
        for token in tokens:
            req = self._requests.get(token)
            if req is not None and not req._left:
                waiting[req._until_left()] = token
        if waiting and timeout_s > 0:
            await asyncio.wait(waiting, timeout=timeout_s)
        still_running = {tok for fut, tok in waiting.items() if not fut.done()}
        return {t for t in tokens if t not in still_running}

    # -- idle timeout ----------------------------------------------------------

    def reap_idle(self) -> list[str]:
        """Start the close of every session idle for idle_timeout_s; returns their ids."""
        now = self._clock()
        self._table.prune(now)
        started: list[str] = []
        if self._shared is not None and self._shared.up:
            return started  # the shared sweep decides (it knows the other replicas' turns)
        for sid in self._table.expired(now):
            if self._begin_close(sid, "idle") is not None:
                self._counters.inc(CLOSED_IDLE)
                started.append(sid)
        return started

    async def _reap_loop(self) -> None:
        while True:
            idle = self._cfg.idle_timeout_s
            if idle is None or not self._cfg.enabled:
                return
            await asyncio.sleep(reap_interval_s(idle))
            try:
                self.reap_idle()
            except Exception:
                log.exception("idle session sweep failed")

    # -- engine session-mode check ---------------------------------------------

    async def check_engines(self) -> bool:
        """Probe engines whose session mode is not known yet (:mod:`.mode_check`)."""
        return await self._mode_check.check()

    def listing(self, *, after: str | None, limit: int) -> dict[str, Any]:
        """One page of the live sessions with their parents and children
        (``GET /kvproxy/sessions``; kvproxy.sessions.listing)."""
        return sessions_page(self._table, self._clock(), after=after, limit=limit)

    def tree(self) -> list[dict[str, Any]]:
        """The recently active parents and their children (the dashboard's tree)."""
        return session_tree(self._table, self._clock())

    def health(self) -> SessionsHealth:
        """Engine session modes found by the start-up check, and warnings."""
        cfg = self._cfg
        if not cfg.enabled:
            return SessionsHealth(enabled=False)
        return sessions_health(
            cfg,
            mode_docs={u: m.to_json() for u, m in self._mode_check.modes.items()},
            mode_warnings=mode_warnings(list(self._mode_check.modes.values())),
            probe_errors=self._mode_check.probe_errors,
            engines=self._engines() if cfg.check_engines else (),
            check_state=self._mode_check.state,
            open_count=self._table.open_count,
            closing_count=self._table.closing_count,
        )

    def state_health(self) -> dict[str, Any]:  # GET /kvproxy/health's "state"
        return {"backend": "memory"} if self._shared is None else self._shared.health()

    # -- metrics ---------------------------------------------------------------

    def _gauges(self) -> dict[str, float]:
        return table_gauges(self._table)

    def totals(self) -> Mapping[str, float]:
        """Cumulative counters since start (never reset by the stats window)."""
        return self._counters.total_items()

    def stats(self, *, reset: bool = False) -> dict[str, float]:
        """JSON stats: window counters (reset when ``reset``) and current gauges.

        Empty when the feature is disabled (``lifecycle_enabled`` is then absent).
        """
        out: dict[str, float] = {}
        if self._cfg.enabled:
            out[LIFECYCLE_ENABLED] = 1.0
            out.update(self._counters.window_items())
            out.update(self._gauges())
        if reset:
            self._counters.reset_window()
        return out

    def collect(self) -> Iterator[Metric]:
        """prometheus-client custom collector: cumulative counters and gauges."""
        yield from gauge_families(
            {LIFECYCLE_ENABLED: 1.0 if self._cfg.enabled else 0.0}, GAUGE_HELP
        )
        yield from counter_families(self._counters, COUNTER_HELP)
        yield from gauge_families(self._gauges(), GAUGE_HELP)
        if self._shared is not None:
            yield from self._shared.collect()

    # -- logging ---------------------------------------------------------------

    def _warn_engine(self, url: str, operation: str, error: str) -> None:
        """WARNING about an engine failure, at most once per engine and operation per 30 s."""
        suppressed = self._warnings.admit((url, operation), time.monotonic())
        if suppressed is None:
            return
        log.warning(
            "session lifecycle: %s on engine %s failed: %s%s",
            operation,
            url,
            error,
            f" ({suppressed} similar failures suppressed)" if suppressed else "",
        )
