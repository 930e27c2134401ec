"""The cards kubelet must not count as whole GPUs, as a long poll for the device plugin
(and, the same way, the ``held`` and ``pods`` feeds).

The core says which cards may not go whole although they are healthy (they hold
shares: :meth:`~gpulet_allocator.decide.core.AllocatorCore.withheld`).
:class:`WithheldFeed` versions that set (a new epoch per start) and answers the
``withheld`` endpoint: a request that names the current epoch and version is held until
the set changes or ``wait_s`` passes (at most
:data:`~gpulet_allocator.protocol.MAX_WITHHELD_WAIT_S`), so the device plugin's
``ListAndWatch`` learns of a change at once without polling. At most
:data:`MAX_WAITING` are held at once; more are answered at once. The allocator says
"maybe changed" after every decision; the set is read again then only while a long
poll waits, else at the next request.

:func:`core_feeds` builds ``withheld`` and ``held`` (the device plugin's cards, for the
reporter) from the core; :func:`pods_feed` the ``pods`` feed: which container holds
which GPU, MIG device, share or time-slicing replica, as the allocator's PodResources
pass (:mod:`.release`) last read it, for the collector's metric labels (so that kubelet
has one reader on the node and the collector no gRPC).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc
import msgspec
from nats.micro.request import Request

from gpulet_allocator import protocol as p
from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.service.replies import Replies
from gpulet_common import codec
from gpulet_common.codec import Codec
from gpulet_common.messages import HeldReply, PodHolder, PodsReply

# Long polls held open at once; past that a request is answered at once (a flood of
# them must not pile up tasks; the device plugin keeps one).
MAX_WAITING = 64

# The ``pods`` feed's value: device UUID -> its holders, and how kubelet answers.
PodsSnapshot = tuple[dict[str, list[PodHolder]], str]
# A ``pods`` reply larger than this leaves the device IDs out (NATS carries 1 MiB).
MAX_PODS_REPLY_BYTES = 256 * 1024


Replicas = dict[str, int]
V = TypeVar("V")


def _withheld_reply(epoch: str, version: int, value: tuple[dict[str, str], Replicas]) -> bytes:
    withheld, replicas = value
    reply = p.WithheldReply(epoch=epoch, version=version, withheld=withheld, replicas=replicas)
    return p.WITHHELD_REPLY.encode(reply)


def _held_reply(epoch: str, version: int, value: tuple[dict[str, str], Replicas]) -> bytes:
    held, replicas = value
    reply = HeldReply(epoch=epoch, version=version, held=held, replicas=replicas)
    return codec.HELD_REPLY.encode(reply)


def pods_reply(epoch: str, version: int, value: PodsSnapshot) -> bytes:
    """The ``pods`` reply; past :data:`MAX_PODS_REPLY_BYTES` without the device IDs
    (each holder keeps its count), so that it always fits one NATS message."""
    holders, source = value
    reply = PodsReply(epoch=epoch, version=version, holders=holders, source=source)
    data = codec.PODS_REPLY.encode(reply)
    if len(data) <= MAX_PODS_REPLY_BYTES:
        return data
    bare = {
        uuid: [msgspec.structs.replace(h, device_ids=[]) for h in held]
        for uuid, held in holders.items()
    }
    return codec.PODS_REPLY.encode(msgspec.structs.replace(reply, holders=bare))


class WithheldFeed(Generic[V]):
    """A versioned value as a long poll: the cards the device plugin may not count
    (``withheld``), the cards its allocations hold (``held``, whose types are common:
    the reporter's slice publisher asks it), the pods holding each device (``pods``,
    the collector's metric labels)."""

    def __init__(
        self,
        replies: Replies,
        source: Callable[[], V],
        initial: V,
        *,
        endpoint: str,
        request: Codec[Any],
        reply: Callable[[str, int, V], bytes],
    ) -> None:
        self._endpoint, self._request, self._reply = endpoint, request, reply
        self._replies = replies
        self._source = source
        self._value = initial
        self._epoch = secrets.token_hex(8)
        self._version = 0
        self._changed = anyio.Event()
        self.waiting = 0
        # The source changed since it was last read (read it before answering).
        self._stale = True

    def follow(self) -> None:
        """The source may have changed: read it again now when a long poll waits on it
        (and wake them if it did), else at the next request. The allocator calls this
        on every change of its record; with nobody waiting it costs nothing."""
        if self.waiting:
            self._refresh()
        else:
            self._stale = True

    def _refresh(self) -> None:
        self._stale = False
        value = self._source()
        if value != self._value:
            self._value = value
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
        if self._stale:
            self._refresh()

        async def answer() -> None:
            data = self._reply(self._epoch, self._version, self._value)
            await self._replies.ok(req, endpoint, data, started)

        current = value.epoch == self._epoch and value.version == self._version
        if not (current and value.wait_s > 0) or self.waiting >= MAX_WAITING:
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
                self.waiting -= 1

        self.waiting += 1
        tg.start_soon(when_changed)


Held = tuple[dict[str, str], Replicas]


def core_feeds(
    replies: Replies, core: AllocatorCore
) -> tuple[WithheldFeed[Held], WithheldFeed[Held]]:
    """The ``withheld`` feed (the device plugin's) and the ``held`` feed (the
    reporter's) of ``core``, each carrying its time-slicing replicas."""
    replicas = core.time_slicing.replicas
    withheld: WithheldFeed[Held] = WithheldFeed(
        replies,
        lambda: (core.withheld(), replicas()),
        ({}, {}),
        endpoint=p.ENDPOINT_WITHHELD,
        request=p.WITHHELD_REQUEST,
        reply=_withheld_reply,
    )
    held: WithheldFeed[Held] = WithheldFeed(
        replies,
        lambda: (core.books.device_plugin_held(), replicas()),
        ({}, {}),
        endpoint=p.ENDPOINT_HELD,
        request=codec.HELD_REQUEST,
        reply=_held_reply,
    )
    return withheld, held


def pods_feed(replies: Replies, pods: Callable[[], PodsSnapshot]) -> WithheldFeed[PodsSnapshot]:
    """The ``pods`` feed: which containers hold which device, from PodResources."""
    return WithheldFeed(
        replies,
        pods,
        ({}, ""),
        endpoint=p.ENDPOINT_PODS,
        request=codec.HELD_REQUEST,
        reply=pods_reply,
    )
