"""The ``session_lifecycle:`` section: session ids, closes, Dynamo's nvext. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from kvproxy.config.errors import check

SESSION_ID_SOURCES = ("body", "header", "nvext", "routing_key", "path")
# The paths whose nvext block session_lifecycle.strip_nvext_paths may remove.
NVEXT_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True, slots=True)
class SessionLifecycleConfig:
    enabled: bool = False
    # Ordered sources of a request's session id.
    id_sources: tuple[str, ...] = SESSION_ID_SOURCES
    id_header: str = "X-Session-ID"
    # A request carrying this header with a true value (kvproxy.vocab.TRUTHY: "1",
    # "true", "yes", "on") is the session's last turn: it closes once that completes.
    final_header: str = "X-Session-Final"
    id_max_length: int = 128
    sticky_routing: bool = False
    on_close: str = "abort"  # abort | wait
    close_timeout_s: float = 2.0
    # on_close=wait: how long to wait for forwarded requests before aborting them anyway.
    wait_timeout_s: float = 60.0
    # Close a session after this many idle seconds; None disables the idle timeout.
    idle_timeout_s: float | None = None
    # Session table bound: past it the least recently active idle session is forgotten
    # (not closed) and counted.
    max_sessions: int = 100_000
    # Closed session ids are remembered this long so that repeated closes are no-ops.
    closed_ttl_s: float = 600.0
    # Read each engine's /server_info at start and report its session mode.
    check_engines: bool = True
    # Bind each session to the data-plane credential (Authorization, else x-api-key)
    # of its first request: later requests of it and its close (/close_session, a
    # final turn, /kvproxy/sessions/{id}/close without the admin token) need the same
    # one, else 403 forbidden. A session opened without a credential stays unbound.
    bind_credential: bool = True
    # Rids one request may name (a rid list, or n samples of one rid): above it 400.
    max_rids_per_request: int = 64
    # SGLang aborts by rid prefix: a client rid shorter than this is never sent in an
    # /abort_request (the request is still ended by dropping its upstream connection).
    # kvproxy's own rids (32 random hex characters) always are.
    abort_rid_min_length: int = 32
    # /abort_request and /close_session posts in flight at once, all sessions together.
    fanout_concurrency: int = 32
    # Dynamo's nvext (docs/dynamo.md). Each switch turns one behaviour off; all default on.
    # agent_hints.priority -> top-level priority; agent_hints.osl -> expected growth.
    agent_hints: bool = True
    # session_control bind (and chat open): sticky routing + sliding inactivity close.
    bind_timeouts: bool = True
    # session_control open on /generate with input_ids: SGLang streaming sessions.
    streaming_sessions: bool = True
    max_streaming_sessions: int = 10_000
    # A streaming session is opened (and kept) only while the KV the engine's streaming
    # sessions hold plus this session's next turn stays within this share of the
    # engine's max_total_num_tokens; past it the session behaves as bind.
    streaming_max_pool_share: float = 0.5
    # agent_hints.speculative_prefill: warm the next turn's prefix after the response.
    speculative_prefill: bool = True
    speculative_prefill_max_in_flight: int = 4
    # Paths on which the nvext block is removed before forwarding (SGLang ignores it on
    # all of them, so none by default).
    strip_nvext_paths: tuple[str, ...] = ()


def validate_session_lifecycle(sl: SessionLifecycleConfig) -> None:
    """Raise ConfigError naming the first ``session_lifecycle.`` key out of range.

    Called only when the feature is enabled."""
    _validate_identity(sl)
    _validate_close(sl)
    _validate_nvext(sl)


def _validate_identity(sl: SessionLifecycleConfig) -> None:
    for src in sl.id_sources:
        check(
            src in SESSION_ID_SOURCES,
            f"session_lifecycle.id_sources: unknown source {src!r} "
            f"(allowed: {', '.join(SESSION_ID_SOURCES)})",
        )
    check(bool(sl.id_sources), "session_lifecycle.id_sources: must not be empty")


def _validate_close(sl: SessionLifecycleConfig) -> None:
    check(
        sl.on_close in ("abort", "wait"),
        f"session_lifecycle.on_close: must be abort or wait (got {sl.on_close!r})",
    )
    check(
        0 < sl.close_timeout_s <= 60,
        f"session_lifecycle.close_timeout_s: must be in (0, 60] (got {sl.close_timeout_s})",
    )
    check(
        sl.wait_timeout_s >= 0,
        f"session_lifecycle.wait_timeout_s: must be >= 0 (got {sl.wait_timeout_s})",
    )
    check(
        sl.idle_timeout_s is None or sl.idle_timeout_s > 0,
        f"session_lifecycle.idle_timeout_s: must be > 0 or null (got {sl.idle_timeout_s})",
    )
    check(
        8 <= sl.id_max_length <= 1024,
        f"session_lifecycle.id_max_length: must be in [8, 1024] (got {sl.id_max_length})",
    )
    check(
        sl.max_sessions >= 1,
        f"session_lifecycle.max_sessions: must be >= 1 (got {sl.max_sessions})",
    )
    check(
        sl.closed_ttl_s >= 0,
        f"session_lifecycle.closed_ttl_s: must be >= 0 (got {sl.closed_ttl_s})",
    )
    check(
        1 <= sl.max_rids_per_request <= 1024,
        "session_lifecycle.max_rids_per_request: must be in [1, 1024] "
        f"(got {sl.max_rids_per_request})",
    )
    check(
        1 <= sl.abort_rid_min_length <= 256,
        "session_lifecycle.abort_rid_min_length: must be in [1, 256] "
        f"(got {sl.abort_rid_min_length})",
    )
    check(
        1 <= sl.fanout_concurrency <= 1024,
        f"session_lifecycle.fanout_concurrency: must be in [1, 1024] (got {sl.fanout_concurrency})",
    )


def _validate_nvext(sl: SessionLifecycleConfig) -> None:
    check(
        sl.max_streaming_sessions >= 1,
        f"session_lifecycle.max_streaming_sessions: must be >= 1 (got {sl.max_streaming_sessions})",
    )
    check(
        0 < sl.streaming_max_pool_share <= 1,
        "session_lifecycle.streaming_max_pool_share: must be in (0, 1] "
        f"(got {sl.streaming_max_pool_share})",
    )
    check(
        1 <= sl.speculative_prefill_max_in_flight <= 1024,
        "session_lifecycle.speculative_prefill_max_in_flight: must be in [1, 1024] "
        f"(got {sl.speculative_prefill_max_in_flight})",
    )
    for p in sl.strip_nvext_paths:
        check(
            p in NVEXT_PATHS,
            f"session_lifecycle.strip_nvext_paths: unknown path {p!r} "
            f"(allowed: {', '.join(NVEXT_PATHS)})",
        )
