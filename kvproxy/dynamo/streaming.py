"""Streaming-session translation for ``session_control.action: open``. Pure.

SGLang's streaming sessions (engine flag ``--enable-streaming-session``) keep a
session's KV in per-session slots outside eviction between turns. What this module
relies on, read in SGLang's ``python/sglang/srt/session/session_controller.py``
(``Session.create_req``, ``_share_token_arrays``, ``_strip_bos_token``,
``SessionController.maybe_reap``) and ``managers/io_struct.py``
(``OpenSessionReqInput``):

- ``POST /open_session {"capacity_of_str_len", "session_id", "streaming": true,
  "timeout"}`` opens one; the engine reaps it ``timeout`` seconds after the start of
  its last turn (checked every second), deferred while a turn runs;
- each later turn is ``/generate`` with ``session_params: {"id": sid}`` and only the
  new tokens; the engine's prompt is the previous turn's ``origin_input_ids`` plus
  its ``output_ids[:max_new_tokens]`` plus the new tokens, minus one leading BOS token
  on the appended part;
- one request in flight per session; ``replace``, ``drop_previous_output`` and a
  non-zero ``offset`` are refused; top-level ``session_id`` together with
  ``session_params`` is a 400 (``GenerateReqInput``);
- an aborted turn leaves the session at its last finished turn.

kvproxy translates a client's ordinary full-context turn into that form only when it
*exactly* extends what the engine holds (previous prompt + output); every other case
falls back to an ordinary full request and closes the streaming session, so the
generated tokens are the same either way. Only ``/generate`` requests with
``input_ids`` are translated. An engine error on a translated turn is retried as the
ordinary request before the client sees anything: a non-streaming answer is read whole
first; a streamed one (SGLang reports errors as a first ``data: {"error": ...}`` event
with HTTP 200) is held until its first event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Plan kinds.
PLAIN = "plain"  # not a streaming session: forward as usual
OPEN = "open"  # open the session on the engine, send the first turn in session form
EXTEND = "extend"  # send only the new tokens with session_params
FALLBACK = "fallback"  # ordinary full request; close the streaming session if open

# Fall-back reasons (counted in metrics under these names).
R_NOT_GENERATE = "not_generate"
R_NO_INPUT_IDS = "no_input_ids"
R_BATCH = "batch_or_n"
R_CLIENT_SESSION_PARAMS = "client_session_params"
R_PLACEMENT_UNKNOWN = "placement_unknown"
R_MOVED = "placement_moved"
R_IN_FLIGHT = "turn_in_flight"
R_BRANCH = "branch"
R_MISMATCH = "mismatch"
R_NO_NEW_TOKENS = "no_new_tokens"
R_LEADING_BOS = "leading_bos"
R_ENGINE_ERROR = "engine_error"
R_OPEN_FAILED = "open_failed"
R_CONTEXT_CHECK = "context_check"
R_POOL_SHARE = "pool_share"
R_RELEASED = "released_for_room"

# SGLang's default max_new_tokens (sampling_params.py), for a turn that sets none.
DEFAULT_MAX_NEW_TOKENS = 128

# The capacity kvproxy asks for on /open_session (a required field; the streaming
# session does not enforce it).
OPEN_CAPACITY = 1 << 20


def request_shape(path: str, body: Mapping[str, Any]) -> tuple[list[int] | None, str | None]:
    """``(input_ids, None)`` when the request can be translated, else ``(None, reason)``."""
    if path != "/generate":
        return None, R_NOT_GENERATE
    if body.get("session_params") is not None:
        return None, R_CLIENT_SESSION_PARAMS
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or body.get("text") is not None:
        return None, R_NO_INPUT_IDS
    if isinstance(ids[0], list) or isinstance(body.get("rid"), list):
        return None, R_BATCH
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return None, R_NO_INPUT_IDS
    sp = body.get("sampling_params")
    if isinstance(sp, list) or (isinstance(sp, Mapping) and sp.get("n") not in (None, 1)):
        return None, R_BATCH
    return ids, None


@dataclass(frozen=True, slots=True)
class Slot:
    """What kvproxy knows one streaming session holds on its engine."""

    session_id: str
    engine: str
    # Previous turn's prompt + output: the engine's context for the next turn.
    context: tuple[int, ...] = ()
    # The first prompt token (a BOS the engine would strip from an appended turn).
    first_token: int | None = None
    in_flight: bool = False
    timeout_s: float | None = None
    # While a turn is in flight: the KV it will pin once it has run (its footprint),
    # counted instead of ``context`` so that concurrent turns cannot overbook a pool.
    reserved: int = 0

    @property
    def held(self) -> int:
        return max(len(self.context), self.reserved)


@dataclass(frozen=True, slots=True)
class Plan:
    kind: str
    reason: str | None = None
    # EXTEND: the new tokens; OPEN: the whole prompt.
    input_ids: tuple[int, ...] = ()
    # FALLBACK: a streaming session exists and must be closed on this engine.
    close_engine: str | None = None
    engine: str | None = None


def plan_turn(
    slot: Slot | None,
    *,
    opening: bool,
    input_ids: Sequence[int] | None,
    ineligible: str | None,
    engine: str | None,
) -> Plan:
    """Decide how to send one turn of a session.

    ``opening``: the request asks for ``action: open``; ``input_ids``/``ineligible``
    come from :func:`request_shape`; ``engine`` is the placement mirror's owner of the
    session's routing key now (None: unknown).
    """
    if slot is None:
        if not opening:
            return Plan(PLAIN)
        if ineligible is not None:
            return Plan(FALLBACK, ineligible)
        if engine is None:
            return Plan(FALLBACK, R_PLACEMENT_UNKNOWN)
        assert input_ids is not None
        return Plan(OPEN, input_ids=tuple(input_ids), engine=engine)
    close = slot.engine

    def fallback(reason: str) -> Plan:
        return Plan(FALLBACK, reason, close_engine=close)

    if ineligible is not None:
        return fallback(ineligible)
    if slot.in_flight:
        return fallback(R_IN_FLIGHT)
    if engine is None:
        return fallback(R_PLACEMENT_UNKNOWN)
    if engine != slot.engine:
        return fallback(R_MOVED)
    assert input_ids is not None
    reason = _extension_mismatch(slot, input_ids)
    if reason is not None:
        return fallback(reason)
    return Plan(EXTEND, input_ids=tuple(input_ids[len(slot.context) :]), engine=engine)


def _extension_mismatch(slot: Slot, input_ids: Sequence[int]) -> str | None:
    """Why ``input_ids`` does not extend the slot's context by new tokens (None: it does)."""
    ctx = slot.context
    n = len(ctx)
    if len(input_ids) <= n:
        prefix_ok = list(input_ids) == list(ctx[: len(input_ids)])
        return R_NO_NEW_TOKENS if prefix_ok and len(input_ids) == n else R_BRANCH
    if list(input_ids[:n]) != list(ctx):
        return R_MISMATCH
    if slot.first_token is not None and input_ids[n] == slot.first_token:
        # SGLang strips a leading BOS from an appended turn: the engine's prompt would
        # not be the client's. (A first token that is not a BOS also lands here: safe.)
        return R_LEADING_BOS
    return None


