"""Decode on one simulated rank: one token per running request, alone or in a prefill step.

Pure; time is passed in. Decode step k allocates one slot per running request; when the
pool cannot give them even after evicting, requests are retracted
(:mod:`kvlab.sim.retraction`), and a lone request that still does not fit is aborted.
A step's duration is ``cfg.cost.decode_s(batch size, total context)``. With mixed chunk
(``enable_mixed_chunk``) every ``mixed_decode_every``-th prefill step also decodes the
running requests, at the decode step's marginal cost, when the pool has a slot for each
without retracting.
"""

from __future__ import annotations

from kvlab.sim.accounting import SchedulerStats, ThroughputWindow
from kvlab.sim.batching import RunningSet
from kvlab.sim.completion import Completion
from kvlab.sim.config import SchedulerConfig
from kvlab.sim.kvcache import KVCache
from kvlab.sim.records import Batch, SimRequest, StepEvents, abort_reason, natural_reason
from kvlab.sim.retraction import Retraction


class DecodeStepper:
    """Forms decode steps (and mixes them into prefill steps) and applies their results."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCache,
        running: RunningSet,
        retraction: Retraction,
        completion: Completion,
        stats: SchedulerStats,
        window: ThroughputWindow,
        finished_outside: list[SimRequest],
    ) -> None:
        self.cfg = config
        self.kv = kv
        self.running = running
        self.retraction = retraction
        self.completion = completion
        self.stats = stats
        self.window = window
        self.finished_outside = finished_outside  # the scheduler's list; the shell drains it
        self._prefill_steps_unmixed = 0  # mixed chunk: prefill steps since one decoded

    def form(self, now: float) -> Batch | None:
        kv = self.kv
        running = self.running
        n = len(running)
        if n > kv.available:
            kv.evict(n - kv.available)
        if n > kv.available:
            self.retraction.retract()
            n = len(running)
            if n == 0:
                return None
            if n > kv.available:
                kv.evict(n - kv.available)
            if n > kv.available:
                # A single request that no longer fits at all: abort it (SGLang
                # aborts what retraction cannot save).
                for req in list(running.requests.values()):
                    running.leave(req)
                    self.completion.finish(
                        req,
                        abort_reason("KV cache pool is full (out of memory)"),
                        now,
                        insert=True,
                    )
                    self.finished_outside.append(req)
                return None
        kv.available -= n
        running.decode_reserved = n
        ctx = running.context_tokens()
        return Batch("decode", self.cfg.cost.decode_s(n, ctx), n, tokens=n, context_tokens=ctx)

    def mix(self, batch: Batch) -> None:
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
        self.running.decode_reserved = n
        ctx = self.running.context_tokens()
        cost = self.cfg.cost
        batch.mixed = n
        batch.context_tokens = ctx
        batch.duration += cost.decode_s(n, ctx) - cost.decode_s(0, 0)

    def finish(self, now: float, ev: StepEvents) -> None:
        """Apply a decode step (or a mixed prefill step's decode) that ended at ``now``."""
        running = self.running
        running.decode_ct += 1
        n = len(running)
        # Slots reserved for requests aborted during the step go back to the pool.
        self.kv.free(running.decode_reserved - n)
        running.decode_reserved = 0
        # Each running request's reserved slot is now its KV (derived from decode_ct).
        self.stats.decode_steps += 1
        running.decay_ratio()
        self.window.record(n, now, self.stats)
        while (req := running.next_done()) is not None:
            running.leave(req)
            self.completion.finish(req, natural_reason(req), now, insert=True)
            ev.finished.append(req)
