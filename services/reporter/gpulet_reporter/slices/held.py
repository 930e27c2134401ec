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

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.bus.longpoll import follow_versions
from gpulet_common.messages import HeldReply, HeldRequest

log = logging.getLogger("gpulet.reporter.slices")

WAIT_S: Final = 15.0
RETRY_MAX_S: Final = 5.0


async def follow_held(
    bus: Bus, node: str, on_reply: Callable[[HeldReply], None], retry_s: float
) -> None:
    """Hand every new ``held`` reply to ``on_reply``; runs until cancelled."""
    subject = subjects.allocator_endpoint(node, subjects.ALLOCATOR_HELD_ENDPOINT)

    async def ask(epoch: str, version: int) -> HeldReply:
        return await bus.request(
            subject,
            HeldRequest(epoch=epoch, version=version, wait_s=WAIT_S),
            codec.HELD_REQUEST,
            codec.HELD_REPLY,
            timeout_s=WAIT_S + 5.0,
        )

    await follow_versions(
        ask,
        on_reply,
        retry_s=retry_s,
        retry_max_s=RETRY_MAX_S,
        what="device-plugin holdings",
        log=log,
    )
