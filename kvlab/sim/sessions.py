"""Sessions of one simulated rank: streaming sessions, legacy sessions and session-radix ids.

Pure; time is passed in. SGLang's three kinds of session:

* **streaming** (``--enable-streaming-session``): the session keeps its last turn's KV
  outside the radix tree between turns (``held``), and the next turn, which sends only
  its new tokens, restores it in O(1). An idle session is reaped after its timeout.
* **legacy** (``/open_session`` without streaming): the engine prepends the session's
  context to each turn's tokens; the KV goes through the radix cache as usual.
* **session-radix**: a request's ``session_id`` tags the radix nodes its turn leaves,
  keeping them out of eviction's way until the session is closed. Ids have generations
  so that a late finish of a closed id's turn never re-tags it (tombstones).

How a finishing turn hands its KV to its streaming session is the finishing code's part
(:mod:`kvlab.sim.completion`); this module owns the tables and their life cycle (the
session records are in :mod:`kvlab.sim.records`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvlab.sim.config import SchedulerConfig
from kvlab.sim.kvcache import KVCache, Node
from kvlab.sim.records import LegacySession, SimError, SimRequest, StreamingSession

CLOSED_SESSION_TOMBSTONES = 8192


class SessionTable:
    """The sessions of one rank and the KV their streaming ones hold."""

    def __init__(self, config: SchedulerConfig, kv: KVCache) -> None:
        self.cfg = config
        self.kv = kv
        self.streaming: dict[str, StreamingSession] = {}
        self.legacy: dict[str, LegacySession] = {}
        self._radix_generations: dict[str, int] = {}
        self._radix_closed: OrderedDict[str, None] = OrderedDict()
        self._generation_ct = 0
        self._next_reap = 0.0

    # ------------------------------------------------------------- open, close

    def open(self, sid: str, now: float, *, streaming: bool, timeout_s: float | None) -> str:
        if streaming and self.cfg.mode != "streaming":
            raise SimError(
                "Streaming sessions are disabled. Please relaunch with --enable-streaming-session."
            )
        if sid in self.streaming or sid in self.legacy:
            raise SimError(
                "Failed to open the session. Check if a session with the same id is still open."
            )
        if streaming:
            self.streaming[sid] = StreamingSession(sid, timeout_s, now)
        else:
            self.legacy[sid] = LegacySession(sid)
        return sid

    def close(self, sid: str) -> None:
        """Idempotent; an unknown id is a no-op."""
        ss = self.streaming.get(sid)
        if ss is not None:
            if ss.active is not None:
                ss.close_pending = True  # deferred until the request finishes
            else:
                self.free_streaming(ss)
        self.legacy.pop(sid, None)
        if self.cfg.mode == "session-radix" and sid not in self._radix_closed:
            self._radix_closed[sid] = None
            while len(self._radix_closed) > CLOSED_SESSION_TOMBSTONES:
                self._radix_closed.popitem(last=False)
            self._radix_generations.pop(sid, None)
            self.kv.release_session(sid)

    def free_streaming(self, ss: StreamingSession) -> None:
        if ss.node is not None:
            self.kv.dec_lock(ss.node)
            ss.node = None
        self.kv.free(ss.held)
        ss.held = 0
        ss.tree_len = 0
        self.streaming.pop(ss.sid, None)

    # --------------------------------------------------------------- requests

    def attach(self, req: SimRequest, params: dict[str, Any]) -> None:
        """Bind ``req`` to the session its ``session_params`` name and prepend the
        session's context (raises :class:`SimError` for what SGLang refuses)."""
        sid = params.get("id")
        if sid is None:
            return
        sid = str(sid)
        ss = self.streaming.get(sid)
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
        ls = self.legacy.get(sid)
        if ls is None:
            raise SimError(f"Invalid request: session id {sid} does not exist")
        req.legacy_session = ls
        req.input_ids = ls.context + req.input_ids

    def start_turn(self, req: SimRequest, now: float) -> None:
        """``req`` was queued: its sessions count it as their active turn."""
        if req.stream_session is not None:
            req.stream_session.active = req
            req.stream_session.last_active = now
        if req.legacy_session is not None:
            req.legacy_session.active += 1

    def end_turn(self, req: SimRequest, reason: dict[str, Any]) -> None:
        """``req`` finished: its sessions keep its context (a streaming one closes now
        if a close was deferred to the end of the turn)."""
        ss = req.stream_session
        if ss is not None:
            if ss.node is not None and req.out is not None:
                ss.context = req.input_ids + req.out.ids(req.generated)
            else:
                # The turn's KV was released: keep the context from before the turn;
                # the next turn re-prefills it (through the radix cache).
                ss.context = req.input_ids[: req.session_base_len]
            ss.active = None
            if ss.close_pending:
                self.free_streaming(ss)
        ls = req.legacy_session
        if ls is not None:
            ls.active -= 1
            if reason.get("type") != "abort" and req.out is not None:
                ls.context = req.input_ids + req.out.ids(req.generated)

    # ------------------------------------------------------------ timeouts

    def timeout(self, ss: StreamingSession) -> float | None:
        return ss.timeout_s if ss.timeout_s is not None else self.cfg.streaming_session_timeout_s

    def next_deadline(self) -> float | None:
        """Earliest simulated time at which an idle streaming session expires."""
        best: float | None = None
        for s in self.streaming.values():
            t = self.timeout(s)
            if t is not None and s.active is None:
                deadline = s.last_active + t
                if best is None or deadline < best:
                    best = deadline
        return None if best is None else max(best, self._next_reap)

    def reap_due(self, now: float, interval: float) -> bool:
        """Whether a reap is due (at most once per ``interval`` simulated seconds)."""
        if now < self._next_reap or not self.streaming:
            return False
        self._next_reap = now + interval
        return True

    def reap(self, now: float) -> int:
        """Close streaming sessions past their timeout; return how many were freed."""
        expired = [
            s
            for s in self.streaming.values()
            if (t := self.timeout(s)) is not None and now - s.last_active >= t
        ]
        freed = 0
        for s in expired:
            if s.active is not None:
                s.close_pending = True
            else:
                self.free_streaming(s)
                freed += 1
        return freed

    def held_tokens(self) -> int:
        return sum(s.held for s in self.streaming.values())

    # ------------------------------------------------------------ session radix

    def ensure_generation(self, sid: str) -> int:
        gen = self._radix_generations.get(sid)
        if gen is None:
            self._radix_closed.pop(sid, None)  # a new request re-opens a closed id
            self._generation_ct += 1
            gen = self._generation_ct
            self._radix_generations[sid] = gen
        return gen

    def radix_sessions(self) -> list[str]:
        return sorted(self._radix_generations)

    def radix_closed(self, sid: str) -> bool:
        """Whether ``sid`` holds a close tombstone."""
        return sid in self._radix_closed

    def radix_closed_count(self) -> int:
        return len(self._radix_closed)

    def maybe_tag(self, req: SimRequest, node: Node, reason: dict[str, Any]) -> None:
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
