#!/usr/bin/env python3
"""Check the simulator's cost model on a GPU: a Qwen3-8B-shaped decoder from random
weights, timed, next to what the cost model predicts for the same points.

    python scripts/gpu_calibrate.py --device cuda --out results/gpu_calibration.json

Measures one **prefill step** (``n`` new tokens attending over ``p`` tokens already in
KV: a prompt, or the uncached suffix of one whose prefix is cached) against ``n`` and
``p``, and one **decode step** (``B`` sequences of ``C`` tokens of context each) against
``B`` and ``C``, with warm-up, CUDA events and synchronisation. Writes the points as
JSON, with :meth:`~kvlab.sim.cost.CostModel.prefill_s` /
:meth:`~kvlab.sim.cost.CostModel.decode_s` of the preset (token scale 1) and the ratio
measured / predicted per point, the constants a least-squares fit of the measurements
gives, and the same as a Markdown table next to the JSON (``.md``).

The model (the only part that needs PyTorch, imported lazily): embedding, per layer
RMSNorm, Q/K/V projections, Qwen3's per-head q/k RMSNorm, rotary embedding, GQA attention
through ``torch.nn.functional.scaled_dot_product_attention`` over a preallocated KV cache
(lower-right causal for a prefix), the output projection, RMSNorm and a SwiGLU MLP; a
final norm and the LM head on the last position of a prefill and on every sequence of a
decode. Weights are random (they do not change timing); nothing is downloaded. It runs
eagerly (no CUDA graphs, no fused kernels): SGLang's decode, captured in CUDA graphs,
pays less launch overhead, so a small-batch decode ratio above 1 is partly this script's.

Flags: ``--device cuda|cpu``, ``--shape qwen3-8b|tiny`` (tiny: two small layers, for the
CPU and the unit test), ``--preset`` (default: ``qwen3-8b-h200`` on an H200, else
``qwen3-8b-h100``), ``--out PATH``, ``--budget-s`` (the measurement stops taking
samples, then points, past it; points it never reached are listed as skipped),
``--repeats``, ``--seed``. Under about 8 minutes on one H100/H200 with the defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.sim.cost import CostModel
from kvlab.sim.presets import cost_model

SCHEMA = 1


@dataclass(frozen=True, slots=True)
class Shape:
    """A decoder's shape (Qwen3's ``config.json`` names in the comments)."""

    layers: int  # num_hidden_layers
    hidden: int  # hidden_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim
    intermediate: int  # intermediate_size
    vocab: int  # vocab_size
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6  # rms_norm_eps


# The presets (kvlab/sim/presets.py) name the model and GPU but carry no shape: Qwen3-8B's
# is its public config.json (36 layers, hidden 4096, 32 query / 8 KV heads of 128,
# intermediate 12288, vocab 151,936), the one the presets' tau_att_s is derived from
# (4 x 36 x 32 x 128 FLOP per query-key pair).
SHAPES: dict[str, Shape] = {
    "qwen3-8b": Shape(36, 4096, 32, 8, 128, 12288, 151_936),
    "tiny": Shape(2, 64, 4, 2, 16, 128, 512),
}


@dataclass(frozen=True, slots=True)
class Point:
    """One measured step: ``prefill`` (``a`` new tokens over ``b`` cached) or ``decode``
    (``a`` sequences of ``b`` context tokens each)."""

    kind: str
    a: int
    b: int

    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.a} new on {self.b} cached"
        return f"decode B {self.a}, context {self.b}"

    def fields(self) -> dict[str, int]:
        if self.kind == "prefill":
            return {"new_tokens": self.a, "cached_tokens": self.b}
        return {"batch": self.a, "context": self.b, "context_tokens": self.a * self.b}


def plan_points(shape_name: str) -> list[Point]:
    """The points for a shape: prefill against prompt length and cached prefix (one
    step: at most SGLang's 8192-token chunk), decode against batch and context (KV of
    at most 262,144 tokens: 38 GB at Qwen3-8B's 147 KB per token, with the 16 GB of
    weights inside an 80 GB H100)."""
    if shape_name == "tiny":
        prefill = [(16, 0), (64, 0), (16, 64)]
        decode = [(1, 32), (4, 32), (4, 128)]
    else:
        prefill = [
            (256, 0),
            (1024, 0),
            (2048, 0),
            (4096, 0),
            (8192, 0),
            (512, 4096),
            (512, 16384),
            (512, 32768),
            (2048, 16384),
            (2048, 32768),
            (8192, 16384),
            (8192, 32768),
        ]
        decode = [
            (1, 1024),
            (1, 16384),
            (8, 1024),
            (8, 8192),
            (16, 4096),
            (32, 1024),
            (32, 4096),
            (64, 1024),
            (64, 4096),
            (128, 1024),
            (128, 2048),
        ]
    return [Point("prefill", n, p) for n, p in prefill] + [Point("decode", b, c) for b, c in decode]


# ---------------------------------------------------------------------- predictions


def predicted_s(model: CostModel, point: Point) -> float:
    """The cost model's step time for ``point`` (token scale 1: real tokens)."""
    if point.kind == "prefill":
        return model.prefill_s(((point.a, point.b),))
    return model.decode_s(point.a, point.a * point.b)


