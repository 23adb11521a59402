"""Freed request buffers kept for reuse: glibc's malloc told not to hand them back.

A request body of a few hundred KB is read, spliced and sent through buffers of its own
size, freed when the request ends. glibc's malloc maps a buffer over its mmap threshold
(128 KB at first, then raised to the largest one freed) and, once more than its trim
threshold (twice that) is free at the top of the heap, gives the memory back to the
kernel. With 1 MB bodies one at a time the heap top was trimmed after nearly every
request (200 KB ones were not, in the same runs), so the next request's buffers were
fresh pages: each 4 KB page costs a minor fault, its zeroing included, about 4-6 µs on
the 2-vCPU virtual machine of the benchmarks (copying a page there takes about 0.15
µs). With 1 MB bodies kvproxy took 517-536 faults per request, 2.0-2.2 ms of its p50,
and 0-1 with this (docs/benchmarks.md, "Page faults of big bodies").

:func:`apply` fixes both thresholds (``mallopt``): buffers up to the mmap threshold come
from the heap, and up to ``server.malloc_retain_bytes`` of freed memory stays there for
the next request. The memory kept is bounded by that setting: the process's RSS stays
near its high-water mark, at most that much above what requests hold, instead of
falling between requests.

Only glibc has these knobs: on another C library (musl, macOS) nothing is done and the
process runs as before. ``kvproxy serve`` applies it at start-up (the benchmarks'
in-process runs and upstream stand-in do too, to match); the app factory does not.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# glibc caps the mmap threshold at HEAP_MAX/2: 32 MiB on 64-bit systems (mallopt refuses
# more). A larger body is mapped per request as before.
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024

Mallopt = Callable[[int, int], int]


def options(retain_bytes: int) -> tuple[tuple[int, int], ...]:
    """The ``mallopt`` calls for ``server.malloc_retain_bytes`` (none for 0: glibc's
    own behaviour)."""
    if retain_bytes <= 0:
        return ()
    return (
        (M_MMAP_THRESHOLD, min(retain_bytes, MMAP_THRESHOLD_MAX)),
        (M_TRIM_THRESHOLD, retain_bytes),
    )


def glibc_mallopt() -> Mallopt | None:
    """This process's ``mallopt`` when its C library is glibc, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def apply(retain_bytes: int, mallopt: Mallopt | None = None) -> str:
    """Set the thresholds for ``retain_bytes``; what was done, in words for the log:
    ``"off"`` (0), ``"unavailable"`` (not glibc), ``"applied"`` or ``"refused"``
    (``mallopt`` said no to one of the calls)."""
    calls = options(retain_bytes)
    if not calls:
        return "off"
    if mallopt is None:
        mallopt = glibc_mallopt()
        if mallopt is None:
            return "unavailable"
    ok = True
    for param, value in calls:
        ok = mallopt(param, value) == 1 and ok  # glibc returns 1 on success
    return "applied" if ok else "refused"


__all__ = ["MMAP_THRESHOLD_MAX", "apply", "glibc_mallopt", "options"]
