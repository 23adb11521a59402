"""The regime grid's cells as data: a fleet of simulated engines, a workload, a context
length, a fleet size and a pool, named ``workload/context/size/ratio``.

The lab's grid (``scripts/regime_grid.py``), its completion timelines
(``scripts/completion_timeline.py``) and the real stack's confirmations
(``scripts/bench_rollout.py``) build the same cell from the same name here, so a cell
run through the real stack is the cell the lab ran: the same workload, pool and placement.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.demo import Scenario
from kvlab.workload.spec import workload_spec

WORKLOADS = ("swe", "rl", "subagents")
# Workloads a cell may name beside the default grid's (the replication's engine and
# traffic: docs/workloads.md); only their long (preset) context fits their prompts.
EXTRA_WORKLOADS = ("claude-code", "burst")
ENGINES = 2
CONTEXTS = {"short": 5_120, "long": None}  # real tokens; None: the preset's
SIZES = (4, 8, 16, 32, 48, 64)
RATIOS = (0.8, 1.5, 2.5, 4.0)


@dataclass(frozen=True)
class Fleet:
    """A cell without its policy: workload, context, size, pool ratio."""

    workload: str
    context: str
    per_engine: int
    ratio: float

    @property
    def key(self) -> str:
        return f"{self.workload}/{self.context}/{self.per_engine}/{self.ratio:g}"

    def scenario(self) -> Scenario:
        ctx = CONTEXTS[self.context]
        overrides = {} if ctx is None else {"context_length": ctx}
        # The engines' preset is the workload's own, as the lab's (rl runs Qwen3-32B on
        # H200s): the scenario's default is the 8B preset.
        preset = workload_spec(self.workload).cost_model
        return Scenario(
            name=self.key,
            workload=self.workload,
            cost_model=preset,
            sessions_per_engine=self.per_engine,
            pool_ratio=self.ratio,
            workload_overrides=overrides,
        )

    def pool(self) -> tuple[int, float]:
        """(pool tokens per engine, the working set / pool it gives): the ratio's pool,
        raised where needed so the longest context fits (SGLang rejects a longer one)."""
        sc = self.scenario()
        need = int(sc.spec().context_length) + 64
        pool = max(sc.pool(), need)
        return pool, sc.live_working_set() / pool

    def metric(self) -> str:
        return "output_tokens_per_s" if self.workload == "rl" else "sessions_per_min"


def parse_fleet(text: str) -> Fleet:
    """A cell from its name, ``workload/context/size/ratio`` (``swe/long/48/1.5``);
    ValueError naming what is wrong otherwise."""
    parts = text.split("/")
    want = f"cell {text!r}: want workload/context/size/ratio, e.g. swe/long/48/1.5"
    if len(parts) != 4:
        raise ValueError(want)
    w, c, n, r = parts
    if w not in WORKLOADS + EXTRA_WORKLOADS or c not in CONTEXTS:
        raise ValueError(
            f"{want}; workloads {WORKLOADS + EXTRA_WORKLOADS}, contexts {tuple(CONTEXTS)}"
        )
    try:
        size, ratio = int(n), float(r)
    except ValueError:
        raise ValueError(f"{want}; size an integer, ratio a number") from None
    if size < 1 or not ratio > 0:
        raise ValueError(f"{want}; size at least 1, ratio above 0")
    return Fleet(w, c, size, ratio)
