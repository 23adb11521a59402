#!/usr/bin/env python3
"""Print the simulator's validation table: each preset's cost model at token scale 1
against the published (or derived) reference points, as Markdown.

    .venv/bin/python scripts/sim_validation.py

The same points are pinned in tests/unit/test_sim_cost.py; docs/simulator.md
("Validation") is this script's output.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.sim.presets import PRESETS, cost_model

CHUNK = 8192

# (check, preset, kind, args, reference seconds or None, source)
POINTS: list[tuple[str, str, str, tuple[int, int], float | None, str]] = [
    ("fresh prefill 1k", "qwen3-8b-h100", "prefill", (1024, 0), None, "derived"),
    (
        "fresh prefill 8k",
        "qwen3-8b-h100",
        "prefill",
        (8192, 0),
        8192 / 27_670,
        "27,670 tok/s, Llama-3.1-8B/H100, 8k prompts (sglang PR #1060)",
    ),
    (
        "fresh prefill 8k",
        "llama3.1-8b-h100",
        "prefill",
        (8192, 0),
        8192 / 27_670,
        "same",
    ),
    ("fresh prefill 32k", "qwen3-8b-h100", "prefill", (32768, 0), None, "no measurement found"),
    ("fresh prefill 40,960", "qwen3-8b-h100", "prefill", (40960, 0), None, "no measurement found"),
    ("fresh prefill 32k", "llama3.1-8b-h100", "prefill", (32768, 0), None, "no measurement found"),
    ("900 new on 4k cached", "qwen3-8b-h100", "prefill", (900, 4000), None, "derived"),
    ("900 new on 16k cached", "qwen3-8b-h100", "prefill", (900, 16000), None, "derived"),
    ("full re-prefill 16.9k", "qwen3-8b-h100", "prefill", (16900, 0), None, "derived"),
    ("900 new on 32k cached", "qwen3-8b-h100", "prefill", (900, 32000), None, "derived"),
    ("full re-prefill 32.9k", "qwen3-8b-h100", "prefill", (32900, 0), None, "derived"),
    ("900 new on 16k cached", "qwen3-32b-h200", "prefill", (900, 16000), None, "derived"),
    ("full re-prefill 16.9k", "qwen3-32b-h200", "prefill", (16900, 0), None, "derived"),
    (
        "decode B 8, ctx 5.25k",
        "qwen3-8b-h100",
        "decode",
        (8, 5250),
        0.00970,
        "median ITL, ML.ENERGY Qwen3-8B/H100 GPQA (vLLM)",
    ),
    ("decode B 16, ctx 5.15k", "qwen3-8b-h100", "decode", (16, 5150), 0.01191, "same"),
    ("decode B 32, ctx 5.55k", "qwen3-8b-h100", "decode", (32, 5550), 0.01687, "same"),
    ("decode B 63, ctx 5.70k", "qwen3-8b-h100", "decode", (63, 5700), 0.02664, "same"),
    (
        "decode B 1, ctx 1k",
        "llama3.1-8b-h100",
        "decode",
        (1, 1000),
        0.0074,
        "upper bound: > 135 tok/s (sglang test_bench_one_batch.py)",
    ),
    (
        "decode B 8, ctx 1.25k",
        "llama3.1-8b-h100",
        "decode",
        (8, 1250),
        0.00732,
        "ML.ENERGY chat Llama-3.1-8B/H100",
    ),
    ("decode B 32, ctx 1.25k", "llama3.1-8b-h100", "decode", (32, 1250), 0.00891, "same"),
    (
        "decode at a full pool, B 32",
        "qwen3-8b-h100",
        "decode_pool",
        (32, 0),
        0.02788,
        "qualitative: 27.88 ms at mean batch 82 (ML.ENERGY, vLLM pool)",
    ),
    ("decode at a full pool, B 32", "qwen3-8b-h200", "decode_pool", (32, 0), None, "derived"),
    ("decode at a full pool, B 32", "qwen3-32b-h200", "decode_pool", (32, 0), None, "derived"),
]


def model_s(preset: str, kind: str, args: tuple[int, int]) -> float:
    c = cost_model(preset)
    if kind == "prefill":
        return c.prefill_tokens_s(args[0], args[1], CHUNK)
    if kind == "decode":
        return c.decode_s(args[0], args[0] * args[1])
    return c.decode_s(args[0], PRESETS[preset].max_total_tokens)


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
    print("| check | preset | model | reference | model vs reference | reference source |")
    print("|---|---|---|---|---|---|")
    for check, preset, kind, args, ref, source in POINTS:
        got = model_s(preset, kind, args)
        if ref is None:
            ref_s, delta = "-", "-"
        else:
            ref_s, delta = fmt(ref), f"{(got / ref - 1) * 100:+.1f}%"
        print(f"| {check} | `{preset}` | {fmt(got)} | {ref_s} | {delta} | {source} |")


if __name__ == "__main__":
    main()
