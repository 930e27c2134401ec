"""``dra.mode`` both: the GPUs the device plugin holds, from the allocator, into the
slice publisher (:meth:`~.publisher.SlicePublisher.set_held`), which taints them
``NoSchedule`` so that the scheduler stops placing claims on them.

The allocator's ``held`` endpoint is a long poll (like the device plugin's
``withheld``): a request naming the current epoch and version is answered when the
set changes. Without an answer (no allocator yet, a timeout) the last known set stays
and the poll is retried with a back-off; the ledger refuses a held GPU to a claim
anyway, so the taint only spares the scheduler a pick that Prepare would refuse.

The same reply carries the time-slicing replicas of each GPU, for the GFD sharing
labels (:mod:`gpulet_reporter.sharelabels`): :func:`follow_held` hands each new reply
to a callback, whoever needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

import anyio

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, BusError
from gpulet_common.messages import HeldReply, HeldRequest

log = logging.getLogger("gpulet.reporter.slices")

WAIT_S: Final = 15.0
RETRY_MAX_S: Final = 5.0


async def follow_held(
    bus: Bus, node: str, on_reply: Callable[[HeldReply], None], retry_s: float
) -> None:
    """Hand every new ``held`` reply to ``on_reply``; runs until cancelled."""
    subject = subjects.allocator_endpoint(node, subjects.ALLOCATOR_HELD_ENDPOINT)
    epoch, version, delay = "", 0, retry_s
    while True:
        try:
            reply = await bus.request(
                subject,
                HeldRequest(epoch=epoch, version=version, wait_s=WAIT_S),
                codec.HELD_REQUEST,
                codec.HELD_REPLY,
                timeout_s=WAIT_S + 5.0,
            )
        except BusError as exc:
            log.debug("device-plugin holdings unknown (%s); asking again in %.1f s", exc, delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
            continue
        delay = retry_s
        if (reply.epoch, reply.version) == (epoch, version):
            await anyio.sleep(0.05)  # the poll's time ran out: a breath, never a hot loop
            continue
        epoch, version = reply.epoch, reply.version
        on_reply(reply)
