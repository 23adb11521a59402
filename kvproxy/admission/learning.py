"""What admission knows of a request's size, and learns from its engine's answer.

* :meth:`Learning.size`: the reservation a request is sized at (None when its body
  cannot be read: the caller fails open);
* :meth:`Learning.first_turn`: a session's first request, whose cached tokens are
  the prefix every session shares;
* :meth:`Learning.observe`: what an engine reported for a finished request calibrates
  the sizer (chars per token, the shared prefix) and, in program mode, gives the
  session's context to the per-engine ledger.

No I/O and no awaits; time is injected. Its one side effect outside its own state:
a rate-limited warning when a body or a report cannot be used.
"""

from __future__ import annotations

from kvproxy.admission.program.core import ProgramCore
from kvproxy.admission.records import AdmissionRequest
from kvproxy.admission.reservation import ReservationSizer
from kvproxy.observability import RateLimitedLog

# Bound on remembered first-request tickets (a request that never reports is dropped).
_FIRST_TURNS_MAX = 10_000


class Learning:
    """Sizing requests and calibrating the sizer from engines' usage reports."""

    __slots__ = ("_first_turns", "_log", "_program", "sizer")

    def __init__(self, sizer: ReservationSizer, program: ProgramCore, log: RateLimitedLog) -> None:
        self.sizer = sizer
        self._program = program
        self._log = log
        # Tickets of sessions' first requests, until the engine reports their usage.
        self._first_turns: dict[str, bool] = {}

    def size(self, req: AdmissionRequest) -> int | None:
        """The request's reservation in tokens; None when the body cannot be sized."""
        sized = self.sized(req)
        return None if sized is None else sized[0]

    def sized(self, req: AdmissionRequest) -> tuple[int, int] | None:
        """The request's reservation in tokens and its completion part (what it asks to
        decode); None when the body cannot be sized."""
        try:
            r = self.sizer.size(req.path, req.body, req.session_id)
            return r.tokens, r.completion_tokens
        except Exception:  # fail open on a body the sizer cannot read
            self._log.warning(
                "size", "admission: cannot size request %s", req.ticket_id, exc_info=True
            )
            return None

    def first_turn(self, ticket: str) -> None:
        """A session's first request: what it finds cached is the shared prefix."""
        first_turns = self._first_turns
        first_turns[ticket] = True
        if len(first_turns) > _FIRST_TURNS_MAX:
            del first_turns[next(iter(first_turns))]

    def learns_from(self, req: AdmissionRequest) -> bool:
        """Whether the engine's usage report for ``req`` would teach :meth:`observe`
        anything: a session's first turn (the shared prefix), a turn program admission
        let run (the session's context), a text prompt (the chars-per-token
        calibration)."""
        ticket = req.ticket_id
        return (
            ticket in self._first_turns
            or self._program.running(ticket)
            or self.sizer.calibrates_from(req.body)
        )

    def observe(
        self,
        req: AdmissionRequest,
        now: float,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        completion_tokens: int | None,
        *,
        enabled: bool,
    ) -> None:
        """Learn from what an engine reported for a finished request (nothing but
        forgetting its first-turn mark when admission is off)."""
        first_turn = self._first_turns.pop(req.ticket_id, False)
        if not enabled:
            return
        program = self._program
        if prompt_tokens is not None and program.running(req.ticket_id):
            try:
                program.observe_response(
                    req.ticket_id,
                    now,
                    prompt_tokens=int(prompt_tokens),
                    completion_tokens=None if completion_tokens is None else int(completion_tokens),
                    cached_tokens=None if cached_tokens is None else int(cached_tokens),
                )
            except Exception:
                self._log.warning("observe", "admission: usage not recorded", exc_info=True)
        try:
            if prompt_tokens is not None:
                self.sizer.observe(req.body, req.session_id, int(prompt_tokens))
            if first_turn and cached_tokens is not None:
                self.sizer.observe_shared(int(cached_tokens))
        except Exception:
            self._log.warning("calibrate", "admission: calibration failed", exc_info=True)
