"""The debouncer alone: quiet window, maximum delay, latest wins, never blocks."""

from __future__ import annotations

import time

import anyio
import pytest

from gpulet_reporter.debounce import Debouncer

pytestmark = pytest.mark.anyio


async def test_a_burst_coalesces_into_the_latest_value() -> None:
    deb: Debouncer[int] = Debouncer(0.1, 1.0)
    start = time.monotonic()
    for i in range(50):
        deb.submit(i)
    with anyio.fail_after(2):
        value = await deb.next()
    elapsed = time.monotonic() - start
    assert value == 49
    assert 0.09 <= elapsed < 0.5
    assert (deb.submitted, deb.coalesced) == (50, 49)
    assert not deb.pending


async def test_a_steady_drizzle_is_released_by_the_maximum_delay() -> None:
    deb: Debouncer[int] = Debouncer(0.1, 0.4)
    released: list[tuple[float, int]] = []
    start = time.monotonic()

    async def drizzle() -> None:
        for i in range(40):  # every 30 ms: never quiet for 100 ms
            deb.submit(i)
            await anyio.sleep(0.03)

    async with anyio.create_task_group() as tg:
        tg.start_soon(drizzle)
        with anyio.fail_after(3):
            value = await deb.next()
            released.append((time.monotonic() - start, value))
        tg.cancel_scope.cancel()
    at, value = released[0]
    assert 0.38 <= at < 0.6
    assert value > 5  # the newest at release time, not the first


async def test_take_now_and_quiet_release() -> None:
    deb: Debouncer[str] = Debouncer(0.05, 0.2)
    assert deb.take_now() is None
    deb.submit("a")
    assert deb.pending_since is not None
    assert deb.take_now() == "a"
    assert deb.taken_since is not None
    assert deb.take_now() is None
    deb.submit("b")
    with anyio.fail_after(1):
        assert await deb.next() == "b"
