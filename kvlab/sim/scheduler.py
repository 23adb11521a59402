"""Continuous-batching scheduler of the simulated engine (one DP rank).

Pure Python, no asyncio, no I/O; time is injected (simulated seconds). The shell
(``kvlab.sim.rank.Rank``, one loop per DP rank) drives it with two calls per step::

    batch = sched.schedule(now)          # decide the next batch, allocate its KV
    now += batch.duration                # the shell sleeps duration * time_scale
    events = sched.finish_batch(batch, now)

and a benchmark can drive the same loop with a fake clock.

The model follows SGLang's ``Scheduler`` (non-overlap event loop):

* Each step runs either a prefill batch or a decode batch; a prefill batch is
  formed whenever a waiting request can be admitted (prefill first, no mixed
  batches), otherwise the running batch decodes one token per request.
* Admission (``PrefillAdder``): FCFS (or by priority with priority scheduling);
  head-of-line blocking. A request is admitted if
  ``extend + min(max_new_tokens - generated, clip) <= available + evictable -
  reserved``, where ``reserved`` is ``new_token_ratio`` x the tokens the running
  requests may still generate. ``new_token_ratio`` starts at 0.7, decays to
  0.098 over 600 decode steps and jumps up after a retraction.
* Prefix matching is capped at ``len(prompt) - 1``, so at least one token is
  always computed. The prefill batch has a token budget (chunked_prefill_size, or
  max_prefill_tokens without chunking); a longer prompt is split into chunks.
* After its prefill the prompt's KV goes into the radix tree (still locked by the
  request, so concurrent requests share it); the prefill yields the first output
  token. Decode step k allocates one slot per running request. At the end the
  KV of ``prompt + output[:-1]`` is inserted and unlocked (evictable cache).
* When a decode step cannot get one slot per request even after evicting, the
  scheduler retracts requests (fewest output tokens first, longest prompt on a
  tie) until ``retract_decode_steps`` steps fit; a retracted request's private
  KV is freed, its cached prefix stays in the tree unlocked, and it re-queues and
  later re-prefills its prompt plus the tokens it had generated.
* With priority scheduling, a waiting request may preempt running ones when the
  batch is at max_running_requests (``_preempt_for``, SGLang's
  ``preempt_to_schedule``).
* Step durations come from ``cfg.cost`` (``kvlab.sim.cost``): a prefill batch
  passes (new tokens, tokens already in KV) per request, a decode step the batch
  size and the running requests' total context.
* Decode bookkeeping is O(1) per step: a request's output length is derived
  from a global decode-step counter, and finishing requests come off a heap.
"""

from __future__ import annotations

import heapq
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvlab.sim.config import SchedulerConfig
from kvlab.sim.hicache import HiKVCache
from kvlab.sim.histogram import E2E_BUCKETS, TTFT_BUCKETS, Histogram
from kvlab.sim.kvcache import KVCache, MatchResult, Node
from kvlab.sim.tokenizer import EOS_TOKEN_ID, OutputStream, rid_seed

CLOSED_SESSION_TOMBSTONES = 8192
GEN_THROUGHPUT_LOG_STEPS = 40  # SGLang's default --decode-log-interval


