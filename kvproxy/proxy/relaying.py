"""The pieces of a response relay that read what passes (kept out of the handlers).

What a relayed response tells admission (its usage) and what is kept of it for the
speculative prefill, and how an attempt's body is handed to the client session.
"""

from __future__ import annotations

from typing import Protocol

import aiohttp

from kvproxy.dynamo.prefill import StreamAnswer
from kvproxy.proxy.body import BodyParts, unjoined
from kvproxy.proxy.pipeline import PARTS_MIN_BYTES
from kvproxy.proxy.turn import ObserveUsage
from kvproxy.proxy.upstream import PartsPayload
from kvproxy.proxy.usage import StreamedBodyUsage, TailWindow, search_usage


class Keep(Protocol):
    """Where a 200's answer is kept (:class:`kvproxy.proxy.dynamo_layer.Keep`)."""

    def body(self, data: bytes) -> None: ...

    def stream(self, answer: StreamAnswer) -> None: ...


# Non-streaming upstream responses up to this size are returned in one write.
RESPONSE_BUFFER_LIMIT = 1024 * 1024


class Kept:
    """A chunked body kept whole up to the buffered-response limit (None past it)."""

    __slots__ = ("_chunks", "_size")

    def __init__(self) -> None:
        self._chunks: list[bytes] | None = []
        self._size = 0

    def feed(self, chunk: bytes) -> None:
        if self._chunks is None:
            return
        self._size += len(chunk)
        if self._size > RESPONSE_BUFFER_LIMIT:
            self._chunks = None
        else:
            self._chunks.append(chunk)

    @property
    def data(self) -> bytes | None:
        return None if self._chunks is None else b"".join(self._chunks)


def usage_readers(
    path: str,
    observe_usage: ObserveUsage | None,
    keep: Keep | None,
    event_stream: bool,
    ok: bool,
) -> tuple[TailWindow | StreamedBodyUsage | None, Kept | StreamAnswer | None]:
    """What a streamed response of ``path`` tells the ledger (an event stream's tail,
    or a JSON body's counts searched as it passes, wherever they are in it), and what is
    kept of it: a chunked JSON body whole, bounded, for ``keep.body``; an event stream's
    answer, bounded, for ``keep.stream`` (``ok``: a 200, the only answer kept)."""
    window: TailWindow | StreamedBodyUsage | None = None
    if observe_usage is not None:
        window = TailWindow() if event_stream else StreamedBodyUsage()
    whole: Kept | StreamAnswer | None = None
    if event_stream:
        if keep is not None and ok:
            whole = StreamAnswer(path, on_done=keep.stream)
    elif keep is not None:
        whole = Kept()
    return window, whole


def observe_streamed(
    observe_usage: ObserveUsage | None,
    keep: Keep | None,
    window: TailWindow | StreamedBodyUsage | None,
    whole: Kept | StreamAnswer | None,
) -> None:
    """A 200 relayed to its end: its usage and what was kept go to their observers."""
    if window is not None and observe_usage is not None:
        observe_usage(window.usage())
    if isinstance(whole, StreamAnswer):
        whole.finish()  # observed at its [DONE] already, unless the stream had none
    elif whole is not None and whole.data is not None and keep is not None:
        keep.body(whole.data)


def payload(
    body: bytes | BodyParts | aiohttp.StreamReader | None,
) -> bytes | PartsPayload | aiohttp.StreamReader | None:
    """An attempt's body as the client session sends it: a spliced big body as its
    parts, a big body as received without aiohttp's copy of it next to the request head
    (:func:`~kvproxy.proxy.body.unjoined`), anything else as it is."""
    if isinstance(body, tuple):
        return PartsPayload(body)
    if isinstance(body, bytes) and len(body) >= PARTS_MIN_BYTES:
        return PartsPayload(unjoined(body))
    return body


def observe_tail_usage(observe: ObserveUsage | None, tail: bytes) -> None:
    """A translated answer's last bytes (Dynamo's relay) read for the usage report."""
    if observe is not None:
        observe(search_usage(tail))


__all__ = [
    "RESPONSE_BUFFER_LIMIT",
    "Keep",
    "Kept",
    "observe_streamed",
    "observe_tail_usage",
    "payload",
    "usage_readers",
]
