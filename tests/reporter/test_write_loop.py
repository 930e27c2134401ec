"""The write loop alone, with a scripted sink: what ends a back-off early, what does not.

A newer desired state cures a failure of what we sent (``conflict``, ``4xx``,
``internal``): it is written as soon as the debouncer releases it, not after the
back-off (60 s here, far past every wait in these tests). A failing server (``5xx``,
``429``, ``timeout``, ``connection``) keeps its back-off whatever arrives meanwhile.
Cancelling the loop (a stop) ends either wait at once. The reconcile counter and the
``waiting`` flag are what the service tests count reads by.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from gpulet_reporter.debounce import Debouncer
from gpulet_reporter.metrics import ReporterMetrics
from gpulet_reporter.writer import WriteError, WriteLoop
from support.metrics import MetricsProbe
from support.reporter_harness import fast_settings, wait_until

pytestmark = pytest.mark.anyio

BACKOFF_S = 60.0  # the shortest back-off here (base 60 s: full jitter never below 30 s)


class ScriptedSink:
    """Records every desired state it is asked to apply; the first ``len(errors)``
    attempts raise the given errors, the rest succeed."""

    description = "scripted sink"

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.attempts: list[str] = []
        self.refreshes = 0

    async def apply(self, desired: str) -> bool:
        self.attempts.append(desired)  # before any await: seen as soon as the loop runs
        if self.errors:
            raise self.errors.pop(0)
        return True

    async def refresh(self) -> None:
        self.refreshes += 1


@asynccontextmanager
async def running_loop(
    sink: ScriptedSink, **settings: Any
) -> AsyncIterator[tuple[WriteLoop[str], Debouncer[str]]]:
    values: dict[str, Any] = {
        "quiet_window_s": 0.01,
        "max_delay_s": 0.05,
        "backoff_base_s": BACKOFF_S,
        "backoff_max_s": 2 * BACKOFF_S,
        "retry_after_max_s": 2 * BACKOFF_S,
    }
    values.update(settings)
    reporter = fast_settings(**values)
    debouncer: Debouncer[str] = Debouncer(reporter.quiet_window_s, reporter.max_delay_s)
    loop = WriteLoop(sink, debouncer, reporter, ReporterMetrics(MetricsProbe().meter))
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        yield loop, debouncer
        tg.cancel_scope.cancel()


def idle(loop: WriteLoop[str], debouncer: Debouncer[str]) -> Callable[[], bool]:
    return lambda: loop.waiting and not debouncer.pending


CURABLE = {
    "conflict": WriteError("conflict", "5 conflicts in a row"),
    "4xx": WriteError("4xx", "HTTP 422 Unprocessable Entity", permanent=True),
    "internal": ValueError("a bug of ours on this desired state"),
}
SERVER_FAILURES = {
    "5xx": WriteError("5xx", "HTTP 503"),
    "429": WriteError("429", "HTTP 429", retry_after=BACKOFF_S),
    "timeout": WriteError("timeout", "no answer within 10.0s"),
    "connection": WriteError("connection", "ConnectionRefusedError"),
}


@asynccontextmanager
async def failed_once(
    error: Exception,
) -> AsyncIterator[tuple[ScriptedSink, WriteLoop[str], Debouncer[str]]]:
    """A running loop whose first write ("v1") failed with ``error``: the sink raised
    without awaiting, so the loop is in its back-off by now."""
    sink = ScriptedSink(error)
    async with running_loop(sink) as (loop, debouncer):
        debouncer.submit("v1")
        await wait_until(lambda: sink.attempts == ["v1"])
        yield sink, loop, debouncer


@pytest.mark.parametrize("reason", sorted(CURABLE))
async def test_a_newer_state_ends_the_back_off_of_a_failure_it_may_cure(reason: str) -> None:
    async with failed_once(CURABLE[reason]) as (sink, loop, debouncer):
        debouncer.submit("v2")
        # Far sooner than the back-off: only the newer state can have ended the wait.
        await wait_until(lambda: loop.applied == "v2", within=BACKOFF_S / 4)
        assert sink.attempts == ["v1", "v2"]
        await wait_until(idle(loop, debouncer))
        assert loop.current == "v2"


@pytest.mark.parametrize("reason", sorted(SERVER_FAILURES))
async def test_a_failing_server_is_backed_off_whatever_arrives(reason: str) -> None:
    async with failed_once(SERVER_FAILURES[reason]) as (sink, _loop, debouncer):
        debouncer.submit("v2")
        debouncer.submit("v3")
        due = debouncer.due_at()
        assert due is not None
        # Past the moment the debouncer would release v3 to a waiting loop (its timer
        # is due first, so a loop woken by it has run and called the sink by now).
        await anyio.sleep(max(0.0, due - time.monotonic()) + 0.2)
        assert sink.attempts == ["v1"]
        assert debouncer.pending  # v3 waits for the back-off, newest wins after it


@pytest.mark.parametrize("reason", ["4xx", "5xx"])
async def test_a_stop_ends_the_back_off_at_once(reason: str) -> None:
    with anyio.fail_after(BACKOFF_S / 4):  # the back-off is at least 30 s
        async with failed_once({**CURABLE, **SERVER_FAILURES}[reason]) as (sink, loop, _deb):
            pass
        # Leaving the block cancelled the loop's task group: the stop.
    assert sink.attempts == ["v1"]
    assert loop.applied is None


async def test_each_reconcile_refreshes_once_and_is_counted() -> None:
    sink = ScriptedSink()
    async with running_loop(sink, reconcile_interval_s=0.02) as (loop, debouncer):
        debouncer.submit("v1")
        await wait_until(lambda: loop.applied == "v1")
        await wait_until(lambda: loop.reconciles >= 5)
        await wait_until(idle(loop, debouncer))
        # Waiting, the loop has finished every reconcile it began: one refresh and one
        # apply of the current state each.
        assert sink.refreshes == loop.reconciles
        assert sink.attempts == ["v1"] * (1 + loop.reconciles)
