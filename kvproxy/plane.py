"""Who may reach the admin plane at all: the Host and Origin checks. Pure.

Before any token is looked at, a request to kvproxy's own endpoints (``/kvproxy/...``,
``/metrics``) must name kvproxy in its ``Host`` header, and a state-changing one sent
by a browser must come from kvproxy's own origin:

- **Host** (:func:`host_allowed`): one of ``server.admin_hosts``; with none configured,
  a loopback name (``localhost``, ``127.0.0.1``, ``::1``) when kvproxy listens on a
  loopback address, any host otherwise. A page on another site whose name resolves to
  127.0.0.1 (DNS rebinding) sends its own name: refused.
- **Origin** (:func:`origin_allowed`): absent (not a browser), kvproxy's own
  ``scheme://host:port``, or one of ``server.admin_origins``. Checked on everything but
  GET and HEAD (a cross-origin page cannot read a GET's answer; it can send a POST).
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name, without a port) is the loopback."""
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """``example:8100`` -> ``example``; ``[::1]:8100`` -> ``::1``; lower case."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        return host.partition(":")[0]
    return host


def host_allowed(host_header: str, admin_hosts: tuple[str, ...], bound_host: str) -> bool:
    name = host_name(host_header)
    if admin_hosts:
        return any(name == host_name(h) for h in admin_hosts)
    if is_loopback(bound_host):
        return is_loopback(name)
    return True


def origin_allowed(
    method: str, origin: str | None, own_origin: str, admin_origins: tuple[str, ...]
) -> bool:
    if method in _SAFE_METHODS or origin is None:
        return True
    origin = origin.strip().lower().rstrip("/")
    return origin == own_origin.lower() or origin in (o.lower().rstrip("/") for o in admin_origins)


def plane_problem(
    *,
    method: str,
    host_header: str,
    origin: str | None,
    scheme: str,
    bound_host: str,
    admin_hosts: tuple[str, ...],
    admin_origins: tuple[str, ...],
) -> str | None:
    """Why the request is refused (403) before any credential is read; None: go on."""
    if not host_allowed(host_header, admin_hosts, bound_host):
        return f"Host {host_header[:100]!r} is not this kvproxy (server.admin_hosts)"
    if not origin_allowed(method, origin, f"{scheme}://{host_header}", admin_origins):
        return f"cross-origin request from {origin!r} refused (server.admin_origins)"
    return None


def exposure_warning(bound_host: str, admin_token: str | None) -> str | None:
    """The start-up WARNING for listening off loopback without an admin token."""
    if admin_token is not None or is_loopback(bound_host):
        return None
    return (
        f"listening on {bound_host} (not loopback) without server.admin_token: anyone who "
        "can reach this port can reload the config, close any unbound session and read "
        "the fleet's details. Set server.admin_token (docs/security.md)"
    )


__all__ = [
    "exposure_warning",
    "host_allowed",
    "host_name",
    "is_loopback",
    "origin_allowed",
    "plane_problem",
]
