"""Wiring, written once: the proxy's three stateful features built together, no I/O.

:class:`Features` builds the session lifecycle
(:class:`~kvproxy.sessions.lifecycle.SessionManager`), Dynamo
(:class:`~kvproxy.dynamo.control.Dynamo`) and admission
(:class:`~kvproxy.admission.coordinator.AdmissionController`) from one running config
and the edges that differ between the server and the lab: the control plane's HTTP
client, the fleet's view (which engines, the router's ring), the clocks, and how the
engines' ``/metrics`` and ``/server_info`` are read. The application factory
(:mod:`kvproxy.app`) and the lab (``kvlab.lab.proxy.LabProxy``) both use it.

The features call one another through this object's own methods, so each is
constructed with everything it needs and none looks another up later:

- a finished session close ends the session's admission residency and its Dynamo state
  (:meth:`Features.session_closed`);
- Dynamo's bind timeout closes a session through the lifecycle, and its prefills ask
  whether the session is open and whether its engine is under KV pressure (admission's
  readings: :meth:`Features.pressure`, :func:`admission_engine_kv`).

Given a store for it (``admission_store``), program admission's ledger is shared with
the other replicas (:class:`~kvproxy.replication.sync.AdmissionSync`, built here with
the coordinator it drains: another replica's records may let a waiting turn go).

They start in the order sessions, Dynamo, admission, its replication, and stop in
reverse (:meth:`Features.running`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import Metric

from kvproxy.admission.coordinator import AdmissionController
from kvproxy.config import LiveConfig
from kvproxy.dynamo.control import Dynamo, DynamoHttp
from kvproxy.sessions.lifecycle import SessionManager
from kvproxy.state.shared import Store, replica_name

if TYPE_CHECKING:
    from kvproxy.replication.sync import AdmissionSync, Channel


class FleetView(Protocol):
    """Which engines there are (:class:`~kvproxy.fleet.registry.Fleet`, or the lab's)."""

    def all_engines(self) -> Sequence[str]: ...

    def healthy_engines(self) -> Sequence[str]: ...

    def ring_workers(self) -> tuple[tuple[str, ...], tuple[str, ...]]: ...


class Features:
    """The session lifecycle, Dynamo and admission of one proxy, wired together."""

    def __init__(
        self,
        live: LiveConfig,
        *,
        http: DynamoHttp,
        fleet: FleetView,
        clock: Callable[[], float],
        timers: Callable[[], float] = time.monotonic,
        store: Store | None = None,
        admission_store: Channel | None = None,
        fetch_metrics: Callable[[str], Awaitable[str]] | None = None,
        server_info: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """``http``: the control plane's client (aiohttp's session, or the lab's
        engines); ``clock``: the event loop's (admission's decisions); ``timers``: the
        session table's and Dynamo's timers; ``store``: the session table shared with
        other replicas; ``admission_store``: the channel program admission's ledger is
        shared on with them (None: this process's alone); ``fetch_metrics`` and
        ``server_info``: how admission reads the engines (None: over ``http``)."""
        self.live = live
        config = live.config
        self.sessions = SessionManager(
            config.session_lifecycle,
            all_engines=fleet.all_engines,
            http=http,
            clock=timers,
            on_closed=self.session_closed,
            store=store,
            state=config.state,
        )
        self.dynamo = Dynamo(
            config,
            http=http,
            router_base=live.router_base,
            ring_workers=fleet.ring_workers,
            close_session=self.bind_timeout,
            session_open=self.session_open,
            pressure=self.pressure,
            engine_kv=self.engine_kv,
            clock=timers,
        )
        self.admission = AdmissionController(
            config.admission,
            healthy_engines=fleet.healthy_engines,
            http=http,
            fetch_metrics=fetch_metrics,
            clock=clock,
            router_policy=config.router.policy,
            workers=fleet.ring_workers,
            server_info=server_info,
            time_scale=config.server.time_scale,
            token_scale=config.server.token_scale,
            router_metrics_url=config.router.metrics_url,
            router_url=config.router.url,
        )
        self.replication = (
            None
            if admission_store is None
            else _replication(live, admission_store, self.admission, clock)
        )

    # -- how the features call one another ----------------------------------------------
    def session_closed(self, session_id: str) -> None:
        """A session's close sequence finished: its KV is no longer resident (admission
        stops counting it) and its streaming slot and bind timer go."""
        self.admission.end_session(session_id)
        self.dynamo.session_closed(session_id)

    async def bind_timeout(self, session_id: str) -> None:
        await self.sessions.close(session_id, reason="bind_timeout")

    def session_open(self, session_id: str) -> bool:
        return self.sessions.state(session_id) == "open"

    def pressure(self, engine: str | None) -> bool:
        """The engine's KV usage at or past the admission pressure threshold (the
        fleet's highest when placement is unknown); known only with admission on."""
        config = self.live.config.admission
        if not config.enabled:
            return False
        if engine is None:
            usage: float | None = self.admission.ledger.pressure
        else:
            usage = self.admission.engine_usage(engine)
        return usage is not None and usage >= config.pressure_threshold

    def engine_kv(self, engine: str) -> tuple[int | None, int | None]:
        """What admission's scrape last read of ``engine`` (its capacity and the KV its
        streaming sessions hold); nothing when admission is off."""
        if not self.live.config.admission.enabled:
            return None, None
        return admission_engine_kv(self.admission, engine)

    # -- lifecycle ---------------------------------------------------------------------
    @asynccontextmanager
    async def running(self) -> AsyncIterator[Features]:
        """Started in order (sessions, Dynamo, admission, its replication) and stopped
        in reverse, those that started also when a later one fails to."""
        features: list[SessionManager | Dynamo | AdmissionController | AdmissionSync] = [
            self.sessions,
            self.dynamo,
            self.admission,
        ]
        if self.replication is not None:
            features.append(self.replication)
        async with AsyncExitStack() as stack:
            for feature in features:
                await feature.start()
                stack.push_async_callback(feature.stop)
            yield self

    def collect(self) -> Iterator[Metric]:
        """The features' own metric families (for the app's registry)."""
        yield from self.sessions.collect()
        yield from self.admission.collect()
        yield from self.dynamo.collect()
        if self.replication is not None:
            yield from self.replication.collect()


def _replication(
    live: LiveConfig,
    store: Channel,
    admission: AdmissionController,
    clock: Callable[[], float],
) -> AdmissionSync:
    """Program admission's ledger shared with the other replicas on ``store``; it drains
    the program gate when their records may let a waiting turn go."""
    from kvproxy.replication.sync import AdmissionSync  # (only where it is shared)

    return AdmissionSync(
        live.config.state,
        store,
        admission.program,
        replica=replica_name(),
        drain=admission.drain_program,
        clock=clock,
    )


def admission_engine_kv(
    admission: AdmissionController, engine: str
) -> tuple[int | None, int | None]:
    """Program admission's per-engine reading of ``engine``: ``(max_total_num_tokens,
    streaming-held tokens)``, or ``(None, None)`` when it has none. The one place that
    reads admission's per-engine view."""
    program = admission.program
    eng = program.ledger.engines.get(engine.rstrip("/")) if program else None
    if eng is None:
        return None, None
    return eng.max_total_num_tokens, eng.streaming_held


__all__ = ["Features", "FleetView", "admission_engine_kv"]
