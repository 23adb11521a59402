"""Named engine presets: a model on a GPU, as SGLang would run it (bf16, TP 1).

Pure. Each preset gives the cost-model constants and the engine defaults that SGLang
derives for that model and GPU: the KV pool (``max_total_num_tokens``), the chunked
prefill size, ``max_prefill_tokens`` and the context length. Every number and its
source is in docs/simulator.md ("Presets"); they come from the project's calibration
reference (§2.3) and are not tuned.

:func:`scheduler_config` applies the token scale ``k`` of docs/simulator.md ("Token
scale"): every token quantity is divided by ``k`` (rounded), the retract headroom of 20
real decode steps becomes ``max(1, round(20 / k))`` simulated steps, and the
``new_token_ratio`` decay over 600 real steps spans ``round(600 / k)`` simulated steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvlab.sim.config import HiCacheConfig, SchedulerConfig, SimConfig
from kvlab.sim.cost import CostModel

# SGLang constants that are counted in real tokens or real decode steps.
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
MAX_TOKEN_SCALE = 1024
# Effective host <-> device bandwidth of a PCIe Gen5 x16 link (H100 / H200 SXM hosts), in
# GB/s: 64 GB/s per direction on paper, about 51-57 GB/s measured with pinned memory
# (docs/simulator.md, "HiCache"); 50 allows for a write-through copy in the other
# direction and SGLang's gather kernel on scattered pages. Measured on one H200
# (scripts/gpu_hostlink.py): 55 GB/s one way, 48 GB/s with the other direction busy,
# 47-49 GB/s through a gather kernel reading pinned host memory.
PCIE5_X16_EFFECTIVE_GB_S = 50.0


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    description: str
    cost: CostModel  # at token scale 1
    max_total_tokens: int  # SGLang's max_total_num_tokens, real tokens
    chunked_prefill_size: int
    max_prefill_tokens: int
    context_length: int
    # For HiCache: KV bytes per token (bf16: layers x kv heads x head dim x 2 x 2), the
    # layer count, and the host link's effective bandwidth in GB/s.
    kv_bytes_per_token: int = 147_456
    num_layers: int = 36
    host_link_gb_s: float = PCIE5_X16_EFFECTIVE_GB_S
    # The engine decodes running requests inside chunked-prefill steps (vLLM; SGLang
    # with --enable-mixed-chunk); False: SGLang's default, a prefill step stalls decode.
    mixed_chunk: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "max_total_num_tokens": self.max_total_tokens,
            "chunked_prefill_size": self.chunked_prefill_size,
            "max_prefill_tokens": self.max_prefill_tokens,
            "context_length": self.context_length,
            **self.cost.to_dict(),
        }


def _calibrated(
    name: str,
    description: str,
    *,
    tau_lin_us: float,
    tau_att_ns: float,
    a_ms: float,
    b_ms: float,
    c_ms_per_1k: float,
    pool: int,
    context: int,
    kv_bytes: int,
    layers: int,
    chunk: int = 8192,
    max_prefill: int = 16384,
    host_link_gb_s: float = PCIE5_X16_EFFECTIVE_GB_S,
    mixed_chunk: bool = False,
) -> Preset:
    # Units as in the reference table: µs, ns, ms, and ms per 1k tokens of S.
    cost = CostModel(
        t0_prefill_s=0.005,
        tau_lin_s=tau_lin_us * 1e-6,
        tau_att_s=tau_att_ns * 1e-9,
        decode_a_s=a_ms * 1e-3,
        decode_b_s=b_ms * 1e-3,
        decode_c_s_per_token=c_ms_per_1k * 1e-6,
        kind="calibrated",
        token_scale=1,
        preset=name,
    )
    return Preset(
        name,
        description,
        cost,
        pool,
        chunk,
        max_prefill,
        context,
        kv_bytes,
        layers,
        host_link_gb_s,
        mixed_chunk,
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        _calibrated(
            "qwen3-8b-h100",
            "Qwen3-8B, bf16, one H100 80GB (mem_fraction_static 0.835)",
            tau_lin_us=27.8,
            tau_att_ns=1.311,
            a_ms=7.0,
            b_ms=0.02,
            c_ms_per_1k=0.0546,
            pool=367_000,
            context=40_960,
            kv_bytes=147_456,
            layers=36,
        ),
        _calibrated(
            "qwen3-8b-h200",
            "Qwen3-8B, bf16, one H200 141GB (mem_fraction_static 0.907)",
            tau_lin_us=27.8,
            tau_att_ns=1.311,
            a_ms=5.6,
            b_ms=0.02,
            c_ms_per_1k=0.0384,
            pool=805_000,
            context=40_960,
            kv_bytes=147_456,
            layers=36,
        ),
        _calibrated(
            "qwen3-32b-h200",
            "Qwen3-32B, bf16, one H200 141GB (mem_fraction_static 0.907)",
            tau_lin_us=113.5,
            tau_att_ns=4.66,
            a_ms=19.0,
            b_ms=0.03,
            c_ms_per_1k=0.0683,
            pool=265_000,
            context=40_960,
            kv_bytes=262_144,
            layers=64,
        ),
        _calibrated(
            "llama3.1-8b-h100",
            "Llama-3.1-8B, bf16, one H100 80GB (mem_fraction_static 0.835)",
            tau_lin_us=27.9,
            tau_att_ns=1.165,
            a_ms=6.5,
            b_ms=0.02,
            c_ms_per_1k=0.0485,
            pool=415_000,
            context=131_072,
            kv_bytes=131_072,
            layers=32,
        ),
        # The engine of the public ThunderAgent replication
        # (zetxqx/thunderagent-original-verification): vLLM 0.28, FP8 weights and KV,
        # TP 2 on two H100s per pod. Every constant's source is in docs/simulator.md
        # ("qwen3-coder-30b-a3b-fp8-h100-tp2").
        _calibrated(
            "qwen3-coder-30b-a3b-fp8-h100-tp2",
            "Qwen3-Coder-30B-A3B-Instruct-FP8 (MoE, 3.3B active), FP8 KV, TP 2 on two "
            "H100 80GB (vLLM gpu-memory-utilization 0.88)",
            tau_lin_us=9.07,
            tau_att_ns=0.715,
            a_ms=6.5,
            b_ms=0.02,
            c_ms_per_1k=0.00917,
            pool=2_237_040,
            context=262_144,
            kv_bytes=49_152,
            layers=48,
            chunk=8192,
            max_prefill=8192,
            host_link_gb_s=2 * PCIE5_X16_EFFECTIVE_GB_S,
            mixed_chunk=True,
        ),
        Preset(
            "legacy",
            "the simulator's original two-constant model (prefill 10 ms + 50 us/token, "
            "decode 12 ms + 0.2 ms per request), blind to attention and context",
            CostModel(),
            200_000,
            8192,
            16384,
            40_960,
        ),
    )
}
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)
DEFAULT_PRESET = "legacy"


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown cost model {name!r}; choose one of {', '.join(PRESET_NAMES)}"
        ) from None


def _check_scale(token_scale: int) -> None:
    if (
        isinstance(token_scale, bool)
        or not isinstance(token_scale, int)
        or not 1 <= token_scale <= MAX_TOKEN_SCALE
    ):
        raise ValueError(f"token_scale must be an integer in [1, {MAX_TOKEN_SCALE}]")


def scale_tokens(tokens: int, token_scale: int) -> int:
    """A fixed token quantity in simulated tokens: ``round(tokens / k)``, at least 1."""
    return max(1, round(tokens / token_scale))


def scale_steps(steps: int, token_scale: int) -> int:
    """A count of real decode steps in simulated steps: ``max(1, round(steps / k))``."""
    return max(1, round(steps / token_scale))


def cost_model(name: str, token_scale: int = 1) -> CostModel:
    """The preset's cost model at token scale ``token_scale``."""
    _check_scale(token_scale)
    return dataclasses.replace(get_preset(name).cost, token_scale=token_scale)


