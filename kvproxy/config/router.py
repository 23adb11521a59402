"""The ``router:`` section: the router kvproxy forwards to, and its engines. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvproxy.config.errors import check
from kvproxy.paths import DEFAULT_FORWARD_PATHS, pattern_problem
from kvproxy.trust import host_pattern_problem

# router.policy values whose placement kvproxy can mirror (a ledger per engine).
ROUTER_POLICIES_MIRRORED = ("consistent_hashing",)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    url: str = "http://127.0.0.1:30000"
    # Static engine base URLs. When non-empty they override discovery through the router.
    engines: tuple[str, ...] = ()
    connect_timeout_s: float = 5.0
    # Whole-request limit for one upstream attempt (streams included); 0 disables it.
    request_timeout_s: float = 3600.0
    # Limit on the silence between two chunks of an upstream response; 0 disables it.
    read_timeout_s: float = 600.0
    # Connection pool size to the router (0 = unlimited).
    max_connections: int = 0
    # How often the engine list is re-read from the router's /workers.
    discovery_interval_s: float = 5.0
    # The router's load-balancing policy as deployed (smg --policy). With
    # consistent_hashing kvproxy mirrors the router's ring and keeps a ledger per
    # engine; with any other policy placement is unknown and program admission falls
    # back to fleet-wide accounting (said at start and in /kvproxy/health).
    policy: str = "cache_aware"
    # smg's Prometheus endpoint (smg --prometheus-host/--prometheus-port), e.g.
    # http://127.0.0.1:29000/metrics. When set, program admission reads smg's
    # consistent-hashing branch counter and counts and warns about requests smg routed
    # off the ring (random_fallback, no_healthy_workers, target_worker_miss).
    metrics_url: str | None = None
    # The router paths kvproxy forwards (its data plane): exact paths, or a path
    # followed by /* for its sub-resources (kvproxy.proxy.paths). Anything else is
    # answered 404 by kvproxy: smg's control plane (/workers, /flush_cache, ...) is
    # not reachable through it. ["/*"] forwards every path (kvproxy's own excepted).
    forward_paths: tuple[str, ...] = DEFAULT_FORWARD_PATHS
    # Forward the paths not in forward_paths too, but only with the admin bearer token
    # (server.admin_token, which must be set; the token itself is not forwarded).
    forward_control_plane: bool = False
    # Engine URLs learned from the router (GET /workers) are used only when http(s);
    # with this list non-empty, only when their host is one of these host names, IP
    # addresses or CIDR networks (e.g. ["10.0.0.0/8", "engine-1.internal"]).
    # Refused URLs are counted and logged (once per URL).
    engine_hosts: tuple[str, ...] = ()


_URL_RE = re.compile(r"^https?://[^/\s]+(/.*)?$")


def is_http_url(url: str) -> bool:
    return bool(_URL_RE.match(url))


def validate_router(r: RouterConfig) -> None:
    """Raise ConfigError naming the first ``router.`` key out of range."""
    check(
        bool(re.match(r"^[a-z_]+$", r.policy)),
        f"router.policy: must be a policy name such as consistent_hashing (got {r.policy!r})",
    )
    check(is_http_url(r.url), f"router.url: must be an http(s) URL (got {r.url!r})")
    check(
        r.metrics_url is None or is_http_url(r.metrics_url),
        f"router.metrics_url: must be null or an http(s) URL (got {r.metrics_url!r})",
    )
    for i, pattern in enumerate(r.forward_paths):
        problem = pattern_problem(pattern)
        check(problem is None, f"router.forward_paths[{i}]: {problem} (got {pattern!r})")
    for i, host in enumerate(r.engine_hosts):
        problem = host_pattern_problem(host)
        check(problem is None, f"router.engine_hosts[{i}]: {problem} (got {host!r})")
    for i, url in enumerate(r.engines):
        check(is_http_url(url), f"router.engines[{i}]: must be an http(s) URL (got {url!r})")
    check(
        r.connect_timeout_s > 0,
        f"router.connect_timeout_s: must be > 0 (got {r.connect_timeout_s})",
    )
    check(
        r.request_timeout_s >= 0,
        f"router.request_timeout_s: must be >= 0 (got {r.request_timeout_s})",
    )
    check(r.read_timeout_s >= 0, f"router.read_timeout_s: must be >= 0 (got {r.read_timeout_s})")
    check(r.max_connections >= 0, f"router.max_connections: must be >= 0 (got {r.max_connections})")
    check(
        r.discovery_interval_s > 0,
        f"router.discovery_interval_s: must be > 0 (got {r.discovery_interval_s})",
    )
