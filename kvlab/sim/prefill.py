"""Prefill on one simulated rank: admission into the next prefill batch, and its results.

Pure; time is passed in. Admission follows SGLang's ``PrefillAdder``: FCFS (or by
priority with priority scheduling), head-of-line blocking. A request is admitted if
``extend + min(max_new_tokens - generated, clip) <= available + evictable - reserved``,
where ``reserved`` is ``new_token_ratio`` x the tokens the running requests (and those
admitted earlier in the batch) may still generate. Prefix matching is capped at
``len(prompt) - 1``, so at least one token is always computed. The batch has a token
budget (chunked_prefill_size, or max_prefill_tokens without chunking); a longer prompt is
split into chunks, one per step. With HiCache, the host part of a prefix match is loaded
back to the device when the request fits with it (:func:`load_overlapped_s` prices it).

After its prefill the prompt's KV goes into the radix tree (still locked by the request,
so concurrent requests share it) and the prefill yields the first output token.
"""

from __future__ import annotations

from kvlab.sim.accounting import SchedulerStats, ThroughputWindow
from kvlab.sim.batching import RunningSet, WaitQueue
from kvlab.sim.completion import Completion
from kvlab.sim.config import HiCacheConfig, SchedulerConfig
from kvlab.sim.hicache import HiKVCache
from kvlab.sim.kvcache import KVCache, MatchResult, Node
from kvlab.sim.records import (
    Batch,
    SimRequest,
    State,
    StepEvents,
    abort_reason,
    fill_ids,
    natural_reason,
)
from kvlab.sim.retraction import Retraction


def load_overlapped_s(hc: HiCacheConfig, compute_s: float, tokens: int) -> float:
    """A prefill step that also loads ``tokens`` back from the host. The load runs on its
    own stream, layer by layer, and layer i's attention waits for layer i's KV
    (HiCacheController's layer_done_counter), so with L layers the step takes
    ``max(compute + load / L, load + compute / L)``."""
    load_s = hc.transfer_s(tokens)
    n = hc.num_layers
    return max(compute_s + load_s / n, load_s + compute_s / n)


