"""Read what a decision needs from a request body without materialising its token ids.

Pure: no I/O, no clock. :func:`scan_object` is a drop-in replacement for
:func:`kvproxy.proxy.body.parse_object` that does not build the big ``input_ids`` list
(36k Python ints for a 200 KB body, most of the parse's cost) nor re-serialise anything.

How it works
    1. *Locate*: for each counted key (``input_ids``, and ``prompt`` as token ids on
       ``/v1/completions``) find ``"key"`` followed by ``:`` and ``[`` with byte searches
       (``bytes.find`` is memchr-fast), then the array's closing ``]``. The array is
       *flat* when no ``[``, ``{``, ``}`` or ``"`` occurs inside it.
    2. *Count*: a flat array whose first element is an integer for orjson (1 to 19
       digits, no leading zero) and that has no trailing comma has ``commas + 1``
       elements: one count of its commas, in place (:mod:`kvproxy.proxy.bytecount`:
       numpy's vectorised compare where it is installed, else ``bytes.count``). Any
       other (a sign, a fraction, a literal first; nested lists as in a batch are not
       flat) is not excised and is parsed normally. The other elements are not looked
       at here: :meth:`BodyScan.validate` checks them (the character set, one
       ``bytes.translate`` pass; an array that is not digits only is parsed) for the
       callers that read an array itself. With ``count=False`` the count too is
       deferred to its first read: every flat array is excised.
    3. *Parse the rest*: the array's bytes are replaced by a sentinel string carrying a
       per-process random nonce and the remaining (small) document is parsed by orjson,
       so every other value, the top-level structure, escapes, unicode, numbers and
       duplicate keys are decided by the same parser as a full parse would use
       (orjson keeps the *last* of duplicate keys, in the position of the first).
    4. *Verify*: the parsed document must hold the sentinel at the top-level key. If
       not (the key was nested somewhere, duplicated, or written with escapes), the body
       is parsed in full: correct, just not faster.

Agreement with the full parse (property-tested in tests/unit/test_scan.py): for every
body, ``scan_object(raw)`` is None, or its :meth:`~BodyScan.validate` False, exactly
when ``parse_object(raw)`` is None, and otherwise ``dict(scan) == parse_object(raw)``
and every count is the full parse's; with one documented exception: ``validate()``
checks a digit array's character set, not element by element, so ``[1,,2]``, ``[1 2]``
and ``[1,02]`` (which no JSON encoder produces) pass where orjson would reject the body.
Before ``validate()`` an excised array is taken on trust past its first element
(``[1,abc]`` is counted as two): the request path reads only counts unless it goes on to
read an array (:func:`kvproxy.proxy.pipeline.plan_request` and the handler call
``validate()`` before such steps); a body forwarded without that check goes as received,
or with fields spliced in, and the engine answers 400 as it would without kvproxy.

The result, :class:`BodyScan`, is a read-only ``Mapping`` of the top-level members, so
the existing pure readers (``resolve_identity``, ``injection_plan``,
``request_priority``, ``completion_tokens``, ``prompt_chars``) accept it unchanged. An
excised array is materialised (by orjson, on its slice) only when someone indexes it;
the readers that only need its length use :attr:`BodyScan.prompt_token_count` and
:attr:`BodyScan.batch_size` instead (or :func:`prompt_token_count` / :func:`batch_size`,
which take a dict or a scan).

Wiring (for the request handler): ``parse_object(raw)`` becomes
``scan_object(raw, counted_keys_for(path))``; the scan is passed wherever the dict went
(``resolve_identity``, ``injection_plan``, ``AdmissionRequest.body``); in the sizer,
``exact_prompt_tokens`` and ``_batch_size`` become :func:`prompt_token_count` and
:func:`batch_size`. ``inject_fields`` keeps splicing into the raw bytes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from kvproxy import vocab
from kvproxy.proxy.bytecount import count_byte

# Top-level keys whose flat token-id arrays are counted instead of parsed.
COUNTED_KEYS: tuple[str, ...] = ("input_ids", "prompt")
# The keys worth looking for on each path: each absent key costs one search through
# the body (about a tenth of a full parse). Chat bodies carry ``messages`` (``input_ids``
# on chat is SGLang 0.5.23's rarely used extension), so they are parsed directly; a
# caller that expects ids on chat passes ``("input_ids",)`` itself.
_KEYS_BY_PATH: dict[str, tuple[str, ...]] = {
    "/generate": ("input_ids",),
    "/v1/completions": COUNTED_KEYS,
    "/v1/chat/completions": (),
}
_DEFAULT_KEYS: tuple[str, ...] = ("input_ids",)
# Arrays shorter than this are parsed normally (excising them saves nothing).
MIN_EXCISE_BYTES = 256
# At most this many digits and the first element is an int for orjson (u64 / i64 range).
_MAX_INT_DIGITS = 19

_WS = b" \t\r\n"
_DIGITS_AND_WS = b"0123456789 \t\r\n"
# An integer for orjson (1 to 19 digits, no leading zero) as an array's first element.
_FIRST_INT = re.compile(rb"[ \t\r\n]*(?:0|[1-9][0-9]{0,18})[ \t\r\n,\]]")
_NONCE = os.urandom(16).hex()

METHOD_SCAN = "scan"  # token arrays counted, the rest parsed
METHOD_FULL = "full"  # parsed in full (nothing to excise, or the scan could not decide)


def _sentinel(key: str) -> str:
    return f"\x00kvproxy-excised:{_NONCE}:{key}"


_SENTINELS = {key: _sentinel(key) for key in COUNTED_KEYS}
_SENTINEL_BYTES = {key: orjson.dumps(value) for key, value in _SENTINELS.items()}
_NEEDLES = {key: b'"' + key.encode() + b'"' for key in COUNTED_KEYS}


def counted_keys_for(path: str) -> tuple[str, ...]:
    """The keys worth counting on ``path``: ``prompt`` only on ``/v1/completions``, none
    on chat (see :data:`_KEYS_BY_PATH`)."""
    return _KEYS_BY_PATH.get(path, _DEFAULT_KEYS)


def _skip_ws(raw: bytes, pos: int, end: int) -> int:
    while pos < end and raw[pos] in _WS:
        pos += 1
    return pos


# Where a key is looked for: ``bytes.find`` in the body's first bytes, then quote by
# quote. ``bytes.find`` of an absent key costs about 0.8 ns per byte here (160 µs per
# 200 KB: a /v1/completions body has no ``input_ids``), while a token-id body has a few
# dozen quotes around its quote-free array, which ``memchr`` crosses in microseconds.
# Each quote costs about 0.3 µs, so small bodies are searched by bytes.find alone.
_KEY_HEAD = 8192
_QUOTE_STEPS = 64  # quotes examined before handing the rest back to bytes.find


def find_key(raw: bytes, needle: bytes) -> int:
    """``raw.find(needle)`` for a ``needle`` that starts with a quote, faster where the
    body's quotes are sparse (the same answer: every occurrence starts at a quote)."""
    i = raw.find(needle, 0, _KEY_HEAD)
    if i >= 0 or len(raw) <= _KEY_HEAD:
        return i
    i = raw.find(b'"', max(0, _KEY_HEAD - len(needle) + 1))  # not wholly in the head
    for _ in range(_QUOTE_STEPS):
        if i < 0 or raw.startswith(needle, i):
            return i
        i = raw.find(b'"', i + 1)
    return raw.find(needle, i)


