"""The allocator service: decides which GPUs a container gets, over NATS.

Flow
----
1. Load the checkpoint (:mod:`.store`) into the :class:`~.core.AllocatorCore`, so a
1. Load the checkpoint (:mod:`.store`) into the :class:`~.core.AllocatorCore`, so a
   kubelet retry after our restart gets the same GPUs. Entries that break an invariant
   are refused and the file rewritten. A corrupt file fails closed (see "Lost record"
   below).
2. Follow the node's inventory and health (:class:`~gpulet_common.nodeview.NodeView`,
   the health service's KV state): unhealthy and lost GPUs take no new allocation,
   recovered ones do again. The ledger holds the only copy of each GPU's health;
   an Allocate reads it in memory and never waits on NATS.
3. Serve the ``nats.micro`` service :data:`~.protocol.SERVICE_NAME` with the
   endpoints ``allocate``, ``allocate-batch``, ``preferred``, ``release`` and ``state`` under
   ``gpulet.allocator.<node>`` (contract: :mod:`.protocol`). It shows up in
   ``$SRV.PING/INFO/STATS``; each endpoint's ``data`` in STATS counts answers by
   outcome and refusals by code.
4. Every ``release_interval_s``, ask kubelet's PodResources API which containers are
   alive and release the allocations of the others (:meth:`~.core.AllocatorCore.reconcile`).
5. With ``allocator.handshake.enabled``, watch this node's pods
   (:mod:`.pod_watch`) into the core's :class:`~.koordinator.PodBook`, so calls that
   belong to a pod koord-scheduler decided for follow that decision, and refused
   decisions become Kubernetes Events on the pod (docs/koordinator.md).

Lost record
-----------
A corrupt checkpoint is kept under a unique name and replaced by a marker that says
the record is lost (:mod:`.store`); the marker survives restarts. While it stands:

* ``allocate`` and ``allocate-batch`` are refused with ``checkpoint_lost``, a message
  that says why and what ends it; ``/readyz`` answers 503 with the same text
  (component state ``blocked``);
* PodResources is asked every ``min(release_interval_s, 5 s)``; each answer's
  whole-GPU containers are adopted (:meth:`~.core.AllocatorCore.adopt`). The record
  counts as rebuilt once PodResources has answered for ``release_grace_s`` (a kubelet
  that just restarted may list no pods for a moment) and the latest answer held
  nothing that cannot be placed (a share: kubelet does not know its card);
* otherwise an operator accepts the loss: ``gpulet allocator reset --confirm`` sends
  ``reset`` (the deploy's ``operator`` NATS user may). What was adopted is kept.

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
:mod:`.store`). nats.micro's ``processing_time`` therefore measures the decision, not
the fsync. Malformed requests are answered ``malformed_request`` and counted; a
handler bug is answered by nats.micro with a 500 (``num_errors``).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import msgspec
import nats.errors
import nats.micro
from kubernetes_asyncio import client as k8s_client
from nats.micro.request import Request
from nats.micro.service import EndpointStats, Service

from gpulet_allocator import protocol as p
from gpulet_allocator.core import AllocatorCore, HeldDevices, Undo
from gpulet_allocator.koordinator import RES_GPU_CORE, RES_GPU_MEMORY_RATIO, PodBook, PodKey
from gpulet_allocator.pod_watch import EventWriter, PodWatch, kube_configuration
from gpulet_allocator.podresources import (
    PodResourcesUnavailable,
    held_devices,
    list_pod_resources,
    live_grants,
)
from gpulet_allocator.store import CheckpointError, CheckpointFile, Committer, Loaded, encode
from gpulet_common import __version__, subjects
from gpulet_common.codec import Codec
from gpulet_common.kube import KubeConfigError
from gpulet_common.lifecycle import idle_disabled
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import ErrorReply
from gpulet_common.nodeview import NodeChange, NodeView
from gpulet_common.refusal import Refused, bounded, one_line, refusal
from gpulet_common.runtime import Runtime
from gpulet_common.settings import Settings
from gpulet_common.telemetry import REQUEST_LATENCY_BUCKETS_S

log = logging.getLogger("gpulet.allocator")

T = TypeVar("T")

UNREADABLE_RETRY_MIN_S = 1.0
UNREADABLE_RETRY_MAX_S = 30.0
# While the record is lost, PodResources is asked at least this often.
LOST_RETRY_S = 5.0

# A refusal quotes the request (unknown IDs, resource names), so a hostile request
# made it as large as itself, and it travels twice (body and header). nats-py checks
# only the body against the server's max_payload: a 900 KB request of unknown IDs got
# a 1.8 MB answer, the server closed the allocator's connection and the service
# died. Bounded once here for every refusal; the header and the log get one line.
# Endpoints whose refusals fail a pod's admission: logged as warnings.
_ALLOCATING = frozenset({p.ENDPOINT_ALLOCATE, p.ENDPOINT_ALLOCATE_BATCH})


def checkpoint_path(settings: Settings) -> Path:
    configured = settings.allocator.checkpoint_path
    if configured:
        return Path(configured)
    return Path(settings.state_dir) / "allocator" / "allocations.json"


@dataclass(slots=True)
class _Counts:
    ok: int = 0
    rejected: int = 0
    malformed: int = 0
    codes: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "rejected": self.rejected,
            "malformed": self.malformed,
            "codes": dict(self.codes),
        }


@dataclass(slots=True)
class _RefusalEvents:
    """Refused scheduler decisions to the Event writer, once there is one."""

    writer: EventWriter | None = None

    def __call__(self, pod: PodKey, message: str) -> None:
        if self.writer is not None:
            self.writer.post(pod, message)


class AllocatorService:
    name = "allocator"

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self._settings = runtime.settings.allocator
        self._node = runtime.node
        plugin = self._settings.plugin
        self.view = NodeView(
            runtime.bus, self._node, retry_s=self._settings.request_retry_s, who="allocator"
        )
        self.view.listen(self._on_view)
        handshake = self._settings.handshake
        #: Refused decisions become Events on their pod (set up in run()).
        self.events: EventWriter | None = None
        # What the core calls on a refusal: holds only the writer, not the service.
        self._refusals = _RefusalEvents()
        self.pod_watch: PodWatch | None = None
        self._handshake_problem = ""
        book = None
        if handshake.enabled:
            koordinator = plugin.profile == "koordinator"
            book = PodBook(
                self._node,
                whole_resource=plugin.resources.gpu,
                core_resource=RES_GPU_CORE if koordinator else plugin.resources.core,
                share_resources=(RES_GPU_CORE, RES_GPU_MEMORY_RATIO)
                if koordinator
                else (plugin.resources.core, plugin.resources.memory),
            )
        self.core = AllocatorCore(
            node=self._node,
            names=plugin.resources,
            shares=plugin.shares,
            mps=self._settings.mps,
            cdi=self._settings.cdi,
            join_window_s=self._settings.share_join_window_s,
            release_grace_s=self._settings.release_grace_s,
            health_of=self.view.healthy,
            profile=plugin.profile,
            book=book,
            on_refusal=self._refusals,
        )
        self.checkpoint = CheckpointFile(checkpoint_path(runtime.settings))
        self._counts = {e: _Counts() for e in p.ENDPOINTS}
        self._committer: Committer | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._checkpoint_error: str | None = None
        # The last probe of the checkpoint's directory (None: writable).
        self._probe_error: str | None = None
        self._pod_resources_log = RateLimitedLog(log, per_minute=2)
        self._pod_resources_state = ""
        # Since when (monotonic) PodResources has answered without a failure.
        self._pod_resources_since: float | None = None
        meter = runtime.meter
        self._requests = meter.create_counter(
            "gpulet.allocator.requests", description="Allocator requests by endpoint and outcome"
        )
        self._latency = meter.create_histogram(
            "gpulet.allocator.request_duration",
            unit="s",
            description="From receiving a request to sending its (durable) answer",
            explicit_bucket_boundaries_advisory=REQUEST_LATENCY_BUCKETS_S,
        )
        self._released = meter.create_counter(
            "gpulet.allocator.released", description="Allocations released, by reason"
        )
        self._allocations = meter.create_up_down_counter(
            "gpulet.allocator.allocations", description="Allocations held"
        )
        self._held = 0
        # The cards kubelet must not count as whole GPUs (core.withheld), versioned for
        # the device plugin's long poll; a new epoch per start.
        self._withheld: dict[str, str] = {}
        self._withheld_epoch = secrets.token_hex(8)
        self._withheld_version = 0
        self._withheld_changed = anyio.Event()
        #: The running nats.micro service (for tests and the status line).
        self.micro: Service | None = None

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
                tg.start_soon(self._release_loop)
                if self.core.book is not None:
                    tg.start_soon(self._handshake)
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

    def _on_handshake_state(self, problem: str) -> None:
        if problem != self._handshake_problem:
            self._handshake_problem = problem
            self._update_status()

    async def _handshake(self) -> None:
        """The pod watch and the Event writer; failures degrade, never end, the service.

        Until the watch has listed, and while the API server is away, the book holds
        what it last knew and calls it cannot match are decided by gpulet as before.
        """
        settings = self._settings.handshake
        book = self.core.book
        assert book is not None
        delay = UNREADABLE_RETRY_MIN_S
        while True:
            try:
                configuration = await kube_configuration(settings)
            except KubeConfigError as exc:
                self._on_handshake_state(f"no pod watch: {exc}")
                log.warning("koord-scheduler handshake: %s; again in %.0fs", exc, delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, UNREADABLE_RETRY_MAX_S)
                continue
            break
        async with k8s_client.ApiClient(configuration) as api:
            self.events = EventWriter(api, self._node, settings)
            self._refusals.writer = self.events
            self.pod_watch = PodWatch(api, book, settings, on_state=self._on_handshake_state)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.events.run)
                await tg.start(self.pod_watch.run)
                log.info("following koord-scheduler's decisions on the pods of %s", self._node)

    def _update_status(self) -> None:
        if self.core.lost is not None:
            self._rt.status.set(self.name, "blocked", self.core.lost_refusal().message)
            return
        disk = self._checkpoint_error or self._probe_error
        if disk:
            # Every Allocate is refused (checkpoint_failed) meanwhile: not ready.
            self._rt.status.set(
                self.name, "blocked", f"{disk}; Allocate is refused until it can be written"
            )
        elif not self.core.ready:
            self._rt.status.set(
                self.name, "degraded", "waiting for the GPU inventory (is the collector running?)"
            )
        elif self._handshake_problem:
            self._rt.status.set(self.name, "degraded", self._handshake_problem)
        else:
            held = self.core.ledger.count()
            gpus = len(self.core.ledger.devices())
            self._rt.status.set(self.name, "ready", f"{gpus} GPUs, {held} allocations")

    def _probe_checkpoint(self) -> None:
        """Readiness must not wait for an Allocate to fail: is the checkpoint writable?"""
        try:
            self.checkpoint.probe()
        except OSError as exc:
            problem: str | None = f"cannot write the allocation checkpoint: {exc}"
        else:
            problem = None
        if problem != self._probe_error:
            self._probe_error = problem
            self._update_status()

    def _on_disk(self, error: str | None) -> None:
        self._checkpoint_error = error
        self._update_status()

    def _on_view(self, change: NodeChange) -> None:
        inventory = self.view.inventory
        if change.inventory and inventory is not None:
            # Takes each GPU's health from the view as it goes.
            if self.core.update_inventory(inventory):
                log.info(
                    "inventory generation %d: %d GPUs", inventory.generation, len(inventory.gpus)
                )
            self._update_status()
        for uuid in change.gpus:
            healthy = self.view.healthy(uuid)
            if self.core.set_health(uuid, healthy):
                log.info("GPU %s is now %s", uuid, "healthy" if healthy else "unhealthy")
        self._follow_withheld()

    def _count_held(self) -> None:
        held = self.core.ledger.count()
        if held != self._held:
            self._allocations.add(held - self._held)
            self._held = held
            self._update_status()
        self._follow_withheld()

    def _follow_withheld(self) -> None:
        """Wake the device plugin's long polls when the withheld cards change."""
        withheld = self.core.withheld()
        if withheld != self._withheld:
            self._withheld = withheld
            self._withheld_version += 1
            changed, self._withheld_changed = self._withheld_changed, anyio.Event()
            changed.set()

    def _stats_data(self, stats: EndpointStats) -> dict[str, Any]:
        counts = self._counts.get(stats.name)
        return counts.as_dict() if counts else {}

    # --- request plumbing ---------------------------------------------------------------

    async def _decode(
        self, req: Request, endpoint: str, codec: Codec[T], started: float
    ) -> T | None:
        """The request body, or None once a malformed one has been answered."""
        try:
            return codec.decode(req.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            problem = f"{codec.type.__name__}: {exc}"
        await self._reject(req, endpoint, "malformed_request", problem, started)
        return None

    async def _send(self, req: Request, data: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            await req.respond(data, headers=headers)
        except ValueError:
            pass  # a publish, not a request: nobody to answer
        except (nats.errors.Error, OSError) as exc:
            log.warning("cannot answer on %s: %s", req.subject, exc)

    async def _ok(self, req: Request, endpoint: str, data: bytes, started: float) -> None:
        await self._send(req, data)
        self._counts[endpoint].ok += 1
        self._record(endpoint, "ok", started)

    def _count_refusal(self, endpoint: str, code: str, message: str) -> None:
        """Count and log one refusal that is being sent."""
        counts = self._counts[endpoint]
        if code == "malformed_request":
            counts.malformed += 1
        else:
            counts.rejected += 1
        counts.codes[code] = counts.codes.get(code, 0) + 1
        log.log(
            logging.WARNING if endpoint in _ALLOCATING else logging.INFO,
            "%s refused: %s: %s",
            endpoint,
            code,
            one_line(bounded(message)),
        )

    async def _reject(
        self, req: Request, endpoint: str, code: str, message: str, started: float
    ) -> None:
        self._count_refusal(endpoint, code, message)
        body, headers = refusal(code, message)
        await self._send(req, body, headers)
        self._record(endpoint, code, started)

    def _record(self, endpoint: str, outcome: str, started: float) -> None:
        attributes = {"endpoint": endpoint, "outcome": outcome}
        self._requests.add(1, attributes)
        self._latency.record(time.perf_counter() - started, {"endpoint": endpoint})

    async def _answer_durably(
        self,
        req: Request,
        endpoint: str,
        data: bytes,
        started: float,
        undo: Undo | None,
        on_answer: Callable[[], None] = lambda: None,
    ) -> None:
        """Answer once the state the answer reflects is on disk (group commit).

        ``on_answer`` runs just before ``data`` is sent (not when a failed write
        replaces it with a refusal).
        """
        committer, version = self._committer, self.core.version
        assert committer is not None
        assert self._tg is not None
        if committer.durable >= version:
            on_answer()
            await self._ok(req, endpoint, data, started)
            return

        async def when_durable() -> None:
            try:
                await committer.wait(version)
            except CheckpointError as exc:
                if undo is not None:
                    undo()
                    self._count_held()
                    detail = f"{exc}; nothing was allocated"
                else:
                    detail = f"{exc}; done in memory only, the next write will retry"
                await self._reject(req, endpoint, "checkpoint_failed", detail, started)
                return
            on_answer()
            await self._ok(req, endpoint, data, started)

        self._tg.start_soon(when_durable)

    def _too_large(self, data: bytes, containers: int) -> str | None:
        """Why ``data`` cannot be sent as an answer, if it cannot.

        A request for thousands of containers (never kubelet's: 5,000 of one GPU do)
        got an answer larger than the server's max_payload: nats-py refused to send
        it, the caller timed out, and the allocation stayed. Refused instead (and, for
        allocate, undone).
        """
        limit = self._rt.bus.client.max_payload
        if len(data) <= limit:
            return None
        return (
            f"the answer for {containers} containers would take {len(data)} bytes, more "
            f"than the {limit} NATS carries in one message: ask for fewer containers"
        )

    # --- endpoints ------------------------------------------------------------------------

    async def _on_allocate(self, req: Request) -> None:
        started = time.perf_counter()
        value = await self._decode(req, p.ENDPOINT_ALLOCATE, p.ALLOCATE_REQUEST, started)
        if value is None:
            return
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

    async def _on_allocate_batch(self, req: Request) -> None:
        """Several kubelet calls in one message, each decided as if it came alone."""
        endpoint = p.ENDPOINT_ALLOCATE_BATCH
        started = time.perf_counter()
        value = await self._decode(req, endpoint, p.ALLOCATE_BATCH_REQUEST, started)
        if value is None:
            return
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

    async def _on_preferred(self, req: Request) -> None:
        started = time.perf_counter()
        value = await self._decode(req, p.ENDPOINT_PREFERRED, p.PREFERRED_REQUEST, started)
        if value is None:
            return
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

    async def _on_release(self, req: Request) -> None:
        started = time.perf_counter()
        value = await self._decode(req, p.ENDPOINT_RELEASE, p.RELEASE_REQUEST, started)
        if value is None:
            return
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

    async def _on_reset(self, req: Request) -> None:
        """The operator accepts the loss of the allocation record."""
        endpoint = p.ENDPOINT_RESET
        started = time.perf_counter()
        value = await self._decode(req, endpoint, p.RESET_REQUEST, started)
        if value is None:
            return
        if not value.confirm:
            await self._reject(
                req,
                endpoint,
                "invalid_request",
                "a reset accepts that allocations of running pods may be unknown: send "
                "confirm (gpulet allocator reset --confirm)",
                started,
            )
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
        """The long poll of the device plugin (see :mod:`.protocol`)."""
        endpoint = p.ENDPOINT_WITHHELD
        started = time.perf_counter()
        value = await self._decode(req, endpoint, p.WITHHELD_REQUEST, started)
        if value is None:
            return

        async def answer() -> None:
            reply = p.WithheldReply(
                epoch=self._withheld_epoch,
                version=self._withheld_version,
                withheld=self._withheld,
            )
            await self._ok(req, endpoint, p.WITHHELD_REPLY.encode(reply), started)

        current = value.epoch == self._withheld_epoch and value.version == self._withheld_version
        if not (current and value.wait_s > 0):
            await answer()
            return
        changed = self._withheld_changed
        wait_s = min(value.wait_s, p.MAX_WITHHELD_WAIT_S)

        async def when_changed() -> None:
            with anyio.move_on_after(wait_s):
                await changed.wait()
            await answer()

        assert self._tg is not None
        # Not in the handler: nats.micro hands an endpoint one message at a time.
        self._tg.start_soon(when_changed)

    async def _on_state(self, req: Request) -> None:
        started = time.perf_counter()
        if await self._decode(req, p.ENDPOINT_STATE, p.STATE_REQUEST, started) is None:
            return
        reply = self.core.state(checkpoint=str(self.checkpoint.path))
        await self._ok(req, p.ENDPOINT_STATE, p.STATE_REPLY.encode(reply), started)

    # --- releasing allocations of pods that are gone -------------------------------------

    async def _release_loop(self) -> None:
        socket = Path(self._settings.pod_resources_socket)
        while True:
            self._probe_checkpoint()
            await self.reconcile_once(socket)
            interval = self._settings.release_interval_s
            if self.core.lost is not None:
                interval = min(interval, LOST_RETRY_S)
            await anyio.sleep(interval)

    async def reconcile_once(self, socket: Path | None = None) -> int:
        """One PodResources pass; returns how many allocations it released."""
        socket = socket or Path(self._settings.pod_resources_socket)
        try:
            response = await list_pod_resources(socket, self._settings.pod_resources_timeout_s)
        except PodResourcesUnavailable as exc:
            self._pod_resources_since = None
            state = "failing" if await anyio.Path(socket).exists() else "absent"
            if state != self._pod_resources_state:
                if state == "absent":
                    log.info(
                        "no PodResources API at %s: allocations are released only by "
                        "explicit release requests",
                        socket,
                    )
                else:
                    self._pod_resources_log.warning("PodResources List failed: %s", exc)
            self._pod_resources_state = state
            if self.core.lost is not None:
                self.core.rebuild_blocker = (
                    f"kubelet's PodResources API at {socket} cannot rebuild it ({exc})"
                )
                self._update_status()
            return 0
        if self._pod_resources_state != "ok":
            log.info("following PodResources at %s", socket)
            self._pod_resources_state = "ok"
        now = anyio.current_time()
        if self._pod_resources_since is None:
            self._pod_resources_since = now
        if self.core.lost is not None:
            self._rebuild(
                held_devices(response, self.core.kind_of), now - self._pod_resources_since
            )
        released = self.core.reconcile(live_grants(response, self.core.kind_of))
        if released:
            self._released.add(len(released), {"reason": "pod_gone"})
            self._count_held()
            self._update_status()
        committer = self._committer
        if committer is not None and committer.durable < self.core.version:
            # A failure is logged by the committer, which keeps retrying.
            with contextlib.suppress(CheckpointError):
                await committer.wait(self.core.version)
        return len(released)

    def _rebuild(self, held: list[HeldDevices], answering_s: float) -> None:
        """One step of rebuilding a lost record from a PodResources answer."""
        core = self.core
        adoption = core.adopt(held)
        if adoption.adopted:
            log.warning(
                "rebuilding the lost allocation record: adopted %d whole-GPU allocation(s) "
                "kubelet's PodResources lists",
                adoption.adopted,
            )
            self._count_held()
        grace = self._settings.release_grace_s
        if not adoption.complete:
            core.rebuild_blocker = f"kubelet's PodResources cannot rebuild it: {adoption.blocker()}"
        elif answering_s < grace:
            core.rebuild_blocker = (
                f"rebuilding it from kubelet's PodResources ({core.ledger.count()} allocation(s) "
                f"so far): PodResources must answer for {grace:g} s (release_grace_s) before "
                "its pod list is trusted"
            )
        else:
            reason = core.end_loss()
            log.warning(
                "the lost allocation record (%s) was rebuilt from kubelet's PodResources: "
                "%d allocation(s); allocating again",
                reason,
                core.ledger.count(),
            )
        self._update_status()
