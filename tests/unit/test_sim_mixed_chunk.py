"""Mixed chunk (SGLang's --enable-mixed-chunk; vLLM's chunked prefill): running requests
decode inside prefill steps, every ``mixed_decode_every``-th one, at the decode step's
marginal cost; off (SGLang's default) a prefill step stalls decode."""

from __future__ import annotations

import pytest

from kvlab.sim.config import CostModel, SchedulerConfig
from kvlab.sim.presets import scheduler_config
from kvlab.sim.scheduler import Scheduler, SimRequest, State
from tests.helpers import seq

COST = CostModel(
    t0_prefill_s=0.005,
    tau_lin_s=1e-5,
    tau_att_s=0.0,
    decode_a_s=0.010,
    decode_b_s=0.001,
    decode_c_s_per_token=1e-6,
    kind="calibrated",
)


def _setup(mixed: bool, every: int = 1) -> tuple[Scheduler, SimRequest]:
    cfg = SchedulerConfig(
        max_total_tokens=100_000,
        chunked_prefill_size=1000,
        max_prefill_tokens=1000,
        cost=COST,
        enable_mixed_chunk=mixed,
        mixed_decode_every=every,
    )
    s = Scheduler(cfg)
    short = SimRequest(rid="short", input_ids=seq(100, 1), max_new_tokens=50)
    s.submit(short, 0.0)
    b = s.schedule(0.0)
    assert b is not None
    s.finish_batch(b, b.duration)  # short is decoding now
    assert short.state is State.DECODE
    s.submit(SimRequest(rid="long", input_ids=seq(5000, 10_000), max_new_tokens=5), 1.0)
    return s, short


@pytest.mark.parametrize(("mixed", "every", "decoded"), [(False, 1, 0), (True, 1, 5), (True, 2, 2)])
def test_running_requests_decode_inside_prefill_steps(
    mixed: bool, every: int, decoded: int
) -> None:
    s, short = _setup(mixed, every)
    before = s.output_len(short)
    now = 1.0
    kinds = []
    for _ in range(5):  # the long prompt's five chunks
        b = s.schedule(now)
        assert b is not None and b.kind == "prefill"
        kinds.append(b.mixed)
        plain = COST.t0_prefill_s + 1000 * COST.tau_lin_s
        if b.mixed:
            ctx = b.context_tokens
            assert b.duration == pytest.approx(plain + COST.decode_s(1, ctx) - COST.decode_s(0, 0))
        else:
            assert b.duration == pytest.approx(plain)
        now += b.duration
        s.finish_batch(b, now)
        s.check_invariants()
    assert s.output_len(short) - before == decoded
    assert sum(kinds) == decoded


def test_the_replication_preset_mixes_once_per_k_chunks() -> None:
    cfg = scheduler_config("qwen3-coder-30b-a3b-fp8-h100-tp2", 16)
    assert cfg.enable_mixed_chunk and cfg.mixed_decode_every == 16
    plain = scheduler_config("qwen3-8b-h100", 16)
    assert not plain.enable_mixed_chunk