def locate_array(raw: bytes, key: str) -> tuple[int, int] | None:
    """``(start, end)`` of the first ``"key": [ ... ]`` in ``raw`` whose interior holds
    no ``[``, ``{``, ``}`` or ``"`` (a *flat* array), else None.

    ``raw[start:end]`` is the array including its brackets. Four ``bytes.find`` calls
    over the array, about 10 µs per 200 KB: what the elements are is not looked at (see
    :func:`count_flat_ids`), nor whether the occurrence is the *top-level* member (see
    :func:`scan_object`).
    """
    needle = _NEEDLES.get(key) or b'"' + key.encode() + b'"'
    i = find_key(raw, needle)
    if i < 0:
        return None
    n = len(raw)
    p = i + len(needle)
    if p < n and raw[p] != 0x3A:  # whitespace before the ":" (the compact form has none)
        p = _skip_ws(raw, p, n)
    if p >= n or raw[p] != 0x3A:  # ":"
        return None
    p += 1
    if p < n and raw[p] != 0x5B:  # whitespace before the "["
        p = _skip_ws(raw, p, n)
    if p >= n or raw[p] != 0x5B:  # "["
        return None
    start = p
    close = raw.find(b"]", start + 1)
    if close < 0:
        return None
    for ch in (b"[", b"{", b"}", b'"'):
        if raw.find(ch, start + 1, close) >= 0:
            return None  # nested or not an array of numbers: parse it normally
    return start, close + 1