def scheduler_config(preset: str, token_scale: int = 1, **overrides: Any) -> SchedulerConfig:
    """A :class:`SchedulerConfig` for ``preset`` at token scale ``token_scale``.

    Pool, chunk, max prefill, context length and the ``max_new_tokens`` estimation clip
    are divided by ``k``; retract headroom and ratio decay are in simulated steps.
    ``overrides`` (SchedulerConfig field names) are applied last, as given: they are in
    simulated tokens already.
    """
    _check_scale(token_scale)
    p = get_preset(preset)
    k = token_scale
    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown SchedulerConfig fields: {sorted(unknown)}")
    chunk = p.chunked_prefill_size
    base = SchedulerConfig(
        max_total_tokens=scale_tokens(p.max_total_tokens, k),
        max_prefill_tokens=scale_tokens(p.max_prefill_tokens, k),
        chunked_prefill_size=scale_tokens(chunk, k) if chunk > 0 else chunk,
        context_length=scale_tokens(p.context_length, k),
        cost=cost_model(preset, k),
        new_token_ratio_decay_steps=scale_steps(NEW_TOKEN_RATIO_DECAY_STEPS, k),
        retract_decode_steps=scale_steps(RETRACT_DECODE_STEPS, k),
        clip_max_new_tokens=scale_tokens(CLIP_MAX_NEW_TOKENS, k),
    )
    if p.mixed_chunk:
        base = dataclasses.replace(base, enable_mixed_chunk=True, mixed_decode_every=k)
    return dataclasses.replace(base, **overrides)


def hicache_config(
    preset: str,
    token_scale: int = 1,
    *,
    ratio: float = 2.0,
    size_gb: int = 0,
    write_policy: str = "write_through",
    host_link_gb_s: float | None = None,
) -> HiCacheConfig:
    """SGLang's HiCache for ``preset`` (defaults: SGLang's, ratio 2.0 and write_through):
    the preset's KV bytes per token, layers and host link (``host_link_gb_s`` overrides
    the link), at ``token_scale``. The legacy preset, which has no model, uses Qwen3-8B's
    shape."""
    _check_scale(token_scale)
    p = get_preset(preset)
    return HiCacheConfig(
        ratio=ratio,
        size_gb=size_gb,
        write_policy=write_policy,
        kv_bytes_per_token=p.kv_bytes_per_token,
        host_link_gb_s=p.host_link_gb_s if host_link_gb_s is None else host_link_gb_s,
        num_layers=p.num_layers,
        token_scale=token_scale,
    )


def sim_config(preset: str, token_scale: int = 1, **overrides: Any) -> SimConfig:
    """A :class:`SimConfig` (the HTTP engine) for ``preset`` at ``token_scale``.

    The scheduler fields come from :func:`scheduler_config`; ``overrides`` may name any
    SimConfig field (scheduler fields are applied as given, in simulated tokens).
    """
    sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    sim_fields = {f.name for f in dataclasses.fields(SimConfig)} - {"scheduler"}
    unknown = set(overrides) - sim_fields - sched_fields
    if unknown:
        raise ValueError(f"unknown SimConfig fields: {sorted(unknown)}")
    sc = scheduler_config(
        preset, token_scale, **{k: v for k, v in overrides.items() if k in sched_fields}
    )
    return SimConfig(scheduler=sc, **{k: v for k, v in overrides.items() if k in sim_fields})