def ratio(measured: float | None, predicted: float | None) -> float | None:
    """measured / predicted, or None where either is missing or not a positive finite
    number."""
    if measured is None or predicted is None:
        return None
    ok = all(math.isfinite(x) and x > 0 for x in (measured, predicted))
    return measured / predicted if ok else None


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting for a 3 x 3 system (None: singular)."""
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(3):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][3] / a[i][i] for i in range(3)]


def least_squares3(
    rows: Sequence[tuple[float, float, float]], ys: Sequence[float]
) -> list[float] | None:
    """The 3 coefficients minimising the squared error of ``rows . x = ys`` relative to
    ``ys`` (each equation divided by its y, so that short steps weigh as much as long
    ones); None with fewer than 3 points or a singular system."""
    if len(rows) < 3 or len(rows) != len(ys):
        return None
    m = [[0.0] * 3 for _ in range(3)]
    v = [0.0] * 3
    for row, y in zip(rows, ys, strict=True):
        w = 1.0 / (y * y) if y > 0 else 0.0
        for i in range(3):
            v[i] += w * row[i] * y
            for j in range(3):
                m[i][j] += w * row[i] * row[j]
    return _solve3(m, v)


def fit_constants(points: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The cost model's constants as the measured points give them (the preset's
    shape: ``t0 + tau_lin n + tau_att n (p + n/2)`` and ``a + b B + c S``)."""
    pre = [p for p in points if p["kind"] == "prefill" and p.get("measured_s")]
    dec = [p for p in points if p["kind"] == "decode" and p.get("measured_s")]
    pf = least_squares3(
        [
            (
                1.0,
                float(p["new_tokens"]),
                p["new_tokens"] * (p["cached_tokens"] + p["new_tokens"] / 2),
            )
            for p in pre
        ],
        [p["measured_s"] for p in pre],
    )
    df = least_squares3(
        [(1.0, float(p["batch"]), float(p["context_tokens"])) for p in dec],
        [p["measured_s"] for p in dec],
    )
    keys_p = ("t0_prefill_s", "tau_lin_s", "tau_att_s")
    keys_d = ("decode_a_s", "decode_b_s", "decode_c_s_per_token")
    out: dict[str, float | None] = {}
    for keys, fit in ((keys_p, pf), (keys_d, df)):
        for i, k in enumerate(keys):
            out[k] = None if fit is None else fit[i]
    return out


# -------------------------------------------------------------------- timing harness


class Timer(Protocol):
    """Times one call of ``fn`` in seconds (waiting for the device to finish)."""

    def __call__(self, fn: Callable[[], object]) -> float: ...


def wall_timer(
    sync: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter
) -> Timer:
    """A timer from a clock and a device synchronisation (the CPU's: none)."""

    def timed(fn: Callable[[], object]) -> float:
        sync()
        start = clock()
        fn()
        sync()
        return clock() - start

    return timed


@dataclass(slots=True)
class Budget:
    """Seconds left for the measurement, on an injected clock."""

    seconds: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


def measure(
    fn: Callable[[], object],
    timer: Timer,
    budget: Budget,
    *,
    warmup: int,
    repeats: int,
    share_s: float,
) -> dict[str, Any]:
    """``warmup`` untimed calls (at least one: kernels chosen, memory allocated), then up
    to ``repeats`` timed ones, stopping early past ``share_s`` seconds of this point or
    the whole budget (at least one timed call). The median is the point's time."""
    started = budget.elapsed()
    for _ in range(max(1, warmup)):
        timer(fn)
        if budget.left() <= 0:
            break
    samples: list[float] = []
    for _ in range(max(1, repeats)):
        samples.append(timer(fn))
        if budget.left() <= 0 or budget.elapsed() - started >= share_s:
            break
    return {
        "measured_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "samples": len(samples),
    }


