"""One request of a session while it is in the proxy: the asyncio shell's handle.

:class:`TrackedRequest` carries the futures a close waits on (the request rejected,
the request gone); :class:`Tracking` is the context manager
:meth:`~kvproxy.sessions.lifecycle.SessionManager.track` returns. Both talk to their
owner, the :class:`~kvproxy.sessions.lifecycle.SessionManager`, through
:class:`RequestOwner`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Protocol, TypeVar

from kvproxy.sessions.lifecycle_core import SessionClosed

T = TypeVar("T")


class RequestOwner(Protocol):
    """What a tracked request needs of the session manager that made it."""

    def enter(
        self,
        session_id: str,
        rid: str,
        rids: tuple[str, ...],
        close_after: bool,
        *,
        forwarded: bool = False,
        parent: str | None = None,
    ) -> TrackedRequest: ...

    def leave(self, req: TrackedRequest) -> None: ...

    def _mark_forwarded(self, req: TrackedRequest) -> None: ...

    def _abort_on_disconnect(self, req: TrackedRequest) -> None: ...


class TrackedRequest:
    """One request of a session, from entering the proxy until it leaves."""

    __slots__ = (
        "_abort_sent",
        "_finished",
        "_forwarded",
        "_left",
        "_manager",
        "_rejected",
        "_rejection",
        "abort_rids",
        "close_after",
        "rid",
        "session_id",
        "token",
    )

    def __init__(
        self,
        manager: RequestOwner,
        session_id: str,
        token: int,
        rid: str,
        abort_rids: tuple[str, ...],
        close_after: bool,
    ) -> None:
        self._manager = manager
        self.session_id = session_id
        self.token = token
        self.rid = rid
        self.abort_rids = abort_rids
        self.close_after = close_after
        self._forwarded = False
        self._rejected = False
        self._abort_sent = False
        self._rejection: asyncio.Future[None] | None = None
        self._left = False  # it has left the proxy (RequestOwner.leave)
        # Made only when a close waits for the request to leave: not on every request.
        self._finished: asyncio.Future[None] | None = None

    @property
    def is_forwarded(self) -> bool:
        return self._forwarded

    @property
    def rejected(self) -> bool:
        return self._rejected

    async def until_forwarded(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` (e.g. the admission wait) unless the session starts closing first.

        If the close comes first, ``aw`` is cancelled and :class:`SessionClosed` is
        raised. If ``aw`` has completed, its result is returned even when a close has
        just begun (a granted lease is not lost); :meth:`forwarded` then raises.
        """
        if self._rejected:
            discard(aw)
            raise SessionClosed(self.session_id)
        task = asyncio.ensure_future(aw)
        if self._rejection is None:
            self._rejection = asyncio.get_running_loop().create_future()
        rejection = self._rejection
        try:
            await asyncio.wait((task, rejection), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise SessionClosed(self.session_id)

    def forwarded(self) -> None:
        """The request is about to go upstream with its rid.

        Raises :class:`SessionClosed` if the session started closing while the
        request was queued (it must not reach the engines after the close began).
        """
        if self._rejected:
            raise SessionClosed(self.session_id)
        if self._forwarded:
            return
        self._forwarded = True
        self._manager._mark_forwarded(self)

    def disconnected(self) -> None:
        """The client went away. If forwarded, abort the request on every engine.

        Fire-and-forget (bounded by close_timeout_s); idempotent.
        """
        if not self._forwarded or self._abort_sent or self._left:
            return
        self._abort_sent = True
        self._manager._abort_on_disconnect(self)

    def _until_left(self) -> asyncio.Future[None]:
        """A future done once the request has left the proxy."""
        if self._finished is None:
            self._finished = asyncio.get_running_loop().create_future()
            if self._left:
                self._finished.set_result(None)
        return self._finished

    def _reject(self) -> None:
        self._rejected = True
        if self._rejection is not None and not self._rejection.done():
            self._rejection.set_result(None)


def discard(aw: Awaitable[Any]) -> None:
    """Dispose of an awaitable that will never be awaited."""
    if asyncio.iscoroutine(aw):
        aw.close()
    elif isinstance(aw, asyncio.Future):
        aw.cancel()


class Tracking(AbstractAsyncContextManager[TrackedRequest]):
    """What :meth:`~kvproxy.sessions.lifecycle.SessionManager.track` returns: a plain class, not a generator-based
    context manager (it is entered on every request of a session)."""

    __slots__ = ("_args", "_manager", "_req")

    def __init__(
        self,
        manager: RequestOwner,
        session_id: str,
        rid: str,
        rids: tuple[str, ...],
        close_after: bool,
    ) -> None:
        self._manager = manager
        self._args = (session_id, rid, rids, close_after)
        self._req: TrackedRequest | None = None

    async def __aenter__(self) -> TrackedRequest:
        self._req = self._manager.enter(*self._args)
        return self._req

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        req, self._req = self._req, None
        if req is not None:
            self._manager.leave(req)
