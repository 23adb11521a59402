"""The proxy's own Prometheus metrics (requests, upstream errors, added latency)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# Paths with their own label value; everything else is "other" (bounded cardinality).
KNOWN_PATHS = frozenset(
    {
        "/generate",
        "/v1/chat/completions",
        "/v1/completions",
        "/close_session",
        "/v1/models",
        "/health",
        "/workers",
    }
)

# Added latency is sub-millisecond when healthy: resolve it finely.
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvproxy_requests",
            "Requests answered by the proxy, by path and status code.",
            ["path", "status"],
            registry=registry,
        )
        self.upstream_errors = Counter(
            "kvproxy_upstream_errors",
            "Upstream (router) failures by type.",
            ["type"],
            registry=registry,
        )
        self.added_latency = Histogram(
            "kvproxy_added_latency_seconds",
            "Time spent in the proxy itself before the response starts, excluding upstream "
            "time and deliberate admission waits.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.slow_clients_dropped = Counter(
            "kvproxy_slow_clients_dropped",
            "Connections closed because the request head (phase=header) or body "
            "(phase=body) did not arrive within server.header_read_timeout_s / "
            "server.body_read_timeout_s.",
            ["phase"],
            registry=registry,
        )
        self.connections_refused = Counter(
            "kvproxy_connections_refused",
            "Client connections answered 503 overloaded past server.max_connections.",
            registry=registry,
        )
        for phase in ("header", "body"):
            self.slow_clients_dropped.labels(phase)  # exported at 0 from the start
        self._children: dict[tuple[str, int], Counter] = {}
        # Plain running totals for the dashboard's rates (no label lookups there).
        self.answered = 0
        self.upstream_failures = 0

    def connection_refused(self) -> None:
        self.connections_refused.inc()

    def slow_client_dropped(self, phase: str) -> None:
        self.slow_clients_dropped.labels(phase).inc()

    def upstream_error(self, kind: str) -> None:
        self.upstream_failures += 1
        self.upstream_errors.labels(kind).inc()

    def count(self, path: str, status: int) -> None:
        key = (path if path in KNOWN_PATHS else "other", status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.requests.labels(key[0], str(status))
        child.inc()
        self.answered += 1
