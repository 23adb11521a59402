"""A reload keeps every restart-only key at its running value (the live config reports
what is in effect), and applies every other key."""

from __future__ import annotations

from typing import Any

import pytest

from kvproxy.admin.reload import RESTART_ONLY, keep_restart_only
from kvproxy.config import Config, from_mapping

# A valid value other than the default for each restart-only key.
CHANGED: dict[str, Any] = {
    "server.host": "127.0.0.2",
    "server.port": 1234,
    "server.max_body_bytes": 1024 * 1024,
    "server.backlog": 16,
    "router.url": "http://127.0.0.1:31999",
    "router.max_connections": 7,
    "server.time_scale": 0.5,
    "server.token_scale": 4,
    "server.gc_threshold": 700,
    "server.malloc_retain_bytes": 0,
    "state.backend": "redis",
    "state.redis_url": "redis://127.0.0.1:6390/1",
    "state.redis_password_env": "OTHER_REDIS_PASSWORD",
    "state.key_prefix": "other:",
    "state.op_timeout_s": 0.2,
    "state.replica_ttl_s": 9.0,
    "state.orphan_abort_after_s": 60.0,
    "state.session_ttl_s": 60.0,
    "state.sweep_interval_s": 2.0,
    "state.retry_interval_s": 3.0,
}


def _value(cfg: Config, key: str) -> Any:
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)


def _with(key: str, value: Any, **extra: dict[str, Any]) -> Config:
    section, name = key.split(".", 1)
    raw: dict[str, dict[str, Any]] = {s: dict(v) for s, v in extra.items()}
    raw.setdefault(section, {})[name] = value
    return from_mapping(raw)


def test_the_table_names_every_restart_only_key() -> None:
    assert set(CHANGED) == set(RESTART_ONLY)


@pytest.mark.parametrize("key", RESTART_ONLY)
def test_a_restart_only_key_keeps_its_running_value(key: str) -> None:
    running = from_mapping({})
    new = _with(key, CHANGED[key], admission={"enabled": True})
    assert _value(new, key) != _value(running, key)  # the file did change it
    kept = keep_restart_only(running, new)
    assert _value(kept, key) == _value(running, key)
    assert kept.admission.enabled  # ... and what applies at once is applied


def test_keys_that_apply_at_once_are_taken_from_the_new_file() -> None:
    running = from_mapping({})
    new = from_mapping({"server": {"log_level": "DEBUG"}, "router": {"policy": "round_robin"}})
    kept = keep_restart_only(running, new)
    assert (kept.server.log_level, kept.router.policy) == ("DEBUG", "round_robin")
