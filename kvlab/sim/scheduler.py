"""Continuous-batching scheduler of the simulated engine (one DP rank): the composition.

Pure Python, no asyncio, no I/O; time is injected (simulated seconds). The shell
(``kvlab.sim.rank.Rank``, one loop per DP rank) drives it with two calls per step::

    batch = sched.schedule(now)          # decide the next batch, allocate its KV
    now += batch.duration                # the shell sleeps duration * time_scale
    events = sched.finish_batch(batch, now)

and a benchmark can drive the same loop with a fake clock.

The model follows SGLang's ``Scheduler`` (non-overlap event loop): each step runs
either a prefill batch or a decode batch; a prefill batch is formed whenever a waiting
request can be admitted (prefill first), otherwise the running batch decodes one token
per request (with mixed chunk, some prefill steps decode too). Step durations come from
``cfg.cost`` (``kvlab.sim.cost``). The parts, one concern each:

* :mod:`kvlab.sim.records` -- requests, session records, batches, :class:`SimError`;
* :mod:`kvlab.sim.intake` -- what a new request may be, and its output length;
* :mod:`kvlab.sim.batching` -- the waiting queue and the running set (O(1) decode
  bookkeeping, ``new_token_ratio``);
* :mod:`kvlab.sim.prefill` -- admission (``PrefillAdder``), prefix matching, chunking,
  HiCache load-back, and what a finished prefill leaves in the radix tree;
* :mod:`kvlab.sim.decode` -- decode steps, mixed chunk, the out-of-memory abort;
* :mod:`kvlab.sim.retraction` -- retraction and priority preemption;
* :mod:`kvlab.sim.completion` -- a finished request's KV (tree or session) and counters;
* :mod:`kvlab.sim.sessions` -- streaming, legacy and session-radix sessions;
* :mod:`kvlab.sim.accounting` -- SGLang's counters, histograms and throughput window;
* :mod:`kvlab.sim.snapshot` -- pool usage and the JSON state for ``/sim/state``.

This module wires them together and keeps the public surface: submission, sessions,
abort, the two step calls, the queries the metrics and ``/sim/state`` read.
"""

from __future__ import annotations

import sys
from typing import Any

from kvlab.sim.accounting import GEN_THROUGHPUT_LOG_STEPS, SchedulerStats, ThroughputWindow
from kvlab.sim.batching import RunningSet, WaitQueue
from kvlab.sim.completion import Completion
from kvlab.sim.config import SchedulerConfig
from kvlab.sim.decode import DecodeStepper
from kvlab.sim.hicache import HiKVCache
from kvlab.sim.intake import check_input, plan_output
from kvlab.sim.kvcache import KVCache
from kvlab.sim.prefill import PrefillPlanner
from kvlab.sim.records import (
    Batch,
    LegacySession,
    SimError,
    SimRequest,
    State,
    StepEvents,
    StreamingSession,
    abort_reason,
)
from kvlab.sim.retraction import Retraction
from kvlab.sim.sessions import CLOSED_SESSION_TOMBSTONES, SessionTable
from kvlab.sim.snapshot import pool, private_tokens, scheduler_snapshot, token_usage

# Names other modules import from here.
__all__ = [
    "CLOSED_SESSION_TOMBSTONES",
    "GEN_THROUGHPUT_LOG_STEPS",
    "Batch",
    "LegacySession",
    "Scheduler",
    "SchedulerStats",
    "SimError",
    "SimRequest",
    "State",
    "StepEvents",
    "StreamingSession",
]


