"""Reservation sizing: how many KV tokens one forwarded attempt may occupy.

Pure. ``reservation = prompt tokens + completion budget`` (the Relax V2 formula,
``compute_reservation_tokens``), computed from the request body alone.

Prompt tokens
    * ``input_ids`` (``/generate``, or chat on SGLang 0.5.23): its length exactly; a
      batch (list of lists) sums the lengths. ``/v1/completions`` with a token-id
      ``prompt`` is counted the same way.
    * Otherwise the prompt is text (``text``, ``prompt``, chat ``messages`` and
      ``tools``). kvproxy does not tokenize: it counts characters and divides by a
      chars-per-token ratio, rounding up. The ratio is learned per session from the
      ``prompt_tokens`` the engines report back for that session's earlier requests
      (an exponentially weighted mean, so it follows the session's language and
      chat template), falls back to a fleet-wide learned ratio for a session never
      seen, and to ``admission.chars_per_token`` before anything was learned. The
      per-session table is bounded (least recently used sessions are forgotten).
      Chat messages add a small fixed per-message allowance for the template's role
      markers; image and audio parts are not counted. A tokenizer hook (exact counts
      for text prompts, as an optional extra) is a possible future extension; the
      estimate is deliberately cheap because it runs for every request.

Completion budget (per generated sequence)
    ``sampling_params.max_new_tokens`` (``/generate``), ``max_completion_tokens`` or
    ``max_tokens`` (OpenAI), else ``nvext.agent_hints.osl`` (an expected output
    length), else ``admission.default_completion_tokens`` (the rollout's maximum
    response length); then ``min(budget, completion_cap)`` where the cap is
    ``admission.expected_decode_cap`` (default: ``default_completion_tokens``). The
    budget is multiplied by the number of sequences: ``n`` and, for a batched
    ``/generate``, the batch size (a list of ``sampling_params`` is summed item by
    item).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

import orjson

from kvproxy import vocab
from kvproxy.config import AdmissionConfig
from kvproxy.record import Record

# Characters allowed per chat message for the template's role markers and separators.
MESSAGE_OVERHEAD_CHARS = 16
# Learned ratios are clamped to this range (a bad report cannot poison the estimate).
MIN_CHARS_PER_TOKEN = 0.5
MAX_CHARS_PER_TOKEN = 16.0

SOURCE_INPUT_IDS = "input_ids"
SOURCE_SESSION = "session"
SOURCE_GLOBAL = "global"
SOURCE_DEFAULT = "default"
SOURCE_NONE = "none"


class Reservation(Record):
    __slots__ = (
        "completion_tokens",
        "prompt_chars",
        "prompt_source",
        "prompt_tokens",
        "shared_tokens",
    )

    def __init__(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        prompt_source: str,
        prompt_chars: int = 0,
        shared_tokens: int = 0,
    ) -> None:
        self.prompt_tokens: Final = prompt_tokens
        self.completion_tokens: Final = completion_tokens
        self.prompt_source: Final = prompt_source  # input_ids | session | global | default | none
        # Characters behind an estimated prompt (0 when prompt_tokens is exact).
        self.prompt_chars: Final = prompt_chars
        # Prompt tokens left out of ``prompt_tokens`` as the learned shared prefix.
        self.shared_tokens: Final = shared_tokens

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


# -- prompt -------------------------------------------------------------------------------


def exact_prompt_tokens(body: Mapping[str, Any]) -> int | None:
    """Prompt tokens when the body carries token ids (``input_ids`` or a token-id ``prompt``).

    The proxy passes a ``kvproxy.proxy.scan.BodyScan``, which has counted the ids
    without building the list: its count is read (a dict has no such attribute).
    """
    counted = getattr(body, "prompt_token_count", None)
    if counted is not None:
        return int(counted)
    n = vocab.token_list_length(body.get("input_ids"))
    if n is None:
        n = vocab.token_list_length(body.get("prompt"))
    return n


def _text_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(v) for v in value if isinstance(v, str))
    return 0


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    total += len(text)
        return total
    return 0


def _message_chars(msg: Any) -> int:
    if not isinstance(msg, Mapping):
        return 0
    total = MESSAGE_OVERHEAD_CHARS + _content_chars(msg.get("content"))
    role = msg.get("role")
    if isinstance(role, str):
        total += len(role)
    reasoning = msg.get("reasoning_content")
    if isinstance(reasoning, str):
        total += len(reasoning)
    tool_calls = msg.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            fn = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(fn, Mapping):
                total += _text_chars(fn.get("name")) + _text_chars(fn.get("arguments"))
    return total


def prompt_chars(body: Mapping[str, Any]) -> int:
    """Characters of a text prompt: ``text``, ``prompt``, chat ``messages`` and ``tools``."""
    total = _text_chars(body.get("text")) + _text_chars(body.get("prompt"))
    messages = body.get("messages")
    if isinstance(messages, list):
        total += sum(_message_chars(m) for m in messages)
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        with contextlib.suppress(TypeError, orjson.JSONEncodeError):
            total += len(orjson.dumps(tools))
    return total


class PromptCalibrator:
    """Chars-per-token ratios learned from engine-reported prompt tokens.

    Per session: an exponentially weighted mean (weight ``alpha`` for the newest
    report) in a table bounded to ``max_sessions`` with least-recently-used eviction.
    Fleet-wide: the same with a smaller weight. Before any report: ``default``.
    """

    __slots__ = ("_global", "_sessions", "alpha", "default", "global_alpha", "max_sessions")

    def __init__(
        self,
        default: float,
        *,
        max_sessions: int = 10_000,
        alpha: float = 0.3,
        global_alpha: float = 0.05,
    ) -> None:
        self.default = default
        self.max_sessions = max_sessions
        self.alpha = alpha
        self.global_alpha = global_alpha
        self._sessions: OrderedDict[str, float] = OrderedDict()
        self._global: float | None = None

    def chars_per_token(self, session_id: str | None) -> tuple[float, str]:
        if session_id is not None:
            ratio = self._sessions.get(session_id)
            if ratio is not None:
                self._sessions.move_to_end(session_id)
                return ratio, SOURCE_SESSION
        if self._global is not None:
            return self._global, SOURCE_GLOBAL
        return self.default, SOURCE_DEFAULT

    def observe(self, session_id: str | None, chars: int, prompt_tokens: int) -> None:
        if chars <= 0 or prompt_tokens <= 0:
            return
        ratio = min(MAX_CHARS_PER_TOKEN, max(MIN_CHARS_PER_TOKEN, chars / prompt_tokens))
        g = self._global
        self._global = ratio if g is None else g + self.global_alpha * (ratio - g)
        if session_id is None:
            return
        prev = self._sessions.get(session_id)
        if prev is None:
            self._sessions[session_id] = ratio
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions[session_id] = prev + self.alpha * (ratio - prev)
            self._sessions.move_to_end(session_id)

    def __len__(self) -> int:
        return len(self._sessions)


# -- completion ---------------------------------------------------------------------------


def _non_negative_int(value: Any) -> int | None:
    if type(value) is int:  # the common case first; also excludes bool
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


def _count(value: Any) -> int:
    if value is None:
        return 1
    n = _non_negative_int(value)
    return n if n is not None and n >= 1 else 1


def expected_output(body: Mapping[str, Any]) -> int | None:
    """``nvext.agent_hints.osl`` (Dynamo's expected output length), None when absent."""
    return _osl(body)


def _osl(body: Mapping[str, Any]) -> int | None:
    hints = vocab.nvext_section(body, "agent_hints")
    return _non_negative_int(hints.get("osl")) if hints is not None else None


def _batch_size(body: Mapping[str, Any]) -> int:
    """Number of prompts in a native ``/generate`` batch (1 when not batched)."""
    if type(body) is not dict:  # a plain dict has no count; compiled, the miss raises
        counted = getattr(body, "batch_size", None)  # a BodyScan's, without the list built
        if counted is not None:
            return int(counted)
    ids = body.get("input_ids")
    if type(ids) is list and ids and type(ids[0]) is list:
        return len(ids)
    text = body.get("text")
    if type(text) is list:
        return max(1, len(text))
    return 1


def _native_limit(sp: Any) -> tuple[int | None, int]:
    """(``sampling_params.max_new_tokens``, ``sampling_params.n``)."""
    if sp is None or not (type(sp) is dict or isinstance(sp, Mapping)):  # dict: no ABC call
        return None, 1
    return _non_negative_int(sp.get("max_new_tokens")), _count(sp.get("n"))


def _openai_limit(body: Mapping[str, Any]) -> tuple[int | None, int]:
    """(``max_completion_tokens`` or ``max_tokens``, ``n``)."""
    limit = _non_negative_int(body.get("max_completion_tokens"))
    if limit is None:
        limit = _non_negative_int(body.get("max_tokens"))
    return limit, _count(body.get("n"))


def completion_tokens(path: str, body: Mapping[str, Any], *, default: int, cap: int) -> int:
    """Completion budget of the request, capped per sequence, times its sequence count.

    ``/generate`` reads ``sampling_params`` first and the OpenAI fields second; the
    OpenAI paths the other way round.
    """
    sp = body.get("sampling_params")
    if type(sp) is list:  # one sampling_params per batch item
        fallback = _osl(body)
        if fallback is None:
            fallback = default
        total = 0
        for item in sp:
            params = item if isinstance(item, Mapping) else {}
            limit = _non_negative_int(params.get("max_new_tokens"))
            total += min(fallback if limit is None else limit, cap) * _count(params.get("n"))
        return total

    if path == "/generate":
        limit, n = _native_limit(sp)
        if limit is None:
            other = _openai_limit(body)
            if other[0] is not None:
                limit, n = other
    else:
        limit, n = _openai_limit(body)
        if limit is None:
            other = _native_limit(sp)
            if other[0] is not None:
                limit, n = other
    if limit is None:
        limit = _osl(body)
        if limit is None:
            limit = default
    return min(limit, cap) * n * _batch_size(body)


# -- sizing -------------------------------------------------------------------------------


class ReservationSizer:
    """Sizes reservations from request bodies and learns prompt chars-per-token.

    It also learns the *shared prefix*: the KV a session's first request finds already
    cached (``cached_tokens`` of a session's first turn: the common system prompt of a
    rollout). That KV exists once in each engine's radix tree however many sessions use
    it, so it is not charged to every request and every resident session again; only
    the prompt beyond it is.
    """

    __slots__ = ("_calibrator", "_cap", "_default_completion", "shared_prefix")

    # Weight of the newest first-turn report in the shared-prefix estimate.
    SHARED_ALPHA = 0.2

    def __init__(self, cfg: AdmissionConfig, *, max_sessions: int = 10_000) -> None:
        self._calibrator = PromptCalibrator(cfg.chars_per_token, max_sessions=max_sessions)
        self._default_completion = cfg.default_completion_tokens
        self._cap = cfg.completion_cap
        self.shared_prefix: float = 0.0

    def observe_shared(self, cached_tokens: int) -> None:
        """A session's first request found ``cached_tokens`` already in the engine."""
        if cached_tokens < 0:
            return
        a = self.SHARED_ALPHA
        self.shared_prefix = (1 - a) * self.shared_prefix + a * cached_tokens

    def configure(self, cfg: AdmissionConfig) -> None:
        self._calibrator.default = cfg.chars_per_token
        self._default_completion = cfg.default_completion_tokens
        self._cap = cfg.completion_cap

    @property
    def calibrator(self) -> PromptCalibrator:
        return self._calibrator

    def prompt(self, body: Mapping[str, Any], session_id: str | None) -> tuple[int, str, int]:
        """(prompt tokens, source, characters behind an estimate)."""
        exact = exact_prompt_tokens(body)
        if exact is not None:
            return exact, SOURCE_INPUT_IDS, 0
        chars = prompt_chars(body)
        if chars <= 0:
            return 0, SOURCE_NONE, 0
        ratio, source = self._calibrator.chars_per_token(session_id)
        return math.ceil(chars / ratio), source, chars

    def size(self, path: str, body: Mapping[str, Any], session_id: str | None) -> Reservation:
        prompt, source, chars = self.prompt(body, session_id)
        # The completion fields are small: a BodyScan's plain members (its token arrays
        # are placeholders there, which a batch check also takes as not a batch, as the
        # scan itself does: an excised array is flat) read without a Python call each.
        fields = getattr(body, "members", body)
        completion = completion_tokens(
            path, fields, default=self._default_completion, cap=self._cap
        )
        shared = min(prompt, int(self.shared_prefix))
        return Reservation(prompt - shared, completion, source, chars, shared)

    @staticmethod
    def calibrates_from(body: Mapping[str, Any]) -> bool:
        """Whether :meth:`observe` learns from this body's report: a text prompt's (a
        token-id prompt's size is known exactly)."""
        return exact_prompt_tokens(body) is None

    def observe(self, body: Mapping[str, Any], session_id: str | None, prompt_tokens: int) -> None:
        """Learn from the prompt tokens an engine reported for a text-prompt request."""
        if prompt_tokens <= 0 or not self.calibrates_from(body):
            return
        self._calibrator.observe(session_id, prompt_chars(body), prompt_tokens)
