"""Agentic workload driver: N sessions x T turns over HTTP, seeded and deterministic.

Each session is a tool-using agent. Turn 0 sends a shared system prefix plus a user
message; every later turn sends the whole conversation so far (previous prompt and the
assistant's reply, exactly as the engine returned it in ``output_ids``) plus a new tool
result, after a simulated tool latency. Because the conversation is rebuilt from the
engine's own output ids, an engine with a radix cache can serve the previous context
from cache; whatever it has to prefill again is measured as *recomputed* prefill.

The driver is a plain HTTP client of whatever base URL it is given (an engine, the
router or kvproxy), so one workload measures every configuration. The session id
travels in the ``X-Session-ID`` header, which is harmless where nothing reads it; at
the end a session optionally POSTs ``{base}/close_session`` (a 404 from a bare router
is tolerated).

Pure parts (token generation, prompt construction, accounting, percentiles, summary)
have no I/O; :func:`run_workload` is the asyncio shell.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

SESSION_HEADER = "X-Session-ID"
ADMISSION_WAIT_HEADER = "X-KVProxy-Admission-Wait-Ms"

# Engine counters scraped before and after a run. Counters are summed over label
# sets; gauges take the maximum.
ENGINE_COUNTERS: tuple[str, ...] = (
    "prompt_tokens_total",
    "cached_tokens_total",
    "evicted_tokens_total",
    "generation_tokens_total",
    "num_aborted_requests_total",
    "num_requests_total",
    "num_retracted_requests_total",
    "retracted_requests_total",
    "num_retractions_total",
)
ENGINE_GAUGES: tuple[str, ...] = ("num_retracted_reqs",)
# Cumulative retraction counters a simulator may expose, in order of preference.
_RETRACTION_COUNTERS = (
    "num_retracted_requests_total",
    "retracted_requests_total",
    "num_retractions_total",
)

TOOL_LATENCY_KINDS = ("lognormal", "uniform", "fixed")
APIS = ("generate", "chat")


class WorkloadError(ValueError):
    """A workload parameter is out of range."""


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Everything that defines a workload. Two runs with equal configs send equal prompts
    (given equal engine replies)."""

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
    api: str = "generate"  # generate | chat
    close_at_end: bool = True
    request_timeout_s: float = 120.0
    # Whole-run deadline; sessions still running when it passes are counted failed.
    run_timeout_s: float = 3600.0
    vocab_size: int = 32000
    # Token ids below this are never drawn (keeps clear of special tokens).
    min_token_id: int = 1000
    session_prefix: str = "agent"
    # Chat only: the model name to send; None asks {base}/v1/models.
    model: str | None = None
    temperature: float = 0.0

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
            (self.api in APIS, f"api must be one of {APIS}"),
            (self.request_timeout_s > 0, "request_timeout_s must be > 0"),
            (self.run_timeout_s > 0, "run_timeout_s must be > 0"),
            (self.vocab_size > self.min_token_id >= 0, "need vocab_size > min_token_id >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise WorkloadError(message)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- pure core


def _rng(cfg: WorkloadConfig, *parts: object) -> random.Random:
    # Seeding with a str is deterministic across processes (sha512 based).
    return random.Random(":".join(str(p) for p in (cfg.seed, *parts)))


def _tokens(rng: random.Random, n: int, cfg: WorkloadConfig) -> list[int]:
    lo, hi = cfg.min_token_id, cfg.vocab_size - 1
    return [rng.randint(lo, hi) for _ in range(n)]


def session_id(cfg: WorkloadConfig, index: int) -> str:
    return f"{cfg.session_prefix}-{cfg.seed}-{index:05d}"


def system_prefix(cfg: WorkloadConfig) -> list[int]:
    """The token ids every session starts with."""
    return _tokens(_rng(cfg, "system"), cfg.system_prefix_tokens, cfg)


def num_turns(cfg: WorkloadConfig, index: int) -> int:
    return _rng(cfg, index, "turns").randint(cfg.turns_min, cfg.turns_max)


def turn_tokens(cfg: WorkloadConfig, index: int, turn: int) -> list[int]:
    """New input of a turn: the user message (turn 0) or a tool result (later turns)."""
    rng = _rng(cfg, index, turn, "input")
    if turn == 0:
        return _tokens(rng, cfg.user_tokens, cfg)
    n = rng.randint(cfg.tool_result_tokens_min, cfg.tool_result_tokens_max)
    return _tokens(rng, n, cfg)


def tool_latency_s(cfg: WorkloadConfig, index: int, turn: int) -> float:
    """Simulated tool time before ``turn`` (seconds, already scaled by time_scale)."""
    rng = _rng(cfg, index, turn, "tool")
    if cfg.tool_latency == "fixed":
        base = cfg.tool_latency_median_s
    elif cfg.tool_latency == "uniform":
        base = rng.uniform(cfg.tool_latency_low_s, cfg.tool_latency_high_s)
    else:
        base = (
            cfg.tool_latency_median_s * math.exp(rng.gauss(0.0, cfg.tool_latency_sigma))
            if cfg.tool_latency_median_s > 0
            else 0.0
        )
    return base * cfg.time_scale


def start_delay_s(cfg: WorkloadConfig, index: int) -> float:
    """Delay before session ``index`` starts: only the first wave is staggered."""
    if index >= cfg.concurrency:
        return 0.0
    return index * cfg.start_stagger_s * cfg.time_scale


def next_prompt(
    previous_prompt: Sequence[int], reply: Sequence[int], new_input: Sequence[int]
) -> list[int]:
    """The next turn's prompt: the whole conversation so far plus the new input."""
    return [*previous_prompt, *reply, *new_input]


def first_prompt(cfg: WorkloadConfig, index: int) -> list[int]:
    return [*system_prefix(cfg), *turn_tokens(cfg, index, 0)]


def context_after_turn(prompt_tokens: int, completion_tokens: int) -> int:
    """Tokens whose KV exists after a turn: the prompt plus every generated token but
    the last (the last sampled token is never fed back, so it has no KV)."""
    return prompt_tokens + max(0, completion_tokens - 1)


def recomputed_tokens(previous_context_len: int, cached_tokens: int) -> int:
    """Prompt tokens an earlier turn of the session already prefilled but that the
    engine did not serve from cache this turn."""
    return max(0, previous_context_len - cached_tokens)


def percentile(values: Iterable[float], q: float) -> float | None:
    """``q``-th percentile (0..100) with linear interpolation between closest ranks;
    None for no values."""
    data = sorted(values)
    if not data:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100] (got {q})")
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(data[lo])
    return float(data[lo] + (data[hi] - data[lo]) * (pos - lo))


