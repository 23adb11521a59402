"""One replica's link to the shared store, as both of its users need it: the session
table's (:class:`~kvproxy.state.shared.SharedState`) and program admission's ledger's
(:class:`~kvproxy.replication.sync.AdmissionSync`).

A link is *up* while the store answers; a call that fails or times out makes it *fall
back* (:meth:`StoreLink.fall_back`: one WARNING, then at most one per 30 s, and the
counters), and a bounded ping (:meth:`StoreLink.ping`) that answers again lets its owner
*rejoin*. It runs its owner's background tasks (:meth:`StoreLink.start`, stopped by
:meth:`StoreLink.stop`, bounded) and the loop that reads a channel
(:meth:`StoreLink.listen`). What falling back and rejoining do to the owner's own state
(its queue, its ledger) stays the owner's: it passes hooks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol

from kvproxy.config import StateConfig
from kvproxy.observability import RateLimitedLog, WindowedCounters
from kvproxy.state.redis_store import StoreUnavailable, redacted_url

_WARN_INTERVAL_S = 30.0


class Pingable(Protocol):
    async def ping(self) -> None: ...

    async def close(self) -> None: ...


class StoreLink:
    """Up or fallen back, the owner's tasks, the bounded ping and the channel's loop."""

    def __init__(
        self,
        cfg: StateConfig,
        store: Pingable,
        counters: WindowedCounters,
        *,
        log: logging.Logger,
        errors: str,
        fallbacks: str,
        warning: str,
        on_fall_back: Callable[[], None],
        warn_keys: int = 2,
    ) -> None:
        """``errors`` / ``fallbacks``: the owner's counter names; ``warning``: the
        WARNING's text, with ``%s`` for the store's URL (redacted) and the error;
        ``on_fall_back``: what the owner drops when the link falls back."""
        self.cfg = cfg
        self._store = store
        self._counters = counters
        self._log = log
        self._errors = errors
        self._fallbacks = fallbacks
        self._warning = warning
        self._on_fall_back = on_fall_back
        self._warnings = RateLimitedLog(log, _WARN_INTERVAL_S, max_keys=warn_keys)
        self.up = False
        self.stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def started(self) -> bool:
        return bool(self._tasks)

    def start(self, loops: list[tuple[Coroutine[Any, Any, None], str]], prefix: str) -> None:
        """Run each ``(coroutine, name)`` as a task named ``<prefix>-<name>``."""
        for coro, name in loops:
            self._tasks.append(asyncio.create_task(coro, name=f"{prefix}-{name}"))

    async def stop(self) -> None:
        """Stop the tasks (bounded: a cancellation a timeout swallowed is sent again,
        three times at most), then close the store's client."""
        self.stopping = True
        tasks, self._tasks = self._tasks, []
        for _ in range(3):
            for task in tasks:
                task.cancel()
            _, pending = await asyncio.wait(tasks, timeout=1.0) if tasks else (set(), set())
            tasks = list(pending)
            if not tasks:
                break
        await self._store.close()

    def fall_back(self, exc: BaseException) -> None:
        """A store call failed: counted; if the link was up it falls back (the owner's
        hook, then one WARNING, rate-limited)."""
        self._counters.inc(self._errors)
        if not self.up:
            return
        self.up = False
        self._counters.inc(self._fallbacks)
        self._on_fall_back()
        self._warnings.warning(
            "store-down",
            self._warning,
            redacted_url(self.cfg.redis_url),
            str(exc) or type(exc).__name__,
        )

    async def ping(self) -> StoreUnavailable | TimeoutError | None:
        """Ping the store (bounded by ``op_timeout_s``, at least 0.5 s: a store coming
        back may be slow once); the error, or None when it answered."""
        try:
            await asyncio.wait_for(self._store.ping(), max(self.cfg.op_timeout_s, 0.5))
        except (StoreUnavailable, TimeoutError) as exc:
            return exc
        return None

    async def listen(
        self,
        messages: Callable[[], AsyncIterator[str]],
        on_message: Callable[[str], Any],
        *,
        while_down: Callable[[], Coroutine[Any, Any, None]] | None,
        on_error: Callable[[], Coroutine[Any, Any, None]],
        what: str,
    ) -> None:
        """Read a channel until stopped: each message to ``on_message``; the store
        failing makes the link fall back. While it is down: ``retry_interval_s`` of
        sleep, then ``while_down`` (a rejoin, or nothing). Any other error is logged,
        then ``on_error``."""
        while not self.stopping:
            if not self.up:
                await asyncio.sleep(self.cfg.retry_interval_s)
                if while_down is not None:
                    await while_down()
                continue
            try:
                async for message in messages():
                    on_message(message)
            except StoreUnavailable as exc:
                self.fall_back(exc)
            except Exception:
                self._log.exception("%s failed", what)
                await on_error()
