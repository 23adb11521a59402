"""Agentic workloads: presets (calibration.md §4), trace replay and the driver.

Pure: :mod:`.model` (the records every other module shares, importing none of them),
:mod:`.spec` (parameters and presets), :mod:`.draw` (seeded draws), :mod:`.plan`
(sessions drawn from a seed), :mod:`.trace` (JSONL traces), :mod:`.report` (summary).
Asyncio without I/O: :mod:`.runner` (closed loop against a
:class:`~kvlab.workload.runner.Transport`). Shell: :mod:`.driver` (HTTP transport and
``kvproxy workload``).
"""

from kvlab.workload.model import (
    Dist,
    SessionPlan,
    SessionRecord,
    TurnOutcome,
    TurnPlan,
    TurnRecord,
    WorkloadError,
    WorkloadResult,
    WorkloadSpec,
)
from kvlab.workload.plan import session_plans
from kvlab.workload.report import percentile, summarize
from kvlab.workload.runner import Transport, run_workload
from kvlab.workload.spec import PRESETS, workload_spec

__all__ = [
    "PRESETS",
    "Dist",
    "SessionPlan",
    "SessionRecord",
    "Transport",
    "TurnOutcome",
    "TurnPlan",
    "TurnRecord",
    "WorkloadError",
    "WorkloadResult",
    "WorkloadSpec",
    "percentile",
    "run_workload",
    "session_plans",
    "summarize",
    "workload_spec",
]