def turn_footprint(body: Mapping[str, Any]) -> int:
    """KV one turn of a streaming session pins once it has run: its full prompt plus its
    output budget (``max_new_tokens``, SGLang's default when absent).

    Read on every request of a fleet that holds a streaming slot: the proxy's
    ``BodyScan`` gives the ids' count without building the list."""
    counted = getattr(body, "input_ids_count", None)
    if counted is not None:
        n = int(counted)
    else:
        ids = body.get("input_ids")
        n = len(ids) if isinstance(ids, list) else 0
    sp = body.get("sampling_params")
    mnt = sp.get("max_new_tokens") if isinstance(sp, Mapping) else None
    if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 0:
        mnt = DEFAULT_MAX_NEW_TOKENS
    return n + mnt


def pool_share_check(
    *,
    footprint: int,
    session_held: int,
    own_held: int,
    reported_held: int | None,
    capacity: int | None,
    share: float,
) -> str | None:
    """Whether a streaming session may open (or keep its slot for) its next turn on an
    engine: ``None`` when it may, else :data:`R_POOL_SHARE` (the session goes as an
    ordinary request and, for a later turn, its slot is closed first).

    Pinned KV is never evicted, so the streaming sessions of one engine must leave room
    for everything else: the KV held by the engine's *other* streaming sessions plus
    this session's ``footprint`` (:func:`turn_footprint`) must stay within ``share`` of
    the engine's ``capacity`` (``max_total_num_tokens``). Held KV is the larger of
    kvproxy's own count on that engine (``own_held``, exact for the slots it opened and
    current) and the engine's last reported ``sglang:streaming_session_held_tokens``
    (``reported_held``, which may include sessions kvproxy did not open); both include
    ``session_held``, this session's own slot, which is not counted twice. An unknown
    capacity admits (nothing to compare with).
    """
    if capacity is None or capacity <= 0:
        return None
    held = max(own_held, reported_held or 0) - session_held
    if max(held, 0) + footprint > share * capacity:
        return R_POOL_SHARE
    return None