class SimError(Exception):
    """A request SGLang would reject with HTTP ``status`` and this message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class State(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class SimRequest:
    rid: str
    input_ids: list[int]  # the full prompt as the engine sees it
    max_new_tokens: int = 128
    # None: not given. SGLang then uses 0 without priority scheduling and the lowest
    # possible value with it (Scheduler._set_or_validate_priority); see submit().
    priority: int | None = 0
    session_id: str | None = None  # top-level session id (session radix cache)
    stream: bool = False
    # Runtime, owned by the scheduler.
    prompt_tokens: int = 0  # reported prompt_tokens (== len(input_ids))
    target_len: int = 0
    stop_token: int | None = None
    out: OutputStream | None = None
    state: State = State.WAITING
    seq: int = 0
    qkey: tuple[int, int] = (0, 0)
    arrival: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    generated: int = 0  # valid unless state is DECODE (use Scheduler.output_len)
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # the part of cached_tokens loaded back from the host
    node: Node | None = None  # locked tree node (end of the request's cached prefix)
    tree_len: int = 0  # tokens of the sequence held by the tree path up to ``node``
    private: int = 0  # KV slots owned by the request outside the tree
    fill_len: int = 0  # tokens of the sequence to prefill in the current admission
    extend_len: int = 0
    prefill_done: int = 0
    g0: int = 0
    gen_base: int = 0
    epoch: int = 0
    abort_pending: str | None = None
    finish_reason: dict[str, Any] | None = None
    num_retractions: int = 0
    generation: int | None = None  # session-radix generation at arrival
    stream_session: StreamingSession | None = None
    session_base_len: int = 0
    legacy_session: LegacySession | None = None

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED


@dataclass(eq=False, slots=True)
class StreamingSession:
    sid: str
    timeout_s: float | None
    last_active: float
    context: list[int] = field(default_factory=list)
    node: Node | None = None  # locked radix prefix (shared system prompt etc.)
    tree_len: int = 0
    held: int = 0  # private KV slots held between turns
    active: SimRequest | None = None
    close_pending: bool = False


@dataclass(eq=False, slots=True)
class LegacySession:
    sid: str
    context: list[int] = field(default_factory=list)
    active: int = 0


@dataclass(slots=True)
class Batch:
    kind: str  # "prefill" | "decode"
    duration: float
    size: int  # prefill: requests; decode: running batch size
    tokens: int = 0  # tokens computed (decode: one per request)
    reqs: list[SimRequest] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    hit_tokens: int = 0
    # Prefill: (new tokens, tokens already in KV) per request, as the cost model saw them.
    items: list[tuple[int, int]] = field(default_factory=list)
    # Decode: total context of the running requests (the cost model's S).
    context_tokens: int = 0
    # HiCache: tokens loaded back from the host for this prefill, and the stall
    # (write-back copies) charged to the step; both 0 without HiCache.
    load_tokens: int = 0
    stall_s: float = 0.0
    # Mixed chunk: running requests decoded in this prefill step (0: none).
    mixed: int = 0


@dataclass(slots=True)
class StepEvents:
    finished: list[SimRequest] = field(default_factory=list)
    first_tokens: list[SimRequest] = field(default_factory=list)


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


class Scheduler:
    def __init__(self, config: SchedulerConfig, now: float = 0.0) -> None:
        self.cfg = config
        session_refs = config.mode == "session-radix"
        # HiCache (SGLang's HiRadixCache) when configured, else the plain radix cache.
        self.hi: HiKVCache | None = None
        if config.hicache is not None:
            self.hi = HiKVCache(
                config.max_total_tokens, config.hicache, config.eviction_policy, session_refs
            )
            self.kv: KVCache = self.hi
        else:
            self.kv = KVCache(config.max_total_tokens, config.eviction_policy, session_refs)
        self._match: MatchResult | None = None  # the last admission match (HiCache)
        self.stats = SchedulerStats()
        self.now = now
        self.requests: dict[str, SimRequest] = {}  # every unfinished request
        self.running: dict[str, SimRequest] = {}  # DECODE
        self._waiting: list[tuple[tuple[int, int], int, SimRequest]] = []
        self.num_waiting = 0
        self._prefilling: set[SimRequest] = set()  # PREFILL (admitted, not decoding yet)
        self.chunked: SimRequest | None = None
        self._inflight: Batch | None = None
        self._seq = 0
        self._decode_ct = 0  # global decode step counter (G)
        self._decode_reserved = 0
        self._finish_heap: list[tuple[int, int, int, SimRequest]] = []
        self._sum_clip = 0  # sum of min(max_new, clip) over running
        self._sum_base = 0  # sum of (gen_base - g0) over running
        self._sum_prompt = 0  # sum of prompt_tokens over running (decode context S)
        self._preemption = config.enable_priority_scheduling
        self.init_ratio = min(config.init_new_token_ratio, 1.0)
        self.min_ratio = min(self.init_ratio * config.min_new_token_ratio_factor, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / max(
            config.new_token_ratio_decay_steps, 1
        )
        self.new_token_ratio = self.init_ratio
        self._tp_window_start = now
        self._tp_window_tokens = 0
        self._tp_window_steps = 0
        # Sessions.
        self.streaming_sessions: dict[str, StreamingSession] = {}
        self.legacy_sessions: dict[str, LegacySession] = {}
        self._radix_generations: dict[str, int] = {}
        self._radix_closed: OrderedDict[str, None] = OrderedDict()
        self._generation_ct = 0
        # Requests finished inside schedule() (out-of-memory aborts); the shell drains it.
        self.finished_outside: list[SimRequest] = []
        self._next_reap = 0.0
        self._prefill_steps_unmixed = 0  # mixed chunk: prefill steps since one decoded

    # =============================================================== queries

    def output_len(self, req: SimRequest) -> int:
        if req.state is State.DECODE:
            return req.gen_base + self._decode_ct - req.g0
        return req.generated

    def _decode_private(self, req: SimRequest) -> int:
        # KV of prompt + output[:-1], minus what the tree holds for the request.
        return req.prompt_tokens + self.output_len(req) - 1 - req.tree_len

    def output_ids(self, req: SimRequest) -> list[int]:
        assert req.out is not None
        return req.out.ids(self.output_len(req))

    @property
    def busy(self) -> bool:
        return bool(self.running or self.num_waiting or self._prefilling)

    def private_tokens(self) -> int:
        """KV slots held outside the tree (running requests, sessions, reserved)."""
        total = self._decode_reserved
        for req in self.requests.values():
            if req.state is State.DECODE:
                total += self._decode_private(req)
            else:
                total += req.private
        for s in self.streaming_sessions.values():
            total += s.held
        return total

    def check_invariants(self) -> None:
        self.kv.check_invariants(self.private_tokens())

    def pool(self) -> dict[str, int]:
        kv = self.kv
        used = kv.max_total_tokens - kv.available - kv.evictable
        return {
            "max_total_num_tokens": kv.max_total_tokens,
            "available": kv.available,
            "evictable": kv.evictable,
            "protected": kv.protected,
            "used": used,
        }

    def token_usage(self) -> float:
        kv = self.kv
        return round((kv.max_total_tokens - kv.available - kv.evictable) / kv.max_total_tokens, 2)

    def streaming_held_tokens(self) -> int:
        return sum(s.held for s in self.streaming_sessions.values())

    def next_deadline(self) -> float | None:
        """Earliest simulated time at which an idle streaming session expires."""
        best: float | None = None
        for s in self.streaming_sessions.values():
            t = self._session_timeout(s)
            if t is not None and s.active is None:
                deadline = s.last_active + t
                if best is None or deadline < best:
                    best = deadline
        return None if best is None else max(best, self._next_reap)

    # ============================================================ submission

    def submit(
        self,
        req: SimRequest,
        now: float,
        *,
        session_params: dict[str, Any] | None = None,
        output_len: int | None = None,
        stop_token_ids: tuple[int, ...] = (),
        ignore_eos: bool = False,
    ) -> SimRequest:
        """Queue a request. Raises :class:`SimError` for what SGLang rejects."""
        self.now = now
        cfg = self.cfg
        if req.rid in self.requests:
            raise SimError(f"Duplicate request ID: {req.rid}")
        if session_params is not None:
            self._apply_session_params(req, session_params)
        n_in = len(req.input_ids)
        self._check_input(req, n_in)
        req.max_new_tokens = min(req.max_new_tokens, cfg.context_length - n_in)
        req.prompt_tokens = n_in
        self._plan_output(req, output_len, stop_token_ids, ignore_eos)
        if req.session_id is not None and cfg.mode == "session-radix":
            req.generation = self._ensure_generation(req.session_id)
        if req.priority is None:
            # Scheduler._set_or_validate_priority (managers/scheduler.py): with priority
            # scheduling a request without a priority gets the lowest value (larger is
            # scheduled first); without it the radix insert uses ``priority or 0``.
            req.priority = -sys.maxsize - 1 if cfg.enable_priority_scheduling else 0
        self._seq += 1
        req.seq = self._seq
        prio_key = -req.priority if cfg.enable_priority_scheduling else 0
        req.qkey = (prio_key, req.seq)
        req.arrival = now
        req.state = State.WAITING
        self.requests[req.rid] = req
        if req.stream_session is not None:
            req.stream_session.active = req
            req.stream_session.last_active = now
        if req.legacy_session is not None:
            req.legacy_session.active += 1
        self._enqueue(req)
        return req

    def _check_input(self, req: SimRequest, n_in: int) -> None:
        """What SGLang rejects about a request's size (raises :class:`SimError`)."""
        cfg = self.cfg
        if n_in == 0:
            raise SimError("The input is empty.")
        if n_in >= cfg.context_length:
            raise SimError(
                f"The input ({n_in} tokens) is longer than the model's context length "
                f"({cfg.context_length} tokens)."
            )
        if n_in + 1 > cfg.max_total_tokens:
            raise SimError(
                f"The input ({n_in} tokens) does not fit in the KV cache "
                f"(max_total_num_tokens={cfg.max_total_tokens})."
            )
        if req.max_new_tokens < 0:
            raise SimError("max_new_tokens must be at least 0")

    def _plan_output(
        self,
        req: SimRequest,
        output_len: int | None,
        stop_token_ids: tuple[int, ...],
        ignore_eos: bool,
    ) -> None:
        """Output length: max_new_tokens unless the workload asks for another one."""
        stop_token = stop_token_ids[0] if stop_token_ids else EOS_TOKEN_ID
        target = req.max_new_tokens
        if output_len is not None:
            target = max(0, min(int(output_len), req.max_new_tokens))
        elif self.cfg.output_len_dist == "uniform" and not ignore_eos and req.max_new_tokens > 0:
            target = 1 + rid_seed(req.rid) % req.max_new_tokens
        by_stop = 0 < target < req.max_new_tokens
        req.target_len = target
        req.stop_token = stop_token if by_stop else None
        req.out = OutputStream(req.rid, target if by_stop else None, stop_token)

    def _apply_session_params(self, req: SimRequest, params: dict[str, Any]) -> None:
        sid = params.get("id")
        if sid is None:
            return
        sid = str(sid)
        ss = self.streaming_sessions.get(sid)
        if ss is not None:
            if ss.close_pending:
                raise SimError(f"Invalid request: session id {sid} does not exist")
            if ss.active is not None:
                raise SimError("Streaming session already has an active request.")
            # Session.create_req (sglang/srt/session/session_controller.py): replace,
            # drop_previous_output and any non-zero offset (-1 included) are refused.
            if params.get("replace"):
                raise SimError("Streaming sessions do not support replace.")
            if params.get("drop_previous_output"):
                raise SimError("Streaming sessions do not support drop_previous_output.")
            if params.get("offset"):
                raise SimError("Streaming sessions do not support offset.")
            req.stream_session = ss
            req.session_base_len = len(ss.context)
            req.input_ids = ss.context + req.input_ids
            return
        ls = self.legacy_sessions.get(sid)
        if ls is None:
            raise SimError(f"Invalid request: session id {sid} does not exist")
        req.legacy_session = ls
        req.input_ids = ls.context + req.input_ids

    def _enqueue(self, req: SimRequest) -> None:
        heapq.heappush(self._waiting, (req.qkey, req.seq, req))
        self.num_waiting += 1

    # ============================================================== sessions

    def open_session(
        self, sid: str, now: float, *, streaming: bool = False, timeout_s: float | None = None
    ) -> str:
        if streaming and self.cfg.mode != "streaming":
            raise SimError(
                "Streaming sessions are disabled. Please relaunch with --enable-streaming-session."
            )
        if sid in self.streaming_sessions or sid in self.legacy_sessions:
            raise SimError(
                "Failed to open the session. Check if a session with the same id is still open."
            )
        if streaming:
            self.streaming_sessions[sid] = StreamingSession(sid, timeout_s, now)
        else:
            self.legacy_sessions[sid] = LegacySession(sid)
        return sid

    def close_session(self, sid: str, now: float) -> None:
        """Idempotent; an unknown id is a no-op."""
        self.now = now
        ss = self.streaming_sessions.get(sid)
        if ss is not None:
            if ss.active is not None:
                ss.close_pending = True  # deferred until the request finishes
            else:
                self._free_streaming_session(ss)
        self.legacy_sessions.pop(sid, None)
        if self.cfg.mode == "session-radix" and sid not in self._radix_closed:
            self._radix_closed[sid] = None
            while len(self._radix_closed) > CLOSED_SESSION_TOMBSTONES:
                self._radix_closed.popitem(last=False)
            self._radix_generations.pop(sid, None)
            self.kv.release_session(sid)

    def _free_streaming_session(self, ss: StreamingSession) -> None:
        if ss.node is not None:
            self.kv.dec_lock(ss.node)
            ss.node = None
        self.kv.free(ss.held)
        ss.held = 0
        ss.tree_len = 0
        self.streaming_sessions.pop(ss.sid, None)

    def _session_timeout(self, ss: StreamingSession) -> float | None:
        return ss.timeout_s if ss.timeout_s is not None else self.cfg.streaming_session_timeout_s

    def maybe_reap(self, now: float, interval: float = 1.0) -> int:
        """:meth:`reap` at most once per ``interval`` simulated seconds (as SGLang does)."""
        if now < self._next_reap or not self.streaming_sessions:
            return 0
        self._next_reap = now + interval
        return self.reap(now)

    def reap(self, now: float) -> int:
        """Close streaming sessions past their timeout; return how many.

        As SGLang's ``Session.is_timed_out`` / ``SessionController.maybe_reap``
        (``sglang/srt/session/session_controller.py``): the clock runs from the start of
        the session's last turn (``create_req``), and a session whose turn is still
        running is closed when that turn finishes (``close_on_finish``).
        """
        self.now = now
        expired = [
            s
            for s in self.streaming_sessions.values()
            if (t := self._session_timeout(s)) is not None and now - s.last_active >= t
        ]
        freed = 0
        for s in expired:
            if s.active is not None:
                s.close_pending = True
            else:
                self._free_streaming_session(s)
                freed += 1
        return freed

    def _ensure_generation(self, sid: str) -> int:
        gen = self._radix_generations.get(sid)
        if gen is None:
            self._radix_closed.pop(sid, None)  # a new request re-opens a closed id
            self._generation_ct += 1
            gen = self._generation_ct
            self._radix_generations[sid] = gen
        return gen

    def radix_sessions(self) -> list[str]:
        return sorted(self._radix_generations)

    # ================================================================ abort

    def abort(
        self, rid: str, now: float, *, abort_all: bool = False, exact: bool = False
    ) -> list[SimRequest]:
        """Abort live requests whose rid starts with ``rid`` (SGLang's prefix match).

        Returns the requests finished by this call. A request inside the batch
        that is being computed finishes when that batch completes.
        """
        self.now = now
        if abort_all:
            targets = list(self.requests.values())
        elif exact:
            r = self.requests.get(rid)
            targets = [r] if r is not None else []
        elif not rid:
            return []
        else:
            targets = [r for r in self.requests.values() if r.rid.startswith(rid)]
        done: list[SimRequest] = []
        inflight = set(self._inflight.reqs) if self._inflight is not None else set()
        for req in targets:
            if req.state is State.WAITING:
                req.epoch += 1
                self.num_waiting -= 1
                self._finish(req, _abort_reason("Abort in waiting queue"), insert=False)
                done.append(req)
            elif req.state is State.PREFILL:
                if req in inflight:
                    req.abort_pending = "Aborted"
                else:
                    self._prefilling.discard(req)
                    if self.chunked is req:
                        self.chunked = None
                    self._finish(req, _abort_reason("Aborted"), insert=False)
                    done.append(req)
            elif req.state is State.DECODE:
                self._leave_running(req)
                self._finish(req, _abort_reason("Aborted"), insert=True)
                done.append(req)
        return done

    # ============================================================ scheduling

    def schedule(self, now: float) -> Batch | None:
        """Pick the next batch (prefill first, else decode); None when idle."""
        if self._inflight is not None:
            raise RuntimeError("schedule() called while a batch is in flight")
        self.now = now
        batch = self._form_prefill(now)
        if batch is not None and self.cfg.enable_mixed_chunk and self.running:
            self._mix_decode(batch)
        if batch is None and self.running:
            batch = self._form_decode(now)
        if batch is not None and self.hi is not None and self.hi.stall_s:
            # Write-back eviction waits for its device -> host copies.
            batch.stall_s = self.hi.take_stall()
            batch.duration += batch.stall_s
        self._inflight = batch
        self.stats.evicted_tokens_total = self.kv.evicted_total
        return batch

    def _peek_waiting(self) -> SimRequest | None:
        w = self._waiting
        while w:
            req = w[0][2]
            if req.state is State.WAITING and w[0][0] == req.qkey:
                return req
            heapq.heappop(w)
        return None

    def _reserved_for_running(self) -> float:
        n = len(self.running)
        if not n:
            return 0.0
        remaining = self._sum_clip - (self._sum_base + n * self._decode_ct)
        return max(remaining, 0) * self.new_token_ratio

    def _form_prefill(self, now: float) -> Batch | None:
        cfg = self.cfg
        kv = self.kv
        if self.num_waiting == 0 and self.chunked is None:
            return None
        chunking = cfg.chunked_prefill_size > 0
        budget = cfg.chunked_prefill_size if chunking else cfg.max_prefill_tokens
        batch = Batch("prefill", 0.0, 0)
        ratio = self.new_token_ratio
        clip = cfg.clip_max_new_tokens

        if self.chunked is not None:
            budget -= self._continue_chunked(batch, budget)
            if self.chunked is not None:  # its next chunk fills the batch
                return self._close_prefill(batch)

        # Requests admitted earlier in this batch reserve their decode tokens too.
        reserved = self._reserved_for_running() + self._decode_reservation(batch.reqs)
        while budget > 0:
            waiting = self._peek_waiting()
            if waiting is None:
                break
            req = waiting
            freed = self._running_slot_for(req, reserved, now)
            if freed is None:
                break
            reserved -= freed
            fill_len = req.prompt_tokens + req.generated
            remaining_new = min(req.max_new_tokens - req.generated, clip)
            nothing_else = not self.running and not self._prefilling and not batch.reqs
            if not nothing_else and 1 + remaining_new > kv.available + kv.evictable - reserved:
                break  # even a full cache hit would not fit
            node, matched, own_lock = self._prefix_for(req, fill_len, now)
            node, matched = self._load_back(
                req, batch, node, matched, remaining_new, reserved, nothing_else
            )
            extend = fill_len - matched
            too_big = bool(batch.reqs) and not chunking and extend > budget
            if too_big or not self._alloc_prefill(extend, remaining_new, reserved, nothing_else):
                if own_lock:
                    kv.dec_lock(node)
                break
            self._start_prefill(req, node, matched, own_lock, fill_len, extend, now)
            chunk = min(extend, budget) if chunking else extend
            batch.reqs.append(req)
            batch.chunks.append(chunk)
            batch.hit_tokens += matched
            budget -= chunk
            reserved += remaining_new * ratio
            if chunk < extend:
                self.chunked = req
                break
        if not batch.reqs:
            return None
        return self._close_prefill(batch)

    def _decode_reservation(self, reqs: list[SimRequest]) -> float:
        """The decode tokens ``reqs`` reserve (clipped, times the new-token ratio)."""
        reserved = 0.0
        for r in reqs:
            reserved += min(r.max_new_tokens - r.generated, self.cfg.clip_max_new_tokens) * (
                self.new_token_ratio
            )
        return reserved

    def _continue_chunked(self, batch: Batch, budget: int) -> int:
        """Add the chunked request's next chunk to ``batch``; return the chunk's size.
        ``self.chunked`` is cleared when that chunk completes its prefill."""
        req = self.chunked
        assert req is not None
        chunk = min(req.extend_len - req.prefill_done, budget)
        batch.reqs.append(req)
        batch.chunks.append(chunk)
        if req.prefill_done + chunk >= req.extend_len:
            self.chunked = None
        return chunk

    def _running_slot_for(self, req: SimRequest, reserved: float, now: float) -> float | None:
        """0.0 when the running batch has room; when it is full, the reservation that
        preempting for ``req`` released, or None (no room)."""
        if len(self.running) + len(self._prefilling) < self.cfg.max_running_requests:
            return 0.0
        # The batch is full. With priority scheduling SGLang then tries to preempt
        # running requests for this one (managers/scheduler.py,
        # _get_new_batch_prefill_raw: batch_is_full -> adder.preempt_to_schedule).
        return self._preempt_for(req, reserved, now) if self._preemption else None

    def _alloc_prefill(
        self, extend: int, remaining_new: int, reserved: float, nothing_else: bool
    ) -> bool:
        """Allocate ``extend`` tokens if they and the decode reservation fit (alone: just them)."""
        return self._fits(extend, remaining_new, reserved, nothing_else) and self.kv.alloc(extend)

    def _fits(self, extend: int, remaining_new: int, reserved: float, nothing_else: bool) -> bool:
        kv = self.kv
        rem_total = kv.available + kv.evictable - reserved
        return extend + remaining_new <= rem_total or (
            nothing_else and extend <= kv.available + kv.evictable
        )

    def _prefix_for(self, req: SimRequest, fill_len: int, now: float) -> tuple[Node, int, bool]:
        """(node, matched tokens, whether the lock on node is the request's own)."""
        self._match = None
        ss = req.stream_session
        if ss is not None and ss.node is not None and ss.tree_len + ss.held >= 1:
            # O(1) restore of the session's held KV.
            return ss.node, min(ss.tree_len + ss.held, fill_len - 1), False
        kv = self.kv
        fill = req.input_ids if req.generated == 0 else self._fill_ids(req)
        m = kv.match_prefix(fill[: fill_len - 1], now)
        kv.inc_lock(m.node)
        self._match = m
        return m.node, m.length, True

    def _load_back(
        self,
        req: SimRequest,
        batch: Batch,
        node: Node,
        matched: int,
        remaining_new: int,
        reserved: float,
        nothing_else: bool,
    ) -> tuple[Node, int]:
        """HiCache: load the host part of the admission match back to the device
        (PrefillAdder.add_one_req -> init_load_back). Only when the request would fit
        with those tokens counted as new (SGLang checks ``extend_input_len``, host hits
        included, against the budget first). Returns the (node, matched) to use."""
        hi = self.hi
        if hi is None:
            return node, matched
        m = self._match
        self._match = None
        if m is None or m.host_node is None or m.node is not node:
            return node, matched
        fill_len = req.prompt_tokens + req.generated
        if not self._fits(fill_len - matched, remaining_new, reserved, nothing_else):
            return node, matched
        new = hi.load_back(m)
        if new is None:
            return node, matched
        hi.inc_lock(new)
        hi.dec_lock(node)
        batch.load_tokens += m.host_length
        req.host_cached_tokens += m.host_length
        return new, matched + m.host_length

    def _start_prefill(
        self,
        req: SimRequest,
        node: Node,
        matched: int,
        own_lock: bool,
        fill_len: int,
        extend: int,
        now: float,
    ) -> None:
        """Move the head of the waiting queue into prefill with ``extend`` new KV tokens."""
        heapq.heappop(self._waiting)
        self.num_waiting -= 1
        if req.first_token_time is None and req.num_retractions == 0:
            self.stats.queue_time.observe(now - req.arrival)
        req.state = State.PREFILL
        self._prefilling.add(req)
        ss = req.stream_session
        if ss is not None and not own_lock:
            # Take over the session's lock and held KV for this turn.
            req.node, req.tree_len = ss.node, ss.tree_len
            req.private += ss.held + extend
            ss.node, ss.tree_len, ss.held = None, 0, 0
        else:
            req.node, req.tree_len = node, matched
            req.private += extend
        req.cached_tokens += matched
        req.fill_len = fill_len
        req.extend_len = extend
        req.prefill_done = 0

    def _preempt_for(self, req: SimRequest, reserved: float, now: float) -> float | None:
        """Preempt running requests of lower priority so that ``req`` can be admitted.

        Checked against SGLang's ``PrefillAdder.preempt_to_schedule``
        (``python/sglang/srt/managers/schedule_policy.py``): running requests are taken
        lowest priority first (latest queued first on a tie) while the priority gap
        exceeds ``priority_scheduling_preemption_threshold`` (strictly), until their
        reserved decode tokens cover ``extend + min(max_new_tokens, clip) - rem_total``;
        the first one within the threshold stops the search. Nothing happens unless both
        conditions hold. Preempted requests release their KV (their cached prefix stays in
        the tree) and go back to the waiting queue, like a retraction. Returns the
        reservation released, or None when nothing was preempted.
        """
        cfg = self.cfg
        kv = self.kv
        clip = cfg.clip_max_new_tokens
        ratio = self.new_token_ratio
        assert req.priority is not None
        fill_len = req.prompt_tokens + req.generated
        fill = req.input_ids if req.generated == 0 else self._fill_ids(req)
        matched = kv.match_prefix(fill[: fill_len - 1], now).length
        deficit = (
            fill_len
            - matched
            + min(req.max_new_tokens, clip)
            - (kv.available + kv.evictable - reserved)
        )
        order = sorted(self.running.values(), key=lambda r: (r.priority, -r.arrival, -r.seq))
        chosen: list[SimRequest] = []
        released = 0.0
        for r in order:
            assert r.priority is not None
            if req.priority - r.priority > cfg.priority_scheduling_preemption_threshold:
                offset = min(r.max_new_tokens - self.output_len(r), clip) * ratio
                chosen.append(r)
                released += offset
                deficit -= offset
                if deficit <= 0:
                    break
            else:
                break
        if not chosen or deficit > 0:
            return None
        for r in chosen:
            self._requeue(r)
        self.stats.num_preempted_requests_total += len(chosen)
        return released

    def _requeue(self, req: SimRequest) -> None:
        """Take a running request off the batch, free its private KV, queue it again."""
        gen = self.output_len(req)
        self._leave_running(req)
        req.generated = gen
        self._release(req)
        if req.stream_session is not None:
            ss = req.stream_session
            ss.node, ss.tree_len, ss.held = None, 0, 0
        req.state = State.WAITING
        req.epoch += 1
        self._enqueue(req)

    def _close_prefill(self, batch: Batch) -> Batch:
        batch.size = len(batch.reqs)
        batch.tokens = sum(batch.chunks)
        # p = tokens already in KV: the cached prefix plus the chunks computed before.
        batch.items = [
            (chunk, r.fill_len - r.extend_len + r.prefill_done)
            for r, chunk in zip(batch.reqs, batch.chunks, strict=True)
        ]
        batch.duration = self.cfg.cost.prefill_s(batch.items)
        if batch.load_tokens:
            batch.duration = self._with_load(batch.duration, batch.load_tokens)
        total = batch.tokens + batch.hit_tokens
        if batch.hit_tokens or total:
            self.stats.cache_hit_rate = round(batch.hit_tokens / total, 4) if total else 0.0
        return batch

    def _with_load(self, compute_s: float, tokens: int) -> float:
        """A prefill step that also loads ``tokens`` back from the host. The load runs
        on its own stream, layer by layer, and layer i's attention waits for layer i's
        KV (HiCacheController's layer_done_counter), so with L layers the step takes
        ``max(compute + load / L, load + compute / L)``."""
        hc = self.cfg.hicache
        assert hc is not None
        load_s = hc.transfer_s(tokens)
        n = hc.num_layers
        return max(compute_s + load_s / n, load_s + compute_s / n)

    def _fill_ids(self, req: SimRequest) -> list[int]:
        assert req.out is not None
        return req.input_ids + req.out.ids(req.generated)

    def _form_decode(self, now: float) -> Batch | None:
        kv = self.kv
        n = len(self.running)
        if n > kv.available:
            kv.evict(n - kv.available)
        if n > kv.available:
            self._retract(now)
            n = len(self.running)
            if n == 0:
                return None
            if n > kv.available:
                kv.evict(n - kv.available)
            if n > kv.available:
                # A single request that no longer fits at all: abort it (SGLang
                # aborts what retraction cannot save).
                for req in list(self.running.values()):
                    self._leave_running(req)
                    self._finish(
                        req, _abort_reason("KV cache pool is full (out of memory)"), insert=True
                    )
                    self.finished_outside.append(req)
                return None
        kv.available -= n
        self._decode_reserved = n
        # S: every running request's context (prompt + output so far), O(1).
        ctx = self._sum_prompt + self._sum_base + n * self._decode_ct
        return Batch("decode", self.cfg.cost.decode_s(n, ctx), n, tokens=n, context_tokens=ctx)

    def _mix_decode(self, batch: Batch) -> None:
        """Mixed chunk: every ``mixed_decode_every``-th prefill step also decodes one
        token of every running request, when the pool has a slot for each without
        retracting (else the step stays a plain prefill), at the marginal cost of a
        decode step (its cost less the empty step's, the weights being read once)."""
        self._prefill_steps_unmixed += 1
        if self._prefill_steps_unmixed < self.cfg.mixed_decode_every:
            return
        kv = self.kv
        n = len(self.running)
        if n > kv.available:
            kv.evict(n - kv.available)
        if n > kv.available:
            return
        self._prefill_steps_unmixed = 0
        kv.available -= n
        self._decode_reserved = n
        ctx = self._sum_prompt + self._sum_base + n * self._decode_ct
        cost = self.cfg.cost
        batch.mixed = n
        batch.context_tokens = ctx
        batch.duration += cost.decode_s(n, ctx) - cost.decode_s(0, 0)

    def _retract(self, now: float) -> None:
        # Checked against SGLang's ScheduleBatch.retract_decode (the reference does not
        # describe it): sort by (output length, -prompt length), retract from the end
        # until num_running * retract_decode_steps slots are free (at least one, never the
        # last request), then re-estimate new_token_ratio.
        kv = self.kv
        steps = self.cfg.retract_decode_steps
        # Streaming-session requests go last: retracting them loses the session's KV.
        order = sorted(
            self.running.values(),
            key=lambda r: (
                r.stream_session is not None,
                self.output_len(r),
                -r.prompt_tokens,
            ),
            reverse=True,
        )
        retracted: list[SimRequest] = []
        first = True
        while order:
            need = len(order) * steps
            if kv.available < need:
                kv.evict(need - kv.available)
            if not first and kv.available >= need:
                break
            if len(order) == 1:
                break
            first = False
            req = order.pop()
            req.num_retractions += 1
            self._requeue(req)
            retracted.append(req)
        if retracted:
            self.stats.num_retracted_reqs = len(retracted)
            self.stats.num_retracted_requests_total += len(retracted)
            total_decoded = sum(self.output_len(r) for r in self.running.values())
            total_max_new = sum(r.max_new_tokens for r in self.running.values())
            if total_max_new:
                est = (total_decoded + steps * len(self.running)) / total_max_new
                self.new_token_ratio = min(1.0, est)

    def finish_batch(self, batch: Batch, now: float) -> StepEvents:
        """Apply the results of ``batch`` at simulated time ``now``."""
        if batch is not self._inflight:
            raise RuntimeError("finish_batch() for a batch that is not in flight")
        self._inflight = None
        self.now = now
        st = self.stats
        st.busy_time_s += batch.duration
        ev = StepEvents()
        if batch.kind == "decode":
            st.realtime_decode_tokens += batch.tokens
            self._finish_decode(batch, now, ev)
        else:
            if batch.mixed:
                # The running requests' tokens first: those finishing their prefill in
                # this step join the running set only after it.
                st.realtime_decode_tokens += batch.mixed
                self._finish_decode(batch, now, ev)
            st.realtime_prefill_compute_tokens += batch.tokens
            st.realtime_prefill_cache_tokens += batch.hit_tokens
            self._finish_prefill(batch, now, ev)
        st.evicted_tokens_total = self.kv.evicted_total
        return ev

    def _finish_prefill(self, batch: Batch, now: float, ev: StepEvents) -> None:
        kv = self.kv
        self.stats.prefill_batches += 1
        for req, chunk in zip(batch.reqs, batch.chunks, strict=True):
            if req.state is not State.PREFILL:
                continue
            req.prefill_done += chunk
            if req.abort_pending is not None:
                self._prefilling.discard(req)
                if self.chunked is req:
                    self.chunked = None
                self._finish(req, _abort_reason(req.abort_pending), insert=False)
                ev.finished.append(req)
                continue
            if req.prefill_done < req.extend_len:
                continue
            self._prefilling.discard(req)
            if req.stream_session is None:
                # cache_unfinished_req: the prompt's KV goes into the tree, still locked.
                fill = req.input_ids if req.generated == 0 else self._fill_ids(req)
                already, node = kv.insert(fill, now, req.priority or 0)
                dup = already - req.tree_len
                if dup > 0:
                    kv.free(dup)
                req.private -= req.fill_len - req.tree_len
                kv.inc_lock(node)
                if req.node is not None:
                    kv.dec_lock(req.node)
                req.node = node
                req.tree_len = req.fill_len
            if req.target_len == 0:
                self._finish(req, {"type": "length", "length": 0}, insert=True)
                ev.finished.append(req)
                continue
            req.generated += 1
            if req.first_token_time is None:
                req.first_token_time = now
                self.stats.ttft.observe(now - req.arrival)
                ev.first_tokens.append(req)
            if req.generated >= req.target_len:
                self._finish(req, self._natural_reason(req), insert=True)
                ev.finished.append(req)
                continue
            self._enter_running(req)

    def _finish_decode(self, batch: Batch, now: float, ev: StepEvents) -> None:
        self._decode_ct += 1
        n = len(self.running)
        # Slots reserved for requests aborted during the step go back to the pool.
        self.kv.free(self._decode_reserved - n)
        self._decode_reserved = 0
        # Each running request's reserved slot is now its KV (derived from _decode_ct).
        self.stats.decode_steps += 1
        self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        self._tp_window_tokens += n
        self._tp_window_steps += 1
        if self._tp_window_steps >= GEN_THROUGHPUT_LOG_STEPS:
            elapsed = now - self._tp_window_start
            if elapsed > 0:
                self.stats.gen_throughput = round(self._tp_window_tokens / elapsed, 2)
            self._tp_window_start = now
            self._tp_window_tokens = 0
            self._tp_window_steps = 0
        heap = self._finish_heap
        g = self._decode_ct
        while heap and heap[0][0] <= g:
            _, _, epoch, req = heapq.heappop(heap)
            if req.state is not State.DECODE or req.epoch != epoch:
                continue
            self._leave_running(req)
            self._finish(req, self._natural_reason(req), insert=True)
            ev.finished.append(req)

    def _enter_running(self, req: SimRequest) -> None:
        req.state = State.DECODE
        req.g0 = self._decode_ct
        req.gen_base = req.generated
        # While decoding, the private KV is derived from the step counter.
        assert req.private == self._decode_private(req), (req.rid, req.private)
        req.private = 0
        self.running[req.rid] = req
        self._sum_clip += min(req.max_new_tokens, self.cfg.clip_max_new_tokens)
        self._sum_base += req.gen_base - req.g0
        self._sum_prompt += req.prompt_tokens
        finish_at = req.g0 + req.target_len - req.gen_base
        heapq.heappush(self._finish_heap, (finish_at, req.seq, req.epoch, req))
        if self._tp_window_steps == 0 and not self._tp_window_tokens:
            self._tp_window_start = self.now

    def _leave_running(self, req: SimRequest) -> None:
        gen = self.output_len(req)
        del self.running[req.rid]
        self._sum_clip -= min(req.max_new_tokens, self.cfg.clip_max_new_tokens)
        self._sum_base -= req.gen_base - req.g0
        self._sum_prompt -= req.prompt_tokens
        req.generated = gen
        req.private = req.prompt_tokens + gen - 1 - req.tree_len
        req.state = State.PREFILL  # transient; the caller sets the final state
        req.epoch += 1

    def _natural_reason(self, req: SimRequest) -> dict[str, Any]:
        if req.stop_token is not None and req.generated >= req.target_len:
            return {"type": "stop", "matched": req.stop_token}
        return {"type": "length", "length": req.max_new_tokens}

    # ============================================================ finishing

    def _release(self, req: SimRequest) -> None:
        """Free the request's private KV and unlock its prefix (no insertion)."""
        if req.private:
            self.kv.free(req.private)
            req.private = 0
        if req.node is not None:
            self.kv.dec_lock(req.node)
            req.node = None
        req.tree_len = 0

    def _count_finished(self, req: SimRequest, *, aborted: bool) -> None:
        """The tokenizer-side counters of a finished request."""
        st = self.stats
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
            st.e2e_latency.observe(self.now - req.arrival)

    def _finish(self, req: SimRequest, reason: dict[str, Any], *, insert: bool) -> None:
        kv = self.kv
        ss = req.stream_session
        if req.state is State.PREFILL:
            self._prefilling.discard(req)
        kv_len = req.tree_len + req.private
        if ss is not None and insert and req.node is not None and not ss.close_pending:
            # The session keeps the turn's KV outside the tree.
            ss.node, ss.tree_len, ss.held = req.node, req.tree_len, req.private
            req.node, req.tree_len, req.private = None, 0, 0
        elif insert and req.node is not None and req.private >= 0 and kv_len > req.tree_len:
            assert req.out is not None
            seq = req.input_ids + req.out.ids(req.generated)
            ids = seq[:kv_len]
            already, node = kv.insert(ids, now=self.now, priority=req.priority or 0)
            dup = already - req.tree_len
            if dup > 0:
                kv.free(dup)
            req.private = 0
            kv.inc_lock(node)
            kv.dec_lock(req.node)
            req.node = node
            req.tree_len = kv_len
            self._maybe_tag_session(req, node, reason)
            kv.dec_lock(node)
            req.node = None
        else:
            if insert and req.node is not None:
                self._maybe_tag_session(req, req.node, reason)
            self._release(req)
        req.state = State.FINISHED
        req.finish_reason = reason
        req.finish_time = self.now
        self.requests.pop(req.rid, None)
        self._count_finished(req, aborted=reason.get("type") == "abort")
        if ss is not None:
            if ss.node is not None and req.out is not None:
                ss.context = req.input_ids + req.out.ids(req.generated)
            else:
                # The turn's KV was released: keep the context from before the turn;
                # the next turn re-prefills it (through the radix cache).
                ss.context = req.input_ids[: req.session_base_len]
            ss.active = None
            if ss.close_pending:
                self._free_streaming_session(ss)
        ls = req.legacy_session
        if ls is not None:
            ls.active -= 1
            if reason.get("type") != "abort" and req.out is not None:
                ls.context = req.input_ids + req.out.ids(req.generated)

    def _maybe_tag_session(self, req: SimRequest, node: Node, reason: dict[str, Any]) -> None:
        # Checked against SGLang's UnifiedSessionRefTracker.register_session_ref: only
        # requests that finish normally, of the session's current generation, tag it;
        # a closed id (tombstone) is never re-tagged by a late finish.
        sid = req.session_id
        if (
            sid is None
            or self.cfg.mode != "session-radix"
            or reason.get("type") == "abort"
            or sid in self._radix_closed
            or self._radix_generations.get(sid) != req.generation
        ):
            return
        self.kv.tag_session(node, sid)

    # ================================================================ admin

    def flush_cache(self) -> bool:
        """Drop the radix cache; only when no request is queued or running."""
        if self.requests:
            return False
        return self.kv.reset()

    def snapshot(self) -> dict[str, Any]:
        """JSON-able dump of the pool, queues and sessions (for ``/sim/state``)."""
        kv = self.kv
        waiting = sorted(
            (r for r in self.requests.values() if r.state is State.WAITING), key=lambda r: r.qkey
        )
        return {
            "pool": {
                **self.pool(),
                "tree_tokens": kv.tree_tokens,
                "tree_nodes": kv.num_nodes,
                "private": self.private_tokens(),
                "session_referenced_evictable": kv.referenced_evictable_tokens(),
                "streaming_held": self.streaming_held_tokens(),
                "token_usage": self.token_usage(),
                "evicted_total": kv.evicted_total,
            },
            "running": [r.rid for r in self.running.values()],
            "prefilling": sorted(r.rid for r in self._prefilling),
            "waiting": [r.rid for r in waiting],
            "new_token_ratio": round(self.new_token_ratio, 4),
            "decode_steps": self._decode_ct,
            "now": self.now,
            "sessions": {
                "radix_open": self.radix_sessions(),
                "radix_referenced": kv.referenced_sessions(),
                "radix_closed": len(self._radix_closed),
                "streaming": {
                    sid: {
                        "held": s.held,
                        "tree_len": s.tree_len,
                        "context_len": len(s.context),
                        "active": s.active.rid if s.active else None,
                        "close_pending": s.close_pending,
                    }
                    for sid, s in self.streaming_sessions.items()
                },
                "legacy": sorted(self.legacy_sessions),
            },
            "stats": {
                "num_requests_total": self.stats.num_requests_total,
                "num_aborted_requests_total": self.stats.num_aborted_requests_total,
                "num_retracted_requests_total": self.stats.num_retracted_requests_total,
                "prompt_tokens_total": self.stats.prompt_tokens_total,
                "cached_tokens_total": self.stats.cached_tokens_total,
                "generation_tokens_total": self.stats.generation_tokens_total,
            },
            **self._hicache_snapshot(),
        }

    def _hicache_snapshot(self) -> dict[str, Any]:
        hi = self.hi
        if hi is None:
            return {}
        return {
            "hicache": {
                "host_total_tokens": hi.host_total,
                "host_used_tokens": hi.host_used,
                "host_only_tokens": hi.host_only,
                "backed_up_total": hi.backed_up_total,
                "loaded_back_total": hi.loaded_back_total,
                "host_evicted_total": hi.host_evicted_total,
                "host_cached_tokens_total": self.stats.host_cached_tokens_total,
            }
        }


def _abort_reason(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}
