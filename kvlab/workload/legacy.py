"""The demo's and the rollout benchmark's agent workload, as before the calibrated presets.

:class:`WorkloadConfig` keeps the fields ``kvproxy demo`` and ``scripts/bench_rollout.py``
set (4-8 turns, a 1k shared prefix, 256-512-token tool results, 48-token replies, 0.5 s
lognormal tool latency); :meth:`WorkloadConfig.spec` turns it into the ``legacy`` preset
with those values and :func:`run_legacy` runs it over HTTP with the shared driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvlab.workload.driver import HttpRun, run_http
from kvlab.workload.model import WorkloadError, WorkloadSpec, fixed, lognormal, uniform
from kvlab.workload.runner import ProgressFn
from kvlab.workload.spec import workload_spec

TOOL_LATENCY_KINDS = ("lognormal", "uniform", "fixed")


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Everything that defines a legacy workload run."""

    num_sessions: int = 16
    # Sessions running at once; a finished session's slot starts the next one.
    concurrency: int = 8
    # Turns per session, drawn uniformly from [min, max] (inclusive) per session.
    turns_min: int = 4
    turns_max: int = 4
    # Tokens shared by every session (the agent's system prompt).
    system_prefix_tokens: int = 512
    # Turn 0's user message.
    user_tokens: int = 64
    # Each later turn's tool result, drawn uniformly from [min, max] tokens.
    tool_result_tokens_min: int = 128
    tool_result_tokens_max: int = 128
    max_new_tokens: int = 64
    # Tool latency between turns: lognormal(median, sigma), uniform[low, high] or fixed
    # (median), multiplied by time_scale.
    tool_latency: str = "lognormal"
    tool_latency_median_s: float = 0.5
    tool_latency_sigma: float = 0.5
    tool_latency_low_s: float = 0.1
    tool_latency_high_s: float = 1.0
    time_scale: float = 1.0
    # The first wave of sessions starts staggered: session i (i < concurrency) starts
    # after i x start_stagger_s (scaled by time_scale), as agents of a rollout do.
    start_stagger_s: float = 0.0
    seed: int = 0
    close_at_end: bool = True
    request_timeout_s: float = 120.0
    # Whole-run deadline; sessions still running when it passes are counted failed.
    run_timeout_s: float = 3600.0
    vocab_size: int = 32000
    # Token ids below this are never drawn (keeps clear of special tokens).
    min_token_id: int = 1000

    def validate(self) -> None:
        checks: list[tuple[bool, str]] = [
            (self.num_sessions >= 0, "num_sessions must be >= 0"),
            (self.concurrency >= 1, "concurrency must be >= 1"),
            (1 <= self.turns_min <= self.turns_max, "need 1 <= turns_min <= turns_max"),
            (self.system_prefix_tokens >= 0, "system_prefix_tokens must be >= 0"),
            (self.user_tokens >= 1, "user_tokens must be >= 1"),
            (
                1 <= self.tool_result_tokens_min <= self.tool_result_tokens_max,
                "need 1 <= tool_result_tokens_min <= tool_result_tokens_max",
            ),
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (
                self.tool_latency in TOOL_LATENCY_KINDS,
                f"tool_latency must be one of {TOOL_LATENCY_KINDS}",
            ),
            (self.tool_latency_median_s >= 0, "tool_latency_median_s must be >= 0"),
            (self.tool_latency_sigma >= 0, "tool_latency_sigma must be >= 0"),
            (
                0 <= self.tool_latency_low_s <= self.tool_latency_high_s,
                "need 0 <= tool_latency_low_s <= tool_latency_high_s",
            ),
            (self.time_scale >= 0, "time_scale must be >= 0"),
            (self.start_stagger_s >= 0, "start_stagger_s must be >= 0"),
            (self.request_timeout_s > 0, "request_timeout_s must be > 0"),
            (self.run_timeout_s > 0, "run_timeout_s must be > 0"),
            (self.vocab_size > self.min_token_id >= 0, "need vocab_size > min_token_id >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise WorkloadError(message)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def spec(self) -> WorkloadSpec:
        """The ``legacy`` preset with this config's values."""
        self.validate()
        if self.tool_latency == "fixed":
            latency = fixed(self.tool_latency_median_s)
        elif self.tool_latency == "uniform":
            latency = uniform(self.tool_latency_low_s, self.tool_latency_high_s)
        else:
            latency = lognormal(self.tool_latency_median_s, self.tool_latency_sigma)
        return workload_spec(
            "legacy",
            turns=uniform(self.turns_min, self.turns_max),
            system_prompt_tokens=self.system_prefix_tokens,
            task_prompt=fixed(self.user_tokens),
            tool_output=uniform(self.tool_result_tokens_min, self.tool_result_tokens_max),
            output=fixed(self.max_new_tokens),
            tool_latency_fast=latency,
            start_stagger_s=self.start_stagger_s,
            close_sessions=self.close_at_end,
            vocab_size=self.vocab_size,
            min_token_id=self.min_token_id,
        )


async def run_legacy(
    cfg: WorkloadConfig,
    base_url: str,
    *,
    engine_urls: Sequence[str] = (),
    progress: ProgressFn | None = None,
    read_stats: bool = True,
) -> HttpRun:
    """Run ``cfg`` against ``base_url``; ``engine_urls`` are scraped before and after."""
    return await run_http(
        cfg.spec(),
        base_url,
        sessions=cfg.num_sessions,
        concurrency=cfg.concurrency,
        seed=cfg.seed,
        time_scale=cfg.time_scale,
        engine_urls=engine_urls,
        progress=progress,
        read_stats=read_stats,
        request_timeout_s=cfg.request_timeout_s,
        run_timeout_s=cfg.run_timeout_s,
    )
