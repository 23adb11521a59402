"""The records one simulated rank's scheduler passes around: requests, sessions, batches.

Pure data: a request and its runtime fields (owned by the scheduler's parts, listed in
:mod:`kvlab.sim.scheduler`), a streaming or legacy session's record, a batch and the
events of a step, plus :class:`SimError` (what SGLang answers for a request it
rejects) and the finish reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvlab.sim.kvcache import Node
from kvlab.sim.tokenizer import OutputStream


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


def fill_ids(req: SimRequest) -> list[int]:
    """The sequence a (re-)admitted request prefills: its prompt and what it generated."""
    assert req.out is not None
    return req.input_ids + req.out.ids(req.generated)


def abort_reason(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def natural_reason(req: SimRequest) -> dict[str, Any]:
    """The finish reason of a request that ran to its end: its stop token or its length."""
    if req.stop_token is not None and req.generated >= req.target_len:
        return {"type": "stop", "matched": req.stop_token}
    return {"type": "length", "length": req.max_new_tokens}
