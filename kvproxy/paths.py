"""Which paths kvproxy forwards to the router, and the one canonical form of a path.

Pure. kvproxy forwards the router's data plane only: the paths of
``router.forward_paths`` (:data:`DEFAULT_FORWARD_PATHS` by default). Anything else
(smg's control plane: ``/workers``, ``/flush_cache``, ``/wasm``, ...) is answered 404
by kvproxy itself, unless ``router.forward_control_plane`` is on and the request
carries the admin bearer token.

A pattern is an exact path (``/generate``) or a path followed by ``/*``, which
matches the path's sub-resources, one or more segments below it
(``/v1/responses/*`` matches ``/v1/responses/abc/cancel``, not ``/v1/responses``).
``/*`` alone matches every path. Matching is a set lookup per segment: nothing is
compiled per request.

A request path is checked once, on the raw request target, before it is routed
(:func:`path_problem`): encoded ``/``, ``?`` and ``#`` (``%2F``, ``%3F``, ``%23``, any
case), dot segments (``.``, ``..``, encoded or not), empty segments and a fragment are
refused, so the decoded path kvproxy routes on has one meaning, and the forward sends
exactly that path, encoded (:func:`encoded_path`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote

# The router's data plane (smg's serving and public routes): what clients of an LLM
# endpoint call. smg's control plane (/workers, /flush_cache, /start_profile,
# /stop_profile, /get_loads, /wasm, /v1/tokenizers, /parse/*) is not in it.
DEFAULT_FORWARD_PATHS: tuple[str, ...] = (
    "/generate",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/responses/*",
    "/v1/conversations",
    "/v1/conversations/*",
    "/v1/messages",
    "/v1/embeddings",
    "/v1/rerank",
    "/rerank",
    "/v1/classify",
    "/v1/tokenize",
    "/v1/detokenize",
    "/v1/models",
    "/health",
    "/health_generate",
    "/liveness",
    "/readiness",
    "/get_model_info",
    "/get_server_info",
)

# kvproxy's own prefix: never forwarded, whatever the patterns say.
OWN_PREFIX = "/kvproxy/"

_SUB = "/*"
# Encoded delimiters a decoded path would give another meaning to.
_ENCODED_DELIMITERS = ("%2f", "%3f", "%23")
_DOT_SEGMENTS = frozenset({".", ".."})
# Characters left as they are in a forwarded path (RFC 3986 pchar and "/").
_PATH_SAFE = "/:@!$&'()*+,;=-._~"


@dataclass(frozen=True, slots=True)
class ForwardRules:
    """Compiled ``router.forward_paths``: exact paths and sub-resource prefixes."""

    exact: frozenset[str]
    prefixes: frozenset[str]  # "/v1/responses" for "/v1/responses/*"; "" for "/*"

    def allows(self, path: str) -> bool:
        """Whether ``path`` (decoded and canonical) is forwarded to the router."""
        if path in self.exact:
            return not path.startswith(OWN_PREFIX)
        prefixes = self.prefixes
        if not prefixes or path.startswith(OWN_PREFIX):
            return False
        i = path.rfind("/")
        while i >= 0:
            if path[:i] in prefixes:
                return True
            i = path.rfind("/", 0, i)
        return False


def pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` is not a valid ``router.forward_paths`` entry; None when it is."""
    if not isinstance(pattern, str) or not pattern.startswith("/"):
        return "must be a path starting with /"
    if pattern == _SUB:
        return None
    base = pattern[: -len(_SUB)] if pattern.endswith(_SUB) else pattern
    if "*" in base:
        return "a * may only end a pattern, as /*"
    if any(c in base for c in "?#% \t") or not base.isascii():
        return "must be a plain ASCII path without ?, #, % or spaces"
    problem = path_problem(base)
    if problem is not None:
        return problem
    if base.startswith(OWN_PREFIX) or base == OWN_PREFIX.rstrip("/"):
        return "kvproxy's own /kvproxy/ paths are never forwarded"
    return None


def compile_forward_paths(patterns: Iterable[str]) -> ForwardRules:
    """The rules of valid ``patterns`` (checked with :func:`pattern_problem` first)."""
    exact: set[str] = set()
    prefixes: set[str] = set()
    for pattern in patterns:
        if pattern.endswith(_SUB):
            prefixes.add(pattern[: -len(_SUB)])
        else:
            exact.add(pattern)
    return ForwardRules(frozenset(exact), frozenset(prefixes))


def path_problem(raw_target: str) -> str | None:
    """Why the raw request target (path and query, as received) is refused; None when
    its path is canonical. The common path (no ``%``, no ``/.``, no ``//``, no ``#``)
    costs four substring tests."""
    if "%" not in raw_target and "/." not in raw_target and "//" not in raw_target:
        return "a fragment (#) is not part of a request target" if "#" in raw_target else None
    if "#" in raw_target:
        return "a fragment (#) is not part of a request target"
    path = raw_target.partition("?")[0]
    lower = path.lower()
    for encoded in _ENCODED_DELIMITERS:
        if encoded in lower:
            return f"an encoded delimiter ({encoded.upper()}) in the path"
    if "//" in path:
        return "an empty segment (//) in the path"
    if "/." in path or "%2e" in lower:
        for segment in lower.split("/"):
            if segment.replace("%2e", ".") in _DOT_SEGMENTS:
                return "a dot segment (. or ..) in the path"
    return None


@functools.lru_cache(maxsize=1024)
def encoded_path(path: str) -> str:
    """``path`` (decoded) as sent upstream: percent-encoded, ``%`` included, so the
    router decodes exactly the path kvproxy routed on."""
    return quote(path, safe=_PATH_SAFE)


def encoded_query(raw_query: str) -> str:
    """The raw query string as received, with anything not ASCII encoded."""
    if raw_query.isascii():
        return raw_query
    return quote(raw_query, safe="/:@!$&'()*+,;=-._~?%")


__all__ = [
    "DEFAULT_FORWARD_PATHS",
    "OWN_PREFIX",
    "ForwardRules",
    "compile_forward_paths",
    "encoded_path",
    "encoded_query",
    "path_problem",
    "pattern_problem",
]
