"""Request classification for admission: scope (train / eval) and protection.

Pure. Both are configured, never coded per deployment:

The two headers below are client input that skips admission: they are honoured only
with ``admission.trust_client_headers: true`` (off by default).

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

from kvproxy import vocab
from kvproxy.config import AdmissionConfig

# Header lookup for multidicts and plain dicts alike (kvproxy.vocab).
header_value = vocab.header


def is_eval(cfg: AdmissionConfig, path: str, headers: Mapping[str, str]) -> bool:
    if cfg.trust_client_headers:
        mode = header_value(headers, cfg.eval_header)
        if mode is not None and mode.strip().lower() == "eval":
            return True
    return bool(cfg.eval_path_prefix) and path.startswith(cfg.eval_path_prefix or "")


def in_scope(cfg: AdmissionConfig, path: str, headers: Mapping[str, str]) -> bool:
    return cfg.scope == "all" or not is_eval(cfg, path, headers)


_as_int = vocab.exact_int


def request_priority(body: Mapping[str, Any]) -> int | None:
    """Top-level ``priority``, else ``nvext.agent_hints.priority``; None when absent."""
    prio = _as_int(body.get("priority"))
    if prio is not None:
        return prio
    hints = vocab.nvext_section(body, "agent_hints")
    return _as_int(hints.get("priority")) if hints is not None else None


def is_protected(cfg: AdmissionConfig, headers: Mapping[str, str], body: Mapping[str, Any]) -> bool:
    if cfg.trust_client_headers and vocab.header_flag(headers, cfg.protected_header):
        return True
    if cfg.protected_priority is None:
        return False
    prio = request_priority(body)
    return prio is not None and prio >= cfg.protected_priority