def parse_prometheus(text: str) -> dict[str, float]:
    """Engine counters and gauges of interest from Prometheus text.

    Accepts ``sglang:`` and ``sglang_`` prefixes and any label order. Counters are
    summed over label sets (they are split by labels such as ``cache_source``); gauges
    take the maximum (replicated rank label sets).
    """
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name_end = len(line)
        for i, ch in enumerate(line):
            if ch in "{ ":
                name_end = i
                break
        name = line[:name_end]
        if name.startswith(("sglang:", "sglang_")):
            name = name[len("sglang:") :]
        else:
            continue
        if name.endswith("_created"):
            continue
        value_part = line[name_end:]
        if value_part.startswith("{"):
            close = value_part.rfind("}")
            if close < 0:
                continue
            value_part = value_part[close + 1 :]
        fields_ = value_part.split()
        if not fields_:
            continue
        try:
            value = float(fields_[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        # prometheus_client exposes a counter "x_total" under family "x"; accept both.
        if name in ENGINE_COUNTERS:
            out[name] = out.get(name, 0.0) + value
        elif name in ENGINE_GAUGES:
            out[name] = max(out.get(name, value), value)
    return out


def diff_counters(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, float]:
    """Fleet-wide counter deltas (after - before, summed over engines). Gauges are
    reported as their maximum after the run."""
    total: dict[str, float] = {}
    for engine, values in after.items():
        prev = before.get(engine, {})
        for name, value in values.items():
            if name in ENGINE_GAUGES:
                total[name] = max(total.get(name, 0.0), value)
            else:
                total[name] = total.get(name, 0.0) + max(0.0, value - prev.get(name, 0.0))
    return total


@dataclass(slots=True)
class RequestRecord:
    session: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # KV context the session's previous turn left (see context_after_turn); 0 on turn 0.
    previous_context_len: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    status: int | None = None
    ok: bool = False
    error: str | None = None
    admission_wait_ms: float | None = None
    start_s: float = 0.0

    @property
    def recomputed_tokens(self) -> int:
        if not self.ok:
            return 0
        return recomputed_tokens(self.previous_context_len, self.cached_tokens)

    @property
    def prefill_tokens(self) -> int:
        if not self.ok:
            return 0
        return max(0, self.prompt_tokens - self.cached_tokens)


@dataclass(slots=True)
class SessionRecord:
    index: int
    session_id: str
    turns_planned: int
    start_s: float = 0.0
    end_s: float | None = None
    turns_done: int = 0
    ok: bool = False
    error: str | None = None
    close_status: int | None = None

    @property
    def duration_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(slots=True)
class RunResult:
    config: WorkloadConfig
    base_url: str
    requests: list[RequestRecord] = field(default_factory=list)
    sessions: list[SessionRecord] = field(default_factory=list)
    wall_s: float = 0.0
    engines_before: dict[str, dict[str, float]] = field(default_factory=dict)
    engines_after: dict[str, dict[str, float]] = field(default_factory=dict)
    proxy_stats: dict[str, Any] | None = None

    @property
    def engine_delta(self) -> dict[str, float]:
        return diff_counters(self.engines_before, self.engines_after)

    @property
    def engine_deltas(self) -> dict[str, dict[str, float]]:
        """Counter deltas per engine (shows how the router spread the load)."""
        return {
            url: diff_counters({url: self.engines_before.get(url, {})}, {url: after})
            for url, after in self.engines_after.items()
        }

    def summary(self) -> dict[str, Any]:
        """One flat dict of the run's headline numbers (JSON-serialisable)."""
        started = self.sessions  # a session is recorded when it starts
        completed = [s for s in self.sessions if s.ok]
        failed = [s for s in started if not s.ok]
        ok_reqs = [r for r in self.requests if r.ok]
        prompt = sum(r.prompt_tokens for r in ok_reqs)
        cached = sum(r.cached_tokens for r in ok_reqs)
        delta = self.engine_delta
        retractions = next((delta[n] for n in _RETRACTION_COUNTERS if n in delta), None)
        if retractions is None:
            retractions = delta.get("num_retracted_reqs")
        ttft = [r.ttft_s for r in ok_reqs if r.ttft_s is not None]
        ttft_first = [r.ttft_s for r in ok_reqs if r.ttft_s is not None and r.turn == 0]
        ttft_later = [r.ttft_s for r in ok_reqs if r.ttft_s is not None and r.turn > 0]
        latency = [r.latency_s for r in ok_reqs if r.latency_s is not None]
        waits = [r.admission_wait_ms for r in self.requests if r.admission_wait_ms is not None]
        durations = [d for s in completed if (d := s.duration_s) is not None]
        minutes = self.wall_s / 60.0
        out: dict[str, Any] = {
            "base_url": self.base_url,
            "sessions_started": len(started),
            "sessions_completed": len(completed),
            "sessions_failed": len(failed),
            "sessions_per_min": _round(len(completed) / minutes if minutes > 0 else 0.0, 3),
            "wall_s": _round(self.wall_s, 3),
            "requests": len(self.requests),
            "requests_ok": len(ok_reqs),
            "requests_failed": len(self.requests) - len(ok_reqs),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": sum(r.completion_tokens for r in ok_reqs),
            "prefill_tokens": sum(r.prefill_tokens for r in ok_reqs),
            "recomputed_prefill_tokens": sum(r.recomputed_tokens for r in ok_reqs),
            "cache_hit_rate": _round(cached / prompt if prompt else 0.0),
            "evicted_tokens": delta.get("evicted_tokens_total"),
            "retractions": retractions,
            "aborted_requests": delta.get("num_aborted_requests_total"),
            "engine_prompt_tokens": delta.get("prompt_tokens_total"),
            "engine_cached_tokens": delta.get("cached_tokens_total"),
            "engine_generation_tokens": delta.get("generation_tokens_total"),
            "ttft_p50_s": _round(percentile(ttft, 50)),
            "ttft_p99_s": _round(percentile(ttft, 99)),
            # First turns (a new session) and later turns (a session already running).
            "ttft_first_turn_p99_s": _round(percentile(ttft_first, 99)),
            "ttft_later_turns_p50_s": _round(percentile(ttft_later, 50)),
            "ttft_later_turns_p99_s": _round(percentile(ttft_later, 99)),
            "latency_p50_s": _round(percentile(latency, 50)),
            "latency_p99_s": _round(percentile(latency, 99)),
            "admission_wait_p50_ms": _round(percentile(waits, 50), 2),
            "admission_wait_p99_ms": _round(percentile(waits, 99), 2),
            "session_time_p50_s": _round(percentile(durations, 50), 3),
            "session_time_p99_s": _round(percentile(durations, 99), 3),
            "errors": _error_counts(self.requests),
        }
        if self.proxy_stats is not None:
            out["proxy_stats"] = self.proxy_stats
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "summary": self.summary(),
            "engine_delta": self.engine_delta,
            "engine_deltas": self.engine_deltas,
        }


def _error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "error").split(":", 1)[0]
            counts[key] = counts.get(key, 0) + 1
    return counts


