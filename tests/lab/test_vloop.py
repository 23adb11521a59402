"""The virtual-time loop: timers fire in order, the clock jumps, no wall time passes."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvlab.lab.vloop import VirtualTimeDeadlock, VirtualTimeLoop, run_virtual


def test_timers_fire_in_order_and_the_clock_jumps() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        fired: list[tuple[str, float]] = []

        async def at(delay: float, name: str) -> None:
            await asyncio.sleep(delay)
            fired.append((name, loop.time()))

        loop.call_later(2.5, lambda: fired.append(("cb", loop.time())))
        await asyncio.gather(at(3.0, "c"), at(1.0, "a"), at(2.0, "b"), at(86_400.0, "day"))
        return fired

    wall0 = time.perf_counter()
    fired = run_virtual(main())
    wall = time.perf_counter() - wall0
    assert [n for n, _ in fired] == ["a", "b", "cb", "c", "day"]
    assert [t for _, t in fired] == pytest.approx([1.0, 2.0, 2.5, 3.0, 86_400.0], abs=1e-9)
    # A simulated day passed; a loop on the real clock would need 3 s to reach "c" alone.
    assert wall < 3.0


def test_wait_for_times_out_on_the_virtual_clock() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(1000.0), 5.0)
        return loop.time()

    assert run_virtual(main(), start=10.0) == pytest.approx(15.0, abs=1e-9)


def test_ready_callbacks_do_not_advance_the_clock() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = []
        for _ in range(100):
            await asyncio.sleep(0)
            seen.append(loop.time())
        return seen

    assert set(run_virtual(main())) == {0.0}


def test_a_deadlock_raises_instead_of_hanging() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nobody will ever resolve it

    with pytest.raises(VirtualTimeDeadlock):
        run_virtual(main())


def test_the_loop_is_an_asyncio_loop_without_io() -> None:
    loop = VirtualTimeLoop()
    try:
        assert isinstance(loop, asyncio.AbstractEventLoop)
        assert loop.time() == 0.0
        assert loop.run_until_complete(asyncio.sleep(7.0, result="ok")) == "ok"
        assert loop.time() == pytest.approx(7.0)
    finally:
        loop.close()
