"""The ``server:`` section: kvproxy's own listener, process and scales. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from kvproxy.config.errors import check, check_each


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    max_body_bytes: int = 64 * 1024 * 1024
    # When set, the admin endpoints (reload, session close, stats reset) require
    # "Authorization: Bearer <token>" and the dashboard asks for it once (then a
    # cookie). Data-plane requests never do.
    admin_token: str | None = None
    # With admin_token set: whether GET /kvproxy/stats and /metrics stay readable
    # without it. /kvproxy/health always answers (probes): its status only, the details
    # with the token (or the dashboard cookie).
    public_stats: bool = True
    # The dashboard cookie: how long it is valid (checked by kvproxy, and its Max-Age),
    # and whether it is marked Secure (null: when the sign-in came over https).
    cookie_max_age_s: int = 43_200
    cookie_secure: bool | None = None
    # Failed dashboard sign-ins allowed per client address and minute; past it 429.
    sign_in_attempts_per_minute: int = 10
    # The admin plane (/kvproxy/..., /metrics) answers only requests whose Host names
    # one of these (host names, with or without a port); empty: the loopback names
    # when host is a loopback address, any host otherwise. Defeats DNS rebinding.
    admin_hosts: tuple[str, ...] = ()
    # Origins (scheme://host:port) a browser may send state-changing admin and session
    # requests from, besides kvproxy's own origin; others get 403.
    admin_origins: tuple[str, ...] = ()
    # Open client connections at once; past it a new one gets 503 overloaded and is
    # closed. 0 = no bound.
    max_connections: int = 4096
    # Request bodies held in memory at once, all requests together (a request waiting
    # for admission holds its body); past it 503 overloaded. 0 = no bound.
    max_buffered_bytes: int = 1024 * 1024 * 1024
    # Seconds to let in-flight requests finish on SIGTERM / SIGINT.
    shutdown_grace_s: float = 10.0
    # Listen backlog: bursts of new connections beyond it wait for SYN retransmits.
    backlog: int = 2048
    # The start-up line and router reachability changes are logged at INFO.
    log_level: str = "INFO"
    # Wall seconds per simulated second: multiplies every kvproxy timer and duration
    # (admission poll interval, staleness, waits, leases, idle times, tick). 1.0 in
    # production; a benchmark against simulated engines running faster than real time
    # sets it below 1 so the dynamics stay the same.
    time_scale: float = 1.0
    # Real tokens per token of the engines: 1 in production. Simulated engines run at a
    # token scale K (docs/simulator.md) where one token stands for K; kvproxy's
    # token-valued admission settings (default_completion_tokens, expected_decode_cap,
    # priority_unit_tokens, session_buffer_tokens) are then divided by K, as time_scale
    # multiplies its durations, so the dynamics stay the same.
    token_scale: int = 1
    # Slow clients: a request head must arrive within header_read_timeout_s (else 408
    # and the connection is closed), a request body within body_read_timeout_s of the
    # head's end (else the connection is closed). 0 disables a bound.
    header_read_timeout_s: float = 15.0
    body_read_timeout_s: float = 60.0
    # The garbage collector's young-generation threshold once serving (the first value
    # of gc.set_threshold; 0 keeps Python's 700). Python's default is below what a few
    # dozen requests in flight hold: each young collection then promotes objects that die
    # soon after, and collections cost 46-91 µs per request at 64 concurrent requests
    # (docs/benchmarks.md, "Garbage collection").
    gc_threshold: int = 10_000
    # Freed memory glibc's malloc keeps for reuse instead of handing it back to the
    # kernel (its trim threshold; buffers up to min(this, 32 MiB) come from the heap):
    # a big body's buffers are then not fresh pages, each a page fault, on every request
    # (kvproxy.heap; docs/benchmarks.md, "Page faults of big bodies"). 0 keeps glibc's
    # own; nothing is done on another C library.
    malloc_retain_bytes: int = 64 * 1024 * 1024


# server.malloc_retain_bytes: 0, or from 1 MiB to what mallopt's int takes.
MIN_MALLOC_RETAIN = 1024 * 1024
MAX_MALLOC_RETAIN = 2**31 - 1

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def validate_server(s: ServerConfig) -> None:
    """Raise ConfigError naming the first ``server.`` key out of range."""
    check(1 <= s.port <= 65535, f"server.port: must be in [1, 65535] (got {s.port})")
    check(
        s.max_body_bytes >= 1024, f"server.max_body_bytes: must be >= 1024 (got {s.max_body_bytes})"
    )
    check(
        s.shutdown_grace_s >= 0, f"server.shutdown_grace_s: must be >= 0 (got {s.shutdown_grace_s})"
    )
    check(
        s.admin_token is None or (s.admin_token.strip() == s.admin_token != ""),
        "server.admin_token: must be null or a non-empty string without surrounding spaces",
    )
    check(0 < s.time_scale <= 100, f"server.time_scale: must be in (0, 100] (got {s.time_scale})")
    check(
        1 <= s.token_scale <= 1024,
        f"server.token_scale: must be an integer in [1, 1024] (got {s.token_scale})",
    )
    check(
        s.log_level.upper() in LOG_LEVELS,
        f"server.log_level: must be one of {', '.join(LOG_LEVELS)} (got {s.log_level!r})",
    )
    check_each(
        "server",
        s,
        ("header_read_timeout_s", "body_read_timeout_s"),
        lambda v: v >= 0,
        "must be >= 0 (0 = no bound)",
    )
    check(
        60 <= s.cookie_max_age_s <= 31_536_000,
        f"server.cookie_max_age_s: must be in [60, 31536000] (got {s.cookie_max_age_s})",
    )
    check(
        1 <= s.sign_in_attempts_per_minute <= 10_000,
        "server.sign_in_attempts_per_minute: must be in [1, 10000] "
        f"(got {s.sign_in_attempts_per_minute})",
    )
    check(s.max_connections >= 0, f"server.max_connections: must be >= 0 (got {s.max_connections})")
    check(
        s.max_buffered_bytes == 0 or s.max_buffered_bytes >= s.max_body_bytes,
        f"server.max_buffered_bytes: must be 0 (no bound) or >= server.max_body_bytes "
        f"(got {s.max_buffered_bytes})",
    )
    for i, origin in enumerate(s.admin_origins):
        check(
            origin.startswith(("http://", "https://")) and origin.count("/") == 2,
            f"server.admin_origins[{i}]: must be scheme://host[:port] (got {origin!r})",
        )
    check(
        s.gc_threshold == 0 or 100 <= s.gc_threshold <= 10_000_000,
        f"server.gc_threshold: must be 0 (Python's default) or in [100, 10000000] "
        f"(got {s.gc_threshold})",
    )
    check(
        s.malloc_retain_bytes == 0
        or MIN_MALLOC_RETAIN <= s.malloc_retain_bytes <= MAX_MALLOC_RETAIN,
        f"server.malloc_retain_bytes: must be 0 (glibc's own) or in [{MIN_MALLOC_RETAIN}, "
        f"{MAX_MALLOC_RETAIN}] (got {s.malloc_retain_bytes})",
    )
