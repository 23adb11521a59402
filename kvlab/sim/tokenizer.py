"""Deterministic stand-in tokenizer and output-token generator for the simulator.

Nothing here loads a model. The tokenizer only has to be *stable*: the same text
always gives the same ids, so prefix caching across turns behaves as with a real
tokenizer.

* Text is split into word pieces with one regular expression: an optional
  leading space plus up to 8 letters, up to 3 digits, or up to 4 other symbols;
  runs of whitespace are their own pieces. English prose comes out at roughly 1.3
  pieces per word, close to a BPE tokenizer.
* A piece's id is ``crc32(piece) % 151643`` (Qwen-sized vocabulary). The ChatML
  specials ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>`` are
  recognised as single tokens 151643, 151644 and 151645.
* Generated tokens come from a fixed vocabulary of 1,024 pseudo-words, each a
  single piece (" kalemo"), so re-tokenizing generated text in the next turn of a
  conversation gives back exactly the generated ids (as a real tokenizer would
  nearly always do). Which words a request generates is a pure function of its
  rid.
* Chat messages are rendered with a ChatML template (``<|im_start|>role\\n...``).
"""

from __future__ import annotations

import hashlib
import random
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

VOCAB_SIZE = 151_936
ENDOFTEXT_ID = 151_643
IM_START_ID = 151_644
IM_END_ID = 151_645
EOS_TOKEN_ID = IM_END_ID
_REGULAR_IDS = 151_643

SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": ENDOFTEXT_ID,
    "<|im_start|>": IM_START_ID,
    "<|im_end|>": IM_END_ID,
}
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_PIECE_RE = re.compile(r" ?[A-Za-z]{1,8}| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]{1,4}|\s+(?!\S)|\s+")

_piece_cache: dict[str, int] = {}
_PIECE_CACHE_MAX = 1_000_000


def piece_id(piece: str) -> int:
    tid = _piece_cache.get(piece)
    if tid is None:
        tid = zlib.crc32(piece.encode("utf-8")) % _REGULAR_IDS
        if len(_piece_cache) < _PIECE_CACHE_MAX:
            _piece_cache[piece] = tid
    return tid


def _encode_plain(text: str, out: list[int]) -> None:
    get = _piece_cache.get
    for piece in _PIECE_RE.findall(text):
        tid = get(piece)
        out.append(piece_id(piece) if tid is None else tid)


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (specials recognised)."""
    out: list[int] = []
    if "<|" in text:
        for i, part in enumerate(_SPECIAL_RE.split(text)):
            if i % 2:
                out.append(SPECIAL_TOKENS[part])
            elif part:
                _encode_plain(part, out)
    else:
        _encode_plain(text, out)
    return out


def _build_output_vocab(size: int = 1024) -> tuple[tuple[int, ...], dict[int, str]]:
    consonants = "bdfgklmnprstvz"
    vowels = "aeiou"
    rng = random.Random(20240611)
    ids: list[int] = []
    text_of: dict[int, str] = {}
    while len(ids) < size:
        word = "".join(
            rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 3))
        )
        piece = " " + word
        tid = piece_id(piece)
        if tid in text_of:
            continue
        ids.append(tid)
        text_of[tid] = piece
    return tuple(ids), text_of


OUTPUT_VOCAB, _OUTPUT_TEXT = _build_output_vocab()
_ID_TEXT: dict[int, str] = {**_OUTPUT_TEXT, **{v: k for k, v in SPECIAL_TOKENS.items()}}


def decode(ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Text of generated ids. Ids outside the output vocabulary render as ``<id>``."""
    parts: list[str] = []
    for tid in ids:
        if tid in SPECIAL_TOKENS.values():
            if not skip_special_tokens:
                parts.append(_ID_TEXT[tid])
            continue
        text = _OUTPUT_TEXT.get(tid)
        parts.append(text if text is not None else f"<{tid}>")
    return "".join(parts)


def rid_seed(rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(rid.encode("utf-8"), digest_size=8).digest(), "big")


class OutputStream:
    """The deterministic token sequence a request with this rid generates.

    ``ids(n)`` is prefix-stable: ``ids(n)[:k] == ids(k)``. When the request finishes
    by a stop token, the last id is that token.
    """

    __slots__ = ("_ids", "_rng", "stop_at", "stop_token")

    def __init__(self, rid: str, stop_at: int | None = None, stop_token: int | None = None):
        self._rng = random.Random(rid_seed(rid))
        self._ids: list[int] = []
        self.stop_at = stop_at  # output length at which the stop token is emitted
        self.stop_token = stop_token

    def ids(self, n: int) -> list[int]:
        have = len(self._ids)
        if n > have:
            self._ids.extend(self._rng.choices(OUTPUT_VOCAB, k=n - have))
            if self.stop_at is not None and self.stop_token is not None and n >= self.stop_at:
                self._ids[self.stop_at - 1] = self.stop_token
        return self._ids[:n]


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """ChatML rendering of OpenAI-style messages (text content parts are joined)."""
    parts: list[str] = []
    for m in messages:
        role = str(m.get("role", "user"))
        content = m.get("content")
        if isinstance(content, list):
            text = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        elif content is None:
            text = ""
        else:
            text = str(content)
        parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
