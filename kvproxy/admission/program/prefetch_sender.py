"""Program admission's prefetches on the event loop (asyncio shell;
docs/admission.md#prefetch-before-the-tool-returns).

The pure parts are in :mod:`kvproxy.admission.program.prefetch`: who is due and whether an
engine may take it (``Prefetches``, over :class:`~kvproxy.admission.program.core.ProgramCore`'s
ledger), the plan, the prompts kept. This keeps each session's last request as its turn asked admission,
and at every tick sends the due prefetches: the prompt as one output token
(:func:`kvproxy.warm.warm_body`) posted to the router with the session's routing key,
in the background, each counted in flight on its engine until it answers. It never
delays the turn that kept the prompt, and is not a turn itself (not tracked, not
admitted); its answer is read and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import orjson

from kvproxy.admission.catalogue import C_PREFETCH_FAILED, C_PREFETCH_NO_PROMPT
from kvproxy.admission.program.core import ProgramCore
from kvproxy.admission.program.prefetch import Prompts
from kvproxy.admission.records import AdmissionRequest
from kvproxy.fleet.client import EngineHttp
from kvproxy.observability import WindowedCounters
from kvproxy.sessions.identity import ROUTING_KEY_HEADER, new_rid
from kvproxy.vocab import header
from kvproxy.warm import warm_body

# A prefetch loads a prefix and decodes one token: one that takes longer than this has
# missed its turn anyway.
PREFETCH_TIMEOUT_S = 60.0


class Prefetcher:
    """The prompts kept for prefetch and the prefetches in flight."""

    def __init__(
        self,
        core: ProgramCore,
        http: EngineHttp | None,
        router_url: str | None,
        counters: WindowedCounters,
        max_bytes: int,
    ) -> None:
        self.core = core
        self.prompts = Prompts(max_bytes)
        self._http = http
        self._router = (router_url or "").rstrip("/")
        self._counters = counters
        self._tasks: set[asyncio.Task[None]] = set()
        self._timeout = aiohttp.ClientTimeout(total=PREFETCH_TIMEOUT_S)

    def keep(self, req: AdmissionRequest) -> None:
        """Keep the session's request (the prompt its prefetch would resend); nothing
        without a router to send to."""
        sid = req.session_id
        if sid is not None and self._router and self._http is not None:
            auth = header(req.headers, "Authorization")
            self.prompts.keep(sid, req.path, req.body, req.routing_key, auth)

    def forget(self, sid: str) -> None:
        self.prompts.forget(sid)

    def send_due(self, now: float) -> None:
        """Send the prefetches due at ``now``, in the background."""
        core = self.core
        for sid, url in core.prefetches(now):
            kept = self.prompts.get(sid)
            body = (
                None
                if kept is None
                else warm_body(kept.path, kept.body, session_id=sid, rid=new_rid())
            )
            if kept is None or body is None:
                core.prefetch_done(url)
                self._counters.inc(C_PREFETCH_NO_PROMPT)
                continue
            # Sent once: the body holds the prompt now (its token ids parsed), and the
            # session's next turn keeps its own.
            self.prompts.forget(sid)
            headers = {
                ROUTING_KEY_HEADER: kept.routing_key or sid,
                "Content-Type": "application/json",
            }
            if kept.authorization is not None:
                headers["Authorization"] = kept.authorization
            task = asyncio.ensure_future(self._send(url, kept.path, body, headers))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(
        self, url: str, path: str, body: dict[str, object], headers: dict[str, str]
    ) -> None:
        assert self._http is not None
        ok = False
        try:
            async with self._http.post(
                self._router + path, data=orjson.dumps(body), headers=headers, timeout=self._timeout
            ) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            pass
        finally:
            self.core.prefetch_done(url)  # also when cancelled (then not counted)
        if not ok:
            self._counters.inc(C_PREFETCH_FAILED)

    async def stop(self) -> None:
        """Cancel the prefetches in flight and forget the prompts."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.prompts.clear()


__all__ = ["PREFETCH_TIMEOUT_S", "Prefetcher"]