class PrefillPlanner:
    """Forms prefill batches and applies their results."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCache,
        hi: HiKVCache | None,
        queue: WaitQueue,
        running: RunningSet,
        retraction: Retraction,
        completion: Completion,
        stats: SchedulerStats,
        window: ThroughputWindow,
        prefilling: set[SimRequest],
    ) -> None:
        self.cfg = config
        self.kv = kv
        self.hi = hi
        self.queue = queue
        self.running = running
        self.retraction = retraction
        self.completion = completion
        self.stats = stats
        self.window = window
        self.prefilling = prefilling  # PREFILL (admitted, not decoding yet)
        self.chunked: SimRequest | None = None
        self._match: MatchResult | None = None  # the last admission match (HiCache)
        self._preemption = config.enable_priority_scheduling

    def drop(self, req: SimRequest) -> None:
        """``req`` leaves prefill (aborted) before its last chunk."""
        self.prefilling.discard(req)
        if self.chunked is req:
            self.chunked = None

    # ================================================================= forming

    def form(self, now: float) -> Batch | None:
        cfg = self.cfg
        kv = self.kv
        if self.queue.num_waiting == 0 and self.chunked is None:
            return None
        chunking = cfg.chunked_prefill_size > 0
        budget = cfg.chunked_prefill_size if chunking else cfg.max_prefill_tokens
        batch = Batch("prefill", 0.0, 0)
        ratio = self.running.new_token_ratio
        clip = cfg.clip_max_new_tokens

        if self.chunked is not None:
            budget -= self._continue_chunked(batch, budget)
            if self.chunked is not None:  # its next chunk fills the batch
                return self._close(batch)

        # Requests admitted earlier in this batch reserve their decode tokens too.
        reserved = self.running.reserved() + self._decode_reservation(batch.reqs)
        while budget > 0:
            waiting = self.queue.peek()
            if waiting is None:
                break
            req = waiting
            freed = self._running_slot_for(req, reserved, now)
            if freed is None:
                break
            reserved -= freed
            fill_len = req.prompt_tokens + req.generated
            remaining_new = min(req.max_new_tokens - req.generated, clip)
            nothing_else = not self.running.requests and not self.prefilling and not batch.reqs
            if not nothing_else and 1 + remaining_new > kv.available + kv.evictable - reserved:
                break  # even a full cache hit would not fit
            node, matched, own_lock = self._prefix_for(req, fill_len, now)
            node, matched = self._load_back(
                req, batch, node, matched, remaining_new, reserved, nothing_else
            )
            extend = fill_len - matched
            too_big = bool(batch.reqs) and not chunking and extend > budget
            if too_big or not self._alloc(extend, remaining_new, reserved, nothing_else):
                if own_lock:
                    kv.dec_lock(node)
                break
            self._start(req, node, matched, own_lock, fill_len, extend, now)
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
        return self._close(batch)

    def _decode_reservation(self, reqs: list[SimRequest]) -> float:
        """The decode tokens ``reqs`` reserve (clipped, times the new-token ratio)."""
        reserved = 0.0
        for r in reqs:
            reserved += min(r.max_new_tokens - r.generated, self.cfg.clip_max_new_tokens) * (
                self.running.new_token_ratio
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
        if len(self.running) + len(self.prefilling) < self.cfg.max_running_requests:
            return 0.0
        # The batch is full. With priority scheduling SGLang then tries to preempt
        # running requests for this one (managers/scheduler.py,
        # _get_new_batch_prefill_raw: batch_is_full -> adder.preempt_to_schedule).
        return self.retraction.preempt_for(req, reserved, now) if self._preemption else None

    def _alloc(self, extend: int, remaining_new: int, reserved: float, nothing_else: bool) -> bool:
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
        fill = req.input_ids if req.generated == 0 else fill_ids(req)
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

    def _start(
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
        self.queue.pop_head()
        if req.first_token_time is None and req.num_retractions == 0:
            self.stats.queue_time.observe(now - req.arrival)
        req.state = State.PREFILL
        self.prefilling.add(req)
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

    def _close(self, batch: Batch) -> Batch:
        batch.size = len(batch.reqs)
        batch.tokens = sum(batch.chunks)
        # p = tokens already in KV: the cached prefix plus the chunks computed before.
        batch.items = [
            (chunk, r.fill_len - r.extend_len + r.prefill_done)
            for r, chunk in zip(batch.reqs, batch.chunks, strict=True)
        ]
        batch.duration = self.cfg.cost.prefill_s(batch.items)
        if batch.load_tokens:
            assert self.cfg.hicache is not None
            batch.duration = load_overlapped_s(self.cfg.hicache, batch.duration, batch.load_tokens)
        total = batch.tokens + batch.hit_tokens
        if batch.hit_tokens or total:
            self.stats.cache_hit_rate = round(batch.hit_tokens / total, 4) if total else 0.0
        return batch

    # ================================================================ finishing

    def finish(self, batch: Batch, now: float, ev: StepEvents) -> None:
        """Apply a prefill step that ended at ``now``: completed prompts go into the tree
        and yield their first token; requests aborted during the step finish."""
        kv = self.kv
        done = self.completion.finish
        self.stats.prefill_batches += 1
        for req, chunk in zip(batch.reqs, batch.chunks, strict=True):
            if req.state is not State.PREFILL:
                continue
            req.prefill_done += chunk
            if req.abort_pending is not None:
                self.drop(req)
                done(req, abort_reason(req.abort_pending), now, insert=False)
                ev.finished.append(req)
                continue
            if req.prefill_done < req.extend_len:
                continue
            self.prefilling.discard(req)
            if req.stream_session is None:
                # cache_unfinished_req: the prompt's KV goes into the tree, still locked.
                fill = req.input_ids if req.generated == 0 else fill_ids(req)
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
                done(req, {"type": "length", "length": 0}, now, insert=True)
                ev.finished.append(req)
                continue
            req.generated += 1
            if req.first_token_time is None:
                req.first_token_time = now
                self.stats.ttft.observe(now - req.arrival)
                ev.first_tokens.append(req)
            if req.generated >= req.target_len:
                done(req, natural_reason(req), now, insert=True)
                ev.finished.append(req)
                continue
            self.running.enter(req)
            self.window.start_if_idle(now)