def count_flat_ids(raw: bytes, start: int, end: int) -> int | None:
    """Elements of the flat array ``raw[start:end]`` when it is made only of digits,
    commas and JSON whitespace and its first element is an integer for orjson; else None.

    One ``bytes.translate`` pass (about 0.33 ms per 200 KB here): the cost of counting.
    """
    inner = raw[start + 1 : end - 1]
    commas = inner.translate(None, _DIGITS_AND_WS)
    if commas.translate(None, b","):
        return None  # signs, fractions, exponents, literals: parse it normally
    body = inner.strip(_WS)
    if not body:
        return 0 if not commas else None
    if body[0] == 0x2C or body[-1] == 0x2C:  # leading or trailing comma
        return None
    first_end = body.find(b",")
    first = body[: first_end if first_end >= 0 else len(body)].rstrip(_WS)
    if len(first) > _MAX_INT_DIGITS or (len(first) > 1 and first[0] == 0x30):
        return None  # a float for orjson, or a leading zero: let the parser decide
    return len(commas) + 1


def count_elements(raw: bytes, start: int, end: int) -> int | None:
    """Elements of the flat array ``raw[start:end]`` counted by its commas, when its first
    element is an integer for orjson (1 to 19 digits, no leading zero) and it has no
    trailing comma; else None.

    One count of the commas over the array in place (no copy, no character-set pass;
    :func:`~kvproxy.proxy.bytecount.count_byte`): for every *valid* array whose first
    element is an integer this is the full parse's length (``vocab.token_list_length``).
    The other elements are not looked at; :func:`count_flat_ids` checks them
    (:meth:`BodyScan.validate`).
    """
    last = end - 1  # the "]"
    if _FIRST_INT.match(raw, start + 1, end) is None:
        # Empty, or a sign, a fraction, a literal, a float for orjson first: parse it.
        return 0 if _skip_ws(raw, start + 1, last) == last else None
    back = last - 1
    while raw[back] in _WS:
        back -= 1
    if raw[back] == 0x2C:  # a trailing comma
        return None
    return count_byte(raw, 0x2C, start + 1, last) + 1  # vectorised where numpy is


def locate_flat_array(raw: bytes, key: str) -> tuple[int, int, int] | None:
    """``(start, end, count)`` of the first ``"key": [digits, ...]`` in ``raw``, else None:
    :func:`locate_array`, then :func:`count_flat_ids`."""
    span = locate_array(raw, key)
    if span is None:
        return None
    count = count_flat_ids(raw, *span)
    return None if count is None else (span[0], span[1], count)


def _as_int(value: Any) -> int | None:
    """An integral JSON number (not bool): ints, and floats with no fraction."""
    if type(value) is int:
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


_NONE: dict[Any, Any] = {}  # shared, never written: BodyScan only reads it
_NO_KEYS: frozenset[str] = frozenset()


