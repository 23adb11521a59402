"""aiohttp shell of the simulated SGLang engine.

One app factory, :func:`create_sim_app`. The pure core (``kvproxy.sim.scheduler``
and ``kvproxy.sim.kvcache``) does all the bookkeeping; this module parses HTTP
bodies into core calls, runs one scheduler-loop task per DP rank (started and
stopped in ``cleanup_ctx``), and wakes request handlers through per-request
asyncio events. No task is created per request or per token.

Time: each loop step asks the core for the next batch, sleeps until the step's end
on the simulated clock, then applies the batch. While the engine is busy, simulated
time advances only by step durations: a step that follows another starts exactly at
its simulated end, so late wake-ups and the loop's own work never stretch a step.
The wall-clock deadline of a step is absolute (``anchor + sim * time_scale``), so a
late wake-up is made up by the following steps; the lag that remains is reported as
overrun (``/server_info``, ``/sim/state``), never folded into simulated time. When
the engine is idle the simulated clock follows the wall clock (divided by
``time_scale``) and is re-anchored there. With ``time_scale == 0`` steps do not
sleep and the clock is the sum of step durations.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import tempfile
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from kvproxy.sim import tokenizer
from kvproxy.sim.config import FaultConfig, SimConfig, validate_faults, validate_sim_config
from kvproxy.sim.metrics import GARBAGE_METRICS, MetricsContext, render_metrics
from kvproxy.sim.scheduler import Scheduler, SimError, SimRequest, State, StepEvents

log = logging.getLogger("kvproxy.sim")

SGLANG_VERSION = "0.5.23"


# ----------------------------------------------------------------------------- state


@dataclass(eq=False, slots=True)
class Waiter:
    """How a handler waits for its request: ``done`` when finished, ``progress`` per step."""

    req: SimRequest
    done: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event | None = None


class Rank:
    """One DP rank: a scheduler, its loop task and its waiters."""

    def __init__(self, index: int, sched: Scheduler, time_scale: float) -> None:
        self.index = index
        self.sched = sched
        self.time_scale = time_scale
        self.wake = asyncio.Event()
        self.waiters: dict[str, Waiter] = {}
        self.streams: dict[str, Waiter] = {}
        # Simulated time ``sim`` maps to wall time ``_anchor_wall + (sim - _anchor_sim) * ts``.
        self._anchor_wall = time.monotonic()
        self._anchor_sim = 0.0
        self._virtual = 0.0
        self._last_end = 0.0  # simulated end of the last step: the clock never goes back
        # (start, end) of the step being computed, in simulated seconds; None when idle.
        self._step: tuple[float, float] | None = None
        # Overrun: how far (wall seconds) the loop ran behind the cost model's deadlines.
        self.lag_s = 0.0  # after the last step (0 when on time)
        self.max_lag_s = 0.0
        self.overrun_s = 0.0  # total lateness introduced (sum of the lag's increases)
        self.late_steps = 0  # steps that ended after their wall-clock deadline
        self.steps = 0
        self.stopped = False  # the loop crashed or the app is shutting down

    def _wall_sim(self) -> float:
        return self._anchor_sim + (time.monotonic() - self._anchor_wall) / self.time_scale

    def now(self) -> float:
        """Simulated time for an event now (an arrival, a close, a step start)."""
        if self.time_scale <= 0:
            return self._virtual
        t = self._wall_sim()
        step = self._step
        if step is not None:
            # During a step the clock stays inside it, even when the loop is late.
            return min(max(t, step[0]), step[1])
        return max(t, self._last_end)

    def to_wall(self, sim_seconds: float) -> float:
        return sim_seconds * self.time_scale

    def clock_stats(self) -> dict[str, float | int]:
        return {
            "steps": self.steps,
            "overrun_s": round(self.overrun_s, 6),
            "lag_s": round(self.lag_s, 6),
            "max_lag_s": round(self.max_lag_s, 6),
            "late_steps": self.late_steps,
        }

    def notify(self, reqs: list[SimRequest]) -> None:
        for req in reqs:
            w = self.waiters.get(req.rid)
            if w is not None and w.req is req:
                w.done.set()
                if w.progress is not None:
                    w.progress.set()

    def notify_streams(self) -> None:
        for w in self.streams.values():
            if w.req.state is State.DECODE and w.progress is not None:
                w.progress.set()

    def release_all(self) -> None:
        """Wake every handler; unfinished requests then fail instead of hanging."""
        self.stopped = True
        for w in list(self.waiters.values()):
            w.done.set()
            if w.progress is not None:
                w.progress.set()

    async def run(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("scheduler loop of dp rank %d crashed", self.index)
            self.release_all()
            raise

    async def _run(self) -> None:
        sched = self.sched
        ts = self.time_scale
        chained = False  # the previous iteration ran a step: start at its simulated end
        while True:
            now = self._last_end if chained and ts > 0 else self.now()
            sched.maybe_reap(now)
            batch = sched.schedule(now)
            if sched.finished_outside:
                self.notify(sched.finished_outside)
                sched.finished_outside.clear()
            if batch is None:
                await self._idle(now, chained)
                chained = False
                continue
            end_sim = await self._sleep_step(now, batch.duration)
            ev = sched.finish_batch(batch, end_sim)
            self.steps += 1
            chained = True
            self._deliver(ev)

    async def _idle(self, now: float, chained: bool) -> None:
        """Wait (bounded by the scheduler's next deadline) for new work."""
        sched = self.sched
        ts = self.time_scale
        if chained and ts > 0:
            # Going idle: re-anchor the clock at the last step's end, so that a
            # lag of the burst is dropped (reported, never folded into simulated
            # time) and idle time follows the wall clock from here.
            self._anchor_sim = self._last_end
            self._anchor_wall = time.monotonic()
            self.lag_s = 0.0
        self.wake.clear()
        deadline = sched.next_deadline()
        timeout = None
        if deadline is not None:
            timeout = max(self.to_wall(deadline - now), 0.001) if ts > 0 else 0.05
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout)
        if ts == 0 and timeout is not None and not self.wake.is_set():
            # Virtual time: an idle engine lets session timeouts elapse.
            self._virtual = max(self._virtual, deadline or 0.0)

    async def _sleep_step(self, now: float, duration: float) -> float:
        """Let a step of ``duration`` simulated seconds pass; return its simulated end."""
        if self.time_scale <= 0:
            self._virtual += duration
            await asyncio.sleep(0)
            return self._virtual
        # Sleep until the step's end on the simulated clock. The deadline is
        # absolute, so a timer that fires early or late is made up by the
        # following steps; simulated time advances by the step's duration only.
        end_sim = now + duration
        self._step = (now, end_sim)
        deadline = self._anchor_wall + (end_sim - self._anchor_sim) * self.time_scale
        delay = deadline - time.monotonic()
        await asyncio.sleep(delay if delay > 0 else 0)
        lag = max(time.monotonic() - deadline, 0.0)
        if lag > self.lag_s:
            self.overrun_s += lag - self.lag_s
        if lag > 0:
            self.late_steps += 1
        self.lag_s = lag
        self.max_lag_s = max(self.max_lag_s, lag)
        self._step = None
        self._last_end = end_sim
        return end_sim

    def _deliver(self, ev: StepEvents) -> None:
        """Wake the handlers of requests that finished or got their first token."""
        if ev.finished:
            self.notify(ev.finished)
        if self.streams:
            for req in ev.first_tokens:
                w = self.streams.get(req.rid)
                if w is not None and w.progress is not None:
                    w.progress.set()
            self.notify_streams()


