"""The request vocabulary: how kvproxy reads headers and body fields of a request.

Pure, no I/O. Identity (:mod:`kvproxy.sessions.identity`), classification
(:mod:`kvproxy.admission.classify`) and reservation sizing
(:mod:`kvproxy.admission.reservation`) read requests only through these helpers, so
a header means the same thing everywhere:

* :func:`header`: case-insensitive lookup that works for aiohttp's multidicts and
  for plain dicts (tests, tools);
* :data:`TRUTHY` / :func:`is_truthy`: the ONE set of values a boolean header
  accepts (``1``, ``true``, ``yes``, ``on``; case and surrounding space ignored);
* :func:`nvext_section`: ``body["nvext"][name]`` when both are JSON objects
  (``session_control``, ``agent_hints``);
* :func:`sample_count`: the request's ``n``; :func:`body_rid`: its ``rid``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

TRUTHY: frozenset[str] = frozenset({"1", "true", "yes", "on"})

_CASE_INSENSITIVE = (CIMultiDict, CIMultiDictProxy)
# The mapping types whose ``get`` ignores case (a caller may read them directly).
CASE_INSENSITIVE = _CASE_INSENSITIVE


def header(headers: Mapping[str, str], name: str) -> str | None:
    """The value of header ``name`` (case-insensitive), or None."""
    value = headers.get(name)
    if value is not None or type(headers) in _CASE_INSENSITIVE:
        return value
    lname = name.lower()
    for key, val in headers.items():
        if key.lower() == lname:
            return val
    return None


def is_truthy(value: str | None) -> bool:
    """True for a header value in :data:`TRUTHY` (None is false)."""
    return value is not None and value.strip().lower() in TRUTHY


def header_flag(headers: Mapping[str, str], name: str) -> bool:
    """Header ``name`` is present with a value in :data:`TRUTHY`."""
    value = header(headers, name)  # is_truthy, inlined (read on every request)
    return value is not None and value.strip().lower() in TRUTHY


# A JSON object read here is a dict (orjson's) or a request body's scan: a dict is
# recognised by its type first, since ``isinstance`` against the ``Mapping`` ABC runs
# a Python-level ``__instancecheck__`` (these helpers run on every request).


def nvext_section(body: Mapping[str, Any] | None, name: str) -> Mapping[str, Any] | None:
    """``body["nvext"][name]`` when ``nvext`` and the section are JSON objects."""
    if body is None:
        return None
    nvext = body.get("nvext")
    if nvext is None or not (type(nvext) is dict or isinstance(nvext, Mapping)):
        return None
    section = nvext.get(name)
    if section is None or not (type(section) is dict or isinstance(section, Mapping)):
        return None
    return section


def exact_int(value: Any) -> int | None:
    """An integer JSON value (an int, or a float with no fraction); bools are not."""
    if type(value) is int:
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def sample_count(body: Mapping[str, Any]) -> int:
    """``n`` of a request: ``sampling_params.n`` (/generate), else top-level ``n`` (OpenAI).

    1 when absent or not a positive integer.
    """
    n: Any = None
    sp = body.get("sampling_params")
    if sp is not None and (type(sp) is dict or isinstance(sp, Mapping)):
        n = sp.get("n")
    if n is None:
        n = body.get("n")
        if n is None:
            return 1
    count = exact_int(n)
    return count if count is not None and count >= 1 else 1


def body_rid(body: Mapping[str, Any]) -> Any:
    """The body's ``rid`` as sent: a string, a list (a batch), or None."""
    return body.get("rid")


def token_list_length(value: Any) -> int | None:
    """Length of a token-id list, or summed lengths of a batch of them; else None."""
    if not isinstance(value, list):
        return None
    if not value:
        return 0
    first = value[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return len(value)
    if isinstance(first, list):
        return sum(len(v) for v in value if isinstance(v, list))
    return None