def run_points(
    points: Sequence[Point],
    prepare: Callable[[Point], Callable[[], object]],
    timer: Timer,
    budget: Budget,
    model: CostModel,
    *,
    warmup: int = 2,
    repeats: int = 5,
    is_oom: Callable[[BaseException], bool] = lambda exc: False,
    release: Callable[[], None] = lambda: None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Measure each point (``prepare`` builds its step, untimed) while the budget lasts;
    returns (measured points with prediction and ratio, skipped points with why)."""
    done: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for i, point in enumerate(points):
        base = {"kind": point.kind, "label": point.label(), **point.fields()}
        if budget.left() <= 0:
            skipped.append({**base, "reason": "budget"})
            continue
        share = budget.left() / (len(points) - i)
        step: Callable[[], object] | None = None
        try:
            step = prepare(point)
            timing = measure(step, timer, budget, warmup=warmup, repeats=repeats, share_s=share)
        except Exception as exc:
            step = None
            release()
            if not is_oom(exc):
                raise
            skipped.append({**base, "reason": "out of memory"})
            continue
        step = None  # the point's KV cache goes before the next one is allocated
        release()
        pred = predicted_s(model, point)
        done.append(
            {
                **base,
                **timing,
                "predicted_s": pred,
                "ratio": ratio(timing["measured_s"], pred),
            }
        )
    return done, skipped


# ---------------------------------------------------------------------------- report


def report(
    points: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
    *,
    model: CostModel,
    shape_name: str,
    device: dict[str, Any],
    budget: Budget,
) -> dict[str, Any]:
    """The JSON document."""
    return {
        "schema": SCHEMA,
        "command": "python scripts/gpu_calibrate.py " + " ".join(sys.argv[1:]),
        "device": device,
        "shape_name": shape_name,
        "shape": asdict(SHAPES[shape_name]),
        "preset": model.preset,
        "cost_model": model.to_dict(),
        "budget_s": budget.seconds,
        "elapsed_s": round(budget.elapsed(), 3),
        "points": points,
        "skipped": skipped,
        "fitted": fit_constants(points),
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def markdown(doc: dict[str, Any]) -> str:
    """The document as a Markdown table (and the fitted constants)."""
    dev = doc["device"]
    lines = [
        f"# Cost model vs {dev.get('name', dev.get('type'))}: shape {doc['shape_name']}, "
        f"preset {doc['preset']}",
        "",
        f"`{doc['command']}`; {dev.get('dtype')}, torch {dev.get('torch')}; "
        f"{doc['elapsed_s']:.0f} s of a {doc['budget_s']:.0f} s budget.",
        "",
        "| point | measured ms | predicted ms | measured / predicted | samples |",
        "|---|---|---|---|---|",
    ]
    for p in doc["points"]:
        r = "-" if p["ratio"] is None else f"{p['ratio']:.2f}"
        lines.append(
            f"| {p['label']} | {_ms(p['measured_s'])} | {_ms(p['predicted_s'])} | {r} | {p['samples']} |"
        )
    for p in doc["skipped"]:
        lines.append(f"| {p['label']} | skipped: {p['reason']} | - | - | 0 |")
    lines += ["", "| constant | preset | fitted to the measurements |", "|---|---|---|"]
    for key, value in doc["fitted"].items():
        have = doc["cost_model"][key]
        lines.append(f"| `{key}` | {have:.4g} | {'-' if value is None else f'{value:.4g}'} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------ the model (PyTorch only)


def _torch(script: str = "gpu_calibrate") -> Any:
    try:
        import torch
    except ImportError:
        raise SystemExit(
            f"{script}: PyTorch is needed for the measurement (pip install torch)"
        ) from None
    return torch


class Decoder:
    """A Qwen3-style decoder from random weights; ``prefill``/``decode`` build one step."""

    def __init__(self, shape: Shape, device: str, dtype: Any, seed: int) -> None:
        torch = self.torch = _torch()
        self.s, self.device, self.dtype = shape, device, dtype
        gen = torch.Generator(device=device).manual_seed(seed)

        def w(*size: int) -> Any:
            t = torch.empty(*size, device=device, dtype=dtype)
            return t.normal_(0.0, 0.02, generator=gen)

        def ones(n: int) -> Any:
            return torch.ones(n, device=device, dtype=dtype)

        s = shape
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.embed = w(s.vocab, s.hidden)
        self.layers = [
            {
                "in_norm": ones(s.hidden),
                "qkv": w(s.hidden, q + 2 * kv),
                "q_norm": ones(s.head_dim),
                "k_norm": ones(s.head_dim),
                "o": w(q, s.hidden),
                "post_norm": ones(s.hidden),
                "gate_up": w(s.hidden, 2 * s.intermediate),
                "down": w(s.intermediate, s.hidden),
            }
            for _ in range(s.layers)
        ]
        self.norm = ones(s.hidden)
        self.lm_head = w(s.hidden, s.vocab)
        self._gen = gen
        # Mask kind -> whether scaled_dot_product_attention(enable_gqa=True) takes it.
        self._gqa: dict[str, bool] = {}

    def _rms(self, x: Any, weight: Any) -> Any:
        torch = self.torch
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.s.eps)).to(x.dtype) * weight

    def _rope(self, positions: Any) -> tuple[Any, Any]:
        torch, d = self.torch, self.s.head_dim
        inv = 1.0 / (self.s.rope_theta ** (torch.arange(0, d, 2, device=self.device).float() / d))
        ang = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((ang, ang), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _rotate(self, x: Any, cos: Any, sin: Any) -> Any:
        half = x.shape[-1] // 2
        rot = self.torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _attend(self, q: Any, k: Any, v: Any, mask: Any) -> Any:
        """SDPA with GQA: ``enable_gqa`` where this PyTorch takes it with this kind of
        mask (tried once per kind, during the warm-up), else K/V repeated per q head."""
        f = self.torch.nn.functional.scaled_dot_product_attention
        causal = isinstance(mask, str)
        m = None if causal else mask
        kind = "causal" if causal else type(m).__name__
        if self._gqa.get(kind, True):
            try:
                out = f(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=True)
                self._gqa[kind] = True
                return out
            except (TypeError, RuntimeError, NotImplementedError):
                if self._gqa.get(kind):
                    raise
                self._gqa[kind] = False
        rep = self.s.heads // self.s.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return f(q, k, v, attn_mask=m, is_causal=causal)

    def _lower_right(self, n: int, total: int) -> Any:
        """The causal mask of ``n`` queries that follow ``total - n`` cached keys."""
        torch = self.torch
        try:
            from torch.nn.attention.bias import causal_lower_right

            return causal_lower_right(n, total)
        except ImportError:
            keys = torch.arange(total, device=self.device)
            queries = torch.arange(total - n, total, device=self.device)
            return keys[None, :] <= queries[:, None]

    def _layer(
        self, L: dict[str, Any], x: Any, cos: Any, sin: Any, kc: Any, vc: Any, at: Any, mask: Any
    ) -> Any:
        """One layer for ``x`` (batch, tokens, hidden); new K/V written at ``at``."""
        s = self.s
        bsz, n, _ = x.shape
        h = self._rms(x, L["in_norm"]) @ L["qkv"]
        q, k, v = h.split(
            [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1
        )
        q = self._rms(q.view(bsz, n, s.heads, s.head_dim), L["q_norm"]).transpose(1, 2)
        k = self._rms(k.view(bsz, n, s.kv_heads, s.head_dim), L["k_norm"]).transpose(1, 2)
        v = v.view(bsz, n, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        kc[:, :, at] = k
        vc[:, :, at] = v
        end = at.stop
        o = self._attend(q, kc[:, :, :end], vc[:, :, :end], mask)
        x = x + o.transpose(1, 2).reshape(bsz, n, -1) @ L["o"]
        gate, up = (self._rms(x, L["post_norm"]) @ L["gate_up"]).chunk(2, dim=-1)
        return x + (self.torch.nn.functional.silu(gate) * up) @ L["down"]

    def _caches(self, bsz: int, length: int) -> list[tuple[Any, Any]]:
        s, torch = self.s, self.torch
        size = (bsz, s.kv_heads, length, s.head_dim)

        def kv() -> Any:
            return torch.empty(size, device=self.device, dtype=self.dtype).normal_(
                0.0, 1.0, generator=self._gen
            )

        return [(kv(), kv()) for _ in range(s.layers)]

    def _step(
        self, ids: Any, positions: Any, caches: Any, at: slice, mask: Any, last_only: bool
    ) -> Callable[[], object]:
        torch = self.torch
        cos, sin = self._rope(positions)

        def run() -> object:
            with torch.inference_mode():
                x = self.embed[ids]
                for L, (kc, vc) in zip(self.layers, caches, strict=True):
                    x = self._layer(L, x, cos, sin, kc, vc, at, mask)
                if last_only:
                    x = x[:, -1:]
                return self._rms(x, self.norm) @ self.lm_head

        return run

    def prefill(self, n: int, cached: int) -> Callable[[], object]:
        """One prefill step: ``n`` new tokens of one request over ``cached`` in KV."""
        torch = self.torch
        ids = torch.randint(0, self.s.vocab, (1, n), device=self.device, generator=self._gen)
        positions = torch.arange(cached, cached + n, device=self.device)
        mask = "causal" if cached == 0 else self._lower_right(n, cached + n)
        caches = self._caches(1, cached + n)
        return self._step(ids, positions, caches, slice(cached, cached + n), mask, True)

    def decode(self, batch: int, context: int) -> Callable[[], object]:
        """One decode step: ``batch`` requests with ``context`` tokens in KV each."""
        torch = self.torch
        ids = torch.randint(0, self.s.vocab, (batch, 1), device=self.device, generator=self._gen)
        positions = torch.tensor([context], device=self.device)
        caches = self._caches(batch, context + 1)
        return self._step(ids, positions, caches, slice(context, context + 1), None, False)


def torch_backend(
    device: str, shape: Shape, seed: int
) -> tuple[Decoder, Timer, dict[str, Any], Callable[[BaseException], bool], Callable[[], None]]:
    """The model, a timer, the device's description, an out-of-memory test and a
    cache release for ``device``."""
    torch = _torch()
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_calibrate: --device cuda but torch.cuda.is_available() is False")
        dtype = torch.bfloat16
        name = torch.cuda.get_device_name(0)

        def timer(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3

        def is_oom(exc: BaseException) -> bool:
            return isinstance(exc, torch.cuda.OutOfMemoryError)

        def release() -> None:
            torch.cuda.empty_cache()

    else:
        # bf16 matmuls are slow on most CPUs; the CPU run checks the pipeline, not timing.
        dtype = torch.float32
        name = "cpu"
        timer = wall_timer()

        def is_oom(exc: BaseException) -> bool:
            return False

        def release() -> None:
            return None

    model = Decoder(shape, device, dtype, seed)
    described = {
        "type": device,
        "name": name,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
    }
    return model, timer, described, is_oom, release


def cuda_graph(step: Callable[[], object]) -> Callable[[], object]:
    """``step`` captured once in a CUDA graph (after two warm-up runs on a side stream,
    as PyTorch's capture requires); the returned call replays it."""
    torch = _torch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay() -> object:
        graph.replay()
        return None

    return replay


def default_preset(device_name: str) -> str:
    return "qwen3-8b-h200" if "H200" in device_name.upper() else "qwen3-8b-h100"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-8b")
    ap.add_argument("--preset", default=None, help="cost-model preset (default: by the GPU)")
    ap.add_argument("--out", type=Path, default=Path("results/gpu_calibration.json"))
    ap.add_argument(
        "--budget-s", type=float, default=420.0, help="measurement budget (default 420)"
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per point (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per point (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="capture each decode step in a CUDA graph and time its replay, as SGLang runs "
        "decode (prefill stays eager)",
    )
    a = ap.parse_args(argv)
    if a.budget_s <= 0 or a.repeats < 1 or a.warmup < 0:
        ap.error("need --budget-s > 0, --repeats >= 1, --warmup >= 0")
    budget = Budget(a.budget_s)
    decoder, timer, device, is_oom, release = torch_backend(a.device, SHAPES[a.shape], a.seed)
    model = cost_model(a.preset or default_preset(device["name"]))

    def prepare(point: Point) -> Callable[[], object]:
        return (
            decoder.prefill(point.a, point.b)
            if point.kind == "prefill"
            else decoder.decode(point.a, point.b)
        )

    if a.cuda_graphs:
        if a.device != "cuda":
            ap.error("--cuda-graphs needs --device cuda")
        eager = prepare

        def prepare(point: Point) -> Callable[[], object]:
            step = eager(point)
            return step if point.kind == "prefill" else cuda_graph(step)

    points, skipped = run_points(
        plan_points(a.shape),
        prepare,
        timer,
        budget,
        model,
        warmup=a.warmup,
        repeats=a.repeats,
        is_oom=is_oom,
        release=release,
    )
    doc = report(points, skipped, model=model, shape_name=a.shape, device=device, budget=budget)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    table = markdown(doc)
    a.out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
