"""close_client: nats-py's own cancellation while closing never ends the caller, and
the deadline still bounds a close that hangs."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import anyio
import anyio.lowlevel
import pytest
from nats.aio.subscription import Subscription

from gpulet_common import codec
from gpulet_common.bus import Bus
from gpulet_common.bus.connection import close_client
from gpulet_common.bus.decoding import UNSUBSCRIBE_S
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.settings.nats import NatsSettings

pytestmark = pytest.mark.anyio


class _Client:
    """A stand-in for the two calls close_client makes (drain, then close)."""

    def __init__(self, close: Any) -> None:
        self.is_closed = False
        self._close = close

    async def drain(self) -> None:
        raise TimeoutError  # draining did not finish: close() must follow

    async def close(self) -> None:
        await self._close()


async def test_a_cancellation_from_inside_nats_py_does_not_end_the_caller() -> None:
    async def close() -> None:
        # As nats-py does: a future of its own, cancelled by itself, awaited here.
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.cancel()
        await fut

    await close_client(cast(Any, _Client(close)), 0.1)  # returns, does not raise
    await anyio.lowlevel.checkpoint()  # and the task is not left cancelled


async def test_a_close_that_hangs_is_still_cut_by_the_deadline() -> None:
    async def close() -> None:
        await anyio.sleep(30)

    started = time.monotonic()
    await close_client(cast(Any, _Client(close)), 0.1)
    assert time.monotonic() - started < 5


async def test_an_unsubscribe_that_hangs_does_not_hold_the_stop(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end of a subscription is shielded; an unsubscribe that never returns (nats-py
    queueing a flush on a connection going away) is given up after UNSUBSCRIBE_S."""

    async def hangs(_self: object, _limit: int = 0) -> None:
        await anyio.sleep_forever()

    monkeypatch.setattr(Subscription, "unsubscribe", hangs)
    async with Bus.connect(NatsSettings(url=nats_server.url)) as bus:
        started = time.monotonic()
        with anyio.move_on_after(0.1):
            async with bus.subscribe("gpu.test.hang", codec.SAMPLES) as messages:
                async for _ in messages:
                    pass
        took = time.monotonic() - started
    assert UNSUBSCRIBE_S <= took < UNSUBSCRIBE_S + 5