class BodyScan(Mapping[str, Any]):
    """The top-level members of a JSON-object request body, token arrays counted lazily.

    A read-only ``Mapping``: ``scan["sampling_params"]``, ``scan.get("rid")``,
    ``"session_id" in scan`` behave exactly as on the dict a full parse returns. The
    properties below are what the session and admission decisions read.
    """

    __slots__ = (
        "_checked",
        "_counts",
        "_doc",
        "_materialised",
        "_raw",
        "_spans",
        "members",
        "method",
    )

    def __init__(
        self,
        doc: dict[str, Any],
        *,
        raw: bytes = b"",
        spans: dict[str, tuple[int, int]] | None = None,
        counts: dict[str, int] | None = None,
        method: str = METHOD_FULL,
    ) -> None:
        self._doc = doc
        # The top-level members as a plain dict, for readers of the small fields (a
        # dict's ``get`` costs no Python call): an excised array's member is a
        # placeholder string there, so read token arrays through the mapping.
        self.members: Mapping[str, Any] = doc
        self._raw = raw
        self._spans: dict[str, tuple[int, int]] = spans if spans is not None else _NONE
        self._counts: dict[str, int] = counts if counts is not None else _NONE
        self._materialised: dict[str, Any] = {}
        # Excised arrays whose interior validate() has checked (a parsed one is too).
        self._checked: set[str] | None = None
        self.method = method

    # -- Mapping ---------------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        if key in self._spans:
            value = self._materialised.get(key)
            if value is None:
                start, end = self._spans[key]
                value = self._materialised[key] = orjson.loads(self._raw[start:end])
            return value
        return self._doc[key]

    def get(self, key: str, default: Any = None) -> Any:
        if key in self._spans:
            return self[key]
        return self._doc.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._doc

    def __iter__(self) -> Iterator[str]:
        return iter(self._doc)

    def __len__(self) -> int:
        return len(self._doc)

    def __repr__(self) -> str:
        counted = ", ".join(f"{k}=<{n} ids>" for k, n in self._counts.items())
        return f"BodyScan(method={self.method!r}, keys={list(self._doc)}, {counted})"

    def to_dict(self) -> dict[str, Any]:
        """The body as a plain dict (materialises excised arrays)."""
        return {key: self[key] for key in self._doc}

    @property
    def size_bytes(self) -> int:
        """The raw body's length (0 when it was built from a parsed document)."""
        return len(self._raw)

    # -- token ids -------------------------------------------------------------------
    @property
    def excised(self) -> tuple[str, ...]:
        """The keys whose arrays were counted and not parsed."""
        return tuple(self._spans)

    def token_count(self, key: str) -> int | None:
        """Length of the token-id list at ``key`` (a batch: summed lengths), else None.

        An excised array is counted by its commas (:func:`count_elements`), on the scan
        with ``count=True``, else on this first read; one whose first element is not an
        integer is parsed, as the full parse would have been. Its other elements are
        taken on trust until :meth:`validate`."""
        count = self._counts.get(key)
        if count is not None:
            return count
        if key not in self._spans:
            return vocab.token_list_length(self._doc.get(key))
        try:
            count = (
                None if key in self._materialised else count_elements(self._raw, *self._spans[key])
            )
            if count is None:
                count = vocab.token_list_length(self[key])
        except orjson.JSONDecodeError:
            return None  # not JSON at all: validate() says so
        if count is not None:
            self._counts[key] = count
        return count

    @property
    def deferred(self) -> tuple[str, ...]:
        """The keys whose arrays were excised and are neither checked by :meth:`validate`
        nor parsed yet: the body is a JSON object only if they are valid JSON."""
        checked, built = self._checked or _NO_KEYS, self._materialised
        return tuple(k for k in self._spans if k not in checked and k not in built)

    def validate(self) -> bool:
        """Check the excised arrays as the full parse would have: False when one is not
        valid JSON (then the body is not a JSON object at all). The interior of a digit
        array is checked for its character set (one ``bytes.translate`` pass); any other
        is parsed.

        Call it before anything reads an excised array itself rather than its count."""
        for key in self.deferred:
            if count_flat_ids(self._raw, *self._spans[key]) is not None:
                if self._checked is None:
                    self._checked = set()
                self._checked.add(key)
                continue
            try:
                self[key]  # parsed (and kept): what the full parse would have said
            except orjson.JSONDecodeError:
                return False
        return True

    @property
    def prompt_token_count(self) -> int | None:
        """Prompt tokens carried as ids: ``input_ids``, else a token-id ``prompt``.

        Equals ``reservation.exact_prompt_tokens`` of the full parse."""
        n = self.token_count("input_ids")
        if n is None:
            n = self.token_count("prompt")
        return n

    @property
    def input_ids_count(self) -> int | None:
        return self.token_count("input_ids")

    @property
    def batch_size(self) -> int:
        """Prompts in a native ``/generate`` batch (1 when not batched).

        Equals ``reservation._batch_size`` of the full parse."""
        if "input_ids" not in self._spans:  # an excised array is flat: not a batch
            ids = self._doc.get("input_ids")
            if type(ids) is list and ids and type(ids[0]) is list:
                return len(ids)
        text = self._doc.get("text")
        if type(text) is list:
            return max(1, len(text))
        return 1

    # -- small fields ----------------------------------------------------------------
    @property
    def session_id(self) -> Any:
        return self._doc.get("session_id")

    @property
    def session_params(self) -> Any:
        return self._doc.get("session_params")

    @property
    def rid(self) -> Any:
        return self._doc.get("rid")

    @property
    def priority(self) -> Any:
        return self._doc.get("priority")

    @property
    def stream(self) -> bool:
        return self._doc.get("stream") is True

    @property
    def sampling_params(self) -> Any:
        """A dict, a list of dicts (a batch), or whatever the client sent."""
        return self._doc.get("sampling_params")

    @property
    def max_new_tokens(self) -> int | None:
        sp = self._doc.get("sampling_params")
        return _as_int(sp.get("max_new_tokens")) if isinstance(sp, dict) else None

    @property
    def n(self) -> int | None:
        """``sampling_params.n`` (/generate), else the top-level ``n`` (OpenAI)."""
        sp = self._doc.get("sampling_params")
        value = sp.get("n") if isinstance(sp, dict) else None
        if value is None:
            value = self._doc.get("n")
        return _as_int(value)

    @property
    def max_tokens(self) -> int | None:
        return _as_int(self._doc.get("max_tokens"))

    @property
    def max_completion_tokens(self) -> int | None:
        return _as_int(self._doc.get("max_completion_tokens"))

    @property
    def nvext(self) -> dict[str, Any] | None:
        value = self._doc.get("nvext")
        return value if isinstance(value, dict) else None

    @property
    def agent_hints(self) -> dict[str, Any] | None:
        nvext = self.nvext
        value = nvext.get("agent_hints") if nvext is not None else None
        return value if isinstance(value, dict) else None

    @property
    def session_control(self) -> dict[str, Any] | None:
        nvext = self.nvext
        value = nvext.get("session_control") if nvext is not None else None
        return value if isinstance(value, dict) else None

    @property
    def has_text(self) -> bool:
        return self._doc.get("text") is not None

    @property
    def has_messages(self) -> bool:
        return self._doc.get("messages") is not None


