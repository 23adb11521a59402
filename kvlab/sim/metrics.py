"""Prometheus text rendering of the simulator's state with SGLang's names and labels.

Pure: takes scheduler snapshots, returns text. Label sets follow SGLang 0.5.23
(``sglang/srt/observability/metrics_collector.py``), sorted alphabetically as
prometheus_client's multiprocess mode writes them:

* scheduler gauges and counters: ``engine_type, model_name, moe_ep_rank, pp_rank,
  tp_rank`` (+ ``dp_rank`` when dp_size > 1, + ``priority=""`` with priority
  scheduling). With ``tp_size > 1`` each series is repeated once per ``tp_rank``
  with identical values, so a parser must not sum over TP ranks.
* tokenizer-side counters and histograms: ``engine_type, model_name`` plus
  ``is_streaming`` / ``cache_source`` where SGLang has them, summed over DP ranks
  (one tokenizer per engine).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from kvlab.sim.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class MetricsContext:
    model_name: str
    tp_size: int = 1
    enable_priority_scheduling: bool = False
    streaming_sessions: bool = False
    # --enable-hierarchical-cache: SGLang then creates its HiCache series.
    hicache: bool = False


def _labels(pairs: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs.items()))
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Writer:
    """Writes the text at once (the reference spelling, :func:`render_metrics_uncached`)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: dict[str, str], value: float) -> None:
        self.lines.append(f"{name}{_labels(labels)} {floatToGoString(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class _TemplateWriter(_Writer):
    """Writes the static text once, a ``str.format`` field where each value goes."""

    def family(self, name: str, kind: str, help_text: str) -> None:
        super().family(_brace(name), kind, _brace(help_text))

    def sample(self, name: str, labels: dict[str, str], value: float) -> None:
        self.lines.append(_brace(f"{name}{_labels(labels)} ") + "{}")


def _brace(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def _go(value: float) -> str:
    """``floatToGoString`` with a fast path for small non-negative integers."""
    if type(value) is int and 0 <= value < 1_000_000:
        return f"{value}.0"
    return floatToGoString(value)


# (name, help) of the scheduler gauges, in SGLang's order.
_GAUGES: tuple[tuple[str, str], ...] = (
    ("num_running_reqs", "The number of running requests."),
    ("num_queue_reqs", "The number of requests in the waiting queue."),
    ("num_grammar_queue_reqs", "The number of requests in the grammar waiting queue."),
    ("gen_throughput", "The generation throughput (token/s)."),
    ("cache_hit_rate", "The prefix cache hit rate."),
    ("token_usage", "The token usage."),
    ("full_token_usage", "The token usage for full attention layers."),
    ("num_used_tokens", "The number of used tokens."),
    ("kv_available_tokens", "Number of free token slots in the KV cache pool."),
    ("kv_evictable_tokens", "Number of evictable (radix-cached) token slots in the KV cache pool."),
    ("kv_used_tokens", "Number of actively used token slots in the KV cache pool."),
    ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
    ("page_size", "KV cache page size in tokens."),
    ("context_len", "Maximum context length."),
    ("num_retracted_reqs", "The number of retracted requests."),
    ("num_paused_reqs", "The number of paused requests by async weight sync."),
    ("utilization", "The utilization."),
    ("new_token_ratio", "The new token ratio."),
)
_STREAMING_GAUGES: tuple[tuple[str, str], ...] = (
    ("num_streaming_sessions", "The number of streaming sessions."),
    (
        "streaming_session_held_tokens",
        "The number of KV tokens currently held by streaming session slots.",
    ),
)


def scheduler_gauges(s: Scheduler, context_len: int) -> dict[str, float]:
    kv = s.kv
    total = kv.max_total_tokens
    used = total - kv.available - kv.evictable
    return {
        "num_running_reqs": len(s.running),
        "num_queue_reqs": s.num_waiting,
        "num_grammar_queue_reqs": 0,
        "gen_throughput": s.stats.gen_throughput,
        "cache_hit_rate": s.stats.cache_hit_rate,
        "token_usage": round(used / total, 2),
        "full_token_usage": round(used / total, 4),
        "num_used_tokens": used,
        "kv_available_tokens": kv.available,
        "kv_evictable_tokens": kv.evictable,
        "kv_used_tokens": used,
        "max_total_num_tokens": total,
        "page_size": 1,
        "context_len": context_len,
        "num_retracted_reqs": s.stats.num_retracted_reqs,
        "num_paused_reqs": 0,
        "utilization": round(used / total, 4),
        "new_token_ratio": round(s.new_token_ratio, 4),
        "num_streaming_sessions": len(s.streaming_sessions),
        "streaming_session_held_tokens": s.streaming_held_tokens(),
    }


class _Renderer:
    """The template of one (context, DP size) and the texts of recent value sets."""

    __slots__ = ("recent", "template")

    def __init__(self, template: str) -> None:
        self.template = template
        self.recent: OrderedDict[tuple[float, ...], str] = OrderedDict()


# Renderers by (context, DP size); a handful in any process.
_RENDERERS: dict[tuple[MetricsContext, int], _Renderer] = {}
_RENDERERS_MAX = 64
# Texts kept per renderer for value sets seen recently (an idle engine's scrapes).
_RECENT_MAX = 8


def render_metrics(
    ctx: MetricsContext,
    ranks: Sequence[Scheduler],
    context_len: int,
    token_usage_override: float | None = None,
) -> str:
    """The engine's ``/metrics`` text for all DP ranks.

    Equal to :func:`render_metrics_uncached` (tests compare them), but cheap: the
    static text (families, label sets) is built once per (context, DP size) as a
    ``str.format`` template by :func:`_emit`, each call only collects the values
    (:func:`_values`, in the same order), and a value set
    seen recently returns its text without formatting (an idle engine's scrapes).
    """
    key = (ctx, len(ranks))
    r = _RENDERERS.get(key)
    if r is None:
        tw = _TemplateWriter()
        _emit(tw, ctx, ranks, context_len, token_usage_override)
        if len(_RENDERERS) >= _RENDERERS_MAX:
            _RENDERERS.clear()
        r = _RENDERERS[key] = _Renderer(tw.text())
    values = _values(ctx, ranks, context_len, token_usage_override)
    recent = r.recent
    text = recent.get(values)
    if text is not None:
        recent.move_to_end(values)
        return text
    text = r.template.format(*map(_go, values))
    recent[values] = text
    if len(recent) > _RECENT_MAX:
        recent.popitem(last=False)
    return text


def render_metrics_uncached(
    ctx: MetricsContext,
    ranks: Sequence[Scheduler],
    context_len: int,
    token_usage_override: float | None = None,
) -> str:
    """The reference spelling of :func:`render_metrics`: every line formatted anew."""
    w = _Writer()
    _emit(w, ctx, ranks, context_len, token_usage_override)
    return w.text()


def _values(
    ctx: MetricsContext,
    ranks: Sequence[Scheduler],
    context_len: int,
    token_usage_override: float | None,
) -> tuple[float, ...]:
    """The values :func:`_emit` writes, in its order, without building any label."""
    tp = ctx.tp_size
    gauges = [scheduler_gauges(s, context_len) for s in ranks]
    if token_usage_override is not None:
        for v in gauges:
            v["token_usage"] = round(token_usage_override, 2)
            v["full_token_usage"] = round(token_usage_override, 4)
    names = _GAUGE_NAMES_STREAMING if ctx.streaming_sessions else _GAUGE_NAMES
    out: list[float] = []
    add = out.append
    for name in names:
        for v in gauges:
            value = v[name]
            for _ in range(tp):
                add(value)
    for s in ranks:
        out.extend([s.stats.num_retracted_requests_total] * tp)
    for s in ranks:
        out.extend([s.kv.evicted_total] * tp)
    if ctx.hicache:
        _hicache_values(ranks, tp, out)
    for s in ranks:
        st = s.stats
        modes = (
            st.realtime_prefill_compute_tokens,
            st.realtime_prefill_cache_tokens,
            st.realtime_decode_tokens,
        )
        for _ in range(tp):
            out.extend(modes)
    _tokenizer_values(ranks, add, ctx.hicache)
    return tuple(out)


def _hicache_values(ranks: Sequence[Scheduler], tp: int, out: list[float]) -> None:
    for attr in ("loaded_back_total", "host_used", "host_total"):
        for s in ranks:
            out.extend([getattr(s.hi, attr, 0)] * tp)


def _tokenizer_values(
    ranks: Sequence[Scheduler], add: Callable[[float], None], hicache: bool
) -> None:
    """The tokenizer side of :func:`_values`: counters and histograms over all ranks."""
    stats = [s.stats for s in ranks]
    for all_attr, stream_attr in _TOKENIZER_COUNTERS:
        streamed = sum(getattr(x, stream_attr) for x in stats)
        add(sum(getattr(x, all_attr) for x in stats) - streamed)
        add(streamed)
    host = sum(x.host_cached_tokens_total for x in stats)
    add(sum(x.cached_tokens_total for x in stats) - host)
    if hicache:
        add(host)
    add(sum(x.num_aborted_requests_total for x in stats))
    for attr in _HISTOGRAMS:
        hists = [getattr(x, attr) for x in stats]
        h = hists[0] if len(hists) == 1 else hists[0].merged(hists[1:])
        cum = 0
        for c in h.counts[: len(h.bounds)]:
            cum += c
            add(cum)
        add(h.count)
        add(h.count)
        add(h.sum)


_GAUGE_NAMES = tuple(name for name, _ in _GAUGES)
_GAUGE_NAMES_STREAMING = _GAUGE_NAMES + tuple(name for name, _ in _STREAMING_GAUGES)
_TOKENIZER_COUNTERS = (
    ("prompt_tokens_total", "stream_prompt_tokens_total"),
    ("generation_tokens_total", "stream_generation_tokens_total"),
    ("num_requests_total", "stream_requests_total"),
)
_HISTOGRAMS = ("ttft", "e2e_latency", "queue_time")


def _scheduler_label_sets(
    ctx: MetricsContext, base: dict[str, str], dp: int, dp_rank: int
) -> list[dict[str, str]]:
    """One label set per TP rank of DP rank ``dp_rank`` (series repeat per TP rank)."""
    out = []
    for tp in range(ctx.tp_size):
        labels = {**base, "moe_ep_rank": "0", "pp_rank": "0", "tp_rank": str(tp)}
        if dp > 1:
            labels["dp_rank"] = str(dp_rank)
        if ctx.enable_priority_scheduling:
            labels["priority"] = ""
        out.append(labels)
    return out


def _emit(
    w: _Writer,
    ctx: MetricsContext,
    ranks: Sequence[Scheduler],
    context_len: int,
    token_usage_override: float | None,
) -> None:
    """Every family and sample of the text, in order, through ``w``."""
    dp = len(ranks)
    base = {"engine_type": "unified", "model_name": ctx.model_name}
    label_sets = [_scheduler_label_sets(ctx, base, dp, i) for i in range(dp)]
    values = [scheduler_gauges(s, context_len) for s in ranks]
    if token_usage_override is not None:  # fault knob: see FaultConfig.token_usage
        for v in values:
            v["token_usage"] = round(token_usage_override, 2)
            v["full_token_usage"] = round(token_usage_override, 4)
    gauges = _GAUGES + (_STREAMING_GAUGES if ctx.streaming_sessions else ())
    for name, help_text in gauges:
        full = f"sglang:{name}"
        w.family(full, "gauge", help_text)
        for i in range(dp):
            for labels in label_sets[i]:
                w.sample(full, labels, values[i][name])

    # Scheduler-side counters. num_retracted_requests_total is not in the reference
    # document; its name and labels are from SGLang's SchedulerMetricsCollector.
    w.family(
        "sglang:num_retracted_requests_total", "counter", "Total number of retracted requests."
    )
    for i, s in enumerate(ranks):
        for labels in label_sets[i]:
            w.sample(
                "sglang:num_retracted_requests_total",
                labels,
                s.stats.num_retracted_requests_total,
            )
    w.family(
        "sglang:evicted_tokens_total", "counter", "The number of tokens evicted from GPU to CPU."
    )
    for i, s in enumerate(ranks):
        for labels in label_sets[i]:
            w.sample(
                "sglang:evicted_tokens_total",
                {**labels, "cache_type": "RadixCache"},
                s.kv.evicted_total,
            )

    if ctx.hicache:
        _emit_hicache(w, ranks, label_sets)
    _emit_realtime_tokens(w, ranks, label_sets)
    _emit_tokenizer(w, ranks, base, ctx.hicache)


# The HiCache series (SGLang creates them only with --enable-hierarchical-cache):
# (name, kind, help, HiKVCache attribute), names and help from SGLang's metrics collector.
_HICACHE_SERIES = (
    (
        "sglang:load_back_tokens_total",
        "counter",
        "The number of tokens loaded from CPU to GPU.",
        "loaded_back_total",
    ),
    (
        "sglang:hicache_host_used_tokens",
        "gauge",
        "Number of tokens currently used in the host KV cache.",
        "host_used",
    ),
    (
        "sglang:hicache_host_total_tokens",
        "gauge",
        "Total capacity of the host KV cache in tokens.",
        "host_total",
    ),
)


def _emit_hicache(
    w: _Writer, ranks: Sequence[Scheduler], label_sets: list[list[dict[str, str]]]
) -> None:
    for name, kind, help_text, attr in _HICACHE_SERIES:
        w.family(name, kind, help_text)
        for i, s in enumerate(ranks):
            for labels in label_sets[i]:
                w.sample(name, labels, getattr(s.hi, attr, 0))


def _emit_realtime_tokens(
    w: _Writer, ranks: Sequence[Scheduler], label_sets: list[list[dict[str, str]]]
) -> None:
    # sglang:realtime_tokens_total{mode}: the scheduler's token counters (scheduler
    # labels plus ``mode``), so recompute = prefill_compute / (prefill_compute +
    # prefill_cache) is visible in the engine's own metrics.
    w.family(
        "sglang:realtime_tokens_total",
        "counter",
        "Total number of tokens processed, updated on each log interval.",
    )
    for i, s in enumerate(ranks):
        for labels in label_sets[i]:
            for mode, value in (
                ("prefill_compute", s.stats.realtime_prefill_compute_tokens),
                ("prefill_cache", s.stats.realtime_prefill_cache_tokens),
                ("decode", s.stats.realtime_decode_tokens),
            ):
                w.sample("sglang:realtime_tokens_total", {**labels, "mode": mode}, value)


def _emit_tokenizer(
    w: _Writer, ranks: Sequence[Scheduler], base: dict[str, str], hicache: bool = False
) -> None:
    """The tokenizer side of :func:`_emit`: one tokenizer for the whole engine."""
    st = [s.stats for s in ranks]

    def total(attr: str) -> int:
        return sum(getattr(x, attr) for x in st)

    for name, help_text, all_attr, stream_attr in (
        (
            "prompt_tokens_total",
            "Number of prefill tokens processed.",
            "prompt_tokens_total",
            "stream_prompt_tokens_total",
        ),
        (
            "generation_tokens_total",
            "Number of generation tokens processed.",
            "generation_tokens_total",
            "stream_generation_tokens_total",
        ),
        (
            "num_requests_total",
            "Number of requests processed.",
            "num_requests_total",
            "stream_requests_total",
        ),
    ):
        full = f"sglang:{name}"
        w.family(full, "counter", help_text)
        streamed = total(stream_attr)
        w.sample(full, {**base, "is_streaming": "false"}, total(all_attr) - streamed)
        w.sample(full, {**base, "is_streaming": "true"}, streamed)
    w.family(
        "sglang:cached_tokens_total",
        "counter",
        "Number of cached prompt tokens by source (device/host/storage).",
    )
    # With HiCache, prefix tokens loaded back from the host count under "host".
    host = total("host_cached_tokens_total")
    w.sample(
        "sglang:cached_tokens_total",
        {**base, "cache_source": "device"},
        total("cached_tokens_total") - host,
    )
    if hicache:
        w.sample("sglang:cached_tokens_total", {**base, "cache_source": "host"}, host)
    w.family("sglang:num_aborted_requests_total", "counter", "Number of requests aborted.")
    w.sample("sglang:num_aborted_requests_total", base, total("num_aborted_requests_total"))

    for name, help_text, attr in (
        ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
        (
            "e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            "e2e_latency",
        ),
        ("queue_time_seconds", "Histogram of queueing time in seconds.", "queue_time"),
    ):
        hists = [getattr(x, attr) for x in st]
        h = hists[0].merged(hists[1:])
        full = f"sglang:{name}"
        w.family(full, "histogram", help_text)
        cum = 0
        for bound, c in zip(h.bounds, h.counts, strict=False):
            cum += c
            w.sample(f"{full}_bucket", {**base, "le": floatToGoString(bound)}, cum)
        w.sample(f"{full}_bucket", {**base, "le": "+Inf"}, h.count)
        w.sample(f"{full}_count", base, h.count)
        w.sample(f"{full}_sum", base, h.sum)


GARBAGE_METRICS = (
    "sglang:token_usage{engine_type=unified model_name= 0.5\n"
    "<html><body>502 upstream garbage</body></html>\n"
    "\x00\x01 not prometheus text {{{\n"
)
