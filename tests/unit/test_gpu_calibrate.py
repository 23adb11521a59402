"""scripts/gpu_calibrate.py: the pure parts (points, timing harness, predictions, fit,
report) without PyTorch, and the whole script on the CPU at the tiny shape where
PyTorch is installed (it is not in the test extra: too big for what it checks)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvlab.sim.presets import cost_model
from tests.helpers import script_module


@pytest.fixture(scope="module")
def gc() -> Iterator[ModuleType]:
    with script_module("gpu_calibrate") as module:
        yield module


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _fake_timer(clock: FakeClock, seconds: Callable[[], float]) -> Callable[[Any], float]:
    def timer(fn: Callable[[], object]) -> float:
        fn()
        dt = seconds()
        clock.t += dt
        return dt

    return timer


def test_the_qwen3_8b_shape_is_the_one_the_presets_attention_cost_assumes(gc: ModuleType) -> None:
    s = gc.SHAPES["qwen3-8b"]
    assert (s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim) == (36, 4096, 32, 8, 128)
    assert (s.intermediate, s.vocab) == (12288, 151_936)
    # tau_att_s = 4 x layers x q heads x head_dim FLOP per pair / 450 TFLOP/s (simulator.md)
    flop = 4 * s.layers * s.heads * s.head_dim
    assert flop / 450e12 == pytest.approx(cost_model("qwen3-8b-h100").tau_att_s, rel=1e-3)
    # KV per token (SGLang's cell_size): 147,456 bytes
    assert s.layers * 2 * s.kv_heads * s.head_dim * 2 == 147_456


@pytest.mark.parametrize("shape", ["qwen3-8b", "tiny"])
def test_points_fit_one_chunk_and_the_memory(gc: ModuleType, shape: str) -> None:
    points = gc.plan_points(shape)
    assert {p.kind for p in points} == {"prefill", "decode"}
    assert any(p.kind == "prefill" and p.b > 0 for p in points)  # a cached prefix
    assert len({(p.kind, p.a, p.b) for p in points}) == len(points)
    for p in points:
        if p.kind == "prefill":
            assert 1 <= p.a <= 8192
        else:
            assert p.a * p.b <= 262_144


def test_predictions_are_the_cost_models(gc: ModuleType) -> None:
    model = cost_model("qwen3-8b-h100")
    assert gc.predicted_s(model, gc.Point("prefill", 900, 16000)) == model.prefill_s(
        ((900, 16000),)
    )
    assert gc.predicted_s(model, gc.Point("decode", 8, 1000)) == model.decode_s(8, 8000)
    assert gc.ratio(0.02, 0.01) == 2.0
    assert gc.ratio(0.0, 0.01) is None and gc.ratio(math.nan, 0.01) is None


def test_measure_warms_up_and_takes_the_median(gc: ModuleType) -> None:
    clock = FakeClock()
    durations = iter([9.0, 9.0, 0.3, 0.1, 0.2])  # two warm-up calls, then three
    calls: list[int] = []
    timer = _fake_timer(clock, lambda: next(durations))
    out = gc.measure(
        lambda: calls.append(1),
        timer,
        gc.Budget(100.0, clock),
        warmup=2,
        repeats=3,
        share_s=100.0,
    )
    assert len(calls) == 5
    assert out == {"measured_s": 0.2, "min_s": 0.1, "max_s": 0.3, "samples": 3}


def test_measure_stops_at_the_points_share_with_one_sample_at_least(gc: ModuleType) -> None:
    clock = FakeClock()
    timer = _fake_timer(clock, lambda: 1.0)
    out = gc.measure(lambda: None, timer, gc.Budget(100.0, clock), warmup=1, repeats=50, share_s=3)
    assert out["samples"] == 2  # warm-up 1 s, then 2 s of samples reach the 3 s share


def test_run_points_predicts_skips_past_the_budget_and_on_oom(gc: ModuleType) -> None:
    clock = FakeClock()
    timer = _fake_timer(clock, lambda: 2.0)
    model = cost_model("qwen3-8b-h100")
    points = [gc.Point("decode", 99, 1), gc.Point("prefill", 64, 0), gc.Point("decode", 1, 1)]
    released: list[int] = []

    def prepare(p: Any) -> Callable[[], object]:
        if p.a == 99:
            raise MemoryError("no room")
        return lambda: None

    done, skipped = gc.run_points(
        points,
        prepare,
        timer,
        gc.Budget(4.0, clock),
        model,
        warmup=1,
        repeats=2,
        is_oom=lambda exc: isinstance(exc, MemoryError),
        release=lambda: released.append(1),
    )
    assert [d["label"] for d in done] == ["prefill 64 new on 0 cached"]
    assert done[0]["measured_s"] == 2.0 and done[0]["new_tokens"] == 64
    assert done[0]["ratio"] == pytest.approx(2.0 / model.prefill_s(((64, 0),)))
    assert [(s["batch"], s["reason"]) for s in skipped] == [(99, "out of memory"), (1, "budget")]
    assert len(released) == 2  # after each prepared point, measured or not
    with pytest.raises(ValueError):  # anything but running out of memory is an error
        gc.run_points(
            points[:1],
            lambda p: (_ for _ in ()).throw(ValueError()),
            timer,
            gc.Budget(9.0, clock),
            model,
        )


def test_the_fit_recovers_the_constants_it_was_given(gc: ModuleType) -> None:
    model = cost_model("qwen3-8b-h200")
    points = []
    for p in gc.plan_points("qwen3-8b"):
        points.append({"kind": p.kind, **p.fields(), "measured_s": gc.predicted_s(model, p)})
    fitted = gc.fit_constants(points)
    for key in ("t0_prefill_s", "tau_lin_s", "tau_att_s", "decode_a_s", "decode_b_s"):
        assert fitted[key] == pytest.approx(getattr(model, key), rel=1e-6), key
    assert fitted["decode_c_s_per_token"] == pytest.approx(model.decode_c_s_per_token, rel=1e-6)
    assert gc.fit_constants(points[:2])["tau_lin_s"] is None  # too few points


def test_report_and_markdown(gc: ModuleType) -> None:
    clock = FakeClock()
    model = cost_model("qwen3-8b-h100")
    budget = gc.Budget(10.0, clock)
    done, skipped = gc.run_points(
        gc.plan_points("tiny"),
        lambda p: lambda: None,
        _fake_timer(clock, lambda: 0.01),
        budget,
        model,
    )
    doc = gc.report(
        done, skipped, model=model, shape_name="tiny", device={"type": "cpu"}, budget=budget
    )
    _check_document(doc)
    text = gc.markdown(doc)
    assert text.count("\n| prefill ") == 3 and text.count("\n| decode ") == 3
    assert "| `tau_att_s` | 1.311e-09 |" in text
    assert gc.default_preset("NVIDIA H200") == "qwen3-8b-h200"
    assert gc.default_preset("NVIDIA H100 80GB HBM3") == "qwen3-8b-h100"


def _check_document(doc: dict[str, Any]) -> None:
    assert doc["schema"] == 1 and doc["preset"] == "qwen3-8b-h100"
    assert set(doc["cost_model"]) >= {"t0_prefill_s", "tau_att_s", "decode_c_s_per_token"}
    assert set(doc["fitted"]) == {
        "t0_prefill_s",
        "tau_lin_s",
        "tau_att_s",
        "decode_a_s",
        "decode_b_s",
        "decode_c_s_per_token",
    }
    assert doc["points"], "no point measured"
    for p in doc["points"]:
        assert p["kind"] in ("prefill", "decode")
        keys = {"new_tokens", "cached_tokens"} if p["kind"] == "prefill" else {"batch", "context"}
        assert keys <= set(p)
        for key in ("measured_s", "predicted_s", "ratio", "min_s", "max_s"):
            assert isinstance(p[key], float) and math.isfinite(p[key]) and p[key] > 0, (key, p)
        assert p["samples"] >= 1
        assert p["ratio"] == pytest.approx(p["measured_s"] / p["predicted_s"])


def test_the_script_on_the_cpu_at_the_tiny_shape(gc: ModuleType, tmp_path: Path) -> None:
    """The measurement itself: runs only where PyTorch is installed (not in the test
    extra); the parts above do not need it."""
    pytest.importorskip("torch")
    out = tmp_path / "cal.json"
    args = ["--device", "cpu", "--shape", "tiny", "--out", str(out), "--budget-s", "60"]
    assert gc.main([*args, "--repeats", "2", "--warmup", "1"]) == 0
    doc = json.loads(out.read_text())
    _check_document(doc)
    assert doc["skipped"] == [] and len(doc["points"]) == len(gc.plan_points("tiny"))
    assert doc["device"]["type"] == "cpu" and doc["shape"]["layers"] == 2
    assert out.with_suffix(".md").read_text().startswith("# Cost model vs cpu")
    # The attention it times is the right one: n queries after a cached prefix see the
    # prefix and the causal part of their own (lower-right), GQA heads shared in pairs.
    import torch

    d = gc.Decoder(gc.SHAPES["tiny"], "cpu", torch.float32, 0)
    n, total = 5, 12
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, total, 16), torch.randn(1, 2, total, 16)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    allowed = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
    scores = (q @ kk.transpose(-1, -2) / 4.0).masked_fill(~allowed, float("-inf"))
    want = scores.softmax(-1) @ vv
    assert torch.allclose(d._attend(q, k, v, d._lower_right(n, total)), want, atol=1e-5)
