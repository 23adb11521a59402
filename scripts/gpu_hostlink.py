#!/usr/bin/env python3
"""Measure the host <-> device link that the simulator's HiCache model assumes: KV of
Qwen3-8B's shape copied between pinned host memory and the GPU, timed, next to what the
preset predicts for the same tokens.

    python scripts/gpu_hostlink.py --device cuda --out results/gpu_hostlink.json

The simulator (kvlab/sim/hicache.py; docs/simulator.md, "HiCache") charges a load of
``n`` tokens ``n x kv_bytes_per_token / host_link_gb_s`` seconds (the preset's 50 GB/s
is derived from published figures, not measured). This script measures, in bf16, with
the preset's KV bytes per token and layer count (Qwen3-8B: 147,456 bytes, 36 layers, so
2,048 bytes of K and as many of V per token and layer):

* ``h2d`` / ``d2h``: one contiguous copy of ``n`` tokens of KV, pinned host memory,
  copy engines (``copy_(non_blocking=True)`` on a side stream), CUDA events.
* ``bidir``: a host -> device copy and a device -> host copy of ``n`` tokens each on two
  streams at once (HiCache's write-through runs while loads come back); the load's
  bandwidth, the other direction's in the note.
* SGLang's ``layer_first`` layout: a host pool ``[2, layers, P, kv_heads x head_dim]``
  (K, V), as ``MHATokenToKVPoolHost`` allocates it, and a device pool of the same shape;
  a load of ``n`` tokens copies, per layer, K and V of those tokens.
  ``layer_contig``: token slots contiguous on both sides (2 x layers copies of ``n`` x
  2,048 bytes). ``layer_pages``: pages of ``page`` tokens at random non-adjacent slots on
  both sides, one ``copy_`` per page, K and V, per layer (SGLang's ``direct`` io
  backend), issued from Python (the note gives the CPU's issue time: when it is close to
  the measured time the point is bound by the issuing, not by the link);
  ``layer_pages_graph``: the same copies captured once in a CUDA graph and replayed (no
  CPU in the loop: the copy engines' own cost per small copy). ``uva_gather``: SGLang's
  default ``kernel`` io backend gathers the token slots with a CUDA kernel that reads
  pinned host memory through unified virtual addressing; emulated here with PyTorch
  alone by a CUDA tensor that aliases the pinned host pool (``__cuda_array_interface__``
  over its pointer, checked against the host data once), ``index_select`` on it into a
  device buffer (a kernel on the SMs reading host memory over PCIe, 8-byte words) then
  ``index_copy_`` into the scattered device slots, per layer, K and V (``page`` 1 is
  SGLang's default page size). ``staged_gather``: ``index_select`` on the CPU into a
  pinned staging buffer (two, alternating), one copy per layer and K/V, then
  ``index_copy_`` on the device.
* ``overlap_copy`` / ``overlap_uva``: a load of ``n`` tokens (contiguous copy; UVA
  gather) on a side stream while the default stream runs a loop of bf16 GEMMs of about
  the load's duration; the load's bandwidth under compute, and in the note its
  bandwidth alone and the GEMMs' slowdown (the simulator assumes the load overlaps the
  prefill layer by layer at full link speed and costs the compute nothing).

Every point gives the preset's prediction (``HiCacheConfig.transfer_s``: ``n x
kv_bytes_per_token / host_link_gb_s``), measured / predicted, and for scale what the
preset charges to recompute the same ``n`` tokens instead
(``CostModel.prefill_tokens_s(n, 0, chunked_prefill_size)``).

Host memory is allocated the way SGLang allocates its host pool: anonymous ``mmap``
then ``cudaHostRegister`` (``torch.cuda.cudart()``), so the pool is pinned at its exact
size; ``pin_memory=True`` if registering fails. The pool holds ``--pool-tokens`` tokens
on each side (65,536 by default: 9.7 GB of pinned host memory and as much device
memory; the 64k-token copies use all of it, the scattered loads at most every other
page of it). The UVA view needs numpy (PyTorch parses ``__cuda_array_interface__``
with it); without it, or if the view does not read back the host's data, the UVA
points are skipped with the reason.

Not emulated: SGLang's own transfer kernels (one kernel per layer for K and V, a
bounded number of blocks so that the load leaves SMs to the prefill, both sides'
indices in one pass; here two PyTorch kernels per layer and K/V, with a device buffer
in between, on the grid PyTorch picks), its ``direct`` backend's C++ loop (here a
Python loop, slower to issue; the CUDA graph variant bounds it from the other side),
how scattered real host slots are (here random pages, the worst case; a node's slots
are often runs), the per-layer events a prefill layer waits on, NUMA placement (the
host pool's pages are first touched by one thread, on whatever node it runs; the GPU's
node is reported, not chosen), and the scheduler around all this.

Flags: ``--device cuda|cpu``, ``--size full|tiny`` (default: full on cuda, tiny on the
CPU: a 256-token pool, for the unit test; the CPU run checks the pipeline, not timing:
plain tensors, wall-clock timers, no streams, no CUDA graph), ``--preset`` (default:
``qwen3-8b-h200`` on an H200, else ``qwen3-8b-h100``), ``--out PATH`` (JSON, and the
same as a Markdown table next to it, ``.md``), ``--budget-s`` (default 150: the
measurement stops taking samples, then points, past it; points it never reached are
listed as skipped), ``--repeats``, ``--warmup``, ``--pool-tokens``, ``--seed``. About
a minute on one H200 with the defaults, allocation included (the budget bounds it: at
most 150 s and one point's samples).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_calibrate import Budget, default_preset, ratio  # the same harness pieces
from gpu_calibrate import _torch as _calibrate_torch

from kvlab.sim.cost import CostModel
from kvlab.sim.presets import Preset, cost_model, get_preset, hicache_config

SCHEMA = 1
DTYPE_BYTES = 2  # bf16, the KV dtype the presets' kv_bytes_per_token assumes

# What each kind of point measures (the JSON carries it; the docstring says more).
KINDS: dict[str, str] = {
    "h2d": "host -> device, one contiguous copy, copy engine",
    "d2h": "device -> host, one contiguous copy, copy engine",
    "bidir": "host -> device while device -> host on another stream (write-through)",
    "layer_contig": "layer_first load, slots contiguous: one copy per layer and K/V",
    "layer_pages": "layer_first load, scattered pages: one copy per page, layer and K/V "
    "(SGLang's direct io backend), issued from Python",
    "layer_pages_graph": "as layer_pages, captured in a CUDA graph and replayed",
    "uva_gather": "layer_first load, scattered slots gathered by a GPU kernel reading "
    "pinned host memory (emulates SGLang's kernel io backend)",
    "staged_gather": "layer_first load, scattered slots gathered on the CPU into pinned "
    "staging, then one copy per layer and K/V",
    "overlap_copy": "contiguous host -> device load while the default stream runs GEMMs",
    "overlap_uva": "UVA-gather load while the default stream runs GEMMs",
}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """KV bytes per token and layers (the preset's), and what follows for one layer."""

    kv_bytes_per_token: int
    layers: int

    @classmethod
    def of(cls, preset: Preset) -> KVLayout:
        return cls(preset.kv_bytes_per_token, preset.num_layers)

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token % (2 * self.layers * DTYPE_BYTES):
            raise ValueError("KV bytes per token must split into K and V of whole bf16 rows")

    @property
    def row_bytes(self) -> int:
        """Bytes of K (or of V) of one token in one layer: kv heads x head dim x 2."""
        return self.kv_bytes_per_token // (2 * self.layers)

    @property
    def row_elems(self) -> int:
        return self.row_bytes // DTYPE_BYTES

    @property
    def word_bytes(self) -> int:
        """The word a gather moves: 8 bytes where a row divides into them, else 2."""
        return 8 if self.row_bytes % 8 == 0 else 2

    def pool_shape(self, tokens: int) -> tuple[int, int, int, int]:
        """SGLang's layer_first host pool (K/V, layer, token, kv heads x head dim)."""
        return (2, self.layers, tokens, self.row_elems)

    def pool_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token


@dataclass(frozen=True, slots=True)
class Point:
    """One measurement: ``kind`` (see KINDS) of ``tokens`` tokens, in pages of ``page``
    tokens where the slots are scattered (0: contiguous)."""

    kind: str
    tokens: int
    page: int = 0

    def label(self) -> str:
        pages = f", pages of {self.page}" if self.page else ""
        return f"{self.kind} {self.tokens} tokens{pages}"

    def fields(self) -> dict[str, Any]:
        return {"kind": self.kind, "tokens": self.tokens, "page": self.page}


SCATTERED = ("layer_pages", "layer_pages_graph", "uva_gather", "staged_gather", "overlap_uva")
POOL_TOKENS = {"full": 65_536, "tiny": 256}


def plan_points(size: str) -> list[Point]:
    """The points, most telling first (the budget cuts the tail): the raw link both
    ways, both at once, the layer_first loads, the load under compute, then the
    page-by-page copies and the CPU gather. Every point fits the pool of its size:
    contiguous copies at most the pool, two at once at most half each, scattered
    pages at most every other page slot."""
    if size == "tiny":
        return [
            Point("h2d", 16),
            Point("h2d", 64),
            Point("d2h", 64),
            Point("bidir", 64),
            Point("layer_contig", 64),
            Point("uva_gather", 32, 1),
            Point("uva_gather", 64, 16),
            Point("overlap_copy", 64),
            Point("overlap_uva", 64, 1),
            Point("layer_pages", 64, 16),
            Point("layer_pages_graph", 64, 16),
            Point("staged_gather", 64, 16),
        ]
    k = 1024
    return [
        *(Point("h2d", n * k) for n in (1, 4, 16, 64)),
        *(Point("d2h", n * k) for n in (1, 4, 16, 64)),
        Point("bidir", 16 * k),
        Point("bidir", 32 * k),
        Point("layer_contig", 4 * k),
        Point("layer_contig", 16 * k),
        Point("uva_gather", 4 * k, 1),
        Point("uva_gather", 16 * k, 1),
        Point("uva_gather", 16 * k, 64),
        Point("overlap_copy", 16 * k),
        Point("overlap_uva", 16 * k, 1),
        Point("layer_pages", 4 * k, 64),
        Point("layer_pages", 16 * k, 64),
        Point("layer_pages", 4 * k, 16),
        Point("layer_pages_graph", 16 * k, 64),
        Point("layer_pages_graph", 4 * k, 16),
        Point("staged_gather", 16 * k, 64),
    ]


def fits(point: Point, pool_tokens: int) -> bool:
    """Whether ``point`` fits a pool of ``pool_tokens`` tokens (see plan_points)."""
    if point.kind == "bidir":
        return 2 * point.tokens <= pool_tokens
    if point.kind in SCATTERED:
        page = point.page
        return (
            page >= 1
            and point.tokens % page == 0
            and point.tokens // page <= len(range(0, pool_tokens // page, 2))
        )
    return 1 <= point.tokens <= pool_tokens


def scattered_pages(pool_tokens: int, tokens: int, page: int, rng: random.Random) -> list[int]:
    """First token slots of ``tokens // page`` pages of ``page`` tokens at random page
    slots of a ``pool_tokens``-token pool, no two adjacent (even page slots only), in
    random order."""
    if page < 1 or tokens % page:
        raise ValueError(f"{tokens} tokens do not make whole pages of {page}")
    candidates = range(0, pool_tokens // page, 2)
    if tokens // page > len(candidates):
        raise ValueError(f"{tokens} tokens in pages of {page} do not fit {pool_tokens}")
    return [slot * page for slot in rng.sample(candidates, tokens // page)]


def page_tokens(starts: Sequence[int], page: int) -> list[int]:
    """Every token slot of the pages that start at ``starts``."""
    return [s + i for s in starts for i in range(page)]


# ---------------------------------------------------------------------- predictions


def predicted_s(preset: str, tokens: int) -> float:
    """What the simulator charges to move ``tokens`` real tokens over the host link."""
    return hicache_config(preset).transfer_s(tokens)


def recompute_s(preset: str, model: CostModel, tokens: int) -> float:
    """What the cost model charges to recompute ``tokens`` tokens (no cached prefix,
    in the preset's prefill chunks)."""
    return model.prefill_tokens_s(tokens, 0, get_preset(preset).chunked_prefill_size)


def gb_s(nbytes: int, seconds: float | None) -> float | None:
    """Bandwidth in GB/s (1e9 bytes, as ``host_link_gb_s``)."""
    return None if seconds is None or not seconds > 0 else nbytes / seconds / 1e9


def row(
    point: Point, timing: dict[str, Any], *, preset: str, model: CostModel, layout: KVLayout
) -> dict[str, Any]:
    """One measured point: its timing, bandwidth, prediction and recompute cost."""
    nbytes = layout.pool_bytes(point.tokens)
    s = timing["measured_s"]
    pred = predicted_s(preset, point.tokens)
    rec = recompute_s(preset, model, point.tokens)
    out: dict[str, Any] = {
        "label": point.label(),
        **point.fields(),
        "bytes": nbytes,
        **timing,
        "gb_s": gb_s(nbytes, s),
        "us_per_token": s / point.tokens * 1e6,
        "predicted_s": pred,
        "ratio": ratio(s, pred),
        "recompute_s": rec,
        "load_over_recompute": ratio(s, rec),
    }
    if "d2h_s" in timing:
        out["d2h_gb_s"] = gb_s(nbytes, timing["d2h_s"])
    if "alone_s" in timing:
        out["alone_gb_s"] = gb_s(nbytes, timing["alone_s"])
    if "gemm_s" in timing:
        out["gemm_slowdown"] = ratio(timing["gemm_s"], timing.get("gemm_alone_s"))
    if "issue_s" in timing:
        out["issue_over_measured"] = ratio(timing["issue_s"], s)
    return out


# -------------------------------------------------------------------- timing harness

# One run of a point: seconds of the timed interval ("s") and of any others it reports.
Step = Callable[[], dict[str, float]]


class Unsupported(Exception):
    """A point this device or this PyTorch cannot measure (it is skipped, with why)."""


def measure(
    step: Step, budget: Budget, *, warmup: int, repeats: int, share_s: float
) -> dict[str, Any]:
    """``warmup`` untimed runs (at least one), then up to ``repeats`` timed ones,
    stopping early past ``share_s`` seconds of this point or the whole budget (one
    timed run at least). The median of "s" is the point's time; every other interval
    a run reports is given as its median under its own name."""
    started = budget.elapsed()
    for _ in range(max(1, warmup)):
        step()
        if budget.left() <= 0:
            break
    samples: list[dict[str, float]] = []
    for _ in range(max(1, repeats)):
        samples.append(step())
        if budget.left() <= 0 or budget.elapsed() - started >= share_s:
            break
    main = [x["s"] for x in samples]
    out: dict[str, Any] = {
        "measured_s": statistics.median(main),
        "min_s": min(main),
        "max_s": max(main),
        "samples": len(samples),
    }
    for key in sorted({k for x in samples for k in x} - {"s"}):
        out[key] = statistics.median(x[key] for x in samples if key in x)
    return out


def run_points(
    points: Sequence[Point],
    prepare: Callable[[Point], Step],
    budget: Budget,
    *,
    preset: str,
    model: CostModel,
    layout: KVLayout,
    warmup: int = 2,
    repeats: int = 5,
    is_oom: Callable[[BaseException], bool] = lambda exc: False,
    release: Callable[[], None] = lambda: None,
    progress: Callable[[str], None] = lambda line: None,
    skip_errors: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Measure each point (``prepare`` builds its step, untimed) while the budget lasts;
    returns (measured points, skipped points with why). A point this device cannot
    measure (:class:`Unsupported`) or cannot fit is skipped; any other error ends the
    run, or with ``skip_errors`` skips the point (one GPU run then still gives every
    point that works). ``progress`` gets a line per point as it ends."""
    done: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for i, point in enumerate(points):
        base = {"label": point.label(), **point.fields()}
        if budget.left() <= 0:
            skipped.append({**base, "reason": "budget"})
            progress(f"{point.label()}: skipped (budget)")
            continue
        share = budget.left() / (len(points) - i)
        step: Step | None = None
        try:
            step = prepare(point)
            timing = measure(step, budget, warmup=warmup, repeats=repeats, share_s=share)
        except Unsupported as exc:
            skipped.append({**base, "reason": f"unsupported: {exc}"})
            progress(f"{point.label()}: skipped ({skipped[-1]['reason']})")
            continue
        except Exception as exc:
            if is_oom(exc):
                reason = "out of memory"
            elif skip_errors:
                reason = f"error: {exc!r}"[:300]
            else:
                raise
            skipped.append({**base, "reason": reason})
            progress(f"{point.label()}: skipped ({reason})")
            continue
        finally:
            step = None  # its buffers go before the next point's are allocated
            release()
        done.append(row(point, timing, preset=preset, model=model, layout=layout))
        r = done[-1]
        progress(
            f"{point.label()}: {r['measured_s'] * 1e3:.3f} ms, {_f(r['gb_s'], '.1f')} GB/s, "
            f"x{_f(r['ratio'], '.2f')} the prediction ({budget.elapsed():.0f} s)"
        )
    return done, skipped


# ---------------------------------------------------------------------------- report


def report(
    points: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
    *,
    preset: str,
    model: CostModel,
    layout: KVLayout,
    size: str,
    pool_tokens: int,
    device: dict[str, Any],
    budget: Budget,
    argv: Sequence[str],
) -> dict[str, Any]:
    """The JSON document."""
    p = get_preset(preset)
    return {
        "schema": SCHEMA,
        "command": "python scripts/gpu_hostlink.py " + " ".join(argv),
        "device": device,
        "size": size,
        "preset": {
            "name": preset,
            "kv_bytes_per_token": p.kv_bytes_per_token,
            "num_layers": p.num_layers,
            "host_link_gb_s": p.host_link_gb_s,
            "chunked_prefill_size": p.chunked_prefill_size,
        },
        "cost_model": model.to_dict(),
        "layout": {
            "pool_tokens": pool_tokens,
            "pool_bytes": layout.pool_bytes(pool_tokens),
            "pool_shape": list(layout.pool_shape(pool_tokens)),
            "row_bytes": layout.row_bytes,
            "dtype": "bfloat16",
        },
        "kinds": KINDS,
        "budget_s": budget.seconds,
        "elapsed_s": round(budget.elapsed(), 3),
        "points": points,
        "skipped": skipped,
    }


def _f(x: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, fmt)


def note(p: dict[str, Any]) -> str:
    """The point's other intervals, in words."""
    parts = []
    if p.get("d2h_gb_s") is not None:
        parts.append(f"d2h at once {p['d2h_gb_s']:.1f} GB/s")
    if p.get("alone_gb_s") is not None:
        parts.append(f"load alone {p['alone_gb_s']:.1f} GB/s")
    if "gemm_slowdown" in p:
        parts.append(
            f"GEMMs x{_f(p['gemm_slowdown'], '.2f')} ({_f(p.get('gemm_alone_s'), '.1f', 1e3)} ms alone)"
        )
    if "issue_s" in p:
        parts.append(f"CPU issue {_f(p['issue_s'], '.1f', 1e3)} ms")
    return "; ".join(parts)


def markdown(doc: dict[str, Any]) -> str:
    """The document as a Markdown table."""
    dev, pre, lay = doc["device"], doc["preset"], doc["layout"]
    lines = [
        f"# Host link vs {dev.get('name', dev.get('type'))}: preset {pre['name']} "
        f"({pre['host_link_gb_s']:g} GB/s)",
        "",
        f"`{doc['command']}`; torch {dev.get('torch')}, CUDA {dev.get('cuda')}; host memory "
        f"{dev.get('host_memory')}; PCIe {dev.get('pcie', '-')}; UVA view: "
        f"{dev.get('uva_view')}; "
        f"{doc['elapsed_s']:.0f} s of a {doc['budget_s']:.0f} s budget.",
        "",
        f"KV {pre['kv_bytes_per_token']:,} bytes/token, {pre['num_layers']} layers "
        f"({lay['row_bytes']:,} bytes of K and of V per token and layer), bf16; pool "
        f"{lay['pool_tokens']:,} tokens ({lay['pool_bytes'] / 1e9:.2f} GB) on each side. "
        "Predicted: tokens x KV bytes / host link; recompute: the preset's prefill of "
        "the same tokens.",
        "",
        "| point | MB | measured ms (min-max) | GB/s | us/token | predicted ms "
        "| measured / predicted | recompute ms | load / recompute | samples | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in doc["points"]:
        lines.append(
            f"| {p['label']} | {p['bytes'] / 1e6:.1f} | {p['measured_s'] * 1e3:.3f} "
            f"({p['min_s'] * 1e3:.3f}-{p['max_s'] * 1e3:.3f}) | {_f(p['gb_s'], '.1f')} "
            f"| {p['us_per_token']:.3f} | {p['predicted_s'] * 1e3:.3f} | {_f(p['ratio'], '.2f')} "
            f"| {p['recompute_s'] * 1e3:.1f} | {_f(p['load_over_recompute'], '.3f')} "
            f"| {p['samples']} | {note(p)} |"
        )
    for p in doc["skipped"]:
        lines.append(f"| {p['label']} | - | skipped: {p['reason']} | - | - | - | - | - | - | 0 | |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------ the link (PyTorch only)


def _torch() -> Any:
    return _calibrate_torch("gpu_hostlink")


class _CpuEvent:
    """torch.cuda.Event's interface on the wall clock (CPU copies are synchronous)."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: _CpuEvent) -> float:
        return (end.t - self.t) * 1e3


class _CudaArray:
    """A pinned host tensor's memory under ``__cuda_array_interface__``: PyTorch then
    makes a CUDA tensor of it, which kernels read through unified virtual addressing."""

    def __init__(self, host: Any, typestr: str) -> None:
        self.host = host  # kept alive as long as the CUDA alias
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


class Link:
    """The host and device KV pools and the steps that move KV between them."""

    def __init__(self, device: str, layout: KVLayout, pool_tokens: int, seed: int) -> None:
        torch = self.torch = _torch()
        self.cuda = device == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise SystemExit("gpu_hostlink: --device cuda but torch.cuda.is_available() is False")
        self.device, self.layout, self.pool = device, layout, pool_tokens
        self.rng = random.Random(seed)
        # The host and device token slots of the last scattered point prepared.
        self.last_slots: tuple[list[int], list[int]] = ([], [])
        self.word = torch.int64 if layout.word_bytes == 8 else torch.int16
        self._registered: int | None = None
        self.host, self.host_memory = self._host_pool()
        self.dev = torch.empty(layout.pool_shape(pool_tokens), dtype=torch.bfloat16, device=device)
        self.host_flat, self.dev_flat = self.host.view(-1), self.dev.view(-1)
        self.host_words, self.dev_words = self.host.view(self.word), self.dev.view(self.word)
        # The default stream and two side streams (None on the CPU: no streams there).
        self.main: Any = torch.cuda.current_stream() if self.cuda else None
        self.side: Any = torch.cuda.Stream() if self.cuda else None
        self.other: Any = torch.cuda.Stream() if self.cuda else None
        self.alias, self.uva = self._uva_alias()

    # -- memory

    def _host_pool(self) -> tuple[Any, str]:
        """SGLang's way (``alloc_mmap``, ``alloc_with_host_register``): shared anonymous
        mmap, page-aligned and populated, then cudaHostRegister with default flags."""
        torch, shape = self.torch, self.layout.pool_shape(self.pool)
        nbytes = self.layout.pool_bytes(self.pool)
        self._mm = mmap.mmap(-1, nbytes)
        host = torch.frombuffer(self._mm, dtype=torch.uint8).view(torch.bfloat16).view(shape)
        # Every page faulted in before it is pinned, as SGLang populates its pool, by one
        # thread: first touch puts the pages on that thread's NUMA node, not spread over
        # every node as a multithreaded zero_() would.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            host.zero_()
        finally:
            torch.set_num_threads(threads)
        if not self.cuda:
            return host, "pageable (cpu run)"
        try:
            rc = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0))
        except Exception as exc:  # no cudart bindings in this build
            rc, why = -1, repr(exc)
        else:
            why = f"rc {rc}"
        if rc == 0:
            self._registered = host.data_ptr()
            return host, f"cudaHostRegister ({'pinned' if host.is_pinned() else 'NOT pinned'})"
        host = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
        return host, f"pin_memory=True (cudaHostRegister failed: {why})"

    def _uva_alias(self) -> tuple[Any, str]:
        """A CUDA tensor over the pinned host pool (words), checked against the host."""
        torch = self.torch
        if not self.cuda:
            return self.host_words, "cpu run: index_select on the host tensor itself"
        typestr = "<i8" if self.word == torch.int64 else "<i2"
        try:
            alias = torch.as_tensor(_CudaArray(self.host_words, typestr))
            probe = self.host_words[1, -1, :8]
            probe.copy_(torch.randint(-(2**15), 2**15, probe.shape, dtype=self.word))
            idx = torch.tensor([self.pool - 1, 0], device="cuda")
            got = torch.index_select(alias[1, -1], 0, idx).cpu()
            want = torch.index_select(self.host_words[1, -1], 0, idx.cpu())
        except Exception as exc:
            return None, f"no CUDA view of pinned host memory: {exc!r}"
        if alias.device.type != "cuda" or alias.data_ptr() != self.host_words.data_ptr():
            return None, "the CUDA view is a copy, not an alias"
        if not torch.equal(got, want):
            return None, "the CUDA view reads other data than the host pool holds"
        return alias, "ok: a CUDA tensor aliasing the pinned host pool (checked)"

    def close(self) -> None:
        """Unregister the host pool (after a failed point the device may refuse: the
        process ends next anyway, so that is reported, not raised)."""
        try:
            if self.cuda:
                self.torch.cuda.synchronize()
            if self._registered is not None:
                self.torch.cuda.cudart().cudaHostUnregister(self._registered)
        except Exception as exc:
            print(f"gpu_hostlink: closing the link: {exc!r}", file=sys.stderr)
        self._registered = None

    def describe(self) -> dict[str, Any]:
        torch = self.torch
        out = {
            "type": self.device,
            "name": torch.cuda.get_device_name(0) if self.cuda else "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "host_memory": self.host_memory,
            "uva_view": self.uva,
        }
        if self.cuda:
            out["pcie"] = _pcie()
        return out

    # -- timing

    def event(self) -> Any:
        return self.torch.cuda.Event(enable_timing=True) if self.cuda else _CpuEvent()

    def on(self, stream: Any) -> Any:
        return self.torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def timed(self, stream: Any, enqueue: Callable[[], object]) -> float:
        """Seconds between events recorded on ``stream`` around what ``enqueue`` queues."""
        start, end = self.event(), self.event()
        start.record(stream)
        with self.on(stream):
            enqueue()
        end.record(stream)
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    # -- the steps

    def prepare(self, point: Point) -> Step:
        if not fits(point, self.pool):
            raise Unsupported(f"does not fit a {self.pool}-token pool")
        build = getattr(self, f"_{point.kind}")
        step: Step = build(point)
        return step

    def _single(self, enqueue: Callable[[], object]) -> Step:
        def step() -> dict[str, float]:
            self.sync()
            return {"s": self.timed(self.side, enqueue)}

        return step

    def _contig(self, tokens: int, to_device: bool, at: int = 0) -> Callable[[], object]:
        per = self.layout.kv_bytes_per_token // DTYPE_BYTES
        h = self.host_flat[at * per : (at + tokens) * per]
        d = self.dev_flat[at * per : (at + tokens) * per]
        src, dst = (h, d) if to_device else (d, h)
        return lambda: dst.copy_(src, non_blocking=True)

    def _h2d(self, p: Point) -> Step:
        return self._single(self._contig(p.tokens, True))

    def _d2h(self, p: Point) -> Step:
        return self._single(self._contig(p.tokens, False))

    def _bidir(self, p: Point) -> Step:
        load = self._contig(p.tokens, True)
        store = self._contig(p.tokens, False, at=p.tokens)

        def step() -> dict[str, float]:
            self.sync()
            start, h_end, d_end = self.event(), self.event(), self.event()
            start.record(self.side)
            if self.cuda:
                self.other.wait_event(start)
            with self.on(self.side):
                load()
            h_end.record(self.side)
            with self.on(self.other):
                store()
            d_end.record(self.other)
            h_end.synchronize()
            d_end.synchronize()
            return {
                "s": float(start.elapsed_time(h_end)) / 1e3,
                "d2h_s": float(start.elapsed_time(d_end)) / 1e3,
            }

        return step

    def _layers(self) -> list[tuple[int, int]]:
        return [(kv, layer) for layer in range(self.layout.layers) for kv in (0, 1)]

    def _layer_contig(self, p: Point) -> Step:
        n = p.tokens
        pairs = [(self.dev[kv, i, :n], self.host[kv, i, :n]) for kv, i in self._layers()]

        def enqueue() -> None:
            for d, s in pairs:
                d.copy_(s, non_blocking=True)

        return self._single(enqueue)

    def _page_pairs(self, p: Point) -> list[tuple[Any, Any]]:
        src = scattered_pages(self.pool, p.tokens, p.page, self.rng)
        dst = scattered_pages(self.pool, p.tokens, p.page, self.rng)
        g = p.page
        self.last_slots = (page_tokens(src, g), page_tokens(dst, g))
        return [
            (self.dev[kv, i, d : d + g], self.host[kv, i, s : s + g])
            for kv, i in self._layers()
            for s, d in zip(src, dst, strict=True)
        ]

    def _layer_pages(self, p: Point) -> Step:
        pairs = self._page_pairs(p)
        issued = [0.0]

        def enqueue() -> None:
            t0 = time.perf_counter()
            for d, s in pairs:
                d.copy_(s, non_blocking=True)
            issued[0] = time.perf_counter() - t0

        def step() -> dict[str, float]:
            self.sync()
            return {"s": self.timed(self.side, enqueue), "issue_s": issued[0]}

        return step

    def _layer_pages_graph(self, p: Point) -> Step:
        if not self.cuda:
            raise Unsupported("CUDA graphs need --device cuda")
        torch, pairs = self.torch, self._page_pairs(p)
        graph = torch.cuda.CUDAGraph()
        self.sync()
        try:
            with torch.cuda.graph(graph, stream=self.other, capture_error_mode="relaxed"):
                for d, s in pairs:
                    d.copy_(s, non_blocking=True)
        except Exception as exc:
            raise Unsupported(f"capturing the copies failed: {exc!r}") from exc
        return self._single(graph.replay)

    def _gather_indices(self, p: Point, device: str) -> tuple[Any, Any]:
        torch = self.torch
        src = page_tokens(scattered_pages(self.pool, p.tokens, p.page, self.rng), p.page)
        dst = page_tokens(scattered_pages(self.pool, p.tokens, p.page, self.rng), p.page)
        self.last_slots = (src, dst)
        return (
            torch.tensor(src, dtype=torch.int64, device=device),
            torch.tensor(dst, dtype=torch.int64, device=self.device),
        )

    def _uva_load(self, p: Point) -> Callable[[], object]:
        if self.alias is None:
            raise Unsupported(self.uva)
        torch = self.torch
        src, dst = self._gather_indices(p, self.device)
        tmp = torch.empty(
            (p.tokens, self.host_words.shape[-1]), dtype=self.word, device=self.device
        )
        views = [(self.alias[kv, i], self.dev_words[kv, i]) for kv, i in self._layers()]

        def enqueue() -> None:
            for h, d in views:
                torch.index_select(h, 0, src, out=tmp)
                d.index_copy_(0, dst, tmp)

        return enqueue

    def _uva_gather(self, p: Point) -> Step:
        return self._single(self._uva_load(p))

    def _staged_gather(self, p: Point) -> Step:
        torch = self.torch
        src, dst = self._gather_indices(p, "cpu")
        shape = (p.tokens, self.host_words.shape[-1])
        stage = [torch.empty(shape, dtype=self.word, pin_memory=self.cuda) for _ in range(2)]
        tmp = [torch.empty(shape, dtype=self.word, device=self.device) for _ in range(2)]
        done = [self.event(), self.event()]
        views = [(self.host_words[kv, i], self.dev_words[kv, i]) for kv, i in self._layers()]

        def enqueue() -> None:
            for j, (h, d) in enumerate(views):
                b = j % 2
                if j >= 2:
                    done[b].synchronize()  # its previous copy has left the staging buffer
                torch.index_select(h, 0, src, out=stage[b])
                tmp[b].copy_(stage[b], non_blocking=True)
                d.index_copy_(0, dst, tmp[b])
                done[b].record(self.side)

        return self._single(enqueue)

    def _overlap_copy(self, p: Point) -> Step:
        return self._overlap(self._contig(p.tokens, True))

    def _overlap_uva(self, p: Point) -> Step:
        return self._overlap(self._uva_load(p))

    def _overlap(self, load: Callable[[], object]) -> Step:
        """``load`` on the side stream against GEMMs on the default one, about as long."""
        torch = self.torch
        m, k = (8192, 4096) if self.cuda else (64, 64)
        dtype = torch.bfloat16 if self.cuda else torch.float32
        a = torch.randn((m, k), dtype=dtype, device=self.device)
        b = torch.randn((k, k), dtype=dtype, device=self.device)
        c = torch.empty((m, k), dtype=dtype, device=self.device)
        for _ in range(3):
            torch.matmul(a, b, out=c)
        self.sync()
        one = self.timed(self.main, lambda: [torch.matmul(a, b, out=c) for _ in range(5)]) / 5
        load()
        self.sync()
        alone = self.timed(self.side, load)
        iters = max(1, min(10_000, round(alone / max(one, 1e-9))))

        def gemms() -> None:
            for _ in range(iters):
                torch.matmul(a, b, out=c)

        def step() -> dict[str, float]:
            self.sync()
            gemm_alone = self.timed(self.main, gemms)
            load_alone = self.timed(self.side, load)
            self.sync()
            start, l_end, g_end = self.event(), self.event(), self.event()
            start.record(self.main)
            if self.cuda:
                self.side.wait_event(start)
            with self.on(self.side):
                load()
            l_end.record(self.side)
            gemms()
            g_end.record(self.main)
            l_end.synchronize()
            g_end.synchronize()
            return {
                "s": float(start.elapsed_time(l_end)) / 1e3,
                "alone_s": load_alone,
                "gemm_s": float(start.elapsed_time(g_end)) / 1e3,
                "gemm_alone_s": gemm_alone,
            }

        return step


def _pcie() -> str:
    """The GPU's PCIe link as nvidia-smi reports it, and its NUMA node against the
    host's (best effort; an idle link may show a lower current generation)."""
    q = "pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
    q += "pcie.link.width.max,pci.bus_id"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()[0]
        gen, gen_max, width, width_max, bus = (x.strip() for x in out.split(","))
    except Exception:
        return "unknown"
    link = f"gen {gen} (max {gen_max}) x{width} (max x{width_max})"
    try:  # nvidia-smi's 00000000:19:00.0 is sysfs's 0000:19:00.0
        pci = Path("/sys/bus/pci/devices") / bus.lower()[-12:]
        node = (pci / "numa_node").read_text().strip()
        nodes = Path("/sys/devices/system/node/online").read_text().strip()
    except OSError:
        return link
    return f"{link}, GPU on NUMA node {node} of {nodes}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--size", choices=tuple(POOL_TOKENS), default=None)
    ap.add_argument("--preset", default=None, help="preset (default: by the GPU)")
    ap.add_argument("--out", type=Path, default=Path("results/gpu_hostlink.json"))
    ap.add_argument("--budget-s", type=float, default=150.0, help="budget (default 150)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per point (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs per point (default 2)")
    ap.add_argument("--pool-tokens", type=int, default=None, help="tokens in each pool")
    ap.add_argument("--seed", type=int, default=0)
    args = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(args)
    if a.budget_s <= 0 or a.repeats < 1 or a.warmup < 0:
        ap.error("need --budget-s > 0, --repeats >= 1, --warmup >= 0")
    size = a.size or ("full" if a.device == "cuda" else "tiny")
    pool = a.pool_tokens or POOL_TOKENS[size]
    budget = Budget(a.budget_s)
    link: Link | None = None
    try:
        torch = _torch()
        name = (
            torch.cuda.get_device_name(0)
            if a.device == "cuda" and torch.cuda.is_available()
            else "cpu"
        )
        preset = a.preset or default_preset(name)
        layout = KVLayout.of(get_preset(preset))
        model = cost_model(preset)
        link = Link(a.device, layout, pool, a.seed)

        def is_oom(exc: BaseException) -> bool:
            return isinstance(exc, torch.cuda.OutOfMemoryError | MemoryError)

        def release() -> None:
            if link is not None and link.cuda:
                torch.cuda.empty_cache()

        points, skipped = run_points(
            plan_points(size),
            link.prepare,
            budget,
            preset=preset,
            model=model,
            layout=layout,
            warmup=a.warmup,
            repeats=a.repeats,
            is_oom=is_oom,
            release=release,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
            skip_errors=True,
        )
        device = link.describe()
    finally:
        if link is not None:
            link.close()
    doc = report(
        points,
        skipped,
        preset=preset,
        model=model,
        layout=layout,
        size=size,
        pool_tokens=pool,
        device=device,
        budget=budget,
        argv=args,
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    table = markdown(doc)
    a.out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
