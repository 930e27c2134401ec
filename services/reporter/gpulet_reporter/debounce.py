"""Coalescing desired states: a quiet window, a maximum delay, latest wins.

Why
---
A failing GPU rarely produces one event: an XID burst, a thermal event, the health
service's follow-ups arrive within a few hundred milliseconds. Writing each would
multiply API writes (koordlet's 3 s timer writes whatever it sees each time). We write
once the inputs have been quiet for ``quiet_s`` (500 ms by default), and never later
than ``max_delay_s`` (2 s) after the first unwritten change, so a steady drizzle of
changes cannot postpone a write for ever and an unhealthy GPU reaches the API within
the maximum delay.

Shape
-----
One slot, not a queue. :meth:`Debouncer.submit` is synchronous: it replaces the
pending value, notes the time and sets an event -- the bus side never awaits anything
here, so a slow or failing API server cannot back up into NATS. The writer awaits
:meth:`next`; while it is busy retrying, newer submissions simply overwrite the slot,
and :meth:`take_now` lets the retry loop pick up the newest state instead of retrying a
stale one. Values must not be None (None means "nothing pending").
:meth:`next_within` is :meth:`next` bounded in time, for a writer that is backing off
but may stop waiting for a newer state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class Debouncer(Generic[T]):
    def __init__(
        self,
        quiet_s: float,
        max_delay_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.quiet_s = max(0.0, quiet_s)
        self.max_delay_s = max(self.quiet_s, max_delay_s)
        self._clock = clock
        self._value: T | None = None
        self._pending = False
        self._first_at = 0.0
        self._last_at = 0.0
        self._event = anyio.Event()
        # For metrics and tests.
        self.submitted = 0
        self.coalesced = 0
        # Clock time of the first change in the batch last taken (for write latency).
        self.taken_since: float | None = None

    @property
    def pending(self) -> bool:
        return self._pending

    @property
    def pending_since(self) -> float | None:
        """Clock time of the oldest change not yet taken, or None."""
        return self._first_at if self._pending else None

    def submit(self, value: T) -> None:
        """Offer a new desired state; never blocks, never fails."""
        now = self._clock()
        if self._pending:
            self.coalesced += 1
        else:
            self._first_at = now
        self._value = value
        self._pending = True
        self._last_at = now
        self.submitted += 1
        self._event.set()

    def take_now(self) -> T | None:
        """The pending value without waiting (None if nothing is pending)."""
        if not self._pending:
            return None
        value = self._value
        self._value = None
        self._pending = False
        self.taken_since = self._first_at
        return value

    def due_at(self) -> float | None:
        """Clock time at which the pending value is released, or None."""
        if not self._pending:
            return None
        return min(self._last_at + self.quiet_s, self._first_at + self.max_delay_s)

    async def next(self) -> T:
        """Wait for a change, then for the quiet window (bounded by the maximum delay)."""
        while True:
            if not self._pending:
                self._event = anyio.Event()
                await self._event.wait()
                continue
            due = self.due_at()
            now = self._clock()
            if due is None:
                continue
            if now >= due:
                value = self.take_now()
                if value is not None:
                    return value
                continue
            # A submit during this sleep can only move the due time later (bounded by
            # the maximum delay), so sleeping to the current due time and re-checking
            # is exact.
            await anyio.sleep(due - now)

    async def next_within(self, seconds: float) -> T | None:
        """:meth:`next`, if it releases a value within ``seconds``; else None.

        Cancelling :meth:`next` takes nothing (a value is taken and returned without an
        await in between), so a value is never lost to the deadline."""
        with anyio.move_on_after(max(0.0, seconds)):
            return await self.next()
        return None