class SimState:
    """Everything the handlers share (stored under :data:`SIM_STATE`)."""

    def __init__(self, cfg: SimConfig) -> None:
        validate_sim_config(cfg)
        self.cfg = cfg
        self.faults: FaultConfig = cfg.faults
        self.model_path = ensure_model_dir(cfg.model_path, cfg.model_name)
        sched_cfg = cfg.scheduler_config()
        self.ranks = [Rank(i, Scheduler(sched_cfg), cfg.time_scale) for i in range(cfg.dp_size)]
        self.metrics_ctx = MetricsContext(
            model_name=cfg.model_name,
            tp_size=cfg.tp_size,
            enable_priority_scheduling=cfg.enable_priority_scheduling,
            streaming_sessions=cfg.mode == "streaming",
        )
        self._rr = 0
        self.created = int(time.time())
        # Last N requests as received (GET /sim/requests), when cfg.record_requests > 0.
        self.recorded: collections.deque[dict[str, Any]] | None = (
            collections.deque(maxlen=cfg.record_requests) if cfg.record_requests > 0 else None
        )
        self.tasks: list[asyncio.Task[None]] = []

    def pick_rank(self, body: Mapping[str, Any], session: str | None) -> Rank:
        n = len(self.ranks)
        if n == 1:
            return self.ranks[0]
        for key in ("routed_dp_rank", "data_parallel_rank"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
                return self.ranks[v]
        if session:
            return self.ranks[zlib.crc32(session.encode()) % n]
        self._rr = (self._rr + 1) % n
        return self.ranks[self._rr]

    def find(self, rid: str) -> tuple[Rank, SimRequest] | None:
        for rank in self.ranks:
            req = rank.sched.requests.get(rid)
            if req is not None:
                return rank, req
        return None


SIM_STATE = web.AppKey("kvproxy_sim_state", SimState)


def ensure_model_dir(path: str | None, model_name: str) -> str:
    """A local directory reported as model_path, so a router never downloads a tokenizer."""
    if path is None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
        path = os.path.join(tempfile.gettempdir(), "kvproxy-sim-model", safe)
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    cfg_file = p / "config.json"
    if not cfg_file.exists():
        with contextlib.suppress(OSError):
            cfg_file.write_bytes(
                orjson.dumps(
                    {
                        "architectures": ["Qwen3ForCausalLM"],
                        "model_type": "qwen3",
                        "vocab_size": tokenizer.VOCAB_SIZE,
                        "eos_token_id": tokenizer.EOS_TOKEN_ID,
                        "kvproxy_sim": True,
                    }
                )
            )
    return str(p)


# ----------------------------------------------------------------------------- helpers


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(message: str, status: int = 400) -> web.Response:
    """SGLang's ``_create_error_response``: ``{"error": {"message": ...}}``."""
    return _json({"error": {"message": message}}, status)


def _validation_error(message: str) -> web.Response:
    """SGLang's handler for request-validation errors (HTTP 400)."""
    return _json(
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
        400,
    )


class BadRequest(Exception):
    def __init__(self, message: str, validation: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.validation = validation


async def _read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def _int(v: Any, name: str, default: int | None = None) -> int | None:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise BadRequest(f"{name} must be an integer")
    return v


def _str(v: Any, name: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise BadRequest(f"{name} must be a string")
    return v


@dataclass(slots=True)
class ParsedRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    priority: int | None
    session_id: str | None
    session_params: dict[str, Any] | None
    stream: bool
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    output_len: int | None


def _common_fields(
    body: Mapping[str, Any], sampling: Mapping[str, Any], input_ids: list[int], max_new: int | None
) -> ParsedRequest:
    rid = _str(body.get("rid"), "rid") or uuid.uuid4().hex
    session_id = _str(body.get("session_id"), "session_id")
    session_params = body.get("session_params")
    if session_params is not None and not isinstance(session_params, dict):
        raise BadRequest("session_params must be an object")
    if session_id is not None and session_params is not None:
        raise BadRequest("session_id and session_params cannot both be set.", validation=False)
    n = _int(sampling.get("n"), "n", 1)
    if n != 1:
        raise BadRequest("The simulator supports n=1 only.", validation=False)
    stop_ids = sampling.get("stop_token_ids") or ()
    if not isinstance(stop_ids, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
    ):
        raise BadRequest("stop_token_ids must be a list of integers")
    custom = sampling.get("custom_params")
    output_len = None
    if isinstance(custom, dict) and custom.get("sim_output_len") is not None:
        output_len = _int(custom.get("sim_output_len"), "custom_params.sim_output_len")
    # None when absent: the scheduler applies SGLang's default (see Scheduler.submit).
    priority = _int(body.get("priority"), "priority")
    return ParsedRequest(
        rid=rid,
        input_ids=input_ids,
        max_new_tokens=128 if max_new is None else max_new,
        priority=priority,
        session_id=session_id,
        session_params=session_params,
        stream=bool(body.get("stream", False)),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(sampling.get("ignore_eos", False)),
        output_len=output_len,
    )


def parse_generate(body: Mapping[str, Any]) -> ParsedRequest:
    text = body.get("text")
    ids = body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise BadRequest("input_embeds is not supported by the simulator.", validation=False)
    if (text is None) == (ids is None):
        raise BadRequest("Either text or input_ids should be provided.", validation=False)
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise BadRequest("Batch requests are not supported by the simulator.", validation=False)
    sampling = body.get("sampling_params") or {}
    if isinstance(sampling, list):
        raise BadRequest("Batch requests are not supported by the simulator.", validation=False)
    if not isinstance(sampling, dict):
        raise BadRequest("sampling_params must be an object")
    if text is not None:
        if not isinstance(text, str):
            raise BadRequest("text must be a string")
        input_ids = tokenizer.encode(text)
    else:
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise BadRequest("input_ids must be a list of integers")
        input_ids = list(ids)
    max_new = _int(sampling.get("max_new_tokens"), "max_new_tokens")
    return _common_fields(body, sampling, input_ids, max_new)


def parse_openai(body: Mapping[str, Any], chat: bool) -> ParsedRequest:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise BadRequest("input_ids must be a list of integers")
            input_ids = list(ids)
        else:
            if not all(isinstance(m, dict) for m in messages):
                raise BadRequest("each message must be an object")
            input_ids = tokenizer.encode(tokenizer.render_chat(messages))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            input_ids = tokenizer.encode(prompt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            input_ids = list(prompt)
        elif isinstance(prompt, list):
            raise BadRequest("Batch prompts are not supported by the simulator.", validation=False)
        else:
            raise BadRequest("prompt must be a string or a list of token ids")
    max_new = _int(body.get("max_completion_tokens"), "max_completion_tokens")
    if max_new is None:
        max_new = _int(body.get("max_tokens"), "max_tokens")
    sampling: dict[str, Any] = {
        "n": body.get("n"),
        "stop_token_ids": body.get("stop_token_ids"),
        "ignore_eos": body.get("ignore_eos", False),
        "custom_params": body.get("custom_params"),
    }
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise BadRequest("stream_options must be an object")
    return _common_fields(body, sampling, input_ids, max_new)


def fake_logprob(token_id: int) -> float:
    """A deterministic stand-in log-probability (the simulator samples nothing)."""
    return -0.01 - (token_id % 997) / 1000.0


def meta_info(
    sched: Scheduler,
    req: SimRequest,
    n_out: int,
    finish: dict[str, Any] | None,
    ids: list[int] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": finish,
        "prompt_tokens": req.prompt_tokens,
        "weight_version": "default",
        "num_retractions": req.num_retractions,
        "reasoning_tokens": 0,
        "completion_tokens": n_out,
        "cached_tokens": req.cached_tokens,
    }
    if ids is not None:
        # return_logprob: [logprob, token_id, text] triples, cumulative like the text.
        meta["output_token_logprobs"] = [[fake_logprob(t), t, None] for t in ids]
        meta["input_token_logprobs"] = []
    if finish is not None and req.finish_time is not None:
        meta["e2e_latency"] = round(req.finish_time - req.arrival, 6)
    return meta


# ----------------------------------------------------------------------------- middleware


DATA_PLANE = frozenset({"/generate", "/v1/chat/completions", "/v1/completions"})
HEALTH = frozenset({"/health", "/health_generate"})


@web.middleware
async def fault_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    st = request.app[SIM_STATE]
    f = st.faults
    path = request.path
    if path in DATA_PLANE or path in HEALTH or path == "/metrics":
        if f.status_503 and path != "/metrics":
            return _error("Service Unavailable (simulated fault)", 503)
        if f.latency_s > 0 and path != "/health":
            await asyncio.sleep(f.latency_s)
    if st.recorded is not None and path in DATA_PLANE | {"/close_session", "/abort_request"}:
        st.recorded.append(
            {
                "path": path,
                "method": request.method,
                "headers": {str(k): v for k, v in request.headers.items()},
                "body": (await request.read()).decode("utf-8", "replace"),
            }
        )
    try:
        return await handler(request)
    except BadRequest as e:
        return _validation_error(e.message) if e.validation else _error(e.message)


# ----------------------------------------------------------------------------- generation


async def _submit(st: SimState, body: Mapping[str, Any], p: ParsedRequest) -> tuple[Rank, Waiter]:
    session = p.session_id
    if session is None and p.session_params is not None:
        session = str(p.session_params.get("id")) if p.session_params.get("id") else None
    rank = st.pick_rank(body, session)
    if rank.stopped:
        raise SimError("The engine's scheduler loop has stopped.", 503)
    if p.rid in rank.waiters or st.find(p.rid) is not None:
        raise SimError(f"Duplicate request ID: {p.rid}")
    req = SimRequest(
        rid=p.rid,
        input_ids=p.input_ids,
        max_new_tokens=p.max_new_tokens,
        priority=p.priority,
        session_id=p.session_id,
        stream=p.stream,
    )
    rank.sched.submit(
        req,
        rank.now(),
        session_params=p.session_params,
        output_len=p.output_len,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
    )
    w = Waiter(req, progress=asyncio.Event() if p.stream else None)
    rank.waiters[p.rid] = w
    if p.stream:
        rank.streams[p.rid] = w
    rank.wake.set()
    return rank, w


def _cancel(rank: Rank, w: Waiter) -> None:
    """Abort a request whose client went away (SGLang aborts on disconnect)."""
    if not w.req.finished:
        done = rank.sched.abort(w.req.rid, rank.now(), exact=True)
        rank.notify(done)
        rank.wake.set()


def _forget(rank: Rank, w: Waiter) -> None:
    if rank.waiters.get(w.req.rid) is w:
        del rank.waiters[w.req.rid]
    if rank.streams.get(w.req.rid) is w:
        del rank.streams[w.req.rid]


async def _wait_done(rank: Rank, w: Waiter) -> None:
    try:
        await w.done.wait()
    except asyncio.CancelledError:
        _cancel(rank, w)
        raise
    finally:
        _forget(rank, w)


async def _stream(
    request: web.Request,
    rank: Rank,
    w: Waiter,
    make_chunks: Any,
) -> web.StreamResponse:
    """Drive an SSE response: ``make_chunks(n_out, finished)`` returns the chunks to send."""
    st = request.app[SIM_STATE]
    resp = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
    )
    sent_chunks = 0
    try:
        await resp.prepare(request)
        assert w.progress is not None
        last = -1
        while True:
            await w.progress.wait()
            w.progress.clear()
            if rank.stopped and not w.req.finished:
                return resp  # no [DONE]: the client sees a truncated stream, as on a crash
            finished = w.req.finished
            n = rank.sched.output_len(w.req)
            if n == last and not finished:
                continue
            last = n
            for chunk in make_chunks(n, finished):
                drop_after = st.faults.drop_stream_after_chunks
                if drop_after is not None and sent_chunks >= drop_after:
                    _cancel(rank, w)
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                sent_chunks += 1
            if finished:
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        _cancel(rank, w)  # the client went away mid-stream
    except asyncio.CancelledError:
        _cancel(rank, w)
        raise
    finally:
        _forget(rank, w)
    return resp


async def _stream_error(request: web.Request, message: str) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    err = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }
    await resp.write(b"data: " + orjson.dumps(err) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def handle_generate(request: web.Request) -> web.StreamResponse:
    st = request.app[SIM_STATE]
    body = await _read_json(request)
    p = parse_generate(body)
    try:
        rank, w = await _submit(st, body, p)
    except SimError as e:
        if p.stream:
            return await _stream_error(request, e.message)
        return _error(e.message, e.status)
    sched = rank.sched
    req = w.req
    logprobs = bool(body.get("return_logprob"))

    if not p.stream:
        await _wait_done(rank, w)
        if not req.finished:
            return _error("The engine stopped before the request finished.", 500)
        ids = sched.output_ids(req)
        return _json(
            {
                "text": tokenizer.decode(ids),
                "output_ids": ids,
                "meta_info": meta_info(
                    sched, req, len(ids), req.finish_reason, ids if logprobs else None
                ),
            }
        )

    def chunks(n: int, finished: bool) -> list[dict[str, Any]]:
        ids = req.out.ids(n) if req.out is not None else []
        finish = req.finish_reason if finished else None
        return [
            {
                "text": tokenizer.decode(ids),
                "output_ids": ids,
                "meta_info": meta_info(sched, req, n, finish, ids if logprobs else None),
            }
        ]

    return await _stream(request, rank, w, chunks)


def _openai_finish(reason: dict[str, Any] | None) -> tuple[str | None, Any]:
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind == "stop":
        return "stop", reason.get("matched")
    if kind == "length":
        return "length", None
    return "abort", None


def _usage(req: SimRequest, n_out: int) -> dict[str, Any]:
    return {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": n_out,
        "total_tokens": req.prompt_tokens + n_out,
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        "reasoning_tokens": 0,
    }


def _openai_whole(
    rank: Rank, req: SimRequest, *, chat: bool, obj: str, created: int, model: Any
) -> web.Response:
    """The non-streamed OpenAI response of a request that is done."""
    if not req.finished:
        return _error("The engine stopped before the request finished.", 500)
    ids = rank.sched.output_ids(req)
    text = tokenizer.decode(ids)
    finish, matched = _openai_finish(req.finish_reason)
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {
            "role": "assistant",
            "content": text,
            "reasoning_content": None,
            "tool_calls": None,
        }
    else:
        choice["text"] = text
    choice.update({"logprobs": None, "finish_reason": finish, "matched_stop": matched})
    return _json(
        {
            "id": req.rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(req, len(ids)),
            "metadata": {"weight_version": "default"},
        }
    )


async def _handle_openai(request: web.Request, chat: bool) -> web.StreamResponse:
    st = request.app[SIM_STATE]
    body = await _read_json(request)
    p = parse_openai(body, chat)
    model = body.get("model") if isinstance(body.get("model"), str) else st.cfg.model_name
    try:
        rank, w = await _submit(st, body, p)
    except SimError as e:
        if p.stream:
            return await _stream_error(request, e.message)
        return _error(e.message, e.status)
    req = w.req
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"

    if not p.stream:
        await _wait_done(rank, w)
        return _openai_whole(rank, req, chat=chat, obj=obj, created=created, model=model)

    chunk_obj = "chat.completion.chunk" if chat else "text_completion"
    opts = body.get("stream_options") or {}
    include_usage = bool(opts.get("include_usage"))
    state: dict[str, Any] = {"sent_text": "", "role_sent": False}

    def chunk(delta_text: str | None, finish: str | None, matched: Any) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0}
        if chat:
            c["delta"] = {"content": delta_text} if delta_text is not None else {}
        else:
            c["text"] = delta_text or ""
        c.update({"logprobs": None, "finish_reason": finish, "matched_stop": matched})
        return {
            "id": req.rid,
            "object": chunk_obj,
            "created": created,
            "model": model,
            "choices": [c],
            "usage": None,
        }

    def chunks(n: int, finished: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if chat and not state["role_sent"]:
            # SGLang opens a chat stream with a role-only chunk.
            state["role_sent"] = True
            first = chunk(None, None, None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            out.append(first)
        text = tokenizer.decode(req.out.ids(n)) if req.out is not None else ""
        delta = text[len(state["sent_text"]) :]
        state["sent_text"] = text
        if delta or not finished:
            out.append(chunk(delta, None, None))
        if finished:
            finish, matched = _openai_finish(req.finish_reason)
            out.append(chunk(None if chat else "", finish, matched))
            if include_usage:
                out.append(
                    {
                        "id": req.rid,
                        "object": chunk_obj,
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": _usage(req, n),
                    }
                )
        return out

    return await _stream(request, rank, w, chunks)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _handle_openai(request, chat=True)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _handle_openai(request, chat=False)


# ----------------------------------------------------------------------------- control plane


async def handle_open_session(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    body = await _read_json(request)
    cap = body.get("capacity_of_str_len")
    if cap is None or _int(cap, "capacity_of_str_len") is None:
        raise BadRequest("Field required: capacity_of_str_len")
    sid = _str(body.get("session_id"), "session_id") or uuid.uuid4().hex
    streaming = bool(body.get("streaming") or False)
    timeout = body.get("timeout")
    if timeout is not None and not isinstance(timeout, int | float):
        raise BadRequest("timeout must be a number")
    rank = st.pick_rank(body, sid)
    for r in st.ranks:
        s = r.sched
        if sid in s.streaming_sessions or sid in s.legacy_sessions:
            return _error(
                "Failed to open the session. Check if a session with the same id is still open."
            )
    try:
        rank.sched.open_session(sid, rank.now(), streaming=streaming, timeout_s=timeout)
    except SimError as e:
        return _error(e.message, e.status)
    rank.wake.set()  # the loop recomputes the idle-timeout deadline
    return _json(sid)


async def handle_close_session(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    body = await _read_json(request)
    sid = _str(body.get("session_id"), "session_id")
    if sid is None:
        raise BadRequest("Field required: session_id")
    for rank in st.ranks:
        rank.sched.close_session(sid, rank.now())
        rank.wake.set()
    return web.Response(status=200)


async def handle_abort(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    body = await _read_json(request)
    rid = _str(body.get("rid"), "rid") or ""
    abort_all = bool(body.get("abort_all", False))
    for rank in st.ranks:
        done = rank.sched.abort(rid, rank.now(), abort_all=abort_all)
        rank.notify(done)
        rank.wake.set()
    return web.Response(status=200)


async def handle_flush_cache(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    for rank in st.ranks:
        rank.sched.flush_cache()
    return web.Response(
        text="Cache flushed.\nPlease check backend logs for more details. (When there are "
        "running or waiting requests, the operation will not be performed.)\n"
    )


async def handle_health(request: web.Request) -> web.Response:
    if any(r.stopped for r in request.app[SIM_STATE].ranks):
        return web.Response(status=503, text="scheduler loop stopped\n")
    return web.Response(status=200)


def server_info(st: SimState, request: web.Request | None = None) -> dict[str, Any]:
    cfg = st.cfg
    c = cfg.cost
    return {
        "model_path": st.model_path,
        "tokenizer_path": st.model_path,
        "served_model_name": cfg.model_name,
        "host": cfg.host,
        "port": cfg.port,
        "tp_size": cfg.tp_size,
        "dp_size": cfg.dp_size,
        "pp_size": 1,
        "ep_size": 1,
        "max_total_num_tokens": cfg.max_total_tokens,
        "max_running_requests": cfg.max_running_requests,
        "max_prefill_tokens": cfg.max_prefill_tokens,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "context_length": cfg.context_length,
        "page_size": 1,
        "schedule_policy": "fcfs",
        "enable_session_radix_cache": cfg.mode == "session-radix",
        "enable_streaming_session": cfg.mode == "streaming",
        "radix_eviction_policy": cfg.eviction_policy,
        "enable_priority_scheduling": cfg.enable_priority_scheduling,
        "priority_scheduling_preemption_threshold": cfg.priority_scheduling_preemption_threshold,
        "disable_radix_cache": False,
        "enable_metrics": True,
        "enable_cache_report": True,
        "load_balance_method": "round_robin",
        "disaggregation_mode": "null",
        "is_embedding": False,
        "skip_tokenizer_init": False,
        "version": SGLANG_VERSION,
        "internal_states": [
            {
                "last_gen_throughput": r.sched.stats.gen_throughput,
                "memory_usage": {"token_capacity": cfg.max_total_tokens},
                "dp_rank": r.index,
            }
            for r in st.ranks
        ],
        "kvproxy_sim": {
            "mode": cfg.mode,
            "time_scale": cfg.time_scale,
            # The cost model: preset, kind, token_scale and every constant (unit in the key).
            "cost_model": c.preset,
            **c.to_dict(),
            # The legacy model's constant names (equal to t0/tau_lin/decode_a/decode_b).
            "prefill_base_s": c.prefill_base_s,
            "prefill_per_token_s": c.prefill_per_token_s,
            "decode_base_s": c.decode_base_s,
            "decode_per_req_s": c.decode_per_req_s,
            "output_len_dist": cfg.output_len_dist,
            "radix_eviction_policy": cfg.eviction_policy,
            "enable_priority_scheduling": cfg.enable_priority_scheduling,
            "priority_scheduling_preemption_threshold": (
                cfg.priority_scheduling_preemption_threshold
            ),
            "retract_decode_steps": cfg.retract_decode_steps,
            "new_token_ratio_decay_steps": cfg.new_token_ratio_decay_steps,
            "clip_max_new_tokens": cfg.clip_max_new_tokens,
            # Wall-clock lateness per DP rank (never folded into simulated time).
            "clock": [{"dp_rank": r.index, **r.clock_stats()} for r in st.ranks],
        },
    }


async def handle_server_info(request: web.Request) -> web.Response:
    return _json(server_info(request.app[SIM_STATE], request))


async def handle_model_info(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    return _json(
        {
            "model_path": st.model_path,
            "tokenizer_path": st.model_path,
            "served_model_name": st.cfg.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
        }
    )


async def handle_models(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    name = st.cfg.model_name
    return _json(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": st.created,
                    "owned_by": "sglang",
                    "root": name,
                    "max_model_len": st.cfg.context_length,
                }
            ],
        }
    )


async def handle_loads(request: web.Request) -> web.Response:
    """``GET /v1/loads`` (SGLang >= 0.5.10), the per-DP-rank load report a router polls."""
    st = request.app[SIM_STATE]
    loads = []
    for r in st.ranks:
        s = r.sched
        kv = s.kv
        used = kv.max_total_tokens - kv.available - kv.evictable
        loads.append(
            {
                "dp_rank": r.index,
                "num_running_reqs": len(s.running),
                "num_waiting_reqs": s.num_waiting,
                "num_total_reqs": len(s.requests),
                "num_used_tokens": used,
                "max_total_num_tokens": kv.max_total_tokens,
                "token_usage": s.token_usage(),
                "gen_throughput": s.stats.gen_throughput,
                "cache_hit_rate": s.stats.cache_hit_rate,
                "utilization": round(used / kv.max_total_tokens, 4),
                "max_running_requests": st.cfg.max_running_requests,
                # Upper bound: prompt tokens of queued requests, before prefix matching.
                "num_waiting_uncached_tokens": sum(
                    q.prompt_tokens + q.generated
                    for q in s.requests.values()
                    if q.state is State.WAITING
                ),
                # Nominal sizes of the modelled GPU: an 8B bf16 model, 128 KiB of KV per token.
                "memory": {
                    "weight_gb": 16.0,
                    "kv_cache_gb": round(kv.max_total_tokens * 131072 / 1e9, 3),
                    "graph_gb": 0.5,
                    "token_capacity": kv.max_total_tokens,
                },
            }
        )
    return _json(
        {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "version": SGLANG_VERSION,
            "dp_rank_count": len(st.ranks),
            "loads": loads,
        }
    )


async def handle_metrics(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    mode = st.faults.metrics
    if mode == "error":
        return web.Response(status=500, text="Internal Server Error (simulated fault)\n")
    if mode == "garbage":
        return web.Response(text=GARBAGE_METRICS, content_type="text/plain")
    text = render_metrics(
        st.metrics_ctx, [r.sched for r in st.ranks], st.cfg.context_length, st.faults.token_usage
    )
    return web.Response(
        body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


# ----------------------------------------------------------------------------- admin


def faults_json(f: FaultConfig) -> dict[str, Any]:
    return dataclasses.asdict(f)


async def handle_get_faults(request: web.Request) -> web.Response:
    return _json(faults_json(request.app[SIM_STATE].faults))


async def handle_set_faults(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    body = await _read_json(request)
    if body.pop("reset", False) is True:  # back to the faults the engine started with
        st.faults = st.cfg.faults
    allowed = {f.name for f in dataclasses.fields(FaultConfig)}
    unknown = set(body) - allowed
    if unknown:
        raise BadRequest(f"unknown fault knobs: {sorted(unknown)}; allowed: {sorted(allowed)}")
    try:
        new = dataclasses.replace(st.faults, **body)
        validate_faults(new)
        if not isinstance(new.status_503, bool):
            raise ValueError("status_503 must be a boolean")
        if not isinstance(new.latency_s, int | float):
            raise ValueError("latency_s must be a number")
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from None
    st.faults = new
    return _json(faults_json(new))


async def handle_requests(request: web.Request) -> web.Response:
    """The recorded requests, oldest first (empty unless started with --record-requests)."""
    st = request.app[SIM_STATE]
    return _json({"requests": list(st.recorded or ())})


async def handle_state(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    ranks = []
    for r in st.ranks:
        snap = r.sched.snapshot()
        snap["dp_rank"] = r.index
        snap["loop_steps"] = r.steps
        snap.update(r.clock_stats())
        ranks.append(snap)
    return _json({"mode": st.cfg.mode, "faults": faults_json(st.faults), "ranks": ranks})


# ----------------------------------------------------------------------------- app


async def _scheduler_loops(app: web.Application) -> AsyncIterator[None]:
    st = app[SIM_STATE]
    st.tasks = [
        asyncio.create_task(r.run(), name=f"kvproxy-sim-scheduler-dp{r.index}") for r in st.ranks
    ]
    yield
    for t in st.tasks:
        t.cancel()
    for t in st.tasks:
        # A crashed loop has logged its exception already.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
    # Unblock any handler still waiting (the server is going away).
    for r in st.ranks:
        r.release_all()


def create_sim_app(cfg: SimConfig) -> web.Application:
    """The simulated engine as an aiohttp application (run it, or use it in tests)."""
    app = web.Application(middlewares=[fault_middleware], client_max_size=256 * 1024 * 1024)
    app[SIM_STATE] = SimState(cfg)
    app.cleanup_ctx.append(_scheduler_loops)
    r = app.router
    r.add_post("/generate", handle_generate)
    r.add_post("/v1/chat/completions", handle_chat)
    r.add_post("/v1/completions", handle_completions)
    for path, handler in (
        ("/open_session", handle_open_session),
        ("/close_session", handle_close_session),
    ):
        r.add_get(path, handler)
        r.add_post(path, handler)
    r.add_post("/abort_request", handle_abort)
    r.add_post("/flush_cache", handle_flush_cache)
    for path in ("/health", "/health_generate"):
        r.add_get(path, handle_health)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, handle_server_info)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, handle_model_info)
    r.add_get("/v1/models", handle_models)
    r.add_get("/v1/loads", handle_loads)
    r.add_get("/metrics", handle_metrics)
    r.add_get("/sim/faults", handle_get_faults)
    r.add_post("/sim/faults", handle_set_faults)
    r.add_get("/sim/state", handle_state)
    r.add_get("/sim/requests", handle_requests)
    return app
