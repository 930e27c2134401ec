"""The debouncer alone: quiet window, maximum delay, latest wins, never blocks."""

from __future__ import annotations

import time

import anyio
import pytest

from gpulet_reporter.debounce import Debouncer
from support.reporter_harness import HeldClock

pytestmark = pytest.mark.anyio


async def test_a_burst_coalesces_into_the_latest_value() -> None:
    """Released by the quiet window (never before it), not the maximum delay: 30 s,
    far past the test's limit, however slow a loaded machine is."""
    deb: Debouncer[int] = Debouncer(0.1, 30.0)
    start = time.monotonic()
    for i in range(50):
        deb.submit(i)
    with anyio.fail_after(10):
        value = await deb.next()
    assert time.monotonic() - start >= 0.09
    assert value == 49
    assert (deb.submitted, deb.coalesced) == (50, 49)
    assert not deb.pending


async def test_a_steady_drizzle_is_released_by_the_maximum_delay() -> None:
    """A change every 30 ms, never quiet for 100 ms, on a clock the test moves: nothing
    is due before the maximum delay (400 ms); then the newest value is released."""
    clock = HeldClock()
    start = clock()
    deb: Debouncer[int] = Debouncer(0.1, 0.4, clock=clock)
    for i in range(40):
        deb.submit(i)
        clock.advance(0.03)
        due = deb.due_at()
        assert due is not None
        if clock() >= due:
            break
    assert due == pytest.approx(start + 0.4)
    assert clock() - start == pytest.approx(0.42)  # the first step at or past it
    with anyio.fail_after(5):
        value = await deb.next()
    assert value == 13  # the newest at release time, not the first
    assert deb.taken_since == start


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
