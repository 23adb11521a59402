"""The hold model: what holding work on an engine will pay, judged from what is known
before any feedback window closes. Pure: no I/O, no clock.

Holding pays when two things are true at once (docs/admission.md, "The hold model"):

* **the engine's sessions cannot all stay resident**: the contexts kvproxy already knows
  (each session's last context, or its first prompt while it has none; the shared
  prefix counted once) exceed ``demand_ratio`` x the engine's room (pool + host tier).
  These are known contexts, not expected peaks: a lower bound of the working set, so
  past the room the engine evicts whatever the schedule does, unless the sessions end
  before they come back. An arrival burst (sessions starting together: an RL step, a
  batch evaluation) crosses it on its first requests;
* **recomputing them is a large share of the engine's work** (``exposure``): a
  context a turn comes back to over that plus the decode it buys, a decoded token
  weighing ``decode_token_weight`` prefill tokens. Before continuing turns have come
  back it is predicted from the prompts against the decode the requests ask for
  (``max_new_tokens``, an ``osl`` hint, then the answers' mean); once
  ``min_returns`` continuing turns have come back in a window, the measured exposure
  replaces it.

And it cannot pay where the engine's room does not hold ``floor_room`` x the
work-conserving floor's turns' contexts (they evict each other whatever is held), nor
on an engine running fewer than ``min_inflight`` turns (nothing to hold back yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvproxy.admission.program.engagement import Load


@dataclass(frozen=True, slots=True)
class ForecastRule:
    """The model's constants (docs/admission.md, "The hold model": one table, each with
    the measurement that set it)."""

    demand_ratio: float = 1.0
    expected_ratio: float = 1.5
    exposure: float = 0.5
    decode_token_weight: float = 16.0
    min_inflight: int = 3
    floor_room: float = 3.0
    min_returns: int = 6
    min_sessions: int = 24


@dataclass(frozen=True, slots=True)
class Outlook:
    """One engine's inputs to the model, read from the ledger."""

    demand: float  # known contexts of its sessions (and the arriving one), credit off
    room: float  # pool + host tier
    sessions: int  # sessions the demand counts
    decode: float  # expected decoded tokens per turn
    inflight: int  # kvproxy's turns in flight on it
    measured_exposure: float | None = None  # from a window with enough returns
    # What the sessions are expected to grow to (the ledger's expected peaks), once the
    # fleet's growth has been seen (None before: never the context-length prior).
    expected: float | None = None
    growth: float = 0.0  # the fleet's per-turn context growth (the prefill a turn adds)


def overflow(o: Outlook, rule: ForecastRule) -> tuple[float, bool] | None:
    """The demand that overflows the room, as the total context the turns come back
    to, and whether it is known (the contexts already there) rather than expected;
    None where neither overflows. Expected peaks count midway (over a session's life
    its turns come back to contexts from where it is to its peak), and the overflow
    judged is that midway total, the one the exposure is then judged on: the peaks
    alone, summed over sessions at every stage of their lives, overflowed 1.5 x the
    room on pools that hold the fleet (swe/long/32/0.8: peaks 2.3 x the room, midway
    1.46 x; both 0.889x off on seed 5 with the peaks judged)."""
    if o.demand > rule.demand_ratio * o.room:
        return o.demand, True
    if o.expected is None:
        return None
    midway = (o.demand + o.expected) / 2
    if midway > rule.expected_ratio * o.room:
        return midway, False
    return None


def exposure(o: Outlook, rule: ForecastRule, total: float, known: bool = True) -> float | None:
    """The share of the engine's work recomputing every context would be. Where the
    overflow is known: predicted from the mean context (``total`` over the sessions)
    against the prefill a turn adds and its decode, and no more than measured once a
    window had enough returns. Where it is only expected (a growth not yet seen to
    last): measured alone, None before (the prediction would take a fleet whose
    sessions end before they grow for one that outgrows its pool)."""
    if not known:
        if o.measured_exposure is None:
            return None
        return o.measured_exposure
    ctx = total / o.sessions if o.sessions > 0 else 0.0
    work = ctx + max(0.0, o.growth) + rule.decode_token_weight * max(0.0, o.decode)
    predicted = ctx / work if work > 0 else 0.0
    if o.measured_exposure is None:
        return predicted
    return min(predicted, o.measured_exposure)


def holding_pays(o: Outlook, rule: ForecastRule) -> bool:
    """Whether the model says to hold work on the engine now."""
    if o.room <= 0 or o.sessions < max(1, rule.min_sessions) or o.inflight < rule.min_inflight:
        return False
    over = overflow(o, rule)
    if over is None:
        return False
    total, known = over
    if o.room < rule.floor_room * rule.min_inflight * (total / o.sessions):
        return False
    x = exposure(o, rule, total, known)
    return x is not None and x >= rule.exposure


def returned_exposure(load: Load, min_returns: int, decode_token_weight: float) -> float | None:
    """The window's exposure when at least ``min_returns`` continuing turns came back
    to a context (None: too few to judge)."""
    if load.returns < min_returns:
        return None
    return load.exposure(decode_token_weight, min_returns)
