"""Batch membership of one simulated rank: the waiting queue and the running (decoding) set.

Pure. Decode bookkeeping is O(1) per step: a running request's output length is derived
from a global decode-step counter (``gen_base + decode_ct - g0``), the sums the
scheduler needs over the running set (clipped budgets, prompts, output so far) are kept
up to date as requests enter and leave, and finishing requests come off a heap keyed by
the step at which they reach their target length.

``new_token_ratio`` (SGLang's estimate of how much of its ``max_new_tokens`` budget a
running request will still generate) lives here too: it scales the reservation the
running set holds against admission.
"""

from __future__ import annotations

import heapq

from kvlab.sim.config import SchedulerConfig
from kvlab.sim.records import SimRequest, State


class WaitQueue:
    """FCFS, or by priority then arrival: requests are keyed by ``req.qkey``. An entry
    whose request left the queue (aborted, or re-keyed) is skipped lazily."""

    __slots__ = ("_heap", "num_waiting")

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int], int, SimRequest]] = []
        self.num_waiting = 0

    def push(self, req: SimRequest) -> None:
        heapq.heappush(self._heap, (req.qkey, req.seq, req))
        self.num_waiting += 1

    def peek(self) -> SimRequest | None:
        w = self._heap
        while w:
            req = w[0][2]
            if req.state is State.WAITING and w[0][0] == req.qkey:
                return req
            heapq.heappop(w)
        return None

    def pop_head(self) -> None:
        """The request :meth:`peek` returned leaves the queue (admitted)."""
        heapq.heappop(self._heap)
        self.num_waiting -= 1

    def forget(self) -> None:
        """A waiting request left the queue out of order (aborted); its entry stays in
        the heap until :meth:`peek` reaches it."""
        self.num_waiting -= 1


class RunningSet:
    """The requests decoding, with the counter that derives their output lengths."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.clip = config.clip_max_new_tokens
        self.requests: dict[str, SimRequest] = {}  # DECODE
        self.decode_ct = 0  # global decode step counter (G)
        self.decode_reserved = 0  # slots allocated for the step in flight
        self._finish_heap: list[tuple[int, int, int, SimRequest]] = []
        self._sum_clip = 0  # sum of min(max_new, clip) over running
        self._sum_base = 0  # sum of (gen_base - g0) over running
        self._sum_prompt = 0  # sum of prompt_tokens over running (decode context S)
        self.init_ratio = min(config.init_new_token_ratio, 1.0)
        self.min_ratio = min(self.init_ratio * config.min_new_token_ratio_factor, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / max(
            config.new_token_ratio_decay_steps, 1
        )
        self.new_token_ratio = self.init_ratio

    def __len__(self) -> int:
        return len(self.requests)

    def output_len(self, req: SimRequest) -> int:
        if req.state is State.DECODE:
            return req.gen_base + self.decode_ct - req.g0
        return req.generated

    def decode_private(self, req: SimRequest) -> int:
        """KV of prompt + output[:-1], minus what the tree holds for the request."""
        return req.prompt_tokens + self.output_len(req) - 1 - req.tree_len

    def reserved(self) -> float:
        """Decode tokens the running requests may still need, times the ratio."""
        n = len(self.requests)
        if not n:
            return 0.0
        remaining = self._sum_clip - (self._sum_base + n * self.decode_ct)
        return max(remaining, 0) * self.new_token_ratio

    def context_tokens(self) -> int:
        """S: every running request's context (prompt + output so far), O(1)."""
        return self._sum_prompt + self._sum_base + len(self.requests) * self.decode_ct

    def enter(self, req: SimRequest) -> None:
        req.state = State.DECODE
        req.g0 = self.decode_ct
        req.gen_base = req.generated
        # While decoding, the private KV is derived from the step counter.
        assert req.private == self.decode_private(req), (req.rid, req.private)
        req.private = 0
        self.requests[req.rid] = req
        self._sum_clip += min(req.max_new_tokens, self.clip)
        self._sum_base += req.gen_base - req.g0
        self._sum_prompt += req.prompt_tokens
        finish_at = req.g0 + req.target_len - req.gen_base
        heapq.heappush(self._finish_heap, (finish_at, req.seq, req.epoch, req))

    def leave(self, req: SimRequest) -> None:
        """Take ``req`` off the set; its output length and private KV become explicit."""
        gen = self.output_len(req)
        del self.requests[req.rid]
        self._sum_clip -= min(req.max_new_tokens, self.clip)
        self._sum_base -= req.gen_base - req.g0
        self._sum_prompt -= req.prompt_tokens
        req.generated = gen
        req.private = req.prompt_tokens + gen - 1 - req.tree_len
        req.state = State.PREFILL  # transient; the caller sets the final state
        req.epoch += 1

    def next_done(self) -> SimRequest | None:
        """A running request that reached its target length by this step, or None."""
        heap = self._finish_heap
        g = self.decode_ct
        while heap and heap[0][0] <= g:
            _, _, epoch, req = heapq.heappop(heap)
            if req.state is not State.DECODE or req.epoch != epoch:
                continue
            return req
        return None

    def decay_ratio(self) -> None:
        self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
