"""Admission's parts built from one config, each handed what it depends on.

:func:`build` makes them in dependency order: the counters and the wait histogram
both modes count in, program mode's core, the reservation sizer and its calibration
(:class:`~kvproxy.admission.learning.Learning`), the fleet-wide ledger and its FIFOs,
each mode's gate, program mode's prefetch sender, and the poller. The controller
(:mod:`kvproxy.admission.coordinator`) owns the result; nothing here runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from kvproxy.admission.catalogue import COUNTERS
from kvproxy.admission.fleet.gate import FleetGate
from kvproxy.admission.fleet.ledger import Ledger
from kvproxy.admission.fleet.queue import FleetAdmission
from kvproxy.admission.gate import Gate
from kvproxy.admission.learning import Learning
from kvproxy.admission.poller import Poller
from kvproxy.admission.program.core import ProgramCore
from kvproxy.admission.program.gate import ProgramGate
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.program.prefetch_sender import Prefetcher
from kvproxy.admission.records import Mode
from kvproxy.admission.report import WaitHistogram
from kvproxy.admission.reservation import ReservationSizer
from kvproxy.admission.scaling import residency_of
from kvproxy.config import AdmissionConfig
from kvproxy.fleet.client import EngineHttp
from kvproxy.observability import RateLimitedLog, WindowedCounters

Workers = Callable[[], tuple[Sequence[str], Sequence[str]]]


class Parts:
    """What :func:`build` made (see the module docstring)."""

    __slots__ = (
        "core",
        "counters",
        "fleet",
        "gates",
        "learning",
        "ledger",
        "poller",
        "prefetcher",
        "program",
        "sizer",
        "waits",
    )

    def __init__(
        self,
        counters: WindowedCounters,
        waits: WaitHistogram,
        core: ProgramCore,
        sizer: ReservationSizer,
        learning: Learning,
        ledger: Ledger,
        fleet: FleetAdmission,
        program: ProgramGate,
        gates: dict[Mode, Gate],
        prefetcher: Prefetcher,
        poller: Poller,
    ) -> None:
        self.counters = counters
        self.waits = waits
        self.core = core  # program mode's pure core
        self.sizer = sizer
        self.learning = learning
        self.ledger = ledger  # fleet mode's ledger (engines' readings, leases)
        self.fleet = fleet  # fleet mode's FIFOs
        self.program = program  # program mode's gate
        self.gates = gates  # each mode's gate
        self.prefetcher = prefetcher
        self.poller = poller


def build(
    cfg: AdmissionConfig,
    params: ProgramParams,
    *,
    http: EngineHttp | None,
    fetch_metrics: Callable[[str], Awaitable[str]] | None,
    metrics_timeout_s: Callable[[], float],
    router_policy: str | None,
    workers: Workers | None,
    router_url: str | None,
    clock: Callable[[], float],
    log: RateLimitedLog,
) -> Parts:
    """Admission's parts for ``cfg`` (scaled) and program mode's ``params``."""
    counters = WindowedCounters(COUNTERS)
    waits = WaitHistogram()
    core = ProgramCore(params)
    sizer = ReservationSizer(cfg)
    learning = Learning(sizer, core, log)
    ledger = Ledger(
        headroom=cfg.headroom,
        pressure_threshold=cfg.pressure_threshold,
        lease_ttl_s=cfg.lease_ttl_s,
        staleness_s=cfg.effective_staleness_s,
        session_residency=residency_of(cfg),
    )
    fleet = FleetAdmission(
        ledger, counters, waits, max_wait_s=cfg.max_wait_s, max_queue=cfg.max_queue
    )
    fleet_gate = FleetGate(
        fleet,
        residency=residency_of(cfg),
        clock=clock,
        log=log,
        size=learning.size,
        first_turn=learning.first_turn,
    )
    program = ProgramGate(
        core,
        cfg,
        router_policy=router_policy,
        workers=workers,
        counters=counters,
        waits=waits,
        clock=clock,
        log=log,
        size=learning.sized,
        first_turn=learning.first_turn,
    )
    program.prefetcher = prefetcher = Prefetcher(
        core, http, router_url, counters, cfg.prefetch_max_bytes
    )
    gates: dict[Mode, Gate] = {Mode.FLEET: fleet_gate, Mode.PROGRAM: program}
    poller = Poller(http, fetch_metrics, metrics_timeout_s, counters, log)
    return Parts(
        counters, waits, core, sizer, learning, ledger, fleet, program, gates, prefetcher, poller
    )
