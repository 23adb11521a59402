"""Drawing from a workload's distributions, seeded: the primitives plans are made of.

Pure. Drawn token counts use stochastic rounding (the mean survives the token scale)
and are at least 1; token ids are drawn clear of the special tokens.
"""

from __future__ import annotations

import math
import random

from kvlab.workload.model import Dist, WorkloadSpec


def stochastic_round(x: float, rng: random.Random) -> int:
    """``floor(x)`` or ``floor(x) + 1`` with the probability of the fraction: keeps
    the mean of a scaled-down value."""
    f = math.floor(x)
    return f + (1 if rng.random() < x - f else 0)


def draw_real(dist: Dist, rng: random.Random) -> float:
    if dist.kind == "fixed":
        return dist.median
    if dist.kind == "uniform":
        return rng.uniform(dist.lo, dist.hi)
    x = dist.median * math.exp(rng.gauss(0.0, dist.sigma)) if dist.sigma > 0 else dist.median
    return min(dist.hi, max(dist.lo, x))


def draw_tokens(dist: Dist, rng: random.Random) -> int:
    """A token count (already scaled): stochastic rounding, at least 1."""
    return max(1, stochastic_round(draw_real(dist, rng), rng))


def draw_count(dist: Dist, rng: random.Random) -> int:
    """An unscaled count (turns): uniform draws integers in [lo, hi]; else rounded."""
    if dist.kind == "uniform":
        return rng.randint(math.ceil(dist.lo), math.floor(dist.hi))
    return max(1, math.floor(draw_real(dist, rng) + 0.5))


def draw_latency(
    fast: Dist, slow: Dist, slow_share: float, cap_s: float, rng: random.Random
) -> float:
    """Tool latency (s) from the two-part mixture, capped."""
    part = slow if slow_share > 0 and rng.random() < slow_share else fast
    return min(cap_s, draw_real(part, rng))


def token_ids(rng: random.Random, n: int, spec: WorkloadSpec) -> list[int]:
    return rng.choices(range(spec.min_token_id, spec.vocab_size), k=n)
