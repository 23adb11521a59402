"""The end of a request on one simulated rank: where its KV goes, and what is counted.

Pure; time is passed in. A request that finishes normally leaves the KV of
``prompt + output[:-1]`` in the radix tree, unlocked (evictable cache), tagged with its
session id under session-radix; a streaming session's turn instead hands its KV to the
session, outside the tree, for the next turn. An aborted request (or one retracted, via
:meth:`Completion.release`) frees its private KV and unlocks its cached prefix.
"""

from __future__ import annotations

from typing import Any

from kvlab.sim.accounting import SchedulerStats, count_finished
from kvlab.sim.kvcache import KVCache
from kvlab.sim.records import SimRequest, State
from kvlab.sim.sessions import SessionTable


class Completion:
    """Finishes requests: KV into the tree or the session, counters, session context."""

    def __init__(
        self,
        kv: KVCache,
        sessions: SessionTable,
        stats: SchedulerStats,
        requests: dict[str, SimRequest],
        prefilling: set[SimRequest],
    ) -> None:
        self.kv = kv
        self.sessions = sessions
        self.stats = stats
        self.requests = requests  # every unfinished request (the scheduler's table)
        self.prefilling = prefilling  # PREFILL (the prefill planner's set)

    def release(self, req: SimRequest) -> None:
        """Free the request's private KV and unlock its prefix (no insertion)."""
        if req.private:
            self.kv.free(req.private)
            req.private = 0
        if req.node is not None:
            self.kv.dec_lock(req.node)
            req.node = None
        req.tree_len = 0

    def finish(self, req: SimRequest, reason: dict[str, Any], now: float, *, insert: bool) -> None:
        """Finish ``req`` at ``now``; ``insert``: its KV goes to the cache (else freed)."""
        kv = self.kv
        ss = req.stream_session
        if req.state is State.PREFILL:
            self.prefilling.discard(req)
        kv_len = req.tree_len + req.private
        if ss is not None and insert and req.node is not None and not ss.close_pending:
            # The session keeps the turn's KV outside the tree.
            ss.node, ss.tree_len, ss.held = req.node, req.tree_len, req.private
            req.node, req.tree_len, req.private = None, 0, 0
        elif insert and req.node is not None and req.private >= 0 and kv_len > req.tree_len:
            assert req.out is not None
            seq = req.input_ids + req.out.ids(req.generated)
            ids = seq[:kv_len]
            already, node = kv.insert(ids, now=now, priority=req.priority or 0)
            dup = already - req.tree_len
            if dup > 0:
                kv.free(dup)
            req.private = 0
            kv.inc_lock(node)
            kv.dec_lock(req.node)
            req.node = node
            req.tree_len = kv_len
            self.sessions.maybe_tag(req, node, reason)
            kv.dec_lock(node)
            req.node = None
        else:
            if insert and req.node is not None:
                self.sessions.maybe_tag(req, req.node, reason)
            self.release(req)
        req.state = State.FINISHED
        req.finish_reason = reason
        req.finish_time = now
        self.requests.pop(req.rid, None)
        count_finished(self.stats, req, now, aborted=reason.get("type") == "abort")
        self.sessions.end_turn(req, reason)
