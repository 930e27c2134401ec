"""The allocator service: the decision core served over NATS.

Flow
----
1. Load the checkpoint (:mod:`gpulet_allocator.state.checkpoint`) into the
   :class:`~gpulet_allocator.decide.core.AllocatorCore`, so a kubelet retry after our
   restart gets the same GPUs. Entries that break an invariant are refused and the
   file rewritten. A corrupt file fails closed (see "Lost record" below).
2. Follow the node's inventory and health (:class:`~gpulet_common.nodeview.NodeView`,
   the health service's KV state): unhealthy and lost GPUs take no new allocation,
   recovered ones do again. The ledger holds the only copy of each GPU's health;
   an Allocate reads it in memory and never waits on NATS.
3. Serve the ``nats.micro`` service :data:`~gpulet_allocator.protocol.SERVICE_NAME`
   with its endpoints under ``gpulet.allocator.<node>`` (contract:
   :mod:`gpulet_allocator.protocol`). It shows up in ``$SRV.PING/INFO/STATS``; each
   endpoint's ``data`` in STATS counts answers by outcome and refusals by code
   (:mod:`.replies`). ``withheld`` is the device plugin's long poll of the cards that
   may not go whole; ``reserve-claim`` and ``release-claim`` are the DRA kubelet
   plugin's (:mod:`.claims`).
4. Every ``min(release_interval_s, pods_poll_s)``, ask kubelet's PodResources API which
   containers are alive and release the allocations of the others (:mod:`.release`);
   the ``pods`` endpoint tells the collector who holds which device from the same
   answer (the allocator is kubelet's one PodResources reader on the node).
5. With ``allocator.handshake.enabled``, watch this node's pods into the core's book
   and post refused decisions as Events (:mod:`.handshake`, docs/koordinator.md).
6. With ``remediation.mode`` ``report`` or ``evict``, follow the health of the GPUs
   and evict the pods that hold a failed one (:mod:`.remediate`, docs/health.md);
   ``remediation`` answers what it would do now.
7. With ``sharing.time_slicing`` configs, watch the node label that picks one and the
   configs file (:mod:`.sharing`) and apply them to the core at once, no restart; the
   replicas go to the device plugin and the reporter with the ``withheld`` and
   ``held`` replies.

Lost record
-----------
A corrupt checkpoint is kept under a unique name and replaced by a marker that says
the record is lost (:mod:`gpulet_allocator.state.checkpoint`); the marker survives
restarts. While it stands, ``allocate`` and ``allocate-batch`` are refused with
``checkpoint_lost``, a message that says why and what ends it; ``/readyz`` answers 503
with the same text (component state ``blocked``). PodResources rebuilds the record
(:mod:`.release`), or an operator accepts the loss: ``gpulet allocator reset
--confirm`` sends ``reset`` (the deploy's ``operator`` NATS user may). What was
adopted is kept.

Readiness
---------
``/readyz`` is ready only while the allocator can allocate: it is ``blocked`` (503) while
the record is lost (above) and while the checkpoint cannot be written (a failed write,
or the directory probed every pass of the release loop), since every Allocate is then
refused ``checkpoint_failed``. Ready, it names the GPUs and the allocations held now.

Concurrency
-----------
nats.micro calls a handler for one message at a time per endpoint, so every decision
is taken in arrival order, synchronously, on the event loop: the ledger never sees
two requests at once. The answer, however, may only leave once the change is durable;
that wait runs in a task of the service's task group, so the next request is decided
while the checkpoint is written and one write covers them all (group commit, see
:mod:`gpulet_allocator.state.checkpoint`). nats.micro's ``processing_time`` therefore
measures the decision, not the fsync. Malformed requests are answered
``malformed_request`` and counted; a handler bug is answered by nats.micro with a 500
(``num_errors``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.abc
import nats.errors
import nats.micro
from nats.micro.request import Request
from nats.micro.service import Service

from gpulet_allocator import protocol as p
from gpulet_allocator.decide.books import Undo
from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.service.claims import ClaimEndpoints, DraHost, LocalClaimCore
from gpulet_allocator.service.durable import Durable
from gpulet_allocator.service.handshake import HandshakeRunner, pod_book
from gpulet_allocator.service.held import HeldCount
from gpulet_allocator.service.mps import MpsSupervisor, control_command
from gpulet_allocator.service.release import PodResourcesFollower
from gpulet_allocator.service.remediate.service import RemediationService
from gpulet_allocator.service.replies import Replies, handler_for
from gpulet_allocator.service.sharing import SharingInputs
from gpulet_allocator.service.status import AllocatorStatus
from gpulet_allocator.service.withheld import core_feeds, pods_feed
from gpulet_allocator.state.checkpoint import (
    CheckpointFile,
    Committer,
    Loaded,
    encode,
)
from gpulet_common import __version__, subjects
from gpulet_common import mps as mps_paths
from gpulet_common.lifecycle import idle_disabled
from gpulet_common.messages import ErrorReply
from gpulet_common.nodeview import NodeChange, NodeView
from gpulet_common.refusal import Refused, bounded, one_line
from gpulet_common.runtime import Runtime, RuntimeService
from gpulet_common.settings import AllocatorSettings, Settings

log = logging.getLogger("gpulet.allocator")
# Once per request whose reply cannot be sent: rate-limited (a caller controls it).

UNREADABLE_RETRY_MIN_S = 1.0
UNREADABLE_RETRY_MAX_S = 30.0


def checkpoint_path(settings: Settings) -> Path:
    configured = settings.allocator.checkpoint_path
    if configured:
        return Path(configured)
    return Path(settings.state_dir) / "allocator" / "allocations.json"


# The refusal of a reset that was not confirmed.
RESET_NEEDS_CONFIRM = (
    "a reset accepts that allocations of running pods may be unknown: send "
    "confirm (gpulet allocator reset --confirm)"
)


class AllocatorService(RuntimeService[AllocatorSettings]):
    name = "allocator"

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime, runtime.settings.allocator)
        plugin = self._settings.plugin
        self.view = NodeView(
            runtime.bus, self._node, retry_s=self._settings.request_retry_s, who="allocator"
        )
        self.view.listen(self._on_view)
        self._inventory_logged: tuple[int, int] | None = None
        self.handshake = HandshakeRunner(self._node, self._settings, self._update_status)
        self.core = AllocatorCore(
            node=self._node,
            names=plugin.resources,
            shares=plugin.shares,
            mps=self._settings.mps,
            mps_root=mps_paths.root(runtime.settings)
            if mps_paths.managed(runtime.settings)
            else "",
            cdi=self._settings.cdi,
            join_window_s=self._settings.share_join_window_s,
            release_grace_s=self._settings.release_grace_s,
            health_of=self.view.healthy,
            profile=plugin.profile,
            book=pod_book(self._node, self._settings),
            on_refusal=self.handshake.refusals,
            mig_strategy=self._settings.mig_strategy,
            time_slicing=runtime.settings.sharing.time_slicing,
        )
        ts = self.core.time_slicing  # its node label and configs file: self.sharing
        self.sharing = SharingInputs(runtime, ts, self._count_held, self._update_status)
        self.checkpoint = CheckpointFile(checkpoint_path(runtime.settings))
        self.replies = replies = Replies(runtime.meter, lambda: runtime.bus.client.max_payload)
        self._ok, self._reject = replies.ok, replies.reject
        self._count_refusal, self._too_large = replies.count_refusal, replies.too_large
        self._stats_data = replies.stats_data
        self._committer: Committer | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        #: Answers sent once the checkpoint holds them (:mod:`.durable`).
        self.durable = Durable(
            lambda: self.core.version,
            lambda: self._committer,
            lambda: self._tg,
            replies,
            self._count_held,
        )
        self._answer_durably = self.durable.answer
        #: What ``/readyz`` says of the allocator (:mod:`.status`).
        self.status = AllocatorStatus(runtime.status, self.name, self.checkpoint)
        meter = runtime.meter
        released = meter.create_counter(
            "gpulet.allocator.released", description="Allocations released, by reason"
        )
        self._released = released
        self.pod_resources = PodResourcesFollower(
            self.core,
            self._settings,
            released=released,
            on_change=self._on_record_change,
            committer=lambda: self._committer,
        )
        #: The long polls of the device plugin (``withheld``), the reporter (``held``) and
        #: the collector (``pods``: who holds which device, from PodResources).
        self.withheld, self.held = core_feeds(replies, self.core)
        gauge = meter.create_up_down_counter(
            "gpulet.allocator.allocations", description="Allocations held"
        )
        feeds = (self.withheld, self.held)
        count = lambda: self.core.ledger.count()  # noqa: E731 (a restore replaces the ledger)
        self.held_count = HeldCount(count, gauge, feeds, self._update_status)
        self.pods = pods_feed(replies, lambda: self.pod_resources.pods)
        self.pod_resources.on_pods = self.pods.follow
        #: The DRA kubelet plugin's endpoints (claims in the same ledger).
        self.claims = ClaimEndpoints(
            self.core, replies, self._answer_durably, self._on_record_change
        )
        #: The DRA kubelet plugin, when this service hosts it (``dra.plugin_host``), and
        #: its decision core (the same decisions as ``reserve-claim``, in process).
        self.claim_core = LocalClaimCore(self.claims, self.durable)
        #: The MPS control daemons of the GPUs that hold shares (.mps), when gpulet runs them.
        self.mps: MpsSupervisor | None = None
        if mps_paths.managed(runtime.settings):
            self.mps = MpsSupervisor(
                mps_paths.root(runtime.settings),
                control_command(
                    self._settings.mps.control_binary,
                    mock=mps_paths.mock_backend(runtime.settings),
                ),
                lambda: self.core.ledger.devices(),
                self._on_mps_change,
            )
        self.dra = DraHost(runtime, self.view, self.claim_core, self.mps)
        #: Evicting the pods of a failed GPU (remediation.mode; docs/health.md).
        self.remediation = RemediationService(
            runtime.settings, self._node, self.core, self.view, meter, runtime
        )
        self._replies = replies
        #: The running nats.micro service (for tests and the status line).
        self.micro: Service | None = None

    async def reconcile_once(self, socket: Path | None = None) -> int:
        """One PodResources pass; returns how many allocations it released."""
        return await self.pod_resources.reconcile_once(socket)

    def _probe_checkpoint(self) -> None:
        if self.status.probe():
            self._update_status()

    def _on_disk(self, error: str | None) -> None:
        self.status.checkpoint_error = error
        self._update_status()

    def _on_record_change(self) -> None:
        self.held_count.changed(status=True)
        if self.mps is not None:
            self.mps.changed()

    def _on_mps_change(self) -> None:
        self._update_status()
        self.dra.health_changed()

    # --- lifecycle ------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        if not self._settings.enabled:
            await idle_disabled(self.name, "allocator.enabled", self._rt.status, task_status)
        reported = False

        def started() -> None:
            nonlocal reported
            if not reported:
                reported = True
                task_status.started()

        loaded = await self._load_checkpoint(started)
        problems = self.core.restore(loaded.state)
        (log.warning if loaded.status in ("corrupt", "lost") else log.info)(
            "checkpoint: %s", loaded.detail
        )
        if self.core.lost is not None:
            log.warning(
                "the allocation record is lost: Allocate is refused until kubelet's "
                "PodResources rebuilds it or `gpulet allocator reset --confirm` accepts the loss"
            )
        for problem in problems:
            log.warning("checkpoint entry set aside: %s", problem)
        self._count_held()
        committer = Committer(
            lambda: encode(self.core.snapshot()), self.checkpoint.write, on_error=self._on_disk
        )
        self._committer = committer
        async with anyio.create_task_group() as tg:
            self._tg = tg
            await tg.start(committer.run)
            if problems or loaded.status == "corrupt":
                committer.request(self.core.version)
            await tg.start(self.view.run)
            service = await nats.micro.add_service(
                self._rt.bus.client,
                name=p.SERVICE_NAME,
                version=__version__,
                description=f"gpulet GPU allocator of node {self._node}",
                metadata={"node": self._node, "checkpoint": str(self.checkpoint.path)},
                stats_handler=self._stats_data,
            )
            self.micro = service
            try:
                handlers: dict[str, Callable[[Request], Awaitable[None]]] = {
                    p.ENDPOINT_ALLOCATE: self._on_allocate,
                    p.ENDPOINT_ALLOCATE_BATCH: self._on_allocate_batch,
                    p.ENDPOINT_PREFERRED: self._on_preferred,
                    p.ENDPOINT_RELEASE: self._on_release,
                    p.ENDPOINT_STATE: self._on_state,
                    p.ENDPOINT_RESET: self._on_reset,
                    p.ENDPOINT_WITHHELD: self._on_withheld,
                    p.ENDPOINT_RESERVE_CLAIM: self.claims.on_reserve,
                    p.ENDPOINT_RELEASE_CLAIM: self.claims.on_release,
                    p.ENDPOINT_HELD: lambda req: self.held.on_request(req, tg),
                    p.ENDPOINT_PODS: lambda req: self.pods.on_request(req, tg),
                    p.ENDPOINT_REMEDIATION: lambda req: self.remediation.on_request(
                        req, self._replies
                    ),
                }
                for endpoint, handler in handlers.items():
                    await service.add_endpoint(
                        name=endpoint,
                        subject=subjects.allocator_endpoint(self._node, endpoint),
                        handler=handler,
                        metadata={"node": self._node},
                    )
                # Endpoints are only reachable once the server has the subscriptions.
                await self._rt.bus.flush()
                tg.start_soon(self.pod_resources.run, self._probe_checkpoint)
                if self.core.book is not None:
                    tg.start_soon(self.handshake.run, self.core.book)
                tg.start_soon(self.remediation.run)
                tg.start_soon(self.sharing.run)
                if self.mps is not None:
                    tg.start_soon(self.mps.run)
                if self._rt.settings.dra.plugin_runs_in("allocator"):
                    tg.start_soon(self.dra.run)
                self._update_status()
                started()
                await anyio.sleep_forever()
            finally:
                self.micro = None
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    try:
                        await service.stop()
                    except (nats.errors.Error, OSError) as exc:
                        log.debug("stopping the micro service: %s", exc)
                self.checkpoint.settle(lambda: encode(self.core.snapshot()))

    async def _load_checkpoint(self, started: Callable[[], None]) -> Loaded:
        """Load the checkpoint, waiting while it exists but cannot be read.

        Starting empty then would hand out GPUs that running pods hold, and the next
        write would erase the record of them, so nothing is served until it reads.
        The service counts as started meanwhile (degraded), so that the services
        after it in ``gpulet run`` are not held up.
        """
        delay = UNREADABLE_RETRY_MIN_S
        while True:
            loaded = await anyio.to_thread.run_sync(self.checkpoint.load)
            if loaded.status != "unreadable":
                return loaded
            self._rt.status.set(
                self.name, "blocked", f"{loaded.detail}; not serving until it can be read"
            )
            started()
            await anyio.sleep(delay)
            delay = min(delay * 2, UNREADABLE_RETRY_MAX_S)

    # --- koord-scheduler's decisions ---------------------------------------------------

    def _update_status(self) -> None:
        mps_problem = self.mps.problem if self.mps is not None else ""
        self.status.update(self.core, self.handshake.problem or self.sharing.problem or mps_problem)

    def _on_view(self, change: NodeChange) -> None:
        inventory = self.view.inventory
        if change.inventory and inventory is not None:
            # Takes each GPU's health from the view as it goes.
            seen = (inventory.generation, len(inventory.gpus))
            # Logged when it changes, not at each republish (every 30 s) or re-read.
            if self.core.update_inventory(inventory) and seen != self._inventory_logged:
                self._inventory_logged = seen
                log.info("inventory generation %d: %d GPUs", *seen)
            self._update_status()
        for uuid in change.gpus:
            for device in (uuid, *self.core.mig_devices_of(uuid)):
                healthy = self.view.healthy(device)
                if self.core.set_health(device, healthy):
                    log.info("GPU %s is now %s", device, "healthy" if healthy else "unhealthy")
        self.withheld.follow()
        if change.gpus:
            self.remediation.on_view()

    def _count_held(self) -> None:
        self.held_count.changed()
        if self.mps is not None:
            self.mps.changed()

    # --- request plumbing ---------------------------------------------------------------

    # --- endpoints ------------------------------------------------------------------------

    @handler_for(p.ENDPOINT_ALLOCATE, p.ALLOCATE_REQUEST)
    async def _on_allocate(self, req: Request, value: p.AllocateRequest, started: float) -> None:
        try:
            answers, undo = self.core.allocate(value.resource, value.containers)
        except Refused as exc:
            await self._reject(req, p.ENDPOINT_ALLOCATE, exc.code, exc.message, started)
            return
        data = p.ALLOCATE_REPLY.encode(p.AllocateReply(containers=answers))
        if problem := self._too_large(data, len(value.containers)):
            undo()
            self._count_held()
            await self._reject(req, p.ENDPOINT_ALLOCATE, "invalid_request", problem, started)
            return
        self._count_held()
        await self._answer_durably(req, p.ENDPOINT_ALLOCATE, data, started, undo)

    @handler_for(p.ENDPOINT_ALLOCATE_BATCH, p.ALLOCATE_BATCH_REQUEST)
    async def _on_allocate_batch(
        self, req: Request, value: p.AllocateBatchRequest, started: float
    ) -> None:
        """Several kubelet calls in one message, each decided as if it came alone."""
        endpoint = p.ENDPOINT_ALLOCATE_BATCH
        if not 0 < len(value.calls) <= p.MAX_BATCH_CALLS:
            size = f"a batch carries 1 to {p.MAX_BATCH_CALLS} calls, not {len(value.calls)}"
            await self._reject(req, endpoint, "invalid_request", size, started)
            return
        outcomes: list[p.AllocateOutcome] = []
        refused: list[ErrorReply] = []
        undos: list[Undo] = []
        for call in value.calls:
            try:
                answers, undo = self.core.allocate(call.resource, call.containers)
            except Refused as exc:
                error = ErrorReply(code=exc.code, message=bounded(exc.message))
                refused.append(error)
                outcomes.append(p.AllocateOutcome(error=error))
                continue
            outcomes.append(p.AllocateOutcome(containers=answers))
            undos.append(undo)

        def undo_all() -> None:
            for undo in reversed(undos):
                undo()

        data = p.ALLOCATE_BATCH_REPLY.encode(p.AllocateBatchReply(outcomes=outcomes))
        if problem := self._too_large(data, sum(len(c.containers) for c in value.calls)):
            undo_all()
            self._count_held()
            await self._reject(req, endpoint, "invalid_request", problem, started)
            return
        self._count_held()

        def count_refused() -> None:
            # Counted once they are sent: a batch refused whole (too large, or the
            # checkpoint failed) answers only its own refusal.
            for error in refused:
                self._count_refusal(endpoint, error.code, error.message)

        await self._answer_durably(
            req, endpoint, data, started, undo_all if undos else None, count_refused
        )

    @handler_for(p.ENDPOINT_PREFERRED, p.PREFERRED_REQUEST)
    async def _on_preferred(
        self, req: Request, value: p.PreferredAllocationRequest, started: float
    ) -> None:
        try:
            answers = self.core.preferred(value.resource, value.containers)
        except Refused as exc:
            await self._reject(req, p.ENDPOINT_PREFERRED, exc.code, exc.message, started)
            return
        data = p.PREFERRED_REPLY.encode(p.PreferredAllocationReply(containers=answers))
        if problem := self._too_large(data, len(value.containers)):
            await self._reject(req, p.ENDPOINT_PREFERRED, "invalid_request", problem, started)
            return
        await self._ok(req, p.ENDPOINT_PREFERRED, data, started)

    @handler_for(p.ENDPOINT_RELEASE, p.RELEASE_REQUEST)
    async def _on_release(self, req: Request, value: p.ReleaseRequest, started: float) -> None:
        try:
            released = self.core.release(value)
        except Refused as exc:
            await self._reject(req, p.ENDPOINT_RELEASE, exc.code, exc.message, started)
            return
        if released:
            self._released.add(len(released), {"reason": "explicit"})
            self._count_held()
            self._update_status()
        data = p.RELEASE_REPLY.encode(p.ReleaseReply(released=released))
        await self._answer_durably(req, p.ENDPOINT_RELEASE, data, started, None)

    @handler_for(p.ENDPOINT_RESET, p.RESET_REQUEST)
    async def _on_reset(self, req: Request, value: p.ResetRequest, started: float) -> None:
        """The operator accepts the loss of the allocation record."""
        endpoint = p.ENDPOINT_RESET
        if not value.confirm:
            await self._reject(req, endpoint, "invalid_request", RESET_NEEDS_CONFIRM, started)
            return
        core = self.core
        reason = core.end_loss()
        kept = core.allocation_views()
        if reason is None:
            detail = f"nothing to reset: the allocation record is intact ({len(kept)} allocations)"
            reply = p.ResetReply(accepted=False, detail=detail, allocations=kept)
            await self._ok(req, endpoint, p.RESET_REPLY.encode(reply), started)
            return
        who = value.requested_by or "an operator"
        detail = (
            f"{who} accepted the loss of the allocation record ({reason}); "
            f"{len(kept)} allocation(s) rebuilt from PodResources are kept; allocating again"
        )
        log.warning("%s", one_line(detail))
        self._update_status()

        def undo() -> None:
            core.mark_lost(reason)
            self._update_status()

        reply = p.ResetReply(accepted=True, detail=detail, allocations=kept)
        await self._answer_durably(req, endpoint, p.RESET_REPLY.encode(reply), started, undo)

    async def _on_withheld(self, req: Request) -> None:
        assert self._tg is not None
        await self.withheld.on_request(req, self._tg)

    @handler_for(p.ENDPOINT_STATE, p.STATE_REQUEST)
    async def _on_state(self, req: Request, _: p.StateRequest, started: float) -> None:
        reply = self.core.state(checkpoint=str(self.checkpoint.path))
        await self._ok(req, p.ENDPOINT_STATE, p.STATE_REPLY.encode(reply), started)

    # --- releasing allocations of pods that are gone -------------------------------------