class Scheduler:
    """One DP rank's scheduler: its parts wired over one KV pool."""

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
        self.stats = SchedulerStats()
        self.now = now
        self.requests: dict[str, SimRequest] = {}  # every unfinished request
        self.prefilling: set[SimRequest] = set()  # PREFILL (admitted, not decoding yet)
        # Requests finished inside schedule() (out-of-memory aborts); the shell drains it.
        self.finished_outside: list[SimRequest] = []
        self.queue = WaitQueue()
        self.runset = RunningSet(config)
        self.running = self.runset.requests  # DECODE
        self.sessions = SessionTable(config, self.kv)
        self.streaming_sessions = self.sessions.streaming
        self.legacy_sessions = self.sessions.legacy
        window = ThroughputWindow(now)
        self.completion = Completion(
            self.kv, self.sessions, self.stats, self.requests, self.prefilling
        )
        self.retraction = Retraction(
            config, self.kv, self.runset, self.queue, self.completion, self.stats
        )
        self.prefill = PrefillPlanner(
            config,
            self.kv,
            self.hi,
            self.queue,
            self.runset,
            self.retraction,
            self.completion,
            self.stats,
            window,
            self.prefilling,
        )
        self.decode = DecodeStepper(
            config,
            self.kv,
            self.runset,
            self.retraction,
            self.completion,
            self.stats,
            window,
            self.finished_outside,
        )
        self._inflight: Batch | None = None
        self._seq = 0

    # =============================================================== queries

    @property
    def num_waiting(self) -> int:
        return self.queue.num_waiting

    @property
    def chunked(self) -> SimRequest | None:
        return self.prefill.chunked

    @property
    def new_token_ratio(self) -> float:
        return self.runset.new_token_ratio

    @new_token_ratio.setter
    def new_token_ratio(self, value: float) -> None:
        self.runset.new_token_ratio = value

    def output_len(self, req: SimRequest) -> int:
        return self.runset.output_len(req)

    def output_ids(self, req: SimRequest) -> list[int]:
        assert req.out is not None
        return req.out.ids(self.output_len(req))

    @property
    def busy(self) -> bool:
        return bool(self.running or self.num_waiting or self.prefilling)

    def private_tokens(self) -> int:
        """KV slots held outside the tree (running requests, sessions, reserved)."""
        return private_tokens(self.requests, self.runset, self.sessions)

    def check_invariants(self) -> None:
        self.kv.check_invariants(self.private_tokens())

    def pool(self) -> dict[str, int]:
        return pool(self.kv)

    def token_usage(self) -> float:
        return token_usage(self.kv)

    def streaming_held_tokens(self) -> int:
        return self.sessions.held_tokens()

    def next_deadline(self) -> float | None:
        """Earliest simulated time at which an idle streaming session expires."""
        return self.sessions.next_deadline()

    def radix_sessions(self) -> list[str]:
        return self.sessions.radix_sessions()

    def snapshot(self) -> dict[str, Any]:
        """JSON-able dump of the pool, queues and sessions (for ``/sim/state``)."""
        return scheduler_snapshot(
            self.kv,
            self.hi,
            self.stats,
            self.requests,
            self.runset,
            self.prefilling,
            self.sessions,
            self.now,
        )

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
            self.sessions.attach(req, session_params)
        n_in = len(req.input_ids)
        check_input(cfg, req, n_in)
        req.max_new_tokens = min(req.max_new_tokens, cfg.context_length - n_in)
        req.prompt_tokens = n_in
        plan_output(cfg, req, output_len, stop_token_ids, ignore_eos)
        if req.session_id is not None and cfg.mode == "session-radix":
            req.generation = self.sessions.ensure_generation(req.session_id)
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
        self.sessions.start_turn(req, now)
        self.queue.push(req)
        return req

    # ============================================================== sessions

    def open_session(
        self, sid: str, now: float, *, streaming: bool = False, timeout_s: float | None = None
    ) -> str:
        return self.sessions.open(sid, now, streaming=streaming, timeout_s=timeout_s)

    def close_session(self, sid: str, now: float) -> None:
        """Idempotent; an unknown id is a no-op."""
        self.now = now
        self.sessions.close(sid)

    def maybe_reap(self, now: float, interval: float = 1.0) -> int:
        """:meth:`reap` at most once per ``interval`` simulated seconds (as SGLang does)."""
        if not self.sessions.reap_due(now, interval):
            return 0
        return self.reap(now)

    def reap(self, now: float) -> int:
        """Close streaming sessions past their timeout; return how many.

        As SGLang's ``Session.is_timed_out`` / ``SessionController.maybe_reap``
        (``sglang/srt/session/session_controller.py``): the clock runs from the start of
        the session's last turn (``create_req``), and a session whose turn is still
        running is closed when that turn finishes (``close_on_finish``).
        """
        self.now = now
        return self.sessions.reap(now)

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
        finish = self.completion.finish
        for req in targets:
            if req.state is State.WAITING:
                req.epoch += 1
                self.queue.forget()
                finish(req, abort_reason("Abort in waiting queue"), now, insert=False)
                done.append(req)
            elif req.state is State.PREFILL:
                if req in inflight:
                    req.abort_pending = "Aborted"
                else:
                    self.prefill.drop(req)
                    finish(req, abort_reason("Aborted"), now, insert=False)
                    done.append(req)
            elif req.state is State.DECODE:
                self.runset.leave(req)
                finish(req, abort_reason("Aborted"), now, insert=True)
                done.append(req)
        return done

    # ================================================================ steps

    def schedule(self, now: float) -> Batch | None:
        """Pick the next batch (prefill first, else decode); None when idle."""
        if self._inflight is not None:
            raise RuntimeError("schedule() called while a batch is in flight")
        self.now = now
        batch = self.prefill.form(now)
        if batch is not None and self.cfg.enable_mixed_chunk and self.running:
            self.decode.mix(batch)
        if batch is None and self.running:
            batch = self.decode.form(now)
        if batch is not None and self.hi is not None and self.hi.stall_s:
            # Write-back eviction waits for its device -> host copies.
            batch.stall_s = self.hi.take_stall()
            batch.duration += batch.stall_s
        self._inflight = batch
        self.stats.evicted_tokens_total = self.kv.evicted_total
        return batch

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
            self.decode.finish(now, ev)
        else:
            if batch.mixed:
                # The running requests' tokens first: those finishing their prefill in
                # this step join the running set only after it.
                st.realtime_decode_tokens += batch.mixed
                self.decode.finish(now, ev)
            st.realtime_prefill_compute_tokens += batch.tokens
            st.realtime_prefill_cache_tokens += batch.hit_tokens
            self.prefill.finish(batch, now, ev)
        st.evicted_tokens_total = self.kv.evicted_total
        return ev

    # ================================================================ admin

    def flush_cache(self) -> bool:
        """Drop the radix cache; only when no request is queued or running."""
        if self.requests:
            return False
        return self.kv.reset()
