"""The intercepted request as data: what to do with it, decided without I/O.

Pure: no sockets, no clock, no shared state. The handler (:mod:`kvproxy.proxy.handlers`)
and the lab (:mod:`kvlab.lab.proxy`) run the same steps:

1. :func:`plan_request` turns one intercepted request (path, the ``/sessions/{id}``
   prefix's id, headers, the body as :func:`read_body` reads it, the config) into a
   :class:`Plan` or a :class:`Refusal` (the error the proxy answers itself: stable
   type and message);
2. the turn (:class:`kvproxy.proxy.turn.TurnFlow`, written once for both) applies the
   stateful parts in order (the injection counters, the Dynamo turn, session
   tracking, the admission wait); :func:`with_turn_headers` folds the turn's routing
   headers into the plan and derives the admission routing key;
3. :func:`final_fields` adds the top-level ``priority`` once admission has answered,
   and :func:`render_body` produces the bytes to forward (spliced, never re-encoded,
   except on the two documented re-serialising paths).

Nothing here raises for bad input: bad input is a :class:`Refusal` (so is a bad
``/close_session`` call: :func:`close_target`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import orjson

from kvproxy.config import Config, SessionLifecycleConfig
from kvproxy.dynamo.nvext import NO_NVEXT, InvalidNvext, Nvext, parse_nvext
from kvproxy.dynamo.nvext import combine_priority as _combine_priority
from kvproxy.proxy.body import BodyParts, inject_fields, splice_parts
from kvproxy.proxy.errors import STATUS, ErrorType
from kvproxy.proxy.scan import BodyScan, counted_keys_for, members, scan_object, validated
from kvproxy.record import Record
from kvproxy.sessions.identity import (
    NO_IDENTITY,
    ROUTING_KEY_HEADER,
    InjectionPlan,
    InvalidSessionId,
    TooManyRids,
    injection_plan,
    new_rid,
    resolve_identity,
)


@dataclass(frozen=True, slots=True)
class Refusal:
    """The proxy answers this request itself: ``status`` with ``{"error": {type, message}}``."""

    kind: ErrorType
    message: str

    @property
    def status(self) -> int:
        return STATUS[self.kind]


# No top-level fields, no headers: the shared defaults (never written).
_NONE: Mapping[str, Any] = MappingProxyType({})


class Plan(Record):
    """What the shell does with one intercepted request.

    ``body`` None: forward the bytes as received, nothing else (features off, or the
    body is not a JSON object). Built on every intercepted request, and rebuilt once
    with a turn's headers: a record (kvproxy.record), read-only, the cheapest to build.
    """

    __slots__ = (
        "abort_rids",
        "admit",
        "body",
        "close_after",
        "fields",
        "headers",
        "injection",
        "nvext",
        "overwrite",
        "parent_id",
        "priority_hint",
        "routing_key",
        "session_id",
        "strip_nvext",
        "ticket",
        "track",
        "turn",
    )

    def __init__(
        self,
        body: Mapping[str, Any] | None,
        fields: Mapping[str, Any] = _NONE,
        overwrite: bool = False,
        headers: Mapping[str, str] = _NONE,
        session_id: str | None = None,
        close_after: bool = False,
        abort_rids: tuple[str, ...] = (),
        ticket: str = "",
        injection: InjectionPlan | None = None,
        nvext: Nvext = NO_NVEXT,
        track: bool = False,
        admit: bool = False,
        routing_key: str | None = None,
        turn: bool = False,
        strip_nvext: bool = False,
        priority_hint: int | None = None,
        parent_id: str | None = None,
    ) -> None:
        self.body: Final = body
        # Top-level fields to add (``overwrite``: one replaces a member the body has).
        self.fields: Final = fields
        self.overwrite: Final = overwrite
        # Request headers to set on the forwarded request.
        self.headers: Final = headers
        # The session the request belongs to (lifecycle tracking, admission residency).
        self.session_id: Final = session_id
        self.close_after: Final = close_after
        # Rids an abort of this request names (client disconnect before the end).
        self.abort_rids: Final = abort_rids
        # The admission ticket (the engine-visible rid when known).
        self.ticket: Final = ticket
        # The injection decision, for the lifecycle's counters (None: lifecycle off).
        self.injection: Final = injection
        self.nvext: Final = nvext
        # Track the request in the session table (lifecycle on, a session).
        self.track: Final = track
        # Wait for admission; ``routing_key`` attributes program admission to a ring owner.
        self.admit: Final = admit
        self.routing_key: Final = routing_key
        # Open a Dynamo turn for the session (lifecycle on, a session).
        self.turn: Final = turn
        # Forward without the top-level ``nvext`` (session_lifecycle.strip_nvext_paths).
        self.strip_nvext: Final = strip_nvext
        # Priority source: the client's agent_hints.priority when agent hints are on.
        self.priority_hint: Final = priority_hint
        # The session's parent, when it names one (docs/sessions.md, "Parent sessions").
        self.parent_id: Final = parent_id

    @property
    def passthrough(self) -> bool:
        return self.body is None

    def with_headers(self, headers: Mapping[str, str], routing_key: str | None) -> Plan:
        """This plan with other request headers and routing key."""
        return Plan(
            self.body,
            self.fields,
            self.overwrite,
            headers,
            self.session_id,
            self.close_after,
            self.abort_rids,
            self.ticket,
            self.injection,
            self.nvext,
            self.track,
            self.admit,
            routing_key,
            self.turn,
            self.strip_nvext,
            self.priority_hint,
            self.parent_id,
        )


PASS_THROUGH = Plan(body=None)


def _body_rid(body: Mapping[str, Any]) -> str | None:
    rid = body.get("rid")
    return rid if isinstance(rid, str) else None


def _lifecycle_plan(
    config: Config,
    path: str,
    path_session_id: str | None,
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    admit: bool,
) -> Plan | Refusal:
    lc = config.session_lifecycle
    top = members(body)  # the small fields, read without a Python call each
    try:
        nvext = parse_nvext(top)  # Dynamo's nvext (docs/dynamo.md)
    except InvalidNvext as bad_nvext:  # (one name per type: mypyc types a name once)
        return Refusal(ErrorType.INVALID_REQUEST, str(bad_nvext))
    try:
        identity = resolve_identity(lc, path_session_id=path_session_id, headers=headers, body=top)
    except InvalidSessionId as bad_id:
        return Refusal(ErrorType.INVALID_SESSION_ID, str(bad_id))
    try:
        inj = injection_plan(lc, identity, top, headers=headers)
    except TooManyRids as too_many:
        return Refusal(ErrorType.INVALID_REQUEST, str(too_many))
    sid = identity.session_id
    plan = Plan(
        body=body,
        fields=inj.fields,  # built for this request and never changed: not copied
        overwrite=bool(inj.overwrites),
        headers=inj.headers,
        session_id=sid,
        close_after=identity.close_after,
        abort_rids=inj.abort_rids,
        ticket=inj.rid or _body_rid(top) or new_rid(),
        injection=inj,
        nvext=nvext,
        track=sid is not None,
        turn=sid is not None,
        admit=admit,
        strip_nvext=path in lc.strip_nvext_paths and "nvext" in top,
        priority_hint=nvext.hints.priority if lc.agent_hints else None,
        parent_id=identity.parent_id,
    )
    if _reads_token_arrays(lc, plan) and not validated(body):
        return PASS_THROUGH  # a deferred token array is not JSON: as the full parse says
    return plan


def _reads_token_arrays(lc: SessionLifecycleConfig, plan: Plan) -> bool:
    """Whether a step after the plan reads a token array itself, not only its count: the
    two re-serialising paths of :func:`render_body` and the speculative prefill (session
    control's streaming turns check for themselves, in the handler)."""
    return (
        plan.strip_nvext
        or plan.overwrite
        or (lc.speculative_prefill and plan.nvext.hints.speculative_prefill)
    )


# The session-id sources with lifecycle semantics off, for the config last seen (a memo:
# the replace is not redone per request; a reload brings a new config object).
_IDENTITY_ONLY: list[tuple[SessionLifecycleConfig, SessionLifecycleConfig]] = []


def _identity_only(lc: SessionLifecycleConfig) -> SessionLifecycleConfig:
    if _IDENTITY_ONLY and _IDENTITY_ONLY[0][0] is lc:
        return _IDENTITY_ONLY[0][1]
    derived = dataclasses.replace(lc, enabled=True)
    _IDENTITY_ONLY[:] = [(lc, derived)]
    return derived


def _admission_only_plan(
    config: Config, path_session_id: str | None, headers: Mapping[str, str], body: Mapping[str, Any]
) -> Plan:
    # Admission alone still needs the session (its KV stays resident between turns),
    # read from the same sources; nothing is injected or refused.
    identity_only = _identity_only(config.session_lifecycle)
    top = members(body)
    try:
        identity = resolve_identity(
            identity_only, path_session_id=path_session_id, headers=headers, body=top
        )
    except InvalidSessionId:
        identity = NO_IDENTITY
    sid = identity.session_id
    routing_key, extra = _routing_key(config, sid, headers, _NONE)
    return Plan(
        body=body,
        session_id=sid,
        ticket=_body_rid(top) or new_rid(),
        admit=True,
        headers=extra,
        routing_key=routing_key,
        parent_id=identity.parent_id,
    )


def _routing_key(
    config: Config, sid: str | None, headers: Mapping[str, str], planned: Mapping[str, str]
) -> tuple[str | None, Mapping[str, str]]:
    """Program admission's routing key for session ``sid`` (the client's header, else the
    planned one, else the session id, then added to the forwarded headers)."""
    if sid is None or not (config.admission.enabled and config.admission.mode == "program"):
        return None, planned
    key = headers.get(ROUTING_KEY_HEADER) or planned.get(ROUTING_KEY_HEADER)
    if key is not None:
        return key, planned
    return sid, {**planned, ROUTING_KEY_HEADER: sid}


def read_body(config: Config, path: str, raw: bytes) -> BodyScan | None:
    """The intercepted body as the plan reads it (None: not a JSON object): token-id
    arrays are never built, and counted only for admission's sizer; the lifecycle alone
    needs neither the list nor its count (:func:`~kvproxy.proxy.scan.scan_object`)."""
    return scan_object(raw, counted_keys_for(path), count=config.admission.enabled)


def plan_request(
    config: Config,
    path: str,
    path_session_id: str | None,
    headers: Mapping[str, str],
    body: Mapping[str, Any] | None,
) -> Plan | Refusal:
    """Decide what to do with one intercepted request (see the module docstring).

    ``body``: the parsed (or scanned) JSON object, None when the body is not one. The
    ticket is the body's or the planned rid, else a fresh random one (the only input
    not in the arguments: random, not time).
    """
    lifecycle_on = config.session_lifecycle.enabled
    admission_on = config.admission.enabled
    if body is None or not (lifecycle_on or admission_on):
        return PASS_THROUGH
    if lifecycle_on:
        # A session's routing key waits for its turn's headers (with_turn_headers).
        return _lifecycle_plan(config, path, path_session_id, headers, body, admission_on)
    return _admission_only_plan(config, path_session_id, headers, body)


def with_turn_headers(
    plan: Plan, config: Config, headers: Mapping[str, str], turn_headers: Mapping[str, str]
) -> Plan:
    """Fold a Dynamo turn's routing headers (bind / open route stickily) into ``plan``
    (the client's own headers win), then derive program admission's routing key: every
    request of a session carries it, so the session is attributed to one ring owner."""
    merged: Mapping[str, str] = plan.headers
    if turn_headers:
        added = {k: v for k, v in turn_headers.items() if headers.get(k) is None}
        merged = {**added, **plan.headers}  # the plan's own headers win, as setdefault did
    if not plan.admit:
        if merged is plan.headers:
            return plan
        return plan.with_headers(merged, plan.routing_key)
    routing_key, merged = _routing_key(config, plan.session_id, headers, merged)
    if merged is plan.headers and routing_key == plan.routing_key:
        return plan
    return plan.with_headers(merged, routing_key)


def final_fields(plan: Plan, steering: int | None) -> tuple[Mapping[str, Any], str | None]:
    """The fields to add once admission has answered, and the priority's source when a
    ``priority`` is added (the combination rule: dynamo/nvext.py)."""
    assert plan.body is not None
    if steering is None and plan.priority_hint is None:
        return plan.fields, None  # no priority to add (the common case): nothing to copy
    fields = dict(plan.fields)
    prio, source = _combine_priority(
        top_level=plan.body.get("priority"), hint=plan.priority_hint, steering=steering
    )
    if prio is None or "priority" in fields:
        return fields, None
    fields["priority"] = prio
    return fields, source


def _materialise(body: Mapping[str, Any]) -> dict[str, Any]:
    to_dict = getattr(body, "to_dict", None)
    return to_dict() if callable(to_dict) else dict(body)


# A body from this size is forwarded as its spliced parts, never joined into one copy.
PARTS_MIN_BYTES = 65536


def render_body(raw: bytes, plan: Plan, fields: Mapping[str, Any]) -> bytes | BodyParts:
    """The body to forward: ``raw`` with ``fields`` spliced in after the opening brace,
    as bytes, or from :data:`PARTS_MIN_BYTES` as its parts (views of ``raw`` around
    the fields' bytes: sent in order, they are the same bytes, and ``raw`` is not
    copied).

    Re-serialised only when ``nvext`` must be stripped or a configured source
    outranks the body's own ``session_id`` (both rare and configured).
    """
    if plan.body is None:
        return raw
    if plan.strip_nvext:
        doc = {k: v for k, v in _materialise(plan.body).items() if k != "nvext"}
        return orjson.dumps({**doc, **fields})
    if not fields:
        return raw
    if plan.overwrite:
        return orjson.dumps({**_materialise(plan.body), **fields})
    if len(raw) >= PARTS_MIN_BYTES:
        return splice_parts(raw, fields)
    return inject_fields(raw, fields)


# Who serves a client's POST /close_session (close_route).
CLOSE_LIFECYCLE: Final = "lifecycle"  # kvproxy: the session's close sequence (SGLang's API)
CLOSE_RESIDENCY: Final = "residency"  # admission's residency ends; the router answers
CLOSE_ROUTER: Final = "router"  # the router alone, like any other path


def close_route(config: Config) -> str:
    """Who serves ``POST /close_session`` with ``config``: the session lifecycle when it
    is on, else admission (its residency ends, then the request goes to the router as it
    came), else the router alone."""
    if config.session_lifecycle.enabled:
        return CLOSE_LIFECYCLE
    if config.admission.enabled:
        return CLOSE_RESIDENCY
    return CLOSE_ROUTER


def close_target(raw: bytes, path_sid: str | None) -> str | Refusal:
    """The session a ``/close_session`` call names (body, else the path's), or why not."""
    sid: object = None
    if raw.strip():
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError:
            doc = None
        if not isinstance(doc, dict):
            return Refusal(
                ErrorType.INVALID_REQUEST, "body must be a JSON object with a session_id"
            )
        sid = doc.get("session_id")
    if path_sid is not None:
        if sid is not None and sid != path_sid:
            return Refusal(
                ErrorType.INVALID_REQUEST,
                f"body session_id {sid!r} does not match the path's session {path_sid!r}",
            )
        sid = path_sid
    if not isinstance(sid, str):
        return Refusal(
            ErrorType.INVALID_REQUEST, "body must be a JSON object with a string session_id"
        )
    return sid


__all__ = [
    "CLOSE_LIFECYCLE",
    "CLOSE_RESIDENCY",
    "CLOSE_ROUTER",
    "PARTS_MIN_BYTES",
    "PASS_THROUGH",
    "Plan",
    "Refusal",
    "close_route",
    "close_target",
    "final_fields",
    "plan_request",
    "read_body",
    "render_body",
    "with_turn_headers",
]