def slots_to_release(
    slots: Sequence[Slot], *, engine: str, footprint: int, capacity: int | None
) -> list[Slot]:
    """Idle slots on ``engine`` to close, least recently used first, so that an ordinary
    request of ``footprint`` tokens can be admitted there: pinned KV is never evicted,
    so a request larger than the pool's unpinned part would otherwise wait for ever
    (and block the queue behind it, including the turns that would free the slots).

    ``slots`` in least-recently-used order. Releases until the KV the engine's slots
    still pin plus ``footprint`` fits ``capacity``; every idle slot when even that is not
    enough; none when the capacity is unknown. Slots with a turn in flight are kept.
    """
    if capacity is None or capacity <= 0:
        return []
    mine = [s for s in slots if s.engine == engine]
    pinned = sum(s.held for s in mine)
    out: list[Slot] = []
    for s in mine:
        if pinned + footprint <= capacity:
            break
        if s.in_flight:
            continue
        out.append(s)
        pinned -= s.held
    return out


def session_body(
    body: Mapping[str, Any], fields: Mapping[str, Any], input_ids: Sequence[int], sid: str
) -> dict[str, Any]:
    """The request in streaming-session form: ``session_params`` and ``input_ids``
    replaced, no top-level ``session_id`` (SGLang rejects the two together); every
    other key as the client sent it, plus kvproxy's fields (rid, priority)."""
    out = {k: v for k, v in body.items() if k != "session_id"}
    out.update({k: v for k, v in fields.items() if k != "session_id"})
    out["input_ids"] = list(input_ids)
    out["session_params"] = {"id": sid}
    return out


def after_turn(
    slot: Slot,
    *,
    prompt: Sequence[int],
    output_ids: Sequence[int] | None,
    prompt_tokens: int | None,
) -> tuple[Slot | None, str | None]:
    """The slot after a translated turn answered 200; ``(None, reason)`` when the
    session can no longer be trusted (close it, later turns go as ordinary requests).

    The engine's own ``prompt_tokens`` must equal the client's full prompt: a check
    that the engine's context is what kvproxy thinks it is.
    """
    if output_ids is None or prompt_tokens != len(prompt):
        return None, R_CONTEXT_CHECK
    return (
        Slot(
            session_id=slot.session_id,
            engine=slot.engine,
            context=(*prompt, *output_ids),
            first_token=slot.first_token if slot.first_token is not None else prompt[0],
            in_flight=False,
            timeout_s=slot.timeout_s,
        ),
        None,
    )


def read_generate_result(doc: Any) -> tuple[list[int] | None, int | None, bool]:
    """``(output_ids, prompt_tokens, aborted)`` from a non-streaming /generate body."""
    if not isinstance(doc, Mapping):
        return None, None, True
    ids = doc.get("output_ids")
    meta = doc.get("meta_info")
    meta = meta if isinstance(meta, Mapping) else {}
    finish = meta.get("finish_reason")
    aborted = isinstance(finish, Mapping) and finish.get("type") == "abort"
    pt = meta.get("prompt_tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        ids = None
    return ids, pt if isinstance(pt, int) else None, aborted


class SlotTable:
    """Bounded table of open streaming sessions, least recently used first."""

    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self._slots: OrderedDict[str, Slot] = OrderedDict()

    def get(self, sid: str) -> Slot | None:
        return self._slots.get(sid)

    def put(self, slot: Slot) -> list[Slot]:
        """Store ``slot``; returns the slots pushed out to stay in bounds (close them)."""
        self._slots[slot.session_id] = slot
        self._slots.move_to_end(slot.session_id)
        evicted: list[Slot] = []
        while len(self._slots) > self.max_slots:
            _, old = self._slots.popitem(last=False)
            evicted.append(old)
        return evicted

    def pop(self, sid: str) -> Slot | None:
        return self._slots.pop(sid, None)

    def __len__(self) -> int:
        return len(self._slots)

    def held_tokens(self, engine: str | None = None) -> int:
        """Tokens the slots hold (on ``engine`` only, when given)."""
        return sum(s.held for s in self._slots.values() if engine is None or s.engine == engine)

    def items(self) -> list[Slot]:
        return list(self._slots.values())


__all__ = [
    "EXTEND",
    "FALLBACK",
    "OPEN",
    "OPEN_CAPACITY",
    "PLAIN",
    "Plan",
    "Slot",
    "SlotTable",
    "after_turn",
    "plan_turn",
    "pool_share_check",
    "read_generate_result",
    "request_shape",
    "session_body",
    "slots_to_release",
    "turn_footprint",
]
