"""Bounded polling for tests: every wait has a deadline and a name for its failure."""

from __future__ import annotations

from collections.abc import Callable

import anyio


async def wait_until(
    predicate: Callable[[], bool],
    *,
    timeout_s: float = 5.0,
    interval_s: float = 0.02,
    what: str = "",
) -> None:
    for _ in range(max(1, int(timeout_s / interval_s))):
        if predicate():
            return
        await anyio.sleep(interval_s)
    if not predicate():
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
