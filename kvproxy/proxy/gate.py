"""Which requests the proxy forwards to the router: the shell of :mod:`kvproxy.paths`.

``router.forward_paths`` compiled once per value (a reload may change it; a request
costs an identity check and a set lookup or two), and the control-plane opt-in:
``router.forward_control_plane`` with the admin bearer token.
"""

from __future__ import annotations

from aiohttp import web

from kvproxy.config import LiveConfig
from kvproxy.credentials import bearer_matches
from kvproxy.paths import OWN_PREFIX, ForwardRules, compile_forward_paths


class ForwardGate:
    __slots__ = ("_live", "_rules", "_rules_of")

    def __init__(self, live: LiveConfig) -> None:
        self._live = live
        self._rules_of: tuple[str, ...] | None = None
        self._rules = compile_forward_paths(())

    def rules(self) -> ForwardRules:
        """``router.forward_paths`` compiled (once per value)."""
        patterns = self._live.config.router.forward_paths
        if patterns is not self._rules_of:
            self._rules = compile_forward_paths(patterns)
            self._rules_of = patterns
        return self._rules

    def control_plane(self, request: web.Request, path: str) -> bool:
        """A path outside the data plane goes to the router only with
        ``router.forward_control_plane`` on and the admin bearer token."""
        config = self._live.config
        token = config.server.admin_token
        return (
            config.router.forward_control_plane
            and token is not None
            and not path.startswith(OWN_PREFIX)
            and bearer_matches(token, request.headers.get("Authorization"))
        )


__all__ = ["ForwardGate"]
