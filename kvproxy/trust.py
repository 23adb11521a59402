"""Which engine URLs learned from the router kvproxy will talk to. Pure.

kvproxy sends every engine it learns of (``GET /workers`` on the router) its
``/close_session``, ``/abort_request`` and metric scrapes. A URL is used only when it
is ``http`` or ``https``, names a host, carries no user name or password, and, with
``router.engine_hosts`` set, its host is one of those names or inside one of those
IP networks (:class:`EngineTrust`). Everything else is dropped from the engine list
(:func:`kvproxy.fleet.trust.trusted_engines`), counted and logged by the fleet.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvproxy.urls import base_url

_HOST_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?$")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def host_pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` is not a host name, an IP address or a CIDR network; None if it is."""
    try:
        ipaddress.ip_network(pattern, strict=False)
        return None
    except ValueError:
        pass
    if _HOST_NAME.match(pattern):
        return None
    return "must be a host name, an IP address or a CIDR network"


@dataclass(frozen=True, slots=True)
class EngineTrust:
    """Compiled ``router.engine_hosts`` (empty: any host)."""

    names: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    @classmethod
    def of(cls, patterns: Iterable[str]) -> EngineTrust:
        names: set[str] = set()
        networks: list[Network] = []
        for pattern in patterns:
            try:
                networks.append(ipaddress.ip_network(pattern, strict=False))
            except ValueError:
                names.add(pattern.lower().rstrip("."))
        return cls(frozenset(names), tuple(networks))

    @property
    def any_host(self) -> bool:
        return not self.names and not self.networks

    def host_allowed(self, host: str) -> bool:
        if self.any_host:
            return True
        if host.lower().rstrip(".") in self.names:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in net for net in self.networks)


def engine_url_problem(url: str, trust: EngineTrust) -> str | None:
    """Why the engine ``url`` (a data-parallel ``@rank`` suffix allowed) is refused;
    None when kvproxy may use it."""
    base = base_url(url)
    try:
        parts = urlsplit(base)
        host = parts.hostname
        _ = parts.port  # a port that is not a number raises
    except ValueError:
        return "not a URL"
    if parts.scheme not in ("http", "https"):
        return "not http or https"
    if not host:
        return "no host"
    if parts.username is not None or parts.password is not None:
        return "credentials in the URL"
    if parts.query or parts.fragment:
        return "a query or fragment in the URL"
    if not trust.host_allowed(host):
        return "host not in router.engine_hosts"
    return None


__all__ = ["EngineTrust", "engine_url_problem", "host_pattern_problem"]
