"""Session identity: where a request's session id comes from, and what to inject.

Pure: no I/O, no clock. The proxy calls :func:`split_session_path` on the raw path,
:func:`resolve_identity` on the request, then :func:`injection_plan` to learn which
top-level fields and headers to add before forwarding.

A session id is 1..``id_max_length`` characters from ``[A-Za-z0-9._:@-]``. The set
is deliberately narrow: ids travel in URLs, headers, JSON and log lines, and the
engine's ``/abort_request`` / ``/close_session`` compare them verbatim.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final
from urllib.parse import unquote

from kvproxy import vocab
from kvproxy.config import SessionLifecycleConfig
from kvproxy.record import Record

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
SESSION_PATH_PREFIX = "/sessions/"
RID_LENGTH = 32  # 16 random bytes in hex

_ID_RE = re.compile(r"[A-Za-z0-9._:@-]+")

# Why an injection was skipped (InjectionPlan.skip_reason).
SKIP_DISABLED = "disabled"
SKIP_NO_SESSION = "no_session"
SKIP_NOT_JSON_OBJECT = "not_json_object"
SKIP_SESSION_PARAMS = "session_params"
SKIP_ALREADY_PRESENT = "already_present"


class InvalidSessionId(ValueError):
    """A session id failed validation. ``str(exc)`` is safe to return to the client."""

    def __init__(self, source: str, reason: str) -> None:
        self.source = source
        self.reason = reason
        super().__init__(f"invalid session id from {_SOURCE_LABELS.get(source, source)}: {reason}")


_SOURCE_LABELS = {
    "body": "the body field session_id",
    "header": "the session header",
    "nvext": "the body field nvext.session_control.session_id",
    "routing_key": f"the {ROUTING_KEY_HEADER} header",
    "path": "the /sessions/{session_id}/ path prefix",
    "close": "the close request",
}


def validate_session_id(value: Any, max_length: int, *, source: str) -> str:
    """Return ``value`` if it is a valid session id, else raise :class:`InvalidSessionId`."""
    if not isinstance(value, str):
        raise InvalidSessionId(source, f"must be a string (got {type(value).__name__})")
    if not value:
        raise InvalidSessionId(source, "must not be empty")
    if len(value) > max_length:
        raise InvalidSessionId(
            source, f"is {len(value)} characters long (at most {max_length} allowed)"
        )
    if not _ID_RE.fullmatch(value):
        bad = sorted({c for c in value if not _ID_RE.fullmatch(c)})
        shown = "".join(bad[:8])
        raise InvalidSessionId(
            source,
            f"contains characters outside [A-Za-z0-9._:@-] ({shown!r})",
        )
    return value


def split_session_path(path: str) -> tuple[str | None, str]:
    """Split a ``/sessions/{session_id}/...`` prefix off ``path``.

    ``"/sessions/abc/v1/chat/completions"`` -> ``("abc", "/v1/chat/completions")``;
    ``"/sessions/abc"`` -> ``("abc", "/")``; any other path -> ``(None, path)``.

    ``path`` may be raw (percent-encoded) or already decoded. The id segment is
    percent-decoded once, strictly (malformed escapes or invalid UTF-8 raise
    :class:`InvalidSessionId`); the rest of the path is returned unchanged. The id
    is not checked against the character set here: :func:`resolve_identity` does
    that, with the configured length limit.
    """
    if not path.startswith(SESSION_PATH_PREFIX):
        return None, path
    tail = path[len(SESSION_PATH_PREFIX) :]
    segment, slash, rest = tail.partition("/")
    if not segment:
        raise InvalidSessionId("path", "the segment after /sessions/ is empty")
    if "%" in segment:
        if re.search(r"%(?![0-9A-Fa-f]{2})", segment):
            raise InvalidSessionId("path", "malformed percent-encoding")
        try:
            segment = unquote(segment, errors="strict")
        except UnicodeDecodeError as exc:
            raise InvalidSessionId("path", "percent-encoding is not valid UTF-8") from exc
    return segment, (slash + rest) if slash else "/"


class SessionIdentity(Record):
    __slots__ = ("close_after", "session_id", "source")

    def __init__(self, session_id: str | None, source: str | None, close_after: bool) -> None:
        self.session_id: Final = session_id
        self.source: Final = source
        # The request is the session's last turn: close the session once it completes.
        self.close_after: Final = close_after

    @property
    def present(self) -> bool:
        return self.session_id is not None


NO_IDENTITY = SessionIdentity(None, None, False)


# Requests are read through the shared vocabulary (kvproxy.vocab).
_header = vocab.header


def _session_control(body: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    return vocab.nvext_section(body, "session_control")


def resolve_identity(
    cfg: SessionLifecycleConfig,
    *,
    path_session_id: str | None,
    headers: Mapping[str, str],
    body: Mapping[str, Any] | None,
) -> SessionIdentity:
    """Find the request's session id in the sources ``cfg.id_sources``, in order.

    The first source that carries a value wins, and that value must be valid
    (otherwise :class:`InvalidSessionId`; later sources are not consulted). A JSON
    ``null`` counts as absent. With the feature disabled nothing is read or
    validated and the request has no identity.
    """
    if not cfg.enabled:
        return NO_IDENTITY
    # Dynamo's session_control (an id source, and its close action): read only when the
    # body has an nvext at all (most have none).
    control = _session_control(body) if body is not None and "nvext" in body else None
    session_id: str | None = None
    source: str | None = None
    for src in cfg.id_sources:
        value: Any = None
        if src == "body":
            value = body.get("session_id") if body is not None else None
        elif src == "header":
            value = _header(headers, cfg.id_header)
        elif src == "nvext":
            value = control.get("session_id") if control is not None else None
        elif src == "routing_key":
            value = _header(headers, ROUTING_KEY_HEADER)
        elif src == "path":
            value = path_session_id
        if value is None:
            continue
        session_id = validate_session_id(value, cfg.id_max_length, source=src)
        source = src
        break
    if session_id is None:
        return NO_IDENTITY
    close_after = bool(control is not None and control.get("action") == "close")
    if not close_after and cfg.final_header:
        # The same truthy values as every other boolean header (vocab.TRUTHY).
        close_after = vocab.header_flag(headers, cfg.final_header)
    return SessionIdentity(session_id, source, close_after)


# Rids drawn from the kernel per ``os.urandom`` call: one system call per this many
# requests, not one per request (a ``getrandom`` call costs about 0.5 µs on the
# benchmark host, docs/benchmarks.md; the pool of rids not yet handed out is ~20 KB).
RID_BATCH = 256
_rids: list[str] = []  # drawn, not yet handed out (popped: each is handed out once)


def new_rid() -> str:
    """A fixed-length request id: 16 random bytes as 32 hex characters.

    SGLang's scheduler aborts by rid *prefix*; equal-length random ids cannot be
    prefixes of one another. (The same randomness as ``uuid4().hex`` at a fraction of
    its cost: no UUID object, and the kernel's random bytes drawn :data:`RID_BATCH`
    rids at a time.) Random, not a counter: a client sees its own rid in the response,
    and must not be able to predict another's (a request sent with it would collide
    with that one in the engine); rids drawn together are independent random bytes
    all the same. A forked child starts with none drawn (``os.register_at_fork``), so
    two processes never hand out the same rids.
    """
    if not _rids:
        drawn = os.urandom(RID_LENGTH // 2 * RID_BATCH).hex()
        _rids.extend(drawn[i : i + RID_LENGTH] for i in range(0, len(drawn), RID_LENGTH))
    return _rids.pop()


os.register_at_fork(after_in_child=_rids.clear)


# No fields, no headers: the shared defaults (never written).
_NONE: Mapping[str, Any] = MappingProxyType({})


class InjectionPlan(Record):
    __slots__ = (
        "abort_rids",
        "fields",
        "headers",
        "overwrites",
        "rid",
        "rid_generated",
        "skip_reason",
    )

    def __init__(
        self,
        fields: Mapping[str, Any] = _NONE,
        overwrites: tuple[str, ...] = (),
        headers: Mapping[str, str] = _NONE,
        rid: str | None = None,
        abort_rids: tuple[str, ...] = (),
        rid_generated: bool = False,
        skip_reason: str | None = None,
    ) -> None:
        # Top-level JSON fields to set. A key listed in ``overwrites`` is already in the
        # body (with another value) and must be replaced; every other key is new.
        self.fields: Final = fields
        self.overwrites: Final = overwrites
        # Request headers to set on the forwarded request.
        self.headers: Final = headers
        # The rid the engine will see (generated or the client's), None when unknown
        # (no JSON object body, or a non-string rid such as a batch list).
        self.rid: Final = rid
        # Every rid an abort of this request must name: the rid, and for n > 1 the
        # engine-expanded ``{rid}_{i}`` (SGLang's tokenizer matches rids exactly).
        self.abort_rids: Final = abort_rids
        self.rid_generated: Final = rid_generated
        # Why no session_id is injected (None when it is): one of the SKIP_* values.
        self.skip_reason: Final = skip_reason

    @property
    def injects_session_id(self) -> bool:
        return "session_id" in self.fields

    @property
    def counts_as_skipped(self) -> bool:
        """The session id was withheld on purpose (counted as injection_skipped)."""
        return self.skip_reason == SKIP_SESSION_PARAMS

    @property
    def empty(self) -> bool:
        return not self.fields and not self.headers


EMPTY_PLAN = InjectionPlan(skip_reason=SKIP_DISABLED)


class TooManyRids(ValueError):
    """The request names more rids than ``session_lifecycle.max_rids_per_request``."""


def _abort_rids(rid: Any, n: int, generated: bool, cfg: SessionLifecycleConfig) -> tuple[str, ...]:
    """The rids an abort of this request names: bounded, and prefix-safe.

    SGLang's scheduler aborts every rid that *starts with* the one named, so a short
    client rid ("0") would abort other clients' requests. kvproxy's own rids (32
    random hex characters) are always named; a client's only when at least
    ``abort_rid_min_length`` long (else the request is ended by dropping its upstream
    connection, which the engine turns into an abort of that request alone). ``n``
    samples of one rid expand to ``{rid}_{i}`` (SGLang's tokenizer matches rids
    exactly) only up to ``max_rids_per_request``; a rid list longer than that is
    :class:`TooManyRids` (400)."""
    cap = cfg.max_rids_per_request
    if isinstance(rid, list) and len(rid) > cap:
        raise TooManyRids(
            f"rid: {len(rid)} rids in one request; at most "
            f"session_lifecycle.max_rids_per_request ({cap})"
        )
    if isinstance(rid, str) and rid:
        if not generated and len(rid) < cfg.abort_rid_min_length:
            return ()
        if 1 < n < cap:
            return (rid, *(f"{rid}_{i}" for i in range(n)))
        return (rid,)
    if isinstance(rid, list) and rid and all(isinstance(r, str) and r for r in rid):
        return tuple(r for r in rid if len(r) >= cfg.abort_rid_min_length)
    return ()


def injection_plan(
    cfg: SessionLifecycleConfig,
    identity: SessionIdentity,
    body: Mapping[str, Any] | None,
    *,
    headers: Mapping[str, str] | None = None,
) -> InjectionPlan:
    """Decide which top-level fields and headers to add to an intercepted request.

    - ``session_id``: added when the request has an identity, unless the body has
      ``session_params`` (SGLang rejects both together; skip_reason
      ``session_params``) or already carries the same top-level ``session_id``.
    - ``rid``: a new fixed-length rid when the body has none (JSON null counts as
      none), so the request can be aborted. Applies with or without a session.
    - ``X-SMG-Routing-Key: <session_id>`` when ``sticky_routing`` is on, unless the
      client sent its own routing key (``headers``, when given).

    Nothing else in the body changes. A rid list longer than
    ``max_rids_per_request`` raises :class:`TooManyRids`.
    """
    if not cfg.enabled:
        return EMPTY_PLAN
    if body is None:  # not a JSON object
        return InjectionPlan(skip_reason=SKIP_NOT_JSON_OBJECT)
    # Built as the final values, not as a list and dicts then copied (every
    # intercepted request is planned here).
    fields: dict[str, Any] = {}
    overwrites: tuple[str, ...] = ()
    skip: str | None = None

    sid = identity.session_id
    if sid is None:
        skip = SKIP_NO_SESSION
    elif body.get("session_params") is not None:
        skip = SKIP_SESSION_PARAMS
    else:
        existing = body.get("session_id")
        if existing == sid:
            skip = SKIP_ALREADY_PRESENT
        else:
            fields["session_id"] = sid
            if "session_id" in body:
                overwrites = ("session_id",)

    rid: Any = vocab.body_rid(body)
    generated = rid is None
    if generated:
        rid = fields["rid"] = new_rid()
        if "rid" in body:  # explicit null
            overwrites = (*overwrites, "rid")

    out_headers: Mapping[str, str] = _NONE
    if (
        sid is not None
        and cfg.sticky_routing
        and (headers is None or _header(headers, ROUTING_KEY_HEADER) is None)
    ):
        out_headers = {ROUTING_KEY_HEADER: sid}

    n = vocab.sample_count(body)
    return InjectionPlan(  # positional (a keyword call costs twice as much), in field order:
        fields,
        overwrites,
        out_headers,
        rid if isinstance(rid, str) else None,  # rid
        _abort_rids(rid, n, generated, cfg),  # abort_rids
        generated,  # rid_generated
        skip,  # skip_reason
    )
