"""Agentic workloads: presets (calibration.md §4), trace replay and the driver.

Pure: :mod:`.spec` (parameters), :mod:`.plan` (sessions drawn from a seed),
:mod:`.trace` (JSONL traces), :mod:`.report` (summary). Asyncio without I/O:
:mod:`.runner` (closed loop against a :class:`~kvlab.workload.runner.Transport`).
Shell: :mod:`.driver` (HTTP transport and ``kvproxy workload``).
"""

from kvlab.workload.plan import SessionPlan, TurnPlan, session_plans
from kvlab.workload.report import percentile, summarize
from kvlab.workload.runner import (
    SessionRecord,
    Transport,
    TurnOutcome,
    TurnRecord,
    WorkloadResult,
    run_workload,
)
from kvlab.workload.spec import PRESETS, Dist, WorkloadError, WorkloadSpec, workload_spec

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
