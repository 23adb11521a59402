"""The ``state:`` section: where the session lifecycle's shared state lives. Pure.

``memory`` (the default) keeps it in the process, as before: nothing is shared and no
server is needed. ``redis`` shares the session table and program admission's ledger
between replicas (``kvproxy serve --workers N``, or processes on several hosts behind a
load balancer); the fleet ledger (``admission.ledger: fleet``) stays per replica
(docs/operations.md, "Running several replicas").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvproxy.config.errors import check, check_each

STATE_BACKENDS = ("memory", "redis")


@dataclass(frozen=True, slots=True)
class StateConfig:
    backend: str = "memory"  # memory | redis
    # redis:// or rediss:// URL, without the password (it is read from the environment).
    redis_url: str = "redis://127.0.0.1:6379/0"
    # The environment variable holding the Redis password (unset or empty: no AUTH).
    redis_password_env: str = "KVPROXY_REDIS_PASSWORD"
    # Every key kvproxy writes starts with this, so several fleets can share a server.
    key_prefix: str = "kvproxy:"
    # Bound on every store call: past it the replica falls back to its local state.
    op_timeout_s: float = 0.05
    # A replica's heartbeat and its close claims expire this long after it stops.
    replica_ttl_s: float = 5.0
    # How long a replica found gone (its heartbeat expired) stays silent before the
    # requests it recorded in flight are aborted on every engine; None: never. Longer
    # than a store stall to tolerate: a replica cut off from Redis only (still serving)
    # loses those of its requests that began before the cut and outlast this.
    orphan_abort_after_s: float | None = 30.0
    # A session's keys expire this long after its last activity (closed or not).
    session_ttl_s: float = 3600.0
    # How often the shared idle sweep runs (one replica at a time, under a lease), and
    # how often a replica that fell back tries the store again.
    sweep_interval_s: float = 1.0
    retry_interval_s: float = 1.0


def validate_state(s: StateConfig) -> None:
    """Raise ConfigError naming the first ``state.`` key out of range."""
    check(
        s.backend in STATE_BACKENDS,
        f"state.backend: must be one of {', '.join(STATE_BACKENDS)} (got {s.backend!r})",
    )
    if s.backend != "redis":
        return
    check(
        s.redis_url.startswith(("redis://", "rediss://", "unix://")),
        "state.redis_url: must be a redis://, rediss:// or unix:// URL",
    )
    check(
        "@" not in s.redis_url.partition("://")[2].partition("/")[0],
        "state.redis_url: must not carry credentials; put the password in the environment "
        "variable named by state.redis_password_env",
    )
    check(
        s.redis_password_env.replace("_", "").isalnum(),
        f"state.redis_password_env: must be an environment variable name (got {s.redis_password_env!r})",
    )
    check(
        bool(s.key_prefix) and len(s.key_prefix) <= 64,
        "state.key_prefix: must be 1..64 characters",
    )
    check(
        0.001 <= s.op_timeout_s <= 5,
        f"state.op_timeout_s: must be in [0.001, 5] (got {s.op_timeout_s})",
    )
    check_each(
        "state",
        s,
        ("replica_ttl_s", "session_ttl_s", "sweep_interval_s", "retry_interval_s"),
        lambda v: v > 0,
        "must be > 0",
    )
    check(
        s.replica_ttl_s >= 2 * s.sweep_interval_s,
        f"state.replica_ttl_s: must be >= 2 x state.sweep_interval_s (got {s.replica_ttl_s})",
    )
    check(
        s.orphan_abort_after_s is None or s.orphan_abort_after_s >= s.replica_ttl_s,
        "state.orphan_abort_after_s: must be null (never) or >= state.replica_ttl_s "
        f"(got {s.orphan_abort_after_s})",
    )
