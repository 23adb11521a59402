"""scripts/gpu_hostlink.py: the pure parts (layout, points, scattered slots, predictions,
timing harness, report) without PyTorch, and the whole script on the CPU at the tiny
size where PyTorch is installed (it is not in the test extra)."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvlab.sim.presets import cost_model, get_preset, hicache_config
from tests.helpers import script_module

PRESET = "qwen3-8b-h200"


@pytest.fixture(scope="module")
def hl() -> Iterator[ModuleType]:
    with script_module("gpu_hostlink") as module:
        yield module


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _fake_step(clock: FakeClock, runs: Iterator[dict[str, float]]) -> Callable[[], Any]:
    """A step whose runs take the given "s" seconds of the fake clock each."""

    def step() -> dict[str, float]:
        out = next(runs)
        clock.t += out["s"]
        return out

    return step


def _layout(hl: ModuleType) -> Any:
    return hl.KVLayout.of(get_preset(PRESET))


def test_the_layout_is_the_presets_qwen3_8b_kv(hl: ModuleType) -> None:
    lay = _layout(hl)
    # 36 layers x (K, V) x 8 kv heads x 128 head dim x 2 bytes
    assert (lay.kv_bytes_per_token, lay.layers) == (147_456, 36)
    assert (lay.row_bytes, lay.row_elems, lay.word_bytes) == (8 * 128 * 2, 8 * 128, 8)
    assert lay.pool_shape(10) == (2, 36, 10, 1024)  # SGLang's layer_first host pool
    assert lay.pool_bytes(65_536) == 65_536 * 147_456
    assert hl.KVLayout(2 * 3 * 2 * 3, 3).word_bytes == 2  # rows of 6 bytes: 2-byte words
    with pytest.raises(ValueError):
        hl.KVLayout(147_456 + 2, 36)  # K and V of a layer are not whole bf16 rows


@pytest.mark.parametrize("size", ["full", "tiny"])
def test_every_point_fits_its_pool_and_every_kind_is_measured(hl: ModuleType, size: str) -> None:
    points = hl.plan_points(size)
    pool = hl.POOL_TOKENS[size]
    assert {p.kind for p in points} == set(hl.KINDS)
    assert len({(p.kind, p.tokens, p.page) for p in points}) == len(points)
    assert all(hl.fits(p, pool) for p in points), [p for p in points if not hl.fits(p, pool)]
    assert all((p.page > 0) == (p.kind in hl.SCATTERED) for p in points)
    if size == "full":
        h2d = [p.tokens for p in points if p.kind == "h2d"]
        assert h2d == [1024, 4096, 16_384, 65_536]
        assert any(p.kind == "uva_gather" and p.page == 1 for p in points)  # SGLang's default


def test_fits_refuses_what_the_pool_cannot_hold(hl: ModuleType) -> None:
    P = hl.Point
    assert hl.fits(P("h2d", 256), 256) and not hl.fits(P("h2d", 257), 256)
    assert hl.fits(P("bidir", 128), 256) and not hl.fits(P("bidir", 129), 256)
    # 256 tokens hold 16 pages of 16, every other one free: 8 pages, 128 tokens
    assert hl.fits(P("uva_gather", 128, 16), 256)
    assert not hl.fits(P("uva_gather", 144, 16), 256)
    assert not hl.fits(P("layer_pages", 24, 16), 256)  # not whole pages
    assert not hl.fits(P("layer_pages", 16, 0), 256)


def test_scattered_pages_are_whole_random_and_never_adjacent(hl: ModuleType) -> None:
    rng = random.Random(0)
    starts = hl.scattered_pages(4096, 1024, 16, rng)
    assert len(starts) == 64 and len(set(starts)) == 64
    assert all(s % 16 == 0 and 0 <= s <= 4096 - 16 for s in starts)
    ordered = sorted(starts)
    assert all(b - a >= 32 for a, b in itertools.pairwise(ordered))
    assert starts != ordered  # in random order, not the pool's
    assert starts != hl.scattered_pages(4096, 1024, 16, rng)  # a new draw each call
    tokens = hl.page_tokens(starts, 16)
    assert len(tokens) == 1024 and tokens[:16] == list(range(starts[0], starts[0] + 16))
    single = hl.scattered_pages(64, 32, 1, random.Random(1))
    assert sorted(single) == list(range(0, 64, 2))  # every other slot of a pool twice as big
    with pytest.raises(ValueError):
        hl.scattered_pages(64, 34, 1, rng)
    with pytest.raises(ValueError):
        hl.scattered_pages(64, 10, 4, rng)


def test_predictions_are_the_simulators(hl: ModuleType) -> None:
    assert hl.predicted_s(PRESET, 16_384) == hicache_config(PRESET).transfer_s(16_384)
    assert hl.predicted_s(PRESET, 16_384) == pytest.approx(16_384 * 147_456 / 50e9)
    model = cost_model(PRESET)
    # in 8192-token chunks, as the simulator prefills a prompt
    assert hl.recompute_s(PRESET, model, 16_384) == pytest.approx(
        model.prefill_s(((8192, 0),)) + model.prefill_s(((8192, 8192),))
    )
    assert hl.recompute_s(PRESET, model, 1024) == model.prefill_s(((1024, 0),))
    assert hl.gb_s(5_000_000_000, 0.1) == pytest.approx(50.0)
    assert hl.gb_s(1, 0.0) is None and hl.gb_s(1, None) is None
    assert hl.ratio(0.02, 0.01) == 2.0
    assert hl.ratio(0.0, 0.01) is None and hl.ratio(math.nan, 0.01) is None
    assert hl.ratio(None, 0.01) is None


def test_a_row_has_bandwidth_prediction_and_recompute(hl: ModuleType) -> None:
    model, lay = cost_model(PRESET), _layout(hl)
    n = 16_384
    nbytes = n * 147_456
    timing = {"measured_s": nbytes / 40e9, "min_s": 0.05, "max_s": 0.07, "samples": 3}
    r = hl.row(hl.Point("h2d", n), timing, preset=PRESET, model=model, layout=lay)
    assert r["bytes"] == nbytes and r["gb_s"] == pytest.approx(40.0)
    assert r["ratio"] == pytest.approx(50.0 / 40.0)  # 40 GB/s against the preset's 50
    assert r["us_per_token"] == pytest.approx(147_456 / 40e9 * 1e6)
    assert r["load_over_recompute"] == pytest.approx(r["measured_s"] / r["recompute_s"])
    assert r["load_over_recompute"] < 0.2  # loading 16k tokens beats recomputing them
    assert "d2h_gb_s" not in r and "gemm_slowdown" not in r
    both = {**timing, "d2h_s": nbytes / 25e9}
    r = hl.row(hl.Point("bidir", n), both, preset=PRESET, model=model, layout=lay)
    assert r["d2h_gb_s"] == pytest.approx(25.0)
    lapped = {**timing, "alone_s": nbytes / 50e9, "gemm_s": 0.06, "gemm_alone_s": 0.05}
    r = hl.row(hl.Point("overlap_copy", n), lapped, preset=PRESET, model=model, layout=lay)
    assert r["alone_gb_s"] == pytest.approx(50.0) and r["gemm_slowdown"] == pytest.approx(1.2)
    assert "GEMMs x1.20 (50.0 ms alone)" in hl.note(r) and "load alone 50.0 GB/s" in hl.note(r)


def test_measure_warms_up_takes_medians_and_keeps_other_intervals(hl: ModuleType) -> None:
    clock = FakeClock()
    warm = [{"s": 9.0}, {"s": 9.0}]
    runs = iter(
        [*warm, {"s": 0.3, "d2h_s": 1.0}, {"s": 0.1, "d2h_s": 3.0}, {"s": 0.2, "d2h_s": 2.0}]
    )
    out = hl.measure(
        _fake_step(clock, runs), hl.Budget(100.0, clock), warmup=2, repeats=3, share_s=100.0
    )
    assert out == {"measured_s": 0.2, "min_s": 0.1, "max_s": 0.3, "samples": 3, "d2h_s": 2.0}
    assert next(runs, None) is None  # five runs taken


def test_measure_stops_at_the_points_share_with_one_sample_at_least(hl: ModuleType) -> None:
    clock = FakeClock()
    runs = iter([{"s": 1.0}] * 50)
    budget = hl.Budget(100.0, clock)
    out = hl.measure(_fake_step(clock, runs), budget, warmup=1, repeats=50, share_s=3)
    assert out["samples"] == 2  # warm-up 1 s, then 2 s of samples reach the 3 s share
    out = hl.measure(
        _fake_step(clock, iter([{"s": 500.0}] * 3)), budget, warmup=1, repeats=5, share_s=1e9
    )
    assert out["samples"] == 1  # the budget ran out in the warm-up: one sample still


def test_run_points_predicts_and_skips_past_the_budget_and_what_cannot_run(
    hl: ModuleType,
) -> None:
    clock = FakeClock()
    model, lay = cost_model(PRESET), _layout(hl)
    P = hl.Point
    points = [P("h2d", 99), P("layer_pages_graph", 64, 16), P("d2h", 64), P("h2d", 1)]
    released: list[int] = []
    lines: list[str] = []

    def prepare(p: Any) -> Callable[[], Any]:
        if p.tokens == 99:
            raise MemoryError("no room")
        if p.kind == "layer_pages_graph":
            raise hl.Unsupported("CUDA graphs need --device cuda")
        return _fake_step(clock, iter([{"s": 2.0}] * 9))

    done, skipped = hl.run_points(
        points,
        prepare,
        hl.Budget(4.0, clock),
        preset=PRESET,
        model=model,
        layout=lay,
        warmup=1,
        repeats=2,
        is_oom=lambda exc: isinstance(exc, MemoryError),
        release=lambda: released.append(1),
        progress=lines.append,
    )
    assert [d["label"] for d in done] == ["d2h 64 tokens"]
    assert done[0]["measured_s"] == 2.0 and done[0]["tokens"] == 64
    assert done[0]["ratio"] == pytest.approx(2.0 / hl.predicted_s(PRESET, 64))
    assert [(s["tokens"], s["reason"]) for s in skipped] == [
        (99, "out of memory"),
        (64, "unsupported: CUDA graphs need --device cuda"),
        (1, "budget"),
    ]
    assert len(released) == 3  # after each prepared point, measured or not
    assert len(lines) == 4 and lines[2].startswith("d2h 64 tokens: 2000.000 ms")

    def broken(p: Any) -> Callable[[], Any]:
        raise ValueError("bad index")

    kw = {"preset": PRESET, "model": model, "layout": lay}
    with pytest.raises(ValueError):  # anything but memory or an unsupported point is an error
        hl.run_points(points[:1], broken, hl.Budget(9.0, clock), **kw)
    # unless the run is told to skip it (the script does: one GPU run gives what works)
    done, skipped = hl.run_points(points[:1], broken, hl.Budget(9.0, clock), skip_errors=True, **kw)
    assert done == [] and skipped[0]["reason"] == "error: ValueError('bad index')"


def test_report_and_markdown(hl: ModuleType) -> None:
    clock = FakeClock()
    model, lay = cost_model(PRESET), _layout(hl)
    budget = hl.Budget(10.0, clock)
    points = hl.plan_points("tiny")

    def prepare(p: Any) -> Callable[[], Any]:
        if p.kind == "layer_pages_graph":
            raise hl.Unsupported("CUDA graphs need --device cuda")
        extra = {"d2h_s": 0.02} if p.kind == "bidir" else {}
        return _fake_step(clock, iter([{"s": 0.01, **extra}] * 9))

    done, skipped = hl.run_points(points, prepare, budget, preset=PRESET, model=model, layout=lay)
    doc = hl.report(
        done,
        skipped,
        preset=PRESET,
        model=model,
        layout=lay,
        size="tiny",
        pool_tokens=256,
        device={"type": "cpu", "name": "cpu"},
        budget=budget,
        argv=["--device", "cpu"],
    )
    _check_document(hl, doc, len(points))
    assert doc["command"] == "python scripts/gpu_hostlink.py --device cpu"
    text = hl.markdown(doc)
    assert text.startswith("# Host link vs cpu: preset qwen3-8b-h200 (50 GB/s)")
    assert text.count("\n| h2d ") == 2 and "d2h at once" in text
    assert "| layer_pages_graph 64 tokens, pages of 16 | - | skipped: unsupported" in text
    assert hl.default_preset("NVIDIA H200") == "qwen3-8b-h200"
    assert hl.default_preset("NVIDIA H100 80GB HBM3") == "qwen3-8b-h100"


def _check_document(hl: ModuleType, doc: dict[str, Any], planned: int) -> None:
    assert doc["schema"] == 1 and doc["kinds"] == hl.KINDS
    assert doc["preset"]["kv_bytes_per_token"] == 147_456 and doc["preset"]["num_layers"] == 36
    assert doc["preset"]["host_link_gb_s"] == 50.0
    assert doc["layout"]["pool_bytes"] == doc["layout"]["pool_tokens"] * 147_456
    assert doc["points"], "no point measured"
    assert len(doc["points"]) + len(doc["skipped"]) == planned
    for p in doc["points"]:
        assert p["kind"] in hl.KINDS and p["bytes"] == p["tokens"] * 147_456
        for key in ("measured_s", "min_s", "max_s", "gb_s", "predicted_s", "ratio", "recompute_s"):
            assert isinstance(p[key], float) and math.isfinite(p[key]) and p[key] > 0, (key, p)
        assert p["min_s"] <= p["measured_s"] <= p["max_s"]
        assert p["ratio"] == pytest.approx(p["measured_s"] / p["predicted_s"])
        assert p["gb_s"] == pytest.approx(p["bytes"] / p["measured_s"] / 1e9)
        assert p["samples"] >= 1
    assert [s["kind"] for s in doc["skipped"]] == ["layer_pages_graph"]


def test_the_script_on_the_cpu_at_the_tiny_size(hl: ModuleType, tmp_path: Path) -> None:
    """The measurement itself: runs only where PyTorch is installed (not in the test
    extra); the parts above do not need it."""
    pytest.importorskip("torch")
    out = tmp_path / "hl.json"
    args = ["--device", "cpu", "--out", str(out), "--budget-s", "60", "--preset", PRESET]
    assert hl.main([*args, "--repeats", "2", "--warmup", "1"]) == 0
    doc = json.loads(out.read_text())
    _check_document(hl, doc, len(hl.plan_points("tiny")))
    assert doc["size"] == "tiny" and doc["layout"]["pool_shape"] == [2, 36, 256, 1024]
    assert doc["device"]["type"] == "cpu" and "CUDA graphs" in doc["skipped"][0]["reason"]
    assert out.with_suffix(".md").read_text().startswith("# Host link vs cpu")
    # The steps move the right bytes: each load puts the host's KV in the device slots.
    import torch

    link = hl.Link("cpu", _layout(hl), 256, seed=3)
    try:
        link.host.copy_(torch.randn(link.host.shape).to(torch.bfloat16))
        link.dev.zero_()
        n = 64 * 147_456 // 2  # bf16 elements of 64 tokens' KV
        link.prepare(hl.Point("h2d", 64))()
        assert torch.equal(link.dev_flat[:n], link.host_flat[:n])
        assert not link.dev_flat[n:].any()  # nothing past the 64 tokens
        for kind, page in (("layer_pages", 16), ("uva_gather", 1), ("staged_gather", 16)):
            link.dev.zero_()
            link.prepare(hl.Point(kind, 64, page))()
            src, dst = link.last_slots
            assert sorted(src) != sorted(dst)  # the two sides are scattered differently
            assert torch.equal(link.dev[:, :, dst], link.host[:, :, src]), kind
        link.dev.copy_(torch.randn(link.dev.shape).to(torch.bfloat16))
        assert not torch.equal(link.host_flat[: 2 * n], link.dev_flat[: 2 * n])
        link.prepare(hl.Point("bidir", 64))()  # loads tokens 0-63, stores 64-127
        assert torch.equal(link.host_flat[: 2 * n], link.dev_flat[: 2 * n])
        assert not torch.equal(link.host_flat[2 * n :], link.dev_flat[2 * n :])
    finally:
        link.close()
