"""The doctor's check of the shared state store (``state.backend: redis``). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from kvproxy.doctor.checks import Line, Status

# Past this median round trip the store's writes are a visible share of a request.
SLOW_STORE_MS = 2.0


@dataclass(frozen=True, slots=True)
class StoreFacts:
    backend: str
    url: str = ""  # redacted
    password_env: str = ""
    password_set: bool = False
    error: str | None = None
    latency_ms: float | None = None  # median of a few PINGs
    version: str | None = None


def store_lines(f: StoreFacts) -> list[Line]:
    """Reachable, authenticated, fast enough; or a line saying nothing is shared."""
    subject = "state store"
    if f.backend != "redis":
        return [
            Line(
                Status.OK,
                subject,
                "memory (this process only): one replica per fleet; several need "
                "state.backend: redis",
            )
        ]
    if f.error is not None:
        auth = "auth" in f.error.lower() or "password" in f.error.lower()
        fix = (
            f"set the environment variable {f.password_env} to the server's password"
            if auth
            else f"start redis-server where state.redis_url points ({f.url}), or fix the URL"
        )
        return [Line(Status.FAIL, subject, f"redis at {f.url}: {f.error}", fix)]
    lines = [
        Line(
            Status.OK,
            subject,
            f"redis {f.version or '?'} at {f.url} answers"
            + (f" (password from {f.password_env})" if f.password_set else " (no password)"),
        )
    ]
    if not f.password_set:
        lines.append(
            Line(
                Status.WARN,
                subject,
                "no password: anyone who reaches the server can read and change the sessions",
                f"set requirepass on the server and {f.password_env} where kvproxy runs",
            )
        )
    if f.latency_ms is not None:
        slow = f.latency_ms > SLOW_STORE_MS
        lines.append(
            Line(
                Status.WARN if slow else Status.OK,
                subject,
                f"round trip {f.latency_ms:.2f} ms (median of 5 PINGs)",
                "put the store next to the replicas (same host or rack)" if slow else None,
            )
        )
    return lines
