"""The HTTP shell: a :class:`HttpTransport` for the runner and ``kvproxy workload``.

The driver is a plain HTTP client of whatever base URL it is given (an engine, the
router or kvproxy), so one workload measures every configuration. Every request carries
the session id in ``X-Session-ID`` and ``X-SMG-Routing-Key`` (what agent frameworks
send, so every configuration routes the same way); a finished session POSTs
``{base}/close_session`` (a 404 from a bare router or engine is tolerated).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson

from kvlab.workload.model import TurnOutcome, WorkloadError, WorkloadResult, WorkloadSpec
from kvlab.workload.plan import is_subagent_id
from kvlab.workload.report import summarize
from kvlab.workload.runner import ProgressFn, run_workload
from kvlab.workload.spec import PRESETS, override_names, resolve_token_scale, workload_spec
from kvlab.workload.wire import (
    _RETRACTION_COUNTERS,
    ADMISSION_WAIT_HEADER,
    FINAL_HEADER,
    ROUTING_KEY_HEADER,
    SESSION_HEADER,
    StreamState,
    diff_counters,
    generate_body,
    identity_headers,
    parse_prometheus,
    parse_sse_line,
    wire_identity,
)

# Bounds the per-run table of close statuses.
MAX_CLOSE_RECORDS = 1_000_000
# Bounds the set of sessions that have sent a first turn (for nvext open vs bind).
MAX_STARTED = 1_000_000

SESSION_CONTROLS = ("none", "open", "bind")
SESSION_CONTROL_SCOPES = ("all", "subagents")
# --token-scale left out: presets and traces of counts run at 1 (the engines' default).
DEFAULT_TOKEN_SCALE = 1


def nvext_for(
    session_id: str,
    *,
    first: bool,
    final: bool,
    max_new_tokens: int,
    control: str = "none",
    speculative_prefill: bool = False,
    timeout_s: float | None = None,
    scope: str = "all",
) -> dict[str, Any] | None:
    """Dynamo's ``nvext`` for one turn (docs/dynamo.md), or None for none. Pure.

    ``control`` ``open``: ``action: open`` on the session's first turn, ``bind`` on the
    ones between, ``close`` on its last; ``bind``: ``bind`` then ``close``. Every turn
    carries ``agent_hints.osl`` (its ``max_new_tokens``) and, when asked,
    ``speculative_prefill``. ``scope`` ``subagents``: only W3 subagent sessions.
    """
    if control not in SESSION_CONTROLS:
        raise WorkloadError(f"session control must be one of {SESSION_CONTROLS} (got {control!r})")
    if scope not in SESSION_CONTROL_SCOPES:
        raise WorkloadError(f"scope must be one of {SESSION_CONTROL_SCOPES} (got {scope!r})")
    if control == "none" and not speculative_prefill:
        return None
    if scope == "subagents" and not is_subagent_id(session_id):
        return None
    hints: dict[str, Any] = {"osl": max_new_tokens}
    if speculative_prefill:
        hints["speculative_prefill"] = True
    out: dict[str, Any] = {"agent_hints": hints}
    if control != "none":
        action = "close" if final else ("open" if first and control == "open" else "bind")
        sc: dict[str, Any] = {"session_id": session_id, "action": action}
        if timeout_s is not None and action != "close":
            sc["timeout"] = timeout_s
        out["session_control"] = sc
    return out


async def _read_sse(
    resp: aiohttp.ClientResponse, state: StreamState, clock: Any, start: float
) -> float | None:
    """Read a streamed /generate answer into ``state``; returns the time to its first
    event (None: no event)."""
    ttft: float | None = None
    # Bounded by the request timeout; each iteration consumes one line.
    async for line in resp.content:
        parsed = parse_sse_line(line)
        if parsed is None:
            continue
        kind, obj = parsed
        if ttft is None:
            ttft = clock() - start
        if kind == "done":
            state.done = True
            break
        if kind == "bad":
            state.error = f"bad_chunk: {obj}"
        elif isinstance(obj, Mapping):
            state.feed_generate(obj)
    return ttft


@dataclass(slots=True)
class _Reply:
    """What a turn learnt of its answer before it ended (or failed)."""

    start: float
    ttft: float | None = None
    wait_ms: float | None = None

    def failed(self, prompt_tokens: int, now: float, error: str) -> TurnOutcome:
        return TurnOutcome(
            output_ids=[],
            prompt_tokens=prompt_tokens,
            cached_tokens=0,
            completion_tokens=0,
            ttft_s=self.ttft if self.ttft is not None else now,
            latency_s=now,
            ok=False,
            error=error,
            admission_wait_ms=self.wait_ms,
        )


def _stream_failure(state: StreamState) -> str | None:
    """The error of an answer read whole but not complete (None: a good answer)."""
    if state.error is not None:
        return state.error
    if not state.done:
        return "truncated: stream ended without [DONE]"
    if state.finish_reason == "abort":
        return "aborted"
    return None


class HttpTransport:
    """Streams SGLang ``/generate`` through ``http`` (one pooled aiohttp session).

    ``send_final``: also send ``X-Session-Final: 1`` on a session's last request (kvproxy
    then closes the session after the response, before the explicit close arrives).
    ``session_control`` / ``speculative_prefill`` / ``session_timeout_s`` /
    ``session_control_scope``: Dynamo's ``nvext`` per turn (:func:`nvext_for`). With
    ``speculative_prefill`` the requests are not streamed (as the Dynamo benchmarks ran;
    kvproxy prefills after a streamed answer too), so TTFT reads as the request's latency.
    ``routing_key``: the ``X-SMG-Routing-Key`` of a session's requests (default: its id).
    As a runner's ``tool_hints`` it tells kvproxy each tool call's length as it starts
    (``POST /kvproxy/sessions/{id}/prefetch``; the answers' statuses counted).
    """

    def __init__(
        self,
        base_url: str,
        http: aiohttp.ClientSession,
        *,
        request_timeout_s: float = 120.0,
        close_sessions: bool = True,
        send_final: bool = False,
        temperature: float = 0.0,
        session_control: str = "none",
        speculative_prefill: bool = False,
        session_timeout_s: float | None = None,
        session_control_scope: str = "all",
        routing_key: Callable[[str], str] | None = None,
        subagent_identity: str = "own",
        retries: int = 0,
    ) -> None:
        nvext_for(
            "probe",
            first=True,
            final=False,
            max_new_tokens=1,
            control=session_control,
            scope=session_control_scope,
        )  # validates the options
        if request_timeout_s <= 0:
            raise WorkloadError(f"request_timeout_s must be > 0 (got {request_timeout_s})")
        self.base = base_url.rstrip("/")
        self.http = http
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.close_sessions = close_sessions
        self.send_final = send_final
        self.temperature = temperature
        self.session_control = session_control
        self.speculative_prefill = speculative_prefill
        self.session_timeout_s = session_timeout_s
        self.session_control_scope = session_control_scope
        self.routing_key = routing_key
        self.subagent_identity = subagent_identity
        self._hint_timeout = aiohttp.ClientTimeout(total=5.0)
        self.retries = retries
        self.retried = 0  # turns sent again after an error
        self._started: set[str] = set()
        # session id -> HTTP status of its /close_session (None: no answer).
        self.close_status: dict[str, int | None] = {}
        # The tool hints' answers: HTTP status (0: no answer) -> count.
        self.tool_hint_status: dict[int, int] = {}

    def _headers(self, session_id: str) -> dict[str, str]:
        # A W3 subagent as the workload's subagent_identity says (wire.identity_headers).
        headers = identity_headers(session_id, self.subagent_identity)
        sid = headers[SESSION_HEADER]
        headers["Content-Type"] = "application/json"
        headers[ROUTING_KEY_HEADER] = self.routing_key(sid) if self.routing_key else sid
        return headers

    def _turn_request(
        self, session_id: str, input_ids: list[int], max_new_tokens: int, final: bool
    ) -> tuple[dict[str, str], dict[str, Any], bool]:
        """The headers and body of one turn, and whether it is streamed."""
        headers = self._headers(session_id)
        if final and self.send_final:
            headers[FINAL_HEADER] = "1"
        stream = not self.speculative_prefill
        body = generate_body(input_ids, max_new_tokens, temperature=self.temperature, stream=stream)
        first = session_id not in self._started
        if first and not final and len(self._started) < MAX_STARTED:
            self._started.add(session_id)
        elif final:
            self._started.discard(session_id)
        nvext = nvext_for(
            session_id,
            first=first,
            final=final,
            max_new_tokens=max_new_tokens,
            control=self.session_control,
            speculative_prefill=self.speculative_prefill,
            timeout_s=self.session_timeout_s,
            scope=self.session_control_scope,
        )
        if nvext is not None:
            body["nvext"] = nvext
        return headers, body, stream

    async def generate(
        self, session_id: str, input_ids: list[int], max_new_tokens: int, *, final: bool
    ) -> TurnOutcome:
        loop = asyncio.get_running_loop()
        start = loop.time()
        headers, body, stream = self._turn_request(session_id, input_ids, max_new_tokens, final)
        for attempt in range(1 + self.retries):
            state = StreamState()
            reply = _Reply(start)
            try:
                error = await self._post_turn(headers, body, stream, state, reply)
            except TimeoutError:
                error = "timeout"
            except aiohttp.ClientError as exc:
                error = f"client_error: {type(exc).__name__} {exc}"
            if error is None:
                error = _stream_failure(state)
            # A client that retries sends the turn again after an error (not a timeout).
            if error is None or error == "timeout" or attempt == self.retries:
                break
            self.retried += 1
        latency = loop.time() - start
        if error is not None:
            return reply.failed(len(input_ids), latency, error)
        return TurnOutcome(
            output_ids=state.output_ids,
            prompt_tokens=state.prompt_tokens
            if state.prompt_tokens is not None
            else len(input_ids),
            cached_tokens=state.cached_tokens or 0,
            completion_tokens=state.completion_tokens
            if state.completion_tokens is not None
            else len(state.output_ids),
            ttft_s=reply.ttft if reply.ttft is not None else latency,
            latency_s=latency,
            finish_reason=state.finish_reason,
            admission_wait_ms=reply.wait_ms,
        )

    async def _post_turn(
        self,
        headers: dict[str, str],
        body: dict[str, Any],
        stream: bool,
        state: StreamState,
        reply: _Reply,
    ) -> str | None:
        """POST one turn and read its answer into ``state``; the error of a non-200."""
        clock = asyncio.get_running_loop().time
        async with self.http.post(
            f"{self.base}/generate",
            data=orjson.dumps(body),
            headers=headers,
            timeout=self.timeout,
        ) as resp:
            wait = resp.headers.get(ADMISSION_WAIT_HEADER)
            if wait is not None:
                with contextlib.suppress(ValueError):
                    reply.wait_ms = float(wait)
            if resp.status != 200:
                text = (await resp.text())[:200]
                return f"http_{resp.status}: {text}"
            if stream:
                reply.ttft = await _read_sse(resp, state, clock, reply.start)
            else:
                with contextlib.suppress(orjson.JSONDecodeError):
                    doc = orjson.loads(await resp.read())
                    if isinstance(doc, Mapping):
                        state.feed_generate(doc)
                        state.done = True
                reply.ttft = clock() - reply.start
        return None

    async def tool_call(self, session_id: str, seconds: float) -> None:
        """``POST /kvproxy/sessions/{id}/prefetch {"in_s": seconds}``."""
        status = 0
        try:
            async with self.http.post(
                f"{self.base}/kvproxy/sessions/{quote(session_id, safe='')}/prefetch",
                data=orjson.dumps({"in_s": seconds}),
                headers=self._headers(session_id),
                timeout=self._hint_timeout,
            ) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError):
            status = 0
        self.tool_hint_status[status] = self.tool_hint_status.get(status, 0) + 1

    async def close(self, session_id: str) -> None:
        if not self.close_sessions:
            return
        if wire_identity(session_id, self.subagent_identity)[0] != session_id:
            return  # a subagent sharing its lead's id leaves it open
        status: int | None = None
        for _ in range(1 + self.retries):  # (sent again after an error, as a turn is)
            try:
                async with self.http.post(
                    f"{self.base}/close_session",
                    data=orjson.dumps({"session_id": session_id}),
                    headers=self._headers(session_id),
                    timeout=self.timeout,
                ) as resp:
                    await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError):
                status = None
            if status is not None and status < 500:
                break
        if len(self.close_status) < MAX_CLOSE_RECORDS:
            self.close_status[session_id] = status


# ------------------------------------------------------------------ engine counters


async def scrape_engine(
    session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0
) -> dict[str, float]:
    """Counters of one engine's ``/metrics``; {} when it cannot be read."""
    try:
        async with session.get(
            f"{url.rstrip('/')}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                return {}
            return parse_prometheus(await resp.text())
    except (aiohttp.ClientError, TimeoutError):
        return {}


async def scrape_engines(
    session: aiohttp.ClientSession, urls: Sequence[str]
) -> dict[str, dict[str, float]]:
    values = await asyncio.gather(*(scrape_engine(session, u) for u in urls))
    return dict(zip(urls, values, strict=True))


async def read_proxy_stats(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float = 5.0
) -> dict[str, Any] | None:
    """``{base}/kvproxy/stats`` JSON, or None where the base URL is not kvproxy."""
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


@dataclass(slots=True)
class HttpRun:
    """One run over HTTP: the runner's records plus what the engines and kvproxy saw."""

    result: WorkloadResult
    base_url: str
    wall_s: float = 0.0
    engines_before: dict[str, dict[str, float]] = field(default_factory=dict)
    engines_after: dict[str, dict[str, float]] = field(default_factory=dict)
    proxy_stats: dict[str, Any] | None = None
    close_status: dict[str, int | None] = field(default_factory=dict)
    # The tool hints' answers (--tool-hints): HTTP status (0: none) -> count.
    tool_hint_status: dict[int, int] = field(default_factory=dict)
    retried_turns: int = 0  # turns sent again after an error (run_http's retries)

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
        """:func:`~kvlab.workload.report.summarize` plus the engines' counter deltas,
        the wall time and kvproxy's stats (JSON-serialisable)."""
        out = summarize(self.result)
        delta = self.engine_delta
        retractions = next((delta[n] for n in _RETRACTION_COUNTERS if n in delta), None)
        if retractions is None:
            retractions = delta.get("num_retracted_reqs")
        closes = [s for s in self.close_status.values() if s is not None]
        out.update(
            {
                "base_url": self.base_url,
                "wall_s": round(self.wall_s, 3),
                "evicted_tokens": delta.get("evicted_tokens_total"),
                "retractions": retractions,
                "aborted_requests": delta.get("num_aborted_requests_total"),
                "engine_prompt_tokens": delta.get("prompt_tokens_total"),
                "engine_cached_tokens": delta.get("cached_tokens_total"),
                "engine_generation_tokens": delta.get("generation_tokens_total"),
                "engine_prefill_compute_tokens": delta.get("realtime_tokens_total:prefill_compute"),
                "engine_prefill_cache_tokens": delta.get("realtime_tokens_total:prefill_cache"),
                "closes_ok": sum(1 for s in closes if s == 200),
                "closes_failed": len(self.close_status) - sum(1 for s in closes if s == 200),
            }
        )
        if self.tool_hint_status:
            out["tool_hints"] = {str(k): v for k, v in sorted(self.tool_hint_status.items())}
        if self.proxy_stats is not None:
            out["proxy_stats"] = self.proxy_stats
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.result.spec.to_dict(),
            "seed": self.result.seed,
            "sessions_requested": self.result.sessions_requested,
            "concurrency": self.result.concurrency,
            "time_scale": self.result.time_scale,
            "summary": self.summary(),
            "engine_delta": self.engine_delta,
            "engine_deltas": self.engine_deltas,
        }


async def run_http(
    spec: WorkloadSpec,
    base_url: str,
    *,
    sessions: int,
    concurrency: int,
    seed: int,
    time_scale: float = 1.0,
    engine_urls: Sequence[str] = (),
    progress: ProgressFn | None = None,
    read_stats: bool = True,
    request_timeout_s: float = 120.0,
    run_timeout_s: float | None = None,
    send_final: bool = False,
    session_control: str = "none",
    speculative_prefill: bool = False,
    session_timeout_s: float | None = None,
    session_control_scope: str = "all",
    routing_key: Callable[[str], str] | None = None,
    tool_hints: bool = False,
    retries: int = 0,
) -> HttpRun:
    """Run ``spec`` against ``base_url`` over HTTP. ``engine_urls`` are scraped
    (``/metrics``) before and after; ``read_stats`` reads ``{base}/kvproxy/stats``;
    ``routing_key`` maps a session id to its ``X-SMG-Routing-Key`` (default: the id);
    ``tool_hints``: tell kvproxy each tool call's length as it starts (its prefetch);
    ``retries``: times a turn is sent again after an error (not after a timeout)."""
    base = base_url.rstrip("/")
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=max(16, 2 * concurrency + 8))
    async with aiohttp.ClientSession(connector=connector) as http:
        run = HttpRun(
            result=WorkloadResult(spec, seed, sessions, concurrency, time_scale), base_url=base
        )
        run.engines_before = await scrape_engines(http, engine_urls)
        transport = HttpTransport(
            base,
            http,
            request_timeout_s=request_timeout_s,
            close_sessions=spec.close_sessions,
            send_final=send_final,
            session_control=session_control,
            speculative_prefill=speculative_prefill,
            session_timeout_s=session_timeout_s,
            session_control_scope=session_control_scope,
            routing_key=routing_key,
            subagent_identity=spec.subagent_identity,
            retries=retries,
        )
        start = loop.time()
        run.result = await run_workload(
            spec,
            transport,
            sessions=sessions,
            concurrency=concurrency,
            seed=seed,
            time_scale=time_scale,
            progress=progress,
            deadline_s=run_timeout_s,
            tool_hints=transport if tool_hints else None,
        )
        run.wall_s = loop.time() - start
        run.close_status = transport.close_status
        run.retried_turns = transport.retried
        run.tool_hint_status = transport.tool_hint_status
        run.engines_after = await scrape_engines(http, engine_urls)
        if read_stats:
            run.proxy_stats = await read_proxy_stats(http, base)
    return run


