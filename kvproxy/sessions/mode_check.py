"""The engines' session mode, read once at start-up: the lifecycle's probe loop.

The asyncio shell around :func:`kvproxy.fleet.engine_info.probe`: reads each engine's
``/server_info`` until every engine is known (bounded rounds with growing delays),
keeps what it read for ``/kvproxy/health`` and logs each warning once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvproxy.fleet.client import EngineHttp
from kvproxy.fleet.engine_info import EngineSessionMode, mode_warnings, probe
from kvproxy.sessions.lifecycle_core import check_delays

log = logging.getLogger("kvproxy.sessions.lifecycle")

_PROBE_TIMEOUT_S = 5.0
_CHECK_DELAYS_S = check_delays(rounds=12, first_s=0.5, max_s=30.0)
_MAX_LOGGED_WARNINGS = 256


class EngineModeCheck:
    """What the probes found: each engine's mode, the errors, the check's state."""

    def __init__(self, http: EngineHttp, engines: Callable[[], list[str]]) -> None:
        self._http = http
        self._engines = engines
        self.state = "not_started"
        self.modes: dict[str, EngineSessionMode] = {}
        self.probe_errors: dict[str, str] = {}
        self._logged: set[str] = set()

    async def check(self) -> bool:
        """Probe engines whose session mode is not known yet.

        Returns True when engines are known and every one of them has been read.
        """
        urls = self._engines()
        todo = [u for u in urls if u not in self.modes]
        if todo:
            results = await asyncio.gather(
                *(probe(self._http, u, _PROBE_TIMEOUT_S) for u in todo), return_exceptions=True
            )
            for url, res in zip(todo, results, strict=True):
                if isinstance(res, EngineSessionMode):
                    self.modes[url] = res
                    self.probe_errors.pop(url, None)
                elif isinstance(res, BaseException):
                    self.probe_errors[url] = str(res) or type(res).__name__
            for warning in mode_warnings([self.modes[u] for u in todo if u in self.modes]):
                if warning not in self._logged and len(self._logged) < _MAX_LOGGED_WARNINGS:
                    self._logged.add(warning)
                    log.warning("session lifecycle: %s", warning)
        return bool(urls) and all(u in self.modes for u in urls)

    async def run(self) -> None:
        """Probe until every engine is read or the rounds run out (a background task;
        its starter sets ``state`` to ``"pending"``)."""
        try:
            for delay in _CHECK_DELAYS_S:
                try:
                    if await self.check():
                        self.state = "done"
                        return
                except Exception:
                    log.exception("engine session-mode check failed")
                await asyncio.sleep(delay)
            self.state = "incomplete"
            if self.probe_errors:
                log.warning(
                    "session lifecycle: could not read the session mode of %d engine(s): %s",
                    len(self.probe_errors),
                    "; ".join(sorted(self.probe_errors.values())[:5]),
                )
        finally:
            if self.state == "pending":
                self.state = "stopped"
