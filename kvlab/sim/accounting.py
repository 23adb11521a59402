"""Metrics accounting of one simulated rank: the counters and histograms SGLang keeps.

Pure. The scheduler's parts add to :class:`SchedulerStats`; :mod:`kvlab.sim.metrics`
renders it. :class:`ThroughputWindow` is SGLang's ``gen_throughput`` (tokens decoded
over the last ``GEN_THROUGHPUT_LOG_STEPS`` decode steps), and :func:`count_finished` the
tokenizer-side counters of a finished request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.sim.histogram import E2E_BUCKETS, TTFT_BUCKETS, Histogram
from kvlab.sim.records import SimRequest

GEN_THROUGHPUT_LOG_STEPS = 40  # SGLang's default --decode-log-interval


@dataclass(slots=True)
class SchedulerStats:
    # Tokenizer-side counters (SGLang counts them when a request finishes).
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    host_cached_tokens_total: int = 0  # cached_tokens_total{cache_source="host"}
    num_requests_total: int = 0
    # The part of the three counters above that came from streaming requests.
    stream_prompt_tokens_total: int = 0
    stream_generation_tokens_total: int = 0
    stream_requests_total: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e_latency: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    num_aborted_requests_total: int = 0
    num_retracted_requests_total: int = 0
    num_retracted_reqs: int = 0  # size of the last retraction (SGLang's gauge)
    # Running requests preempted by a waiting one of higher priority (priority scheduling).
    num_preempted_requests_total: int = 0
    # sglang:realtime_tokens_total{mode=...}: tokens computed by prefill, prefix tokens
    # served from the radix cache at admission, and tokens decoded.
    realtime_prefill_compute_tokens: int = 0
    realtime_prefill_cache_tokens: int = 0
    realtime_decode_tokens: int = 0
    # sglang:evicted_tokens_total: tokens evicted from the radix tree (KVCache.evicted_total).
    evicted_tokens_total: int = 0
    cache_hit_rate: float = 0.0  # of the last prefill batch
    gen_throughput: float = 0.0
    prefill_batches: int = 0
    decode_steps: int = 0
    busy_time_s: float = 0.0


class ThroughputWindow:
    """Tokens decoded since the window opened; every ``GEN_THROUGHPUT_LOG_STEPS`` decode
    steps their rate becomes ``stats.gen_throughput`` and the window starts again."""

    __slots__ = ("start", "steps", "tokens")

    def __init__(self, now: float) -> None:
        self.start = now
        self.tokens = 0
        self.steps = 0

    def start_if_idle(self, now: float) -> None:
        """A request starts decoding: an empty window opens now."""
        if self.steps == 0 and not self.tokens:
            self.start = now

    def record(self, tokens: int, now: float, stats: SchedulerStats) -> None:
        """One decode step of ``tokens`` tokens ended at ``now``."""
        self.tokens += tokens
        self.steps += 1
        if self.steps >= GEN_THROUGHPUT_LOG_STEPS:
            elapsed = now - self.start
            if elapsed > 0:
                stats.gen_throughput = round(self.tokens / elapsed, 2)
            self.start = now
            self.tokens = 0
            self.steps = 0


def count_finished(stats: SchedulerStats, req: SimRequest, now: float, *, aborted: bool) -> None:
    """The tokenizer-side counters of a request that finished at ``now``."""
    st = stats
    st.num_requests_total += 1
    st.prompt_tokens_total += req.prompt_tokens
    st.generation_tokens_total += req.generated
    st.cached_tokens_total += req.cached_tokens
    st.host_cached_tokens_total += req.host_cached_tokens
    if req.stream:
        st.stream_requests_total += 1
        st.stream_prompt_tokens_total += req.prompt_tokens
        st.stream_generation_tokens_total += req.generated
    if aborted:
        st.num_aborted_requests_total += 1
    else:
        st.e2e_latency.observe(now - req.arrival)
