"""The admission controller: each request to its mode's gate (asyncio shell).

One :class:`AdmissionController` per proxy process is admission's only writer: every
decision, release and poll runs on the event loop without awaiting in between, so
nothing needs a lock. Decision order (:meth:`AdmissionController.admit`): admission
off -> ``pass``/``disabled``; out of scope -> ``pass``/``out_of_scope`` (neither
counted); protected -> ``bypass``/``protected``; else the gate of the mode
(:class:`~kvproxy.admission.gate.Gate`, one per :class:`~kvproxy.admission.records.Mode`)
decides: program mode's when it is active (mode ``program``, ledger ``engine``, a
router policy kvproxy can mirror), else fleet mode's. A lease and a waiter carry their
mode back to their gate; a lease is released exactly once when the ``async with``
block exits. Its bases show (:mod:`kvproxy.admission.view`) and steer program mode
(:mod:`kvproxy.admission.controls`); its parts are wired once
(:mod:`kvproxy.admission.wiring`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from kvproxy.admission import classify
from kvproxy.admission.catalogue import C_BYPASS, C_BYPASS_PROTECTED, C_POLL_ERROR, C_SESSION_ENDED
from kvproxy.admission.controls import ProgramControls
from kvproxy.admission.poller import Loops
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.records import (
    BYPASS_PROTECTED,
    PASS_DISABLED,
    PASS_OUT_OF_SCOPE,
    AdmissionRequest,
    Decision,
    Mode,
    Outcome,
)
from kvproxy.admission.scaling import residency_of, time_scaled, token_scaled
from kvproxy.admission.waiters import Admission, Waiter
from kvproxy.admission.wiring import build
from kvproxy.config import AdmissionConfig
from kvproxy.fleet.client import EngineHttp
from kvproxy.observability import RateLimitedLog

log = logging.getLogger(__name__)
_LOG_INTERVAL_S = 30.0  # minimum seconds between two log lines of the same kind
# What each gate's waiters leave as when admission stops, and when a reload turns it off.
_ON_STOP = {Mode.FLEET: Outcome.DEGRADED, Mode.PROGRAM: Outcome.BYPASS_NO_METRICS}
_ON_DISABLE = {Mode.FLEET: Outcome.DISABLED, Mode.PROGRAM: Outcome.BYPASS_NO_METRICS}
_END_ORDER = (Mode.PROGRAM, Mode.FLEET)  # a closed session leaves program mode's first


class AdmissionController(ProgramControls):
    """Program-aware admission in front of the router. See the module docstring."""

    def __init__(
        self,
        cfg: AdmissionConfig,
        *,
        healthy_engines: Callable[[], Sequence[str]],
        http: EngineHttp | None,
        clock: Callable[[], float] | None = None,
        fetch_metrics: Callable[[str], Awaitable[str]] | None = None,
        router_policy: str | None = None,
        workers: Callable[[], tuple[Sequence[str], Sequence[str]]] | None = None,
        server_info: Mapping[str, Mapping[str, Any]] | None = None,
        time_scale: float = 1.0,
        token_scale: int = 1,
        router_metrics_url: str | None = None,
        router_url: str | None = None,
    ) -> None:
        """``healthy_engines``: engine URLs to poll; ``router_policy``: the router's
        (None: unknown); ``workers``: the ring's (registered, available) URLs (default:
        the healthy engines); ``server_info``: the engines' (else read over ``http``);
        ``time_scale`` / ``token_scale`` scale ``cfg``; time is the loop's by default."""
        self._log = RateLimitedLog(log, _LOG_INTERVAL_S)
        self._time_scale, self._token_scale = time_scale, token_scale
        self._raw_cfg = token_scaled(cfg, token_scale)
        self._cfg = time_scaled(self._raw_cfg, time_scale)
        self._healthy_engines = healthy_engines
        self._clock = clock = clock or _loop_time
        self._router_metrics_url = router_metrics_url
        self._p = p = build(
            self._cfg, ProgramParams.from_config(self._raw_cfg, time_scale), http=http,
            fetch_metrics=fetch_metrics, metrics_timeout_s=lambda: self._cfg.metrics_timeout_s,
            router_policy=router_policy, workers=workers, router_url=router_url, clock=clock,
            log=self._log,
        )  # fmt: skip
        self._counters, self._program, self._gates = p.counters, p.program, p.gates
        # Program mode's core, the fleet ledger, the prefetch sender: read by the app.
        self.program, self.ledger, self.prefetcher = p.core, p.ledger, p.prefetcher
        for url, info in (server_info or {}).items():
            self.set_server_info(url, info)
        self._loops = Loops(p.counters, self._log)

    async def start(self) -> None:
        """If enabled: one poll, then the background poll and tick tasks."""
        if not self._cfg.enabled or self._loops.running:
            return
        await self.poll_once()
        program = self._program
        self._loops.start(
            lambda: self._cfg.poll_interval_s, self.poll_once,
            lambda: self.program.p.tick_s, program.tick_if_busy,
        )  # fmt: skip
        program.say_fallback()

    async def stop(self) -> None:
        """Stop polling and the timers; every waiter leaves (fail open)."""
        await self._loops.stop()
        await self.prefetcher.stop()
        for mode, gate in self._gates.items():
            gate.release_all(_ON_STOP[mode])
        self.ledger.clear_engines()
        self.ledger.clear_residency()

    async def reconfigure(self, cfg: AdmissionConfig) -> None:
        """Hot reload. Thresholds apply to the next decision; toggling starts or stops."""
        was_enabled = self._cfg.enabled
        self._raw_cfg = token_scaled(cfg, self._token_scale)
        self.program.configure(ProgramParams.from_config(self._raw_cfg, self._time_scale))
        self._cfg = cfg = time_scaled(self._raw_cfg, self._time_scale)
        self._p.sizer.configure(cfg)
        for gate in self._gates.values():
            gate.configure(cfg)
        if was_enabled and not cfg.enabled:
            await self._loops.stop()
            for mode, gate in self._gates.items():
                gate.release_all(_ON_DISABLE[mode])
            self.program.clear()
            self.ledger.clear_engines()
            self.ledger.clear_residency()
        elif cfg.enabled and not was_enabled:
            await self.start()
        elif cfg.enabled:
            for gate in self._gates.values():
                gate.rearm()  # max_wait_s may have changed; program mode may be off

    # -- decisions ---------------------------------------------------------------------

    def admit(self, req: AdmissionRequest) -> Admission:
        """Decide for one upstream attempt when the ``async with`` block is entered.
        Cancelled while waiting, the ticket is cancelled atomically and CancelledError
        propagates; a granted lease is released once when the block exits."""
        return Admission(self, req)

    def _decide(self, req: AdmissionRequest) -> Decision | tuple[Waiter, bool]:
        cfg = self._cfg
        if not cfg.enabled:
            return PASS_DISABLED
        if not classify.in_scope(cfg, req.path, req.headers):
            return PASS_OUT_OF_SCOPE
        if classify.is_protected(cfg, req.headers, req.body):
            self._counters.inc(C_BYPASS)
            self._counters.inc(C_BYPASS_PROTECTED)
            return BYPASS_PROTECTED
        return self._gates[Mode.PROGRAM if self._program.active else Mode.FLEET].decide(req)

    def _cancel_waiter(self, w: Waiter) -> None:
        self._gates[w.mode].cancel(w, self._clock())

    def _release(self, mode: Mode, lease_id: str, ticket: str) -> None:
        self._gates[mode].release(lease_id, ticket, self._clock())

    def _aged_turn_ended(self, req: AdmissionRequest, tokens: int) -> None:
        """An aged (lease-less) turn of a session ended: the session is resident now."""
        if self._cfg.enabled and residency_of(self._cfg) and req.session_id is not None:
            self.ledger.note_unleased_turn(req.session_id, tokens, self._clock())

    def end_session(self, session_id: str) -> None:
        """The session closed: each gate forgets it (idempotent), freeing room. Its
        waiting requests stay (their owner cancels them); a live lease of it is
        released normally."""
        for mode in _END_ORDER:
            if self._gates[mode].end_session(session_id, self._clock()):
                self._counters.inc(C_SESSION_ENDED)

    def drain_program(self) -> None:
        """Release the program gate's waiting turns that may go now (another replica's
        records changed the ledger: :mod:`kvproxy.replication.sync`)."""
        self._gates[Mode.PROGRAM].drain(self._clock())

    def learns_from(self, req: AdmissionRequest) -> bool:
        """Whether the engine's usage report for ``req`` (decided) teaches anything."""
        return self._cfg.enabled and self._p.learning.learns_from(req)

    def observe_usage(
        self,
        req: AdmissionRequest,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        completion_tokens: int | None = None,
    ) -> None:
        """Learn from what an engine reported for a finished request (sizes, context)."""
        now, enabled = self._clock(), self._cfg.enabled
        self._p.learning.observe(
            req, now, prompt_tokens, cached_tokens, completion_tokens, enabled=enabled
        )

    async def poll_once(self) -> None:
        """Scrape every healthy engine once and reconcile the ledgers; never raises."""
        try:
            urls = list(dict.fromkeys(self._healthy_engines()))
            program, cfg, poller = self._program, self._cfg, self._p.poller
            program.refresh_placement(urls)
            if cfg.priority_steering or cfg.growth_reservation:
                for mode in await poller.probe(urls, program.modes):
                    program.note_mode(mode)
            results = await poller.scrape(urls)
            now = self._clock()
            poller.observe(urls, results, now, self.ledger, self.program.ledger)
            if self._router_metrics_url is not None and program.active:
                await poller.check_diversion(self._router_metrics_url)
            self._p.fleet.housekeep(now, self._cfg.session_idle_s)
            self._gates[Mode.FLEET].drain(now)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._counters.inc(C_POLL_ERROR)
            self._log.warning("poll", "admission: poll iteration failed", exc_info=True)


def _loop_time() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
