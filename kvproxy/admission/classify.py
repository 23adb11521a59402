"""Request classification for admission: scope (train / eval) and protection.

Pure. Both are configured, never coded per deployment:

* **eval** traffic is a request whose ``admission.eval_header`` (default
  ``X-KVProxy-Mode``) equals ``eval`` (case-insensitive), or whose path starts with
  ``admission.eval_path_prefix``. With ``scope: train`` eval traffic is out of scope
  (forwarded untouched, not counted); with ``scope: all`` everything is in scope.
* **protected** work bypasses admission without touching the ledger: the request
  carries ``admission.protected_header`` (default ``X-KVProxy-Protected``) with a
  true value (``1``, ``true``, ``yes``, ``on``), or its priority is at or above
  ``admission.protected_priority``. The priority is the body's top-level
  ``priority`` (SGLang's field) or else ``nvext.agent_hints.priority``. In SGLang a
  higher integer is the higher priority by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from kvproxy.config import AdmissionConfig

_CASE_INSENSITIVE = (CIMultiDict, CIMultiDictProxy)
_TRUE = frozenset({"1", "true", "yes", "on"})


def header_value(headers: Mapping[str, str], name: str) -> str | None:
    """Header lookup that also works for a plain (case-sensitive) dict."""
    value = headers.get(name)
    if value is None and type(headers) not in _CASE_INSENSITIVE:
        value = headers.get(name.lower())
    return value


def is_eval(cfg: AdmissionConfig, path: str, headers: Mapping[str, str]) -> bool:
    mode = header_value(headers, cfg.eval_header)
    if mode is not None and mode.strip().lower() == "eval":
        return True
    return bool(cfg.eval_path_prefix) and path.startswith(cfg.eval_path_prefix or "")


def in_scope(cfg: AdmissionConfig, path: str, headers: Mapping[str, str]) -> bool:
    return cfg.scope == "all" or not is_eval(cfg, path, headers)


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def request_priority(body: Mapping[str, Any]) -> int | None:
    """Top-level ``priority``, else ``nvext.agent_hints.priority``; None when absent."""
    prio = _as_int(body.get("priority"))
    if prio is not None:
        return prio
    nvext = body.get("nvext")
    if isinstance(nvext, Mapping):
        hints = nvext.get("agent_hints")
        if isinstance(hints, Mapping):
            return _as_int(hints.get("priority"))
    return None


def is_protected(cfg: AdmissionConfig, headers: Mapping[str, str], body: Mapping[str, Any]) -> bool:
    flag = header_value(headers, cfg.protected_header)
    if flag is not None and flag.strip().lower() in _TRUE:
        return True
    if cfg.protected_priority is None:
        return False
    prio = request_priority(body)
    return prio is not None and prio >= cfg.protected_priority
