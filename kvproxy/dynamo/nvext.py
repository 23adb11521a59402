"""Dynamo's ``nvext`` request extension, read and mapped to SGLang. Pure.

NVIDIA Dynamo's guide to SGLang for agentic workloads marks requests with::

    "nvext": {
      "agent_hints": {"priority": int, "osl": int, "speculative_prefill": bool},
      "session_control": {"session_id": str, "action": "bind" | "open" | "close",
                          "timeout": seconds}
    }

:func:`parse_nvext` validates the block (bad input is a clear error, never a silent
drop); :func:`combine_priority` is the rule for the top-level ``priority`` kvproxy
forwards; :func:`strip_nvext` removes the block from the raw bytes where the next hop
would reject it.

Whether SGLang rejects ``nvext``: the OpenAI request models
(``sglang/srt/entrypoints/openai/protocol.py``: ``ChatCompletionRequest``,
``CompletionRequest``) are pydantic ``BaseModel`` classes without a ``model_config``
``extra`` setting, so pydantic's default ``extra="ignore"`` applies and the field is
dropped silently; ``/generate``'s ``GenerateReqInput`` (``managers/io_struct.py``) is a
dataclass whose unknown keys are dropped as well. Nothing needs stripping for SGLang
itself, so the default strips nowhere (``session_lifecycle.strip_nvext_paths``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

ACTIONS = ("bind", "open", "close")
# Dynamo's default for a bound session's inactivity timeout (seconds).
DEFAULT_BIND_TIMEOUT_S = 300.0
# SGLang's --priority-scheduling-preemption-threshold default: a waiting request whose
# priority exceeds a running one's by this much or more preempts it.
PREEMPTION_GAP = 10
# kvproxy's own eviction-steering values live in [0, STEERING_MAX] (priority.py).
STEERING_MAX = 9


class InvalidNvext(ValueError):
    """``nvext`` is malformed. ``str(exc)`` is safe to return to the client."""


@dataclass(frozen=True, slots=True)
class AgentHints:
    priority: int | None = None
    osl: int | None = None
    speculative_prefill: bool = False


@dataclass(frozen=True, slots=True)
class SessionControl:
    action: str | None = None  # bind | open | close | None
    timeout_s: float | None = None  # as the client sent it (None: absent)


@dataclass(frozen=True, slots=True)
class Nvext:
    present: bool = False
    hints: AgentHints = AgentHints()
    control: SessionControl = SessionControl()

    def bind_timeout_s(self) -> float | None:
        """The inactivity timeout kvproxy enforces for ``bind`` (and chat ``open``)."""
        if self.control.action not in ("bind", "open"):
            return None
        t = self.control.timeout_s
        return DEFAULT_BIND_TIMEOUT_S if t is None else t


NO_NVEXT = Nvext()


def _int_field(value: Any, name: str, *, minimum: int | None = None) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidNvext(f"nvext.{name} must be an integer (got {type(value).__name__})")
    if minimum is not None and value < minimum:
        raise InvalidNvext(f"nvext.{name} must be >= {minimum} (got {value})")
    return value


def _parse_hints(hints_raw: Any) -> AgentHints:
    if hints_raw is None:
        return AgentHints()
    if not isinstance(hints_raw, Mapping):
        raise InvalidNvext("nvext.agent_hints must be an object")
    spec = hints_raw.get("speculative_prefill", False)
    if spec is None:
        spec = False
    if not isinstance(spec, bool):
        raise InvalidNvext("nvext.agent_hints.speculative_prefill must be a boolean")
    return AgentHints(
        priority=_int_field(hints_raw.get("priority"), "agent_hints.priority"),
        osl=_int_field(hints_raw.get("osl"), "agent_hints.osl", minimum=0),
        speculative_prefill=spec,
    )


def _parse_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidNvext("nvext.session_control.timeout must be a number of seconds")
    if not 0 < timeout <= 86_400:
        raise InvalidNvext(
            f"nvext.session_control.timeout must be in (0, 86400] seconds (got {timeout})"
        )
    return float(timeout)


def _parse_control(control_raw: Any) -> SessionControl:
    if control_raw is None:
        return SessionControl()
    if not isinstance(control_raw, Mapping):
        raise InvalidNvext("nvext.session_control must be an object")
    action = control_raw.get("action")
    if action is not None and action not in ACTIONS:
        raise InvalidNvext(
            f"nvext.session_control.action must be one of {', '.join(ACTIONS)} (got {action!r})"
        )
    return SessionControl(action=action, timeout_s=_parse_timeout(control_raw.get("timeout")))


def parse_nvext(body: Mapping[str, Any]) -> Nvext:
    """Read and validate ``body["nvext"]``; :data:`NO_NVEXT` when absent or null."""
    raw = body.get("nvext")
    if raw is None:
        return NO_NVEXT
    if not isinstance(raw, Mapping):
        raise InvalidNvext("nvext must be an object")
    hints = _parse_hints(raw.get("agent_hints"))
    control = _parse_control(raw.get("session_control"))
    return Nvext(present=True, hints=hints, control=control)


def combine_priority(
    *, top_level: Any, hint: int | None, steering: int | None
) -> tuple[int | None, str]:
    """The top-level ``priority`` kvproxy adds to a request, and why.

    Returns ``(value, source)``; ``value`` None means "add nothing".

    - The body's own top-level ``priority`` is SGLang's field: it always wins and
      nothing is added (``"body"``).
    - A client hint (``agent_hints.priority``) is forwarded exactly as given
      (``"hint"``), and kvproxy's steering is *not* added to it: adding any offset
      in [0, 9] to hinted requests changes the gap between two hinted requests by up
      to 9, which can turn the client's gap of 1..9 into 10+ (a preemption the client
      never asked for) or its gap of 10+ into less (a preemption lost). Hinted
      requests therefore keep exactly the client's relative order and gaps.
    - Without a hint, kvproxy's eviction-steering value (in [0, 9], see
      ``admission/priority.py``) is added (``"steering"``): any two such requests
      differ by at most 9 < 10, so steering alone never preempts.
    - Neither: nothing (``"none"``).

    A hinted session is not eviction-steered by kvproxy; a client that wants both
    picks its hints within [0, 9] (then a hinted and a steered request also stay
    within the gap) or leaves the hint out.
    """
    if top_level is not None:
        return None, "body"
    if hint is not None:
        return hint, "hint"
    if steering is not None:
        return max(0, min(STEERING_MAX, steering)), "steering"
    return None, "none"


def strip_nvext(raw: bytes, body: Mapping[str, Any]) -> bytes:
    """The body without its top-level ``nvext`` key; every other key untouched.

    Re-serialises the object (key order kept); used only on the paths configured in
    ``session_lifecycle.strip_nvext_paths``.
    """
    if "nvext" not in body:
        return raw
    return orjson.dumps({k: v for k, v in body.items() if k != "nvext"})


def strips_on(paths: Sequence[str], path: str) -> bool:
    return path in paths


__all__ = [
    "ACTIONS",
    "DEFAULT_BIND_TIMEOUT_S",
    "NO_NVEXT",
    "PREEMPTION_GAP",
    "AgentHints",
    "InvalidNvext",
    "Nvext",
    "SessionControl",
    "combine_priority",
    "parse_nvext",
    "strip_nvext",
    "strips_on",
]
