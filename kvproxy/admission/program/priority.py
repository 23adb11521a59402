"""The eviction priority kvproxy injects per session. Pure.

SGLang with ``--radix-eviction-policy priority`` evicts the lowest (priority, last
access) first, and a node's priority only ratchets up along a cached path
(``mem_cache/radix_cache.py``: ``node.priority = max(node.priority, req.priority)``).
With ``--enable-priority-scheduling`` a larger priority is also scheduled first and
a gap of ``--priority-scheduling-preemption-threshold`` (default 10) or more preempts
a running request, so values stay in [0, 9].

kvproxy's choice: ``floor(log2(context / unit))`` clamped to [0, max], monotone per
session (never lower than what it already sent), so small sessions (the ones cheapest
to recompute, the ones kvproxy pauses first) are evicted before deep ones.
"""

from __future__ import annotations

import math


def size_priority(context_tokens: int, *, unit_tokens: int = 4096, max_priority: int = 9) -> int:
    """``floor(log2(context / unit))`` in [0, max_priority]; 0 below two units."""
    if context_tokens < 2 * unit_tokens:
        return 0
    return min(max_priority, int(math.log2(context_tokens / unit_tokens)))


def next_priority(
    previous: int, context_tokens: int, *, unit_tokens: int = 4096, max_priority: int = 9
) -> int:
    """The session's priority for its next request: monotone (ratchets like SGLang's)."""
    return max(
        previous, size_priority(context_tokens, unit_tokens=unit_tokens, max_priority=max_priority)
    )
