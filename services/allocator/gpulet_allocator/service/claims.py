"""The DRA kubelet plugin's decisions: in process, or over NATS.

The allocator service hosts the DRA kubelet plugin by default (``dra.plugin_host``,
:class:`DraHost`); the plugin's decision core is then :class:`LocalClaimCore`, which
decides on the service's event loop, like a NATS request, and returns once the change
is durable (:meth:`~.durable.Durable.settle`). Prepare pays no process hop for it:
through NATS it took four process wake-ups (plugin, nats-server, allocator,
nats-server, plugin), 2-3 ms of a Prepare on a busy node. Decisions stay one at a time
whoever asks: both paths decide synchronously on the one event loop.

With ``plugin_host = "device-plugin"`` the plugin asks over NATS:
``reserve-claim`` and ``release-claim`` (:class:`ClaimEndpoints`),
served beside the device plugin's (:mod:`.nats`), decided by the same core
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
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import anyio
from nats.micro.request import Request

from gpulet_allocator import protocol as p
from gpulet_allocator.decide.books import Undo
from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.kubelet.dra.contract import ClaimDevice, Reservation
from gpulet_allocator.kubelet.dra.terms import claim_requests, reservation
from gpulet_allocator.service.durable import Durable
from gpulet_allocator.service.replies import Replies, handler_for
from gpulet_allocator.state.records import ClaimRecord
from gpulet_common.nodeview import NodeView
from gpulet_common.refusal import Refused, one_line
from gpulet_common.runtime import Runtime

if TYPE_CHECKING:
    from gpulet_allocator.kubelet.dra.service import DraPluginRunner

if TYPE_CHECKING:
    from gpulet_allocator.service.mps import MpsSupervisor

log = logging.getLogger("gpulet.allocator")

# How long after a failure the DRA kubelet plugin is started again (DraHost).
RESTART_S = 5.0


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

    def reserve(
        self,
        uid: str,
        devices: Sequence[p.ClaimDeviceRequest],
        *,
        namespace: str = "",
        name: str = "",
    ) -> tuple[ClaimRecord, Undo | None]:
        """Decide a reservation (raises Refused); say it and count it if it changed."""
        record, undo = self._core.claims.reserve(uid, devices, namespace=namespace, name=name)
        if undo is not None:
            log.info(
                "reserved %s for DRA claim %s/%s (%s)",
                ", ".join(d.device for d in record.devices),
                one_line(record.namespace[:64]),
                one_line(record.name[:64]),
                one_line(record.uid[:64]),
            )
            self._on_change()
        return record, undo

    def release(self, uid: str) -> bool:
        """Free what the claim holds; say it and count it if it held something."""
        released = self._core.claims.release(uid)
        if released:
            log.info("released DRA claim %s", one_line(uid[:64]))
            self._on_change()
        return released

    @handler_for(p.ENDPOINT_RESERVE_CLAIM, p.RESERVE_CLAIM_REQUEST)
    async def on_reserve(self, req: Request, value: p.ReserveClaimRequest, started: float) -> None:
        endpoint = p.ENDPOINT_RESERVE_CLAIM
        try:
            record, undo = self.reserve(
                value.claim_uid, value.devices, namespace=value.namespace, name=value.name
            )
        except Refused as exc:
            await self.replies.reject(req, endpoint, exc.code, exc.message, started)
            return
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
        released = self.release(value.claim_uid)
        data = p.RELEASE_CLAIM_REPLY.encode(p.ReleaseClaimReply(released=released))
        await self._answer_durably(req, endpoint, data, started, None)


class LocalClaimCore:
    """The DRA kubelet plugin's decision core in the allocator's process.

    The same decisions as ``reserve-claim`` / ``release-claim`` (:class:`ClaimEndpoints`),
    taken synchronously on the service's event loop, and the same durability: a
    reservation returns once the checkpoint holds it; a failed write undoes it and
    raises ``checkpoint_failed``. A refusal is the core's :class:`Refused`, as the
    NATS core raises it.
    """

    def __init__(self, endpoints: ClaimEndpoints, durable: Durable) -> None:
        self._endpoints = endpoints
        self._durable = durable

    async def reserve_claim(
        self,
        claim_uid: str,
        devices: Sequence[ClaimDevice],
        *,
        namespace: str = "",
        name: str = "",
    ) -> Reservation:
        record, undo = self._endpoints.reserve(
            claim_uid, claim_requests(devices), namespace=namespace, name=name
        )
        await self._durable.settle(undo)
        return reservation(record.uid, record.uid, record.devices)

    async def release_claim(self, claim_uid: str) -> bool:
        released = self._endpoints.release(claim_uid)
        await self._durable.settle(None)
        return released


class DraHost:
    """Runs the DRA kubelet plugin in the allocator service (``dra.plugin_host``
    ``allocator``) over :class:`LocalClaimCore`; grpc is imported only then.

    The plugin shares the allocator's process but not its fate: a failure of the
    plugin that escapes it (a bug of ours; a bad claim is already that claim's
    ``error``) is logged, said on the status board and the plugin started again
    :data:`RESTART_S` later, while the ledger goes on serving the device plugin.
    """

    def __init__(
        self,
        runtime: Runtime,
        view: NodeView,
        core: LocalClaimCore,
        mps: MpsSupervisor | None = None,
    ) -> None:
        self._rt = runtime
        self._view = view
        self._core = core
        self._mps = mps
        #: The running plugin (for tests).
        self.runner: DraPluginRunner | None = None
        #: How many times the plugin failed and was started again.
        self.restarts = 0

    def health_changed(self) -> None:
        """A GPU's MPS daemon died or came back: the health stream says so again."""
        runner = self.runner
        if runner is not None and runner.health is not None:
            runner.health.changed()

    async def run(self) -> None:
        from gpulet_allocator.kubelet.dra.service import STATUS_NAME, DraPluginRunner

        while True:
            self.runner = DraPluginRunner(self._rt, self._view, self._core, self._mps)
            try:
                await self.runner.run()
            except Exception as exc:
                log.exception("the DRA kubelet plugin failed; starting it again in %g s", RESTART_S)
                self._rt.status.set(
                    STATUS_NAME,
                    "degraded",
                    f"the DRA kubelet plugin failed ({type(exc).__name__}); "
                    f"starting it again in {RESTART_S:g} s",
                )
            self.restarts += 1
            await anyio.sleep(RESTART_S)
