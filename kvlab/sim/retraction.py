"""Taking running requests off one simulated rank's batch: retraction and preemption.

Pure; time is passed in. Both free the request's private KV (its cached prefix stays in
the radix tree, unlocked) and queue it again; it later re-prefills its prompt plus the
tokens it had generated.

* **Retraction** (SGLang's ``ScheduleBatch.retract_decode``): a decode step cannot get
  one slot per running request even after evicting, so requests leave the batch (fewest
  output tokens first, longest prompt on a tie; streaming-session turns last) until
  ``retract_decode_steps`` steps fit; then ``new_token_ratio`` is re-estimated.
* **Preemption** (priority scheduling, ``PrefillAdder.preempt_to_schedule``): a waiting
  request of higher priority takes the place of running ones when the batch is full.
"""

from __future__ import annotations

from kvlab.sim.accounting import SchedulerStats
from kvlab.sim.batching import RunningSet, WaitQueue
from kvlab.sim.completion import Completion
from kvlab.sim.config import SchedulerConfig
from kvlab.sim.kvcache import KVCache
from kvlab.sim.records import SimRequest, State, fill_ids


class Retraction:
    """Retracts and preempts running requests back into the waiting queue."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCache,
        running: RunningSet,
        queue: WaitQueue,
        completion: Completion,
        stats: SchedulerStats,
    ) -> None:
        self.cfg = config
        self.kv = kv
        self.running = running
        self.queue = queue
        self.completion = completion
        self.stats = stats

    def requeue(self, req: SimRequest) -> None:
        """Take a running request off the batch, free its private KV, queue it again."""
        gen = self.running.output_len(req)
        self.running.leave(req)
        req.generated = gen
        self.completion.release(req)
        if req.stream_session is not None:
            ss = req.stream_session
            ss.node, ss.tree_len, ss.held = None, 0, 0
        req.state = State.WAITING
        req.epoch += 1
        self.queue.push(req)

    def retract(self) -> None:
        # Checked against SGLang's ScheduleBatch.retract_decode (the reference does not
        # describe it): sort by (output length, -prompt length), retract from the end
        # until num_running * retract_decode_steps slots are free (at least one, never the
        # last request), then re-estimate new_token_ratio.
        kv = self.kv
        running = self.running
        steps = self.cfg.retract_decode_steps
        # Streaming-session requests go last: retracting them loses the session's KV.
        order = sorted(
            running.requests.values(),
            key=lambda r: (
                r.stream_session is not None,
                running.output_len(r),
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
            self.requeue(req)
            retracted.append(req)
        if retracted:
            self.stats.num_retracted_reqs = len(retracted)
            self.stats.num_retracted_requests_total += len(retracted)
            total_decoded = sum(running.output_len(r) for r in running.requests.values())
            total_max_new = sum(r.max_new_tokens for r in running.requests.values())
            if total_max_new:
                est = (total_decoded + steps * len(running)) / total_max_new
                running.new_token_ratio = min(1.0, est)

    def preempt_for(self, req: SimRequest, reserved: float, now: float) -> float | None:
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
        ratio = self.running.new_token_ratio
        assert req.priority is not None
        fill_len = req.prompt_tokens + req.generated
        fill = req.input_ids if req.generated == 0 else fill_ids(req)
        matched = kv.match_prefix(fill[: fill_len - 1], now).length
        deficit = (
            fill_len
            - matched
            + min(req.max_new_tokens, clip)
            - (kv.available + kv.evictable - reserved)
        )
        order = sorted(
            self.running.requests.values(), key=lambda r: (r.priority, -r.arrival, -r.seq)
        )
        chosen: list[SimRequest] = []
        released = 0.0
        for r in order:
            assert r.priority is not None
            if req.priority - r.priority > cfg.priority_scheduling_preemption_threshold:
                offset = min(r.max_new_tokens - self.running.output_len(r), clip) * ratio
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
            self.requeue(r)
        self.stats.num_preempted_requests_total += len(chosen)
        return released