# ------------------------------------------------------------------------------- CLI


def parse_sets(items: Sequence[str], flag: str = "--set") -> dict[str, str]:
    """``["turns_median=20", ...]`` -> ``{"turns_median": "20"}`` (names and values
    stripped); :class:`WorkloadError` naming ``flag`` for an item without a name."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise WorkloadError(f"{flag} expects NAME=VALUE (got {item!r})")
        out[key.strip()] = value.strip()
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", help="kvproxy, router or engine, e.g. http://127.0.0.1:8100")
    p.add_argument(
        "--workload",
        default="swe",
        help=f"a preset ({', '.join(PRESETS)}) or trace:PATH (trace:sample: the packaged sample)",
    )
    p.add_argument(
        "--token-scale",
        type=int,
        default=None,
        help=f"tokens per macro-token (match the engines; default {DEFAULT_TOKEN_SCALE}, "
        "a trace with explicit ids: its own)",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=None,
        help="main sessions to run (default: 2 x concurrency; a trace: all)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="main sessions at once (default: the preset's sessions per engine)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply tool latencies (use the simulated engines' --time-scale)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a workload parameter in real tokens, e.g. turns_median=20 (repeatable; --list-params)",
    )
    p.add_argument(
        "--engine", action="append", default=[], help="engine URL to scrape /metrics (repeatable)"
    )
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--run-timeout-s", type=float, default=None, help="stop the run after this long")
    p.add_argument(
        "--final-header", action="store_true", help="send X-Session-Final: 1 on each last turn"
    )
    p.add_argument(
        "--session-control",
        choices=SESSION_CONTROLS,
        default="none",
        help="Dynamo nvext.session_control per session: open on the first turn (streaming "
        "session) or bind, close on the last (docs/dynamo.md)",
    )
    p.add_argument(
        "--session-control-scope",
        choices=SESSION_CONTROL_SCOPES,
        default="all",
        help="which sessions carry nvext: all, or only W3 subagents",
    )
    p.add_argument(
        "--session-timeout-s", type=float, default=None, help="nvext.session_control.timeout"
    )
    p.add_argument(
        "--speculative-prefill",
        action="store_true",
        help="nvext.agent_hints.speculative_prefill on every turn (requests not streamed)",
    )
    p.add_argument(
        "--tool-hints",
        action="store_true",
        help="tell kvproxy each tool call's length as it starts "
        "(POST /kvproxy/sessions/{id}/prefetch; admission.prefetch)",
    )
    p.add_argument("--json", metavar="PATH", help="write spec, summary and engine deltas here")
    p.add_argument(
        "--list-params", action="store_true", help="print the workload's parameters and exit"
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _spec_from_args(a: argparse.Namespace) -> WorkloadSpec:
    scale, note = resolve_token_scale(a.workload, a.token_scale, DEFAULT_TOKEN_SCALE)
    if note is not None:
        print(f"kvproxy workload: {note}", file=sys.stderr)
    return workload_spec(a.workload, scale, **parse_sets(a.set))


def run(a: argparse.Namespace) -> int:
    try:
        spec = _spec_from_args(a)
        if a.list_params:
            print(json.dumps(spec.to_dict(), indent=2))
            print("override names: " + ", ".join(override_names()), file=sys.stderr)
            return 0
        if not a.base_url:
            raise WorkloadError("--base-url is required")
        concurrency = a.concurrency if a.concurrency is not None else spec.sessions_per_engine
        if a.sessions is not None:
            sessions = a.sessions
        elif spec.trace is not None:
            sessions = len(spec.trace.sessions)
        else:
            sessions = 2 * concurrency
        if concurrency < 1 or sessions < 0:
            raise WorkloadError("need --concurrency >= 1 and --sessions >= 0")
        if a.time_scale < 0:
            raise WorkloadError("--time-scale must be >= 0")
    except WorkloadError as exc:
        print(f"invalid workload: {exc}", file=sys.stderr)
        return 2

    def progress(done: int, failed: int, total: int) -> None:
        if not a.quiet:
            print(
                f"{done + failed}/{total} sessions ({failed} failed)", file=sys.stderr, flush=True
            )

    result = asyncio.run(
        run_http(
            spec,
            a.base_url,
            sessions=sessions,
            concurrency=concurrency,
            seed=a.seed,
            time_scale=a.time_scale,
            engine_urls=a.engine,
            progress=progress,
            request_timeout_s=a.request_timeout_s,
            run_timeout_s=a.run_timeout_s,
            send_final=a.final_header,
            session_control=a.session_control,
            speculative_prefill=a.speculative_prefill,
            session_timeout_s=a.session_timeout_s,
            session_control_scope=a.session_control_scope,
            tool_hints=a.tool_hints,
        )
    )
    doc = result.to_dict()
    if a.json:
        with open(a.json, "w") as fh:
            fh.write(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc["summary"], indent=2))
    return 0 if doc["summary"]["sessions_failed"] == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvproxy.workload",
        description="Run an agentic workload against a base URL (kvproxy, router or engine).",
    )
    add_arguments(p)
    return run(p.parse_args(argv))
