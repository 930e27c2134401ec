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
from typing import Any

import anyio
import anyio.abc
from nats.micro.request import Request

from gpulet_allocator import protocol as p
from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.service.replies import Replies
from gpulet_common import codec
from gpulet_common.codec import Codec
from gpulet_common.messages import HeldReply

# Long polls held open at once; past that a request is answered at once (a flood of
# them must not pile up tasks; the device plugin keeps one).
MAX_WAITING = 64


Replicas = dict[str, int]


def _withheld_reply(
    epoch: str, version: int, withheld: dict[str, str], replicas: Replicas
) -> bytes:
    reply = p.WithheldReply(epoch=epoch, version=version, withheld=withheld, replicas=replicas)
    return p.WITHHELD_REPLY.encode(reply)


def _held_reply(epoch: str, version: int, held: dict[str, str], replicas: Replicas) -> bytes:
    reply = HeldReply(epoch=epoch, version=version, held=held, replicas=replicas)
    return codec.HELD_REPLY.encode(reply)


class WithheldFeed:
    """A versioned set of cards as a long poll; ``held`` builds the same feed of the
    cards the device plugin's allocations hold (the ``held`` endpoint, whose types are
    common: the reporter's slice publisher asks it)."""

    def __init__(
        self,
        replies: Replies,
        withheld: Callable[[], dict[str, str]],
        *,
        endpoint: str = p.ENDPOINT_WITHHELD,
        request: Codec[Any] = p.WITHHELD_REQUEST,
        reply: Callable[[str, int, dict[str, str], Replicas], bytes] = _withheld_reply,
        replicas: Callable[[], Replicas] = dict,
    ) -> None:
        self._endpoint, self._request, self._reply = endpoint, request, reply
        self._replies = replies
        self._source = withheld
        self._withheld: dict[str, str] = {}
        # The time-slicing replicas of each GPU, carried along (the same long poll).
        self._replicas_of = replicas
        self._replicas: Replicas = {}
        self._epoch = secrets.token_hex(8)
        self._version = 0
        self._changed = anyio.Event()
        self._waiting = 0

    def follow(self) -> None:
        """Read the core's set again; wake the long polls when it changed."""
        withheld, replicas = self._source(), self._replicas_of()
        if (withheld, replicas) != (self._withheld, self._replicas):
            self._withheld, self._replicas = withheld, replicas
            self._version += 1
            changed, self._changed = self._changed, anyio.Event()
            changed.set()

    async def on_request(self, req: Request, tg: anyio.abc.TaskGroup) -> None:
        """Answer now, or (a current long poll) from a task of ``tg``: nats.micro hands
        an endpoint one message at a time."""
        endpoint = self._endpoint
        started = time.perf_counter()
        value = await self._replies.decode(req, endpoint, self._request, started)
        if value is None:
            return

        async def answer() -> None:
            data = self._reply(self._epoch, self._version, self._withheld, self._replicas)
            await self._replies.ok(req, endpoint, data, started)

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


def core_feeds(replies: Replies, core: AllocatorCore) -> tuple[WithheldFeed, WithheldFeed]:
    """The ``withheld`` feed (the device plugin's) and the ``held`` feed (the
    reporter's) of ``core``, each carrying its time-slicing replicas."""
    replicas = core.time_slicing.replicas
    withheld = WithheldFeed(replies, core.withheld, replicas=replicas)
    return withheld, held_feed(replies, core.books.device_plugin_held, replicas)


def held_feed(
    replies: Replies, held: Callable[[], dict[str, str]], replicas: Callable[[], Replicas] = dict
) -> WithheldFeed:
    return WithheldFeed(
        replies,
        held,
        endpoint=p.ENDPOINT_HELD,
        request=codec.HELD_REQUEST,
        reply=_held_reply,
        replicas=replicas,
    )