# ----------------------------------------------------------------------- wire helpers


def generate_body(cfg: WorkloadConfig, prompt: Sequence[int]) -> dict[str, Any]:
    return {
        "input_ids": list(prompt),
        "sampling_params": {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
        },
        "stream": True,
    }


def tokens_to_text(tokens: Sequence[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


def chat_body(
    cfg: WorkloadConfig, messages: Sequence[Mapping[str, str]], model: str
) -> dict[str, Any]:
    return {
        "model": model,
        "messages": list(messages),
        "max_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _finish_reason_name(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        t = value.get("type")
        return str(t) if t is not None else None
    return str(value)


@dataclass(slots=True)
class StreamState:
    """Accumulates one streamed reply (SGLang /generate or OpenAI chat chunks)."""

    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False
    chunks: int = 0

    def feed_generate(self, chunk: Mapping[str, Any]) -> None:
        self.chunks += 1
        if "error" in chunk:
            self.error = f"stream_error: {chunk['error']}"
            return
        meta = chunk.get("meta_info") or {}
        ids = chunk.get("output_ids")
        completion = meta.get("completion_tokens")
        if isinstance(ids, list):
            # Cumulative by default; with incremental output each chunk is a delta.
            if isinstance(completion, int):
                cumulative = len(ids) == completion
            else:
                cumulative = ids[: len(self.output_ids)] == self.output_ids
            if cumulative:
                self.output_ids = [int(t) for t in ids]
            else:
                self.output_ids.extend(int(t) for t in ids)
        if isinstance(meta.get("prompt_tokens"), int):
            self.prompt_tokens = meta["prompt_tokens"]
        if isinstance(meta.get("cached_tokens"), int):
            self.cached_tokens = meta["cached_tokens"]
        if isinstance(completion, int):
            self.completion_tokens = completion
        reason = _finish_reason_name(meta.get("finish_reason"))
        if reason is not None:
            self.finish_reason = reason

    def feed_chat(self, chunk: Mapping[str, Any]) -> None:
        self.chunks += 1
        if "error" in chunk:
            self.error = f"stream_error: {chunk['error']}"
            return
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if isinstance(content, str):
                self.text += content
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finish_reason = str(reason)
        usage = chunk.get("usage")
        if isinstance(usage, Mapping):
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            if isinstance(usage.get("completion_tokens"), int):
                self.completion_tokens = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, Mapping) and isinstance(details.get("cached_tokens"), int):
                self.cached_tokens = details["cached_tokens"]


def parse_sse_line(line: bytes) -> tuple[str, Any] | None:
    """``data: {...}`` -> ("json", obj); ``data: [DONE]`` -> ("done", None); else None."""
    s = line.strip()
    if not s.startswith(b"data:"):
        return None
    payload = s[5:].strip()
    if payload == b"[DONE]":
        return ("done", None)
    if not payload:
        return None
    try:
        return ("json", orjson.loads(payload))
    except orjson.JSONDecodeError:
        return ("bad", payload[:200].decode("utf-8", "replace"))


# ------------------------------------------------------------------------ asyncio shell

ProgressFn = Callable[[int, int, int], None]  # (completed, failed, total)


async def scrape_engine(session: Any, url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Counters of one engine's ``/metrics``; {} when it cannot be read."""
    import aiohttp

    try:
        async with session.get(
            f"{url.rstrip('/')}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                return {}
            return parse_prometheus(await resp.text())
    except (aiohttp.ClientError, TimeoutError):
        return {}


async def scrape_engines(session: Any, urls: Sequence[str]) -> dict[str, dict[str, float]]:
    values = await asyncio.gather(*(scrape_engine(session, u) for u in urls))
    return dict(zip(urls, values, strict=True))


async def read_proxy_stats(
    session: Any, base_url: str, timeout_s: float = 5.0
) -> dict[str, Any] | None:
    """``{base}/kvproxy/stats`` JSON, or None where the base URL is not kvproxy."""
    import aiohttp

    try:
        async with session.get(
            f"{base_url.rstrip('/')}/kvproxy/stats", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
            return data if isinstance(data, dict) else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def _discover_model(session: Any, base_url: str, timeout_s: float) -> str:
    import aiohttp

    try:
        async with session.get(
            f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status == 200:
                data = await resp.json(content_type=None)
                models = data.get("data") if isinstance(data, dict) else None
                if models and isinstance(models[0], dict) and models[0].get("id"):
                    return str(models[0]["id"])
    except (aiohttp.ClientError, TimeoutError, ValueError):
        pass
    return "default"


class _Driver:
    def __init__(
        self,
        cfg: WorkloadConfig,
        base_url: str,
        http: Any,
        result: RunResult,
        progress: ProgressFn | None,
        model: str,
    ) -> None:
        self.cfg = cfg
        self.base = base_url.rstrip("/")
        self.http = http
        self.result = result
        self.progress = progress
        self.model = model
        self.t0 = time.monotonic()
        self.next_index = 0
        self.completed = 0
        self.failed = 0

    def _now(self) -> float:
        return time.monotonic() - self.t0

    async def worker(self) -> None:
        # Each worker runs at most num_sessions sessions; the shared index bounds all.
        for _ in range(self.cfg.num_sessions):
            if self.next_index >= self.cfg.num_sessions:
                return
            index = self.next_index
            self.next_index += 1
            delay = start_delay_s(self.cfg, index)
            if delay > 0:
                await asyncio.sleep(delay)
            await self.run_session(index)

    async def run_session(self, index: int) -> None:
        cfg = self.cfg
        rec = SessionRecord(
            index=index, session_id=session_id(cfg, index), turns_planned=num_turns(cfg, index)
        )
        rec.start_s = max(self._now(), 1e-9)
        self.result.sessions.append(rec)
        try:
            await self._turns(rec)
        except asyncio.CancelledError:
            rec.error = rec.error or "cancelled"
            rec.end_s = self._now()
            self.failed += 1
            raise
        rec.end_s = self._now()
        if rec.ok:
            self.completed += 1
        else:
            self.failed += 1
        if self.progress is not None:
            self.progress(self.completed, self.failed, cfg.num_sessions)

    async def _turns(self, rec: SessionRecord) -> None:
        cfg = self.cfg
        prompt = first_prompt(cfg, rec.index)
        messages: list[dict[str, str]] = [
            {"role": "system", "content": tokens_to_text(system_prefix(cfg))},
            {"role": "user", "content": tokens_to_text(turn_tokens(cfg, rec.index, 0))},
        ]
        previous_context = 0
        for turn in range(rec.turns_planned):
            if turn > 0:
                delay = tool_latency_s(cfg, rec.index, turn)
                if delay > 0:
                    await asyncio.sleep(delay)
            req = RequestRecord(session=rec.index, turn=turn, previous_context_len=previous_context)
            self.result.requests.append(req)
            if cfg.api == "generate":
                state = await self._request(
                    req, rec.session_id, generate_body(cfg, prompt), "/generate", chat=False
                )
            else:
                state = await self._request(
                    req,
                    rec.session_id,
                    chat_body(cfg, messages, self.model),
                    "/v1/chat/completions",
                    chat=True,
                )
            if not req.ok or state is None:
                rec.error = f"turn {turn}: {req.error}"
                break
            rec.turns_done += 1
            previous_context = context_after_turn(req.prompt_tokens, req.completion_tokens)
            if turn + 1 < rec.turns_planned:
                new_input = turn_tokens(cfg, rec.index, turn + 1)
                prompt = next_prompt(prompt, state.output_ids, new_input)
                messages.append({"role": "assistant", "content": state.text})
                messages.append({"role": "user", "content": tokens_to_text(new_input)})
        else:
            rec.ok = True
        if cfg.close_at_end:
            rec.close_status = await self._close(rec.session_id)

    async def _request(
        self, req: RequestRecord, sid: str, body: dict[str, Any], path: str, *, chat: bool
    ) -> StreamState | None:
        import aiohttp

        cfg = self.cfg
        req.start_s = self._now()
        start = time.monotonic()
        state = StreamState()
        if not chat:
            req.prompt_tokens = len(body["input_ids"])
        try:
            async with self.http.post(
                f"{self.base}{path}",
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json", SESSION_HEADER: sid},
                timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s),
            ) as resp:
                req.status = resp.status
                wait = resp.headers.get(ADMISSION_WAIT_HEADER)
                if wait is not None:
                    with contextlib.suppress(ValueError):
                        req.admission_wait_ms = float(wait)
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    req.error = f"http_{resp.status}: {text}"
                    return None
                await self._consume(resp, state, start, req, chat=chat)
        except TimeoutError:
            req.error = "timeout"
            return None
        except aiohttp.ClientError as exc:
            req.error = f"client_error: {type(exc).__name__} {exc}"
            return None
        req.latency_s = time.monotonic() - start
        if state.prompt_tokens is not None:
            req.prompt_tokens = state.prompt_tokens
        req.cached_tokens = state.cached_tokens or 0
        req.completion_tokens = (
            state.completion_tokens
            if state.completion_tokens is not None
            else len(state.output_ids)
        )
        req.finish_reason = state.finish_reason
        if state.error is not None:
            req.error = state.error
        elif not state.done:
            req.error = "truncated: stream ended without [DONE]"
        elif state.finish_reason == "abort":
            req.error = "aborted"
        else:
            req.ok = True
        return state if req.ok else None

    async def _consume(
        self, resp: Any, state: StreamState, start: float, req: RequestRecord, *, chat: bool
    ) -> None:
        # Bounded by the request timeout; each iteration consumes one line.
        async for line in resp.content:
            parsed = parse_sse_line(line)
            if parsed is None:
                continue
            kind, obj = parsed
            if req.ttft_s is None:
                req.ttft_s = time.monotonic() - start
            if kind == "done":
                state.done = True
                break
            if kind == "bad":
                state.error = f"bad_chunk: {obj}"
                continue
            if isinstance(obj, Mapping):
                if chat:
                    state.feed_chat(obj)
                else:
                    state.feed_generate(obj)

    async def _close(self, sid: str) -> int | None:
        import aiohttp

        try:
            async with self.http.post(
                f"{self.base}/close_session",
                data=orjson.dumps({"session_id": sid}),
                headers={"Content-Type": "application/json", SESSION_HEADER: sid},
                timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s),
            ) as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, TimeoutError):
            return None


async def run_workload(
    cfg: WorkloadConfig,
    base_url: str,
    *,
    engine_urls: Sequence[str] = (),
    progress: ProgressFn | None = None,
    read_stats: bool = True,
) -> RunResult:
    """Run the workload against ``base_url`` and return every measurement.

    ``engine_urls`` are scraped (``/metrics``) before and after the run; ``read_stats``
    reads ``{base}/kvproxy/stats`` afterwards (None where the base URL is not kvproxy).
    """
    import aiohttp

    cfg.validate()
    base = base_url.rstrip("/")
    result = RunResult(config=cfg, base_url=base)
    connector = aiohttp.TCPConnector(limit=max(16, 2 * cfg.concurrency + 8))
    async with aiohttp.ClientSession(connector=connector) as http:
        result.engines_before = await scrape_engines(http, engine_urls)
        model = cfg.model or "default"
        if cfg.api == "chat" and cfg.model is None:
            model = await _discover_model(http, base, cfg.request_timeout_s)
        driver = _Driver(cfg, base, http, result, progress, model)
        start = time.monotonic()
        workers = [
            asyncio.create_task(driver.worker())
            for _ in range(min(cfg.concurrency, cfg.num_sessions))
        ]
        try:
            done, pending = await asyncio.wait(workers, timeout=cfg.run_timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise exc
        finally:
            for task in workers:
                task.cancel()
        result.wall_s = time.monotonic() - start
        result.engines_after = await scrape_engines(http, engine_urls)
        if read_stats:
            result.proxy_stats = await read_proxy_stats(http, base)
    result.sessions.sort(key=lambda s: s.index)
    return result


# ------------------------------------------------------------------------------- CLI


def _parse_args(argv: Sequence[str] | None) -> Any:
    import argparse

    d = WorkloadConfig()
    p = argparse.ArgumentParser(
        prog="python -m kvproxy.sim.agents",
        description="Run the agentic workload against a base URL (kvproxy, router or engine).",
    )
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8100")
    p.add_argument(
        "--engine", action="append", default=[], help="engine base URL to scrape (repeatable)"
    )
    p.add_argument("--sessions", type=int, default=d.num_sessions)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--turns", default=f"{d.turns_min}-{d.turns_max}", help="N or MIN-MAX")
    p.add_argument("--system-prefix-tokens", type=int, default=d.system_prefix_tokens)
    p.add_argument("--user-tokens", type=int, default=d.user_tokens)
    p.add_argument(
        "--tool-result-tokens",
        default=f"{d.tool_result_tokens_min}-{d.tool_result_tokens_max}",
        help="N or MIN-MAX",
    )
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--tool-latency", choices=TOOL_LATENCY_KINDS, default=d.tool_latency)
    p.add_argument("--tool-latency-median-s", type=float, default=d.tool_latency_median_s)
    p.add_argument("--tool-latency-sigma", type=float, default=d.tool_latency_sigma)
    p.add_argument(
        "--tool-latency-range-s",
        default=f"{d.tool_latency_low_s}-{d.tool_latency_high_s}",
        help="LOW-HIGH for --tool-latency uniform",
    )
    p.add_argument("--time-scale", type=float, default=d.time_scale)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--api", choices=APIS, default=d.api)
    p.add_argument("--model", default=None, help="chat only (default: ask /v1/models)")
    p.add_argument("--no-close", action="store_true", help="do not POST /close_session")
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument("--run-timeout-s", type=float, default=d.run_timeout_s)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--json", metavar="PATH", help="write the summary and config here")
    return p.parse_args(argv)


def _range(text: str, cast: Callable[[str], Any]) -> tuple[Any, Any]:
    lo, _, hi = text.partition("-")
    return cast(lo), cast(hi or lo)


def main(argv: Sequence[str] | None = None) -> int:
    import json
    import sys

    a = _parse_args(argv)
    turns = _range(a.turns, int)
    tools = _range(a.tool_result_tokens, int)
    lat = _range(a.tool_latency_range_s, float)
    cfg = WorkloadConfig(
        num_sessions=a.sessions,
        concurrency=a.concurrency,
        turns_min=turns[0],
        turns_max=turns[1],
        system_prefix_tokens=a.system_prefix_tokens,
        user_tokens=a.user_tokens,
        tool_result_tokens_min=tools[0],
        tool_result_tokens_max=tools[1],
        max_new_tokens=a.max_new_tokens,
        tool_latency=a.tool_latency,
        tool_latency_median_s=a.tool_latency_median_s,
        tool_latency_sigma=a.tool_latency_sigma,
        tool_latency_low_s=lat[0],
        tool_latency_high_s=lat[1],
        time_scale=a.time_scale,
        seed=a.seed,
        api=a.api,
        model=a.model,
        close_at_end=not a.no_close,
        request_timeout_s=a.request_timeout_s,
        run_timeout_s=a.run_timeout_s,
        vocab_size=a.vocab_size,
    )
    try:
        cfg.validate()
    except WorkloadError as exc:
        print(f"invalid workload: {exc}", file=sys.stderr)
        return 2

    def progress(done: int, failed: int, total: int) -> None:
        print(f"{done + failed}/{total} sessions ({failed} failed)", file=sys.stderr, flush=True)

    result = asyncio.run(run_workload(cfg, a.base_url, engine_urls=a.engine, progress=progress))
    doc = result.to_dict()
    text = json.dumps(doc, indent=2)
    if a.json:
        with open(a.json, "w") as fh:
            fh.write(text + "\n")
    print(json.dumps(doc["summary"], indent=2))
    return 0 if result.summary()["sessions_failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
