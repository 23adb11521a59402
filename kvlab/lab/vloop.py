"""A virtual-time asyncio event loop: timers fire in order, no time passes.

:class:`VirtualTimeLoop` is an ordinary selector event loop whose :meth:`time` is a
virtual clock. Its selector never waits: when no callback is ready, asyncio asks the
selector to wait until the next timer is due, and the selector moves the clock forward
by exactly that timeout instead of sleeping. ``asyncio.sleep``, ``call_later``,
``wait_for`` and every ``loop.time()`` reading therefore run on simulated seconds, in
the order real time would give them, as fast as the CPU allows.

The loop does no I/O: the selector reports no events. A loop with no ready callback
and no timer can never make progress again, so it raises :class:`VirtualTimeDeadlock`
instead of blocking forever. Threads (``call_soon_threadsafe``, executors) are not
supported: nothing would wake the loop.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualTimeDeadlock(RuntimeError):
    """Nothing is ready and no timer is scheduled: the simulation cannot continue."""


class _VirtualSelector(selectors.BaseSelector):
    """Keeps registrations (the loop's self-pipe) but never waits and never reports."""

    def __init__(self) -> None:
        self._map: dict[Any, selectors.SelectorKey] = {}
        self.now = 0.0

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, 0, events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise VirtualTimeDeadlock(
                "virtual-time loop: no callback is ready and no timer is scheduled "
                "(every task waits for something that can no longer happen)"
            )
        if timeout > 0:
            self.now += timeout
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock starting at ``start`` seconds."""

    def __init__(self, start: float = 0.0) -> None:
        self._vsel = _VirtualSelector()
        self._vsel.now = float(start)
        super().__init__(self._vsel)
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._vsel.now


def run_virtual(main: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualTimeLoop`; close it after."""
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(start)) as runner:
        return runner.run(main)
