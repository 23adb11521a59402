"""The cached /metrics renderer writes exactly what the reference renderer writes."""

from __future__ import annotations

import pytest

from kvlab.sim.config import SchedulerConfig
from kvlab.sim.metrics import MetricsContext, render_metrics, render_metrics_uncached
from kvlab.sim.scheduler import Scheduler, SimRequest

MAX_STEPS = 10_000


def _run(s: Scheduler, now: float, steps: int) -> float:
    for _ in range(steps):
        batch = s.schedule(now)
        s.finished_outside.clear()
        if batch is None:
            return now
        now += batch.duration
        s.finish_batch(batch, now)
    return now


@pytest.mark.parametrize(
    "ctx",
    [
        MetricsContext(model_name="m"),
        MetricsContext(model_name="m", tp_size=2, enable_priority_scheduling=True),
        MetricsContext(model_name='we"ird\\name', streaming_sessions=True),
    ],
)
@pytest.mark.parametrize("dp", [1, 2])
def test_cached_renderer_equals_reference_through_a_run(ctx: MetricsContext, dp: int) -> None:
    ranks = [Scheduler(SchedulerConfig(max_total_tokens=3_000), now=0.0) for _ in range(dp)]
    now = 0.0
    texts: set[str] = set()
    for i in range(12):
        for r, s in enumerate(ranks):
            ids = list(range(1000 * i + r, 1000 * i + r + 200 + 37 * i))
            s.submit(SimRequest(rid=f"{r}-{i}", input_ids=ids, max_new_tokens=40), now)
        # Idle scrapes (same values) and scrapes mid-run (new values) alike.
        for _ in range(2):
            for override in (None, 0.5):
                got = render_metrics(ctx, ranks, 4096, override)
                assert got == render_metrics_uncached(ctx, ranks, 4096, override)
                texts.add(got)
        for s in ranks:
            now = max(now, _run(s, now, 5 + i))
    for s in ranks:
        now = _run(s, now, MAX_STEPS)
    final = render_metrics(ctx, ranks, 4096)
    assert final == render_metrics_uncached(ctx, ranks, 4096)
    assert final not in texts  # the counters moved: a cached text was not reused
    assert "sglang:evicted_tokens_total" in final
