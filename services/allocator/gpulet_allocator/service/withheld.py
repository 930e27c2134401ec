"""The cards kubelet must not count as whole GPUs, as a long poll for the device plugin.

The core says which cards may not go whole although they are healthy (they hold
shares: :meth:`~gpulet_allocator.decide.core.AllocatorCore.withheld`).
:class:`WithheldFeed` versions that set (a new epoch per start) and answers the
``withheld`` endpoint: a request that names the current epoch and version is held until
the set changes or ``wait_s`` passes (at most
:data:`~gpulet_allocator.protocol.MAX_WITHHELD_WAIT_S`), so the device plugin's
``ListAndWatch`` learns of a change at once without polling. At most
:data:`MAX_WAITING` are held at once; more are answered at once.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import anyio
import anyio.abc
from nats.micro.request import Request

from gpulet_allocator import protocol as p
from gpulet_allocator.service.replies import Replies

# Long polls held open at once; past that a request is answered at once (a flood of
# them must not pile up tasks; the device plugin keeps one).
MAX_WAITING = 64


class WithheldFeed:
    def __init__(self, replies: Replies, withheld: Callable[[], dict[str, str]]) -> None:
        self._replies = replies
        self._source = withheld
        self._withheld: dict[str, str] = {}
        self._epoch = secrets.token_hex(8)
        self._version = 0
        self._changed = anyio.Event()
        self._waiting = 0

    def follow(self) -> None:
        """Read the core's set again; wake the long polls when it changed."""
        withheld = self._source()
        if withheld != self._withheld:
            self._withheld = withheld
            self._version += 1
            changed, self._changed = self._changed, anyio.Event()
            changed.set()

    async def on_request(self, req: Request, tg: anyio.abc.TaskGroup) -> None:
        """Answer now, or (a current long poll) from a task of ``tg``: nats.micro hands
        an endpoint one message at a time."""
        endpoint = p.ENDPOINT_WITHHELD
        started = time.perf_counter()
        value = await self._replies.decode(req, endpoint, p.WITHHELD_REQUEST, started)
        if value is None:
            return

        async def answer() -> None:
            reply = p.WithheldReply(
                epoch=self._epoch, version=self._version, withheld=self._withheld
            )
            await self._replies.ok(req, endpoint, p.WITHHELD_REPLY.encode(reply), started)

        current = value.epoch == self._epoch and value.version == self._version
        if not (current and value.wait_s > 0) or self._waiting >= MAX_WAITING:
            await answer()
            return
        changed = self._changed
        wait_s = min(value.wait_s, p.MAX_WITHHELD_WAIT_S)

        async def when_changed() -> None:
            try:
                with anyio.move_on_after(wait_s):
                    await changed.wait()
                await answer()
            finally:
                self._waiting -= 1

        self._waiting += 1
        tg.start_soon(when_changed)
