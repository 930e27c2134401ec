"""The test runner drops only grpc.aio's spurious poller errors (see tests/conftest.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from anyio._backends import _asyncio as _anyio_asyncio


class _Handle:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<Handle {self.name}()>"


def _collected(exc: BaseException, handle: str) -> list[BaseException]:
    runner = SimpleNamespace(_exceptions=[])
    loop = asyncio.new_event_loop()
    try:
        context = {"exception": exc, "handle": _Handle(handle), "message": "x"}
        _anyio_asyncio.TestRunner._exception_handler(runner, loop, context)  # type: ignore[arg-type]
    finally:
        loop.close()
    return list(runner._exceptions)


def test_spurious_grpc_poller_errors_are_dropped() -> None:
    poller = "PollerCompletionQueue._handle_events"
    assert _collected(RuntimeError("Event loop is closed"), poller) == []
    assert _collected(BlockingIOError(11, "again"), poller) == []


def test_every_other_error_still_fails_the_test() -> None:
    poller = "PollerCompletionQueue._handle_events"
    assert len(_collected(RuntimeError("something else"), poller)) == 1
    assert len(_collected(RuntimeError("Event loop is closed"), "Bus._reconnected")) == 1
    assert len(_collected(ValueError("boom"), "anything")) == 1
