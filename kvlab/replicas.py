"""Several kvproxy replicas for a lab run: started behind nginx round robin with their
state shared on a password-protected redis-server, one SIGKILLed on a timer, and
each one's counters read back. Used by :mod:`kvlab.rollout` (``--replicas``)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# The environment variable the replicas read the Redis password from (state.redis_password_env).
PASSWORD_ENV = "KVPROXY_REDIS_PASSWORD"

# What each replica's /metrics says of its admission decisions and of the shared state.
_METRICS = (
    "agentic_kv_admission_decision_",
    "agentic_kv_admission_event_",
    "agentic_kv_state_",
)


def start(
    doc: Mapping[str, Any],
    count: int,
    router_url: str,
    *,
    tag: str,
    out_dir: Path,
    log_dir: Path,
    track: Callable[[Any], Any],
) -> tuple[str, dict[str, Any], tuple[int, ...], tuple[str, ...]]:
    """A redis-server with a fresh password, ``count`` kvproxy replicas sharing their
    state on it (``doc`` with ``state.backend: redis``) and nginx round robin over them.
    Returns nginx's URL, a replica's config, the replicas' PIDs and URLs."""
    import yaml

    from kvlab import stack as stk

    password = secrets.token_hex(16)
    os.environ[PASSWORD_ENV] = password  # inherited by the replicas only
    redis = track(stk.start_redis(log_dir=log_dir / "redis", password=password))
    # A dead replica is noticed within replica_ttl_s of wall time, which a compressed run
    # stretches by 1 / time scale (5 s at 0.1 would be 50 simulated seconds): 1 s here,
    # beats 4 a second, as the multi-replica tests run them.
    state = {
        "backend": "redis",
        "redis_url": redis.url,
        "key_prefix": f"kvproxy-{tag}:",
        "replica_ttl_s": 1.0,
        "sweep_interval_s": 0.25,
        "retry_interval_s": 0.25,
    }
    pids: list[int] = []
    urls: list[str] = []
    replica_doc: dict[str, Any] = dict(doc)
    for i in range(count):
        port = stk.free_port()
        replica_doc = {**doc, "server": {**doc["server"], "port": port}, "state": state}
        cfg_path = out_dir / f"kvproxy-{tag}-r{i}.yaml"
        cfg_path.write_text(yaml.safe_dump(replica_doc, sort_keys=False))
        proc = track(
            stk.start_kvproxy(
                config_path=cfg_path, router_url=router_url, port=port, log_dir=log_dir
            )
        )
        pids.append(proc.pid)
        urls.append(proc.url)
    lb = track(stk.start_nginx(log_dir=log_dir, upstreams=urls))
    return lb.url, replica_doc, tuple(pids), tuple(urls)


def counters(urls: Sequence[str], timeout_s: float = 5.0) -> list[dict[str, float]]:
    """Per replica (None-free: a dead one is an empty dict), its admission decisions and
    shared-state counters from ``GET /metrics``."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    out: list[dict[str, float]] = []
    for url in urls:
        got: dict[str, float] = {}
        with contextlib.suppress(OSError, ValueError):
            with opener.open(f"{url}/metrics", timeout=timeout_s) as resp:
                text = resp.read().decode()
            for line in text.splitlines():
                name, _, value = line.partition(" ")
                if name.startswith(_METRICS) and not name.endswith("_created"):
                    got[name] = float(value)
        out.append(got)
    return out


def facts(count: int, killed: dict[str, Any], retried: int, urls: Sequence[str]) -> dict[str, Any]:
    """What a run says of its replicas: how many, the one killed, the turns the
    clients resent, each replica's admission and shared-state counters."""
    return {
        "replicas": count,
        "killed_replica": killed,
        "retried_turns": retried,
        "replica_counters": counters(urls),
    }


def arm_kill(
    after_s: float | None, pids: Sequence[int], es: contextlib.ExitStack
) -> dict[str, Any]:
    """With ``after_s``: a timer that SIGKILLs the first replica then (by its PID); the
    dict it fills says when it fired."""
    out: dict[str, Any] = {}
    if after_s is None or not pids:
        return out
    pid = pids[0]
    t0 = time.monotonic()

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            out.update(pid=pid, at_s=round(time.monotonic() - t0, 2))

    timer = threading.Timer(after_s, kill)
    timer.daemon = True
    timer.start()
    es.callback(timer.cancel)
    return out