def prompt_token_count(body: Mapping[str, Any]) -> int | None:
    """``reservation.exact_prompt_tokens`` for a dict or a :class:`BodyScan` (no list
    built for the latter): the drop-in for the sizer's reads."""
    if type(body) is BodyScan:  # (the ABC's isinstance is a Python-level call)
        return body.prompt_token_count
    n = vocab.token_list_length(body.get("input_ids"))
    return n if n is not None else vocab.token_list_length(body.get("prompt"))


def batch_size(body: Mapping[str, Any]) -> int:
    """``reservation._batch_size`` for a dict or a :class:`BodyScan`."""
    if type(body) is BodyScan:
        return body.batch_size
    ids = body.get("input_ids")
    if type(ids) is list and ids and type(ids[0]) is list:
        return len(ids)
    text = body.get("text")
    return max(1, len(text)) if type(text) is list else 1


def members(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """The body's top-level members as a plain mapping: a scan's :attr:`BodyScan.members`
    (token arrays are placeholders there), a dict as it is. For the planners that read
    only the small fields (session id, rid, ``nvext``, sampling parameters)."""
    return body.members if type(body) is BodyScan else body


def validated(body: Mapping[str, Any]) -> bool:
    """:meth:`BodyScan.validate` for a scan; True for a dict (a full parse's result)."""
    return body.validate() if type(body) is BodyScan else True


def _full(raw: bytes) -> BodyScan | None:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return BodyScan(doc, raw=raw, method=METHOD_FULL) if isinstance(doc, dict) else None


def _arrays_to_excise(
    raw: bytes, keys: tuple[str, ...], count: bool
) -> list[tuple[int, int, str, int]]:
    """``(start, end, key, count)`` of each array worth excising, sorted by position
    (count -1: deferred)."""
    found: list[tuple[int, int, str, int]] = []
    for key in keys:
        span = locate_array(raw, key)
        if span is None or span[1] - span[0] < MIN_EXCISE_BYTES:
            continue
        n = count_elements(raw, *span) if count else -1
        if n is not None:
            found.append((span[0], span[1], key, n))
    found.sort()
    return found


def scan_object(
    raw: bytes, keys: tuple[str, ...] = COUNTED_KEYS, *, count: bool = True
) -> BodyScan | None:
    """The body as a :class:`BodyScan`, or None when it is not a JSON object.

    Same answer as :func:`kvproxy.proxy.body.parse_object` (see the module docstring
    for the one documented difference), without building flat token-id arrays under
    ``keys`` (a subset of :data:`COUNTED_KEYS`; :func:`counted_keys_for` gives the
    path's). Bodies too small to hold an array worth excising are parsed directly.

    ``count=False`` defers the arrays' counting (and checking) to the first read of a
    count or of :meth:`BodyScan.validate`: for callers that need neither (session
    lifecycle without admission) the arrays are only located.
    """
    if len(raw) < MIN_EXCISE_BYTES:
        return _full(raw) if raw else None
    found = _arrays_to_excise(raw, keys, count)
    if not found:
        return _full(raw)
    parts: list[bytes] = []
    spans: dict[str, tuple[int, int]] = {}
    counts: dict[str, int] = {}  # the scan's own (a count read later is added)
    prev = 0
    for start, end, key, n in found:
        if start < prev:  # overlapping finds cannot both be top-level arrays
            return _full(raw)
        parts += (raw[prev:start], _SENTINEL_BYTES[key])
        prev = end
        spans[key] = (start, end)
        if n >= 0:
            counts[key] = n
    parts.append(raw[prev:])
    try:
        doc = orjson.loads(b"".join(parts))
    except orjson.JSONDecodeError:
        return _full(raw)
    if type(doc) is not dict:
        return _full(raw)
    for key in spans:
        if doc.get(key) != _SENTINELS[key]:
            # The occurrence found was nested, overridden by a later duplicate, or the
            # top-level key was spelled with escapes: the scan cannot decide.
            return _full(raw)
    return BodyScan(doc, raw=raw, spans=spans, counts=counts, method=METHOD_SCAN)


__all__ = [
    "COUNTED_KEYS",
    "METHOD_FULL",
    "METHOD_SCAN",
    "BodyScan",
    "batch_size",
    "count_elements",
    "count_flat_ids",
    "counted_keys_for",
    "find_key",
    "locate_array",
    "locate_flat_array",
    "members",
    "prompt_token_count",
    "scan_object",
    "validated",
]
