"""Peer schedulers modelled in the lab (not part of kvproxy): pure cores with injected
time, run by :mod:`kvlab.lab.peer_proxy` in place of kvproxy.

- :mod:`.thunder`: ThunderAgent's program scheduler (``thunder``, ``thunder-origin``,
  ``thunder-router``);
- :mod:`.cap`: a fixed cap on live sessions per engine (``cap:N``).
"""

from __future__ import annotations

PEER_POLICIES = ("thunder", "thunder-origin", "thunder-router")
CAP_PREFIX = "cap:"


def is_peer(policy: str) -> bool:
    return policy in PEER_POLICIES or policy.startswith(CAP_PREFIX)


def parse_cap(policy: str) -> int:
    """``cap:N`` -> N (>= 1); ValueError otherwise."""
    text = policy[len(CAP_PREFIX) :] if policy.startswith(CAP_PREFIX) else ""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"cap policy must be cap:N with N >= 1 live sessions per engine, got {policy!r}"
        )
    return n
