"""How often one byte occurs in a large buffer: vectorised where numpy is installed.

Admission counts a body's token ids by the commas of its flat array
(:func:`kvproxy.proxy.scan.count_elements`). CPython's one-byte ``bytes.count`` tests
each byte in turn, about 1 ns per byte here: at 1 MB that one count was most of what
admission cost a request. numpy's compare-and-count runs over the same bytes in place
(no copy) at 0.09-0.17 ns per byte, for a fixed cost of about 4 µs, which a count wins
back from about 4 KB up, so spans from 8 KB are counted by numpy (docs/benchmarks.md,
"The token-id count vectorised").

numpy is optional: every SGLang host has it (the engine depends on it), and
``pip install 'kvproxy[fast]'`` adds it elsewhere; without it the count is
``bytes.count``. The answer is the same either way (tests/unit/test_bytecount.py). It is
imported by :func:`load`, which the app calls at start-up when admission is on (no
request pays the import, about 150 ms), or else on the first large count.

Pure: no I/O, no state but the imported module.
"""

from __future__ import annotations

from typing import Any

# Below this many bytes ``bytes.count`` is as fast as numpy's fixed cost.
VECTOR_MIN_BYTES = 8192

_numpy: Any = None  # the numpy module once load() found it
_loaded = False  # load() has run (numpy found or not)


def load() -> bool:
    """Import numpy for the vectorised count, once; True when it is installed."""
    global _numpy, _loaded
    if not _loaded:
        _loaded = True
        try:
            import numpy

            _numpy = numpy
        except ImportError:
            _numpy = None
    return _numpy is not None


def count_byte(raw: bytes, byte: int, start: int, end: int) -> int:
    """``raw.count(bytes([byte]), start, end)``, vectorised for large spans when numpy
    is installed. ``0 <= start <= end <= len(raw)``."""
    n = end - start
    if n >= VECTOR_MIN_BYTES and (_numpy is not None or (not _loaded and load())):
        np = _numpy
        return int(np.count_nonzero(np.frombuffer(raw, np.uint8, n, start) == byte))
    return raw.count(_ONE_BYTE[byte], start, end)


_ONE_BYTE: tuple[bytes, ...] = tuple(bytes((b,)) for b in range(256))


__all__ = ["VECTOR_MIN_BYTES", "count_byte", "load"]
