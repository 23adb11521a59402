"""ThunderAgent's program scheduler as a pure core (arXiv 2602.13692), written from the
paper and the public descriptions of its code and ports; no I/O, time injected.

A *program* is an agent session. Its state: its context ``tokens`` (``usage.total_tokens``
of its last response; before the first, its prompt), its ``backend``, its phase
(``reasoning`` while a request of it is on an engine, ``acting`` while it waits for a
tool) and whether it is ``paused``.

- **Capacity**, per backend: ``sum_R c + w * sum_A c + buffer * #programs <=
  capacity`` over its active (not paused) programs (paper eq. 6-7). ``w`` is the acting
  weight (1.0). An acting program counts ``c * 2^(-idle / h)`` with
  the half-life ``h`` (the paper's decay; ``--use-acting-token-decay`` in the code, 1 s
  in the replication); ``h = 0`` turns decay off. By default (``decay_scope="all"``)
  the decayed tokens count everywhere (admission, pause, resume), as the paper's
  capacity writes it and as the replication's llm-d port behaved (its gate saw 1.08x
  its capacity while the live sessions' prompts summed to 1.58x the pool, step 20);
  ``decay_scope="resume"`` is the public code's flag: decayed for resume only.
- **Admission**: a request of an active program passes at once (its KV is resident,
  the paper never holds it). A new program, or one that is paused, waits unless it fits
  now; a waiting program is *pending*. A new program goes to the least-loaded backend
  with room, or, ``new_placement="router"`` (``thunder-router``), only to the backend
  the router picked for it.
- **Tick** every 5 s: resume, then pause.
  - *Resume*: candidates in the order pending programs that were paused (a request of
    theirs is waiting) -> new programs -> paused acting programs (no request yet), each
    group by tokens descending (best-fit decreasing), each placed on the backend with the
    most room where it fits (most-room, with migration: its next turn is sent there, so
    its prefix is recomputed there), or, ``origin_only``, only on its own backend. A
    program waiting ``force_after_s`` (1800 s) is admitted whatever the room.
  - *Pause*: on each backend over capacity (decayed only with ``decay_scope="all"``), pause acting programs smallest first (the
    least progress: fewest tokens; the paper's Lemma 4.1, recompute grows with c^2,
    so shortest-first loses least) until it fits; if no acting program is left, mark
    the smallest reasoning program to pause when its response arrives. A pause frees
    nothing on the engine: its LRU evicts what is no longer used.
- Programs are never released by the replication's clients; one idle for
  ``idle_ttl_s`` (3600 s) is forgotten (the port's eviction TTL). ``release`` exists for
  a client that does release (ThunderAgent's ``POST /programs/release``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

REASONING = "reasoning"
ACTING = "acting"
RESUME_PLACEMENTS = ("most-room", "origin-first", "origin-only")
NEW_PLACEMENTS = ("least-loaded", "router")
DEFAULT_CHARS_PER_TOKEN = 5.0  # ThunderAgent's ratio before its first response


@dataclass(frozen=True, slots=True)
class ThunderConfig:
    capacity_tokens: int  # per backend: max_total_num_tokens
    acting_weight: float = 1.0
    buffer_tokens: int = 100  # per program
    tick_s: float = 5.0
    force_after_s: float = 1800.0
    acting_half_life_s: float = 1.0  # resume-side decay; 0: off
    # Where a resumed program goes: "most-room" (upstream: the backend with the most
    # room, migrating it), "origin-first" (the llm-d port: its own backend if it fits
    # there, else the most room), "origin-only" (the replication's variant: only its own).
    resume_placement: str = "most-room"
    # Where a new program goes: "least-loaded" (ThunderAgent is the router: the backend
    # with the fewest active tokens that has room) or "router" (the backend the router
    # picks, as a scheduler in front of the router must take it: ``thunder-router``).
    new_placement: str = "least-loaded"
    # Where the acting decay applies: "all" (the paper's capacity, eq. 6-7; the
    # replication's llm-d port) or "resume" (the public code's --use-acting-token-decay).
    decay_scope: str = "all"
    idle_ttl_s: float = 3600.0
    # ThunderAgent counts a request's tokens as its characters / a chars-per-token ratio
    # learned from responses, 5.0 until the first response of any program. The lab's
    # requests are token ids: this is the traffic's chars per token, so that until the
    # first response a request counts tokens x chars_per_token / 5.0 (5.0: exact; the
    # replication's random-word preambles: not published, see docs/lab.md).
    chars_per_token: float = 5.0

    def __post_init__(self) -> None:
        if self.capacity_tokens < 1 or self.tick_s <= 0 or self.force_after_s < 0:
            raise ValueError("thunder: capacity >= 1, tick > 0 and force_after >= 0 required")
        if self.acting_weight < 0 or self.buffer_tokens < 0 or self.acting_half_life_s < 0:
            raise ValueError("thunder: weights, buffer and half-life must be >= 0")
        if self.resume_placement not in RESUME_PLACEMENTS:
            raise ValueError(f"thunder: resume_placement must be one of {RESUME_PLACEMENTS}")
        if self.new_placement not in NEW_PLACEMENTS:
            raise ValueError(f"thunder: new_placement must be one of {NEW_PLACEMENTS}")
        if not self.chars_per_token > 0:
            raise ValueError("thunder: chars_per_token must be > 0")
        if self.decay_scope not in ("resume", "all"):
            raise ValueError("thunder: decay_scope must be 'resume' or 'all'")


@dataclass(slots=True)
class Program:
    pid: str
    tokens: int
    backend: str | None = None
    phase: str = REASONING
    paused: bool = False
    pause_pending: bool = False  # paused as soon as its response arrives
    waiting_since: float | None = None  # a request of it waits for admission
    acting_since: float = 0.0
    last_seen: float = 0.0
    turns: int = 0
    started: bool = False  # admitted at least once


@dataclass(slots=True)
class ThunderCounters:
    pauses: int = 0
    resumes: int = 0
    migrations: int = 0
    forced: int = 0
    immediate: int = 0
    forgotten: int = 0
    pause_marks: int = 0


@dataclass(slots=True)
class ThunderScheduler:
    """The per-program state and the rules above; every method takes ``now``."""

    cfg: ThunderConfig
    backends: Sequence[str]
    programs: dict[str, Program] = field(default_factory=dict)
    counters: ThunderCounters = field(default_factory=ThunderCounters)
    calibrated: bool = False  # a response has been seen (the chars-per-token ratio)

    # -- accounting --------------------------------------------------------------

    def _weight(self, p: Program, now: float, *, decay: bool) -> float:
        if p.phase == REASONING:
            return float(p.tokens)
        w = self.cfg.acting_weight * p.tokens
        h = self.cfg.acting_half_life_s
        if (decay or self.cfg.decay_scope == "all") and h > 0:
            w *= math.pow(2.0, -max(0.0, now - p.acting_since) / h)
        return w

    def used(self, backend: str, now: float, *, decay: bool = False) -> float:
        """Tokens counted on ``backend`` by its active programs (decayed for resume)."""
        total = 0.0
        for p in self.programs.values():
            if p.backend == backend and not p.paused and p.started:
                total += self._weight(p, now, decay=decay) + self.cfg.buffer_tokens
        return total

    def room(self, backend: str, now: float, *, decay: bool = False) -> float:
        return self.cfg.capacity_tokens - self.used(backend, now, decay=decay)

    # -- requests and responses ----------------------------------------------------

    def request(
        self, pid: str, prompt_tokens: int, now: float, routed: str | None = None
    ) -> str | None:
        """A request of ``pid`` arrives: the backend it goes to now, or None (it waits
        until a tick resumes it, or forces it after ``force_after_s``). ``routed``: the
        backend the router picks for it; with ``new_placement="router"`` a new program
        is placed there and nowhere else."""
        p = self.programs.get(pid)
        if p is None:
            p = self.programs[pid] = Program(pid, prompt_tokens)
            if self.cfg.new_placement == "router":
                if routed is None or routed not in self._order:
                    raise ValueError(
                        f"thunder: new_placement router needs a backend, got {routed!r}"
                    )
                p.backend = routed
        # The prompt is the context the request puts on the engine (the last response's
        # usage.total_tokens plus the tool output since; smaller after a compaction).
        p.tokens = self._estimate(prompt_tokens)
        p.last_seen = now
        p.phase = REASONING
        if p.started and not p.paused:
            return p.backend
        if not p.started and p.waiting_since is None and not self._queued():
            # A new program: the backend with the least active tokens that has room
            # for it (decayed only with decay_scope "all"), else it waits; it always
            # waits while any program is paused or waiting (fairness: the queue first).
            target = self._new_backend(p, now)
            if target is not None:
                self.counters.immediate += 1
                self._admit(p, target, now)
                return target
        p.waiting_since = now
        return None

    def response(self, pid: str, total_tokens: int, now: float) -> None:
        """The response of ``pid``'s request: its context is ``total_tokens``
        (``usage.total_tokens``); it now waits for its tool (acting). A program marked
        for pause is paused now."""
        self.calibrated = True
        p = self.programs.get(pid)
        if p is None:
            return
        p.tokens = total_tokens
        p.phase = ACTING
        p.acting_since = now
        p.last_seen = now
        p.turns += 1
        if p.pause_pending:
            p.pause_pending = False
            p.paused = True
            self.counters.pauses += 1

    def release(self, pid: str) -> None:
        """``POST /programs/release``: the program ends."""
        self.programs.pop(pid, None)

    # -- the tick ------------------------------------------------------------------

    def tick(self, now: float) -> list[tuple[str, str]]:
        """Forget idle programs, force the overdue, resume, then pause; returns the
        waiting programs admitted, ``(pid, backend)``."""
        self._forget(now)
        admitted = self._force(now)
        admitted += self._resume(now)
        self._pause(now)
        return admitted

    def _forget(self, now: float) -> None:
        for pid in [
            p.pid
            for p in self.programs.values()
            if p.waiting_since is None
            and p.phase == ACTING
            and now - p.last_seen >= self.cfg.idle_ttl_s
        ]:
            del self.programs[pid]
            self.counters.forgotten += 1

    def _force(self, now: float) -> list[tuple[str, str]]:
        """Programs waiting ``force_after_s``: admitted on their own backend (a new one
        on the backend with the least active tokens), whatever the room."""
        out: list[tuple[str, str]] = []
        for p in sorted(self.programs.values(), key=lambda q: (q.waiting_since or 0.0, q.pid)):
            if p.waiting_since is None or now - p.waiting_since < self.cfg.force_after_s:
                continue
            target = p.backend if p.backend is not None else self._least_loaded(now)
            self.counters.forced += 1
            self._admit(p, target, now)
            out.append((p.pid, target))
        return out

    def _candidates(self) -> list[Program]:
        """Paused and new programs in resume priority: paused with a request waiting,
        new, paused acting (no request yet); smallest first within each group."""
        waiting = [p for p in self.programs.values() if p.waiting_since is not None]
        groups = (
            [p for p in waiting if p.started],
            [p for p in waiting if not p.started],
            [p for p in self.programs.values() if p.paused and p.waiting_since is None],
        )
        out: list[Program] = []
        for group in groups:
            out.extend(sorted(group, key=lambda p: (p.tokens, p.pid)))
        return out

    def _resume(self, now: float) -> list[tuple[str, str]]:
        """Best-fit decreasing: take candidates in priority order while their total
        fits the backends' total (decayed) room, then place them largest first, each on
        the backend its placement allows with the most room left, skipping one that
        fits nowhere."""
        rooms = {b: self.room(b, now, decay=True) for b in self.backends}
        total = sum(r for r in rooms.values() if r > self.cfg.buffer_tokens)
        chosen: list[Program] = []
        need = 0.0
        for p in self._candidates():
            if need + self._need(p) <= total:
                chosen.append(p)
                need += self._need(p)
        admitted: list[tuple[str, str]] = []
        for p in sorted(chosen, key=lambda q: (-q.tokens, q.pid)):
            target = self._placement(p, rooms)
            if target is None:
                continue
            rooms[target] -= self._need(p)
            waiting = p.waiting_since is not None
            self.counters.resumes += p.started
            self._admit(p, target, now)
            if waiting:
                admitted.append((p.pid, target))
        return admitted

    def _placement(self, p: Program, rooms: dict[str, float]) -> str | None:
        mode = self.cfg.resume_placement
        need = self._need(p)
        if not p.started and self.cfg.new_placement == "router":
            assert p.backend is not None  # placed by the router on its first request
            return p.backend if rooms[p.backend] >= need else None
        if p.backend is not None and mode != "most-room":
            if rooms[p.backend] >= need:
                return p.backend
            if mode == "origin-only":
                return None
        best = max(self.backends, key=lambda b: (rooms[b], -self._order[b]))
        return best if rooms[best] >= need else None

    def _pause(self, now: float) -> None:
        """On each backend over capacity (decayed only with decay_scope "all"): pause acting programs smallest
        first; then mark reasoning ones smallest first (paused at their response), their
        tokens counted as freed, until it fits."""
        for b in self.backends:
            over = -self.room(b, now)
            if over <= 0:
                continue
            active = [
                p for p in self.programs.values() if p.backend == b and p.started and not p.paused
            ]
            order = sorted(active, key=lambda p: (p.tokens, p.turns, p.pid))
            for p in order:
                if over <= 0:
                    break
                if p.phase == ACTING and p.started:
                    p.paused = True
                    self.counters.pauses += 1
                    over -= self._weight(p, now, decay=False) + self.cfg.buffer_tokens
            for p in order:
                if over <= 0:
                    break
                if p.phase == REASONING and not p.pause_pending and not p.paused:
                    p.pause_pending = True
                    self.counters.pause_marks += 1
                    over -= p.tokens

    # -- placement -----------------------------------------------------------------

    def _estimate(self, tokens: int) -> int:
        """ThunderAgent's count of a request's tokens: exact once a response has set
        its chars-per-token ratio, before that at the default 5.0 chars per token."""
        if self.calibrated:
            return tokens
        return round(tokens * self.cfg.chars_per_token / DEFAULT_CHARS_PER_TOKEN)

    def _queued(self) -> bool:
        return any(p.paused or p.waiting_since is not None for p in self.programs.values())

    @property
    def _order(self) -> dict[str, int]:
        return {b: i for i, b in enumerate(self.backends)}

    def _need(self, p: Program) -> float:
        return p.tokens + self.cfg.buffer_tokens

    def _active_tokens(self, backend: str) -> int:
        return sum(
            p.tokens
            for p in self.programs.values()
            if p.backend == backend and p.started and not p.paused
        )

    def _least_loaded(self, now: float) -> str:
        return min(self.backends, key=lambda b: (self._active_tokens(b), self._order[b]))

    def _new_backend(self, p: Program, now: float) -> str | None:
        if self.cfg.new_placement == "router":
            assert p.backend is not None
            return p.backend if self.room(p.backend, now) >= self._need(p) else None
        fits = [b for b in self.backends if self.room(b, now) >= self._need(p)]
        if not fits:
            return None
        return min(fits, key=lambda b: (self._active_tokens(b), self._order[b]))

    def _admit(self, p: Program, backend: str, now: float) -> None:
        if p.backend is not None and p.backend != backend:
            self.counters.migrations += 1
        p.backend = backend
        p.paused = False
        p.pause_pending = False
        p.started = True
        p.last_seen = now
        p.waiting_since = None
