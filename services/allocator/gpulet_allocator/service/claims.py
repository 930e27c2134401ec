"""The DRA kubelet plugin's endpoints: ``reserve-claim`` and ``release-claim``.

Served beside the device plugin's (:mod:`.nats`), decided by the same core
(:meth:`~gpulet_allocator.decide.claims.Claims.reserve`, rules in
:mod:`gpulet_allocator.decide.claims`) against the same ledger, and answered, like an
Allocate, only once the change is durable in the same checkpoint (a reservation whose
write failed is undone and refused ``checkpoint_failed``). A refusal goes back in the
one convention (:mod:`gpulet_common.refusal`); the plugin's
:meth:`~gpulet_common.bus.Bus.request` raises it again as the same
:class:`~gpulet_common.refusal.Refused`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from nats.micro.request import Request

from gpulet_allocator import protocol as p
from gpulet_allocator.decide.books import Undo
from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.service.replies import Replies, handler_for
from gpulet_common.refusal import Refused, one_line

log = logging.getLogger("gpulet.allocator")


class AnswerDurably(Protocol):
    def __call__(
        self, req: Request, endpoint: str, data: bytes, started: float, undo: Undo | None
    ) -> Awaitable[None]: ...


class ClaimEndpoints:
    def __init__(
        self,
        core: AllocatorCore,
        replies: Replies,
        answer_durably: AnswerDurably,
        on_change: Callable[[], None],
    ) -> None:
        self._core = core
        self.replies = replies
        self._answer_durably = answer_durably
        self._on_change = on_change

    @handler_for(p.ENDPOINT_RESERVE_CLAIM, p.RESERVE_CLAIM_REQUEST)
    async def on_reserve(self, req: Request, value: p.ReserveClaimRequest, started: float) -> None:
        endpoint = p.ENDPOINT_RESERVE_CLAIM
        try:
            record, undo = self._core.claims.reserve(
                value.claim_uid, value.devices, namespace=value.namespace, name=value.name
            )
        except Refused as exc:
            await self.replies.reject(req, endpoint, exc.code, exc.message, started)
            return
        if undo is not None:
            log.info(
                "reserved %s for DRA claim %s/%s (%s)",
                ", ".join(d.device for d in record.devices),
                one_line(record.namespace[:64]),
                one_line(record.name[:64]),
                one_line(record.uid[:64]),
            )
            self._on_change()
        reply = p.ReserveClaimReply(
            claim_uid=record.uid,
            allocation=record.uid,
            devices=record.devices,
        )
        data = p.RESERVE_CLAIM_REPLY.encode(reply)
        await self._answer_durably(req, endpoint, data, started, undo)

    @handler_for(p.ENDPOINT_RELEASE_CLAIM, p.RELEASE_CLAIM_REQUEST)
    async def on_release(self, req: Request, value: p.ReleaseClaimRequest, started: float) -> None:
        endpoint = p.ENDPOINT_RELEASE_CLAIM
        released = self._core.claims.release(value.claim_uid)
        if released:
            log.info("released DRA claim %s", one_line(value.claim_uid[:64]))
            self._on_change()
        data = p.RELEASE_CLAIM_REPLY.encode(p.ReleaseClaimReply(released=released))
        await self._answer_durably(req, endpoint, data, started, None)
