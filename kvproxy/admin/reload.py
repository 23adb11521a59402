"""Re-reading the YAML while running (``SIGHUP`` or ``POST /kvproxy/config/reload``).

Every key applies at once except those in :data:`RESTART_ONLY`, which keep their
running values until a restart (the reply and the log name them).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from aiohttp import web

from kvproxy.config import Config, ConfigError, apply_overrides, load_config
from kvproxy.keys import ADMISSION, CONFIG, DYNAMO, FLEET, SESSIONS

log = logging.getLogger(__name__)

# Keys whose change needs a restart; everything else applies on reload.
RESTART_ONLY = (
    "server.host",
    "server.port",
    "server.max_body_bytes",
    "server.backlog",
    "router.url",
    "router.max_connections",
    "server.time_scale",
    "server.token_scale",
    "server.gc_threshold",
    "server.malloc_retain_bytes",
    "state.backend",
    "state.redis_url",
    "state.redis_password_env",
    "state.key_prefix",
    "state.op_timeout_s",
    "state.replica_ttl_s",
    "state.orphan_abort_after_s",
    "state.session_ttl_s",
    "state.sweep_interval_s",
    "state.retry_interval_s",
)


def keep_restart_only(running: Config, new: Config) -> Config:
    """``new`` with every key of :data:`RESTART_ONLY` at its ``running`` value: the live
    config reports what is in effect until a restart."""
    sections: dict[str, dict[str, Any]] = {}
    for key in RESTART_ONLY:
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = getattr(getattr(running, section), name)
    return dataclasses.replace(
        new,
        **{
            section: dataclasses.replace(getattr(new, section), **kept)
            for section, kept in sections.items()
        },
    )


def _changed_keys(old: Config, new: Config) -> list[str]:
    changed = []
    for section in ("server", "router", "session_lifecycle", "admission"):
        a, b = getattr(old, section), getattr(new, section)
        for f in dataclasses.fields(a):
            if getattr(a, f.name) != getattr(b, f.name):
                changed.append(f"{section}.{f.name}")
    return changed


async def reload_config(app: web.Application) -> dict[str, Any]:
    """Re-read the YAML (CLI overrides re-applied) and apply it to ``app``'s live config
    and features. Raises ConfigError."""
    live, admission = app[CONFIG], app[ADMISSION]
    running = live.config
    if running.source is None:
        raise ConfigError("no config file to reload (kvproxy was started without --config)")
    new = apply_overrides(load_config(running.source), live.overrides)
    changed = _changed_keys(running, new)
    pending = [k for k in changed if k in RESTART_ONLY]
    new = keep_restart_only(running, new)
    live.config = new
    app[FLEET].reconfigure(new.router)
    await app[SESSIONS].reconfigure(new.session_lifecycle)
    await admission.reconfigure(new.admission)
    app[DYNAMO].reconfigure(new)
    if new.router.policy != admission.placement.policy:
        admission.set_router_policy(new.router.policy)
    logging.getLogger("kvproxy").setLevel(new.server.log_level.upper())
    live.reloads += 1
    applied = [k for k in changed if k not in RESTART_ONLY]
    log.warning("config reloaded from %s; applied: %s", new.source, ", ".join(applied) or "nothing")
    if pending:
        log.warning("config keys that need a restart to change: %s", ", ".join(pending))
    return {"status": "reloaded", "applied": applied, "restart_required": pending}
