"""The reporter service: the node's Device CR and GPU node labels, from the bus.

Flow
----
1. Follow the node's inventory and every GPU's health state through a
   :class:`~gpulet_common.nodeview.NodeView`: the collector's inventory, and the
   health service's ``gpu_health`` KV state, ordered by KV revision and read again
   after every reconnection to NATS. Neither has to be there at start: the view
   asks and watches with back-off, so start order does not matter. Health events
   (``gpu.health.<node>``) are not read: they are for alerting and history.
2. Every change goes to the :class:`ReporterCore`, which folds it into the inventory
   and the health view and rebuilds the intent; only an intent that differs from the
   previous one reaches the :class:`Debouncer`.
3. The :class:`WriteLoop` takes debounced intents and applies them through a sink --
   :class:`KubeWriter` against the API server, or :class:`OfflineSink` when there is
   no cluster -- in a task of its own, so the bus side never waits for the API.

No write happens before the first usable inventory (see :mod:`gpulet_reporter.core`).

The node condition ``GpuletGPUHealthy`` and the optional taint
(:mod:`gpulet_reporter.node_health`) follow the same view: every change re-evaluates
the :class:`NodeHealthKeeper`, whose changed intents go through a debouncer of their
own to a second :class:`WriteLoop` with a :class:`NodeHealthWriter`, so a failing
Device write never holds back the condition, nor the other way round. A probe asks the
health service for its state every ``health_probe_interval_s``: its answers are what
tells a live health service from a KV bucket nobody updates any more. In no-cluster
mode the condition is not written (there is no Node).

With ``dra.mode`` ``dra`` or ``both`` the same view also feeds the node's
ResourceSlices (:class:`~gpulet_reporter.slices.publisher.SlicePublisher`), through
the same API client; with ``both``, the GPUs the device plugin holds (the allocator's
``held`` long poll, :mod:`.slices.held`) are tainted ``NoSchedule`` there.

With ``sharing.time_slicing`` configs, the same long poll brings the replicas each
GPU is offered as (the allocator's plan of the node's config) for GFD's sharing labels
(:mod:`gpulet_reporter.sharelabels`), and, with DRA on, a time-sliced GPU is tainted
``NoSchedule`` in the slices (the ledger refuses it to a claim). One poll
(:meth:`ReporterService._follow_held`) feeds both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc

from gpulet_common import codec, subjects
from gpulet_common.bus import BusError, Refused
from gpulet_common.kubeapi import KubeClient
from gpulet_common.lifecycle import idle_disabled
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import HealthStateRequest, HeldReply, Inventory
from gpulet_common.nodeview import NodeChange, NodeView
from gpulet_common.runtime import Runtime, RuntimeService
from gpulet_common.settings import ReporterSettings
from gpulet_reporter.core import ReporterCore
from gpulet_reporter.debounce import Debouncer
from gpulet_reporter.desired import DesiredState
from gpulet_reporter.facts import DMI_PRODUCT_NAME, node_facts, read_machine_type
from gpulet_reporter.health_view import HealthView
from gpulet_reporter.kube import SERVICE_ACCOUNT_DIR, KubeConfigError, KubeTarget, load_target
from gpulet_reporter.metrics import ReporterMetrics
from gpulet_reporter.node_health import NodeHealthIntent, NodeHealthKeeper, NodeHealthWriter
from gpulet_reporter.offline import OfflineSink
from gpulet_reporter.pcie import make_resolver
from gpulet_reporter.slices.held import follow_held
from gpulet_reporter.slices.publisher import SlicePublisher
from gpulet_reporter.writer import KubeWriter, NodeApi, WriteLoop, WriteSink

log = logging.getLogger("gpulet.reporter")

MAX_ASK_INTERVAL_S = 300.0


class ReporterService(RuntimeService[ReporterSettings]):
    name = "reporter"

    def __init__(
        self,
        runtime: Runtime,
        *,
        env: dict[str, str] | None = None,
        sa_dir: Path = SERVICE_ACCOUNT_DIR,
        sysfs_pci_devices: Path | None = None,
        machine_type_file: Path = DMI_PRODUCT_NAME,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(runtime, runtime.settings.reporter)
        self._env = env
        self._sa_dir = sa_dir
        self.metrics = ReporterMetrics(runtime.meter)
        self.core = ReporterCore(
            self._node,
            self._settings,
            pcie_root=make_resolver(sysfs_pci_devices)
            if sysfs_pci_devices is not None
            else make_resolver(),
            on_degraded=lambda detail: runtime.status.set(self.name, "degraded", detail),
            facts=node_facts(runtime.settings, read_machine_type(machine_type_file)),
            clock=clock,
        )
        # The debouncer's and the Device loop's clock (a test may hold time still).
        self._clock = clock
        self.view = NodeView(
            runtime.bus, self._node, retry_s=self._settings.request_retry_s, who="reporter"
        )
        self.view.listen(self._on_view)
        self.node_health = NodeHealthKeeper(self._node, self._settings)
        self._probe_log = RateLimitedLog(log, per_minute=1)
        self.target: KubeTarget | None = None
        self.sink: WriteSink[DesiredState] | None = None
        self.loop: WriteLoop[DesiredState] | None = None
        self.node_health_writer: NodeHealthWriter | None = None
        self.node_health_loop: WriteLoop[NodeHealthIntent] | None = None
        #: The ResourceSlice publisher (``dra.mode`` dra or both; for tests).
        self.slices: SlicePublisher | None = None
        # The allocator's last ``held`` reply (None: none yet).
        self._held: HeldReply | None = None

    # The core's state, for tests and the CLI.
    @property
    def inventory(self) -> Inventory | None:
        return self.core.inventory

    @property
    def desired(self) -> DesiredState | None:
        return self.core.desired

    @property
    def debouncer(self) -> Debouncer[DesiredState]:
        return self.core.debouncer

    @property
    def health(self) -> HealthView:
        return self.core.health

    # -- lifecycle ---------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        if not self._settings.enabled:
            await idle_disabled(self.name, "reporter.enabled", self._rt.status, task_status)
        async with anyio.create_task_group() as tg:
            await tg.start(self.view.run)
            tg.start_soon(self._write)
            if self._settings.node_condition:
                tg.start_soon(self._probe_health)
            dra_mode = self._rt.settings.dra.mode
            if self._rt.settings.sharing.time_slicing.enabled or dra_mode == "both":
                tg.start_soon(self._follow_held)
            task_status.started()

    # -- inputs ------------------------------------------------------------------

    async def _follow_held(self) -> None:
        """The allocator's ``held`` reply: the time-slicing replicas for GFD's sharing
        labels, and what the slices taint (the device plugin's GPUs, time-sliced GPUs)."""
        retry_s = self._settings.request_retry_s
        await follow_held(self._rt.bus, self._node, self._on_held, retry_s)

    def _on_held(self, reply: HeldReply) -> None:
        self._held = reply
        self.core.on_replicas(reply.replicas)
        if self.slices is not None:
            self.slices.set_held(reply.held, reply.replicas)

    def _on_view(self, change: NodeChange) -> None:
        inventory = self.view.inventory
        if change.inventory and inventory is not None:
            self.core.on_inventory(inventory)
        for uuid in change.gpus:
            self.core.on_health(uuid, self.view.health(uuid))
            self.core.on_last_reset(uuid, self.view.last_reset(uuid))
        self._update_node_health()

    def _update_node_health(self) -> None:
        if self._settings.node_condition:
            self.node_health.update(
                self.core.inventory,
                self.view.healths(),
                health_seen=self.view.health_seen.is_set(),
            )

    async def _probe_health(self) -> None:
        """Ask the health service for its state: an answer (even an error reply) says it
        is alive. Re-evaluates the condition after each try, which is also what turns
        it Unknown once the answers stop for ``health_stale_after_s``."""
        interval = self._settings.health_probe_interval_s
        while True:
            try:
                await self._rt.bus.request(
                    subjects.health_state(self._node),
                    HealthStateRequest(),
                    codec.HEALTH_STATE_REQUEST,
                    codec.HEALTH_STATE,
                    timeout_s=min(interval, 2.0),
                )
            except Refused:
                self.node_health.answered()
            except BusError as exc:
                log.debug("health service state request unanswered: %s", exc)
            except Exception as exc:
                # Whatever else a request can raise, it is no answer, and it must not end
                # the reporter: the condition turns Unknown in time and says so.
                self._probe_log.warning(
                    "health service state request failed: %s: %s", type(exc).__name__, exc
                )
            else:
                self.node_health.answered()
            self._update_node_health()
            await anyio.sleep(interval)

    # -- output ------------------------------------------------------------------

    async def _resolve_target(self) -> KubeTarget:
        delay = self._settings.request_retry_s
        while True:
            try:
                return await load_target(
                    self._settings,
                    nvml_backend=self._rt.settings.nvml.backend,
                    env=self._env,
                    sa_dir=self._sa_dir,
                )
            except KubeConfigError as exc:
                self._rt.status.set(self.name, "degraded", f"no usable cluster config: {exc}")
                await anyio.sleep(delay)
                delay = min(delay * 2, MAX_ASK_INTERVAL_S)

    def _offline_dir(self) -> Path:
        if self._settings.offline_output_dir:
            return Path(self._settings.offline_output_dir).expanduser()
        return Path(self._rt.settings.state_dir or ".") / "reporter"

    def _status(self, state: str, detail: str) -> None:
        if state == "degraded":
            self._rt.status.set(self.name, "degraded", detail)
        else:
            self._rt.status.set(self.name, "ready", detail)

    async def _write(self) -> None:
        target = self.target = await self._resolve_target()
        if target.configuration is None:
            sink = OfflineSink(
                self._offline_dir(), self._node, self._settings, reason=target.offline_reason
            )
            log.warning(
                "no cluster (%s): the Device this node would apply goes to %s and the log",
                target.offline_reason,
                sink.device_path,
            )
            self._rt.status.set(self.name, "ready", f"no cluster; writing {sink.device_path}")
            await self._run_loop(sink)
            return
        log.info(
            "reporting Device %s and node labels to %s (%s)",
            self._node,
            target.server,
            target.source,
        )
        api = KubeClient(target.configuration)
        try:
            async with anyio.create_task_group() as tg:
                node_api = NodeApi(api, self._node, self._settings, self.metrics)
                if self._settings.node_condition:
                    tg.start_soon(self._run_node_health_loop, node_api, target.server)
                if self._rt.settings.dra.serves_dra:
                    tg.start_soon(self._run_slices, api, target.server)
                await self._run_loop(KubeWriter(node_api, server=target.server))
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await api.close()

    async def _run_slices(self, api: KubeClient, server: str) -> None:
        """``dra.mode`` dra or both: the node's ResourceSlices (:mod:`.slices`)."""
        settings = self._rt.settings
        self.slices = SlicePublisher(
            api,
            self._node,
            settings.dra,
            meter=self._rt.meter,
            server=server,
            # What follows the allocator's ``held`` answer is not lowered before it.
            await_held=settings.sharing.time_slicing.enabled or settings.dra.mode == "both",
            await_health=settings.health.enabled,
        )
        self.slices.attach(self.view)
        if self._held is not None:
            self.slices.set_held(self._held.held, self._held.replicas)
        await self.slices.run()

    async def _run_node_health_loop(self, node_api: NodeApi, server: str) -> None:
        writer = self.node_health_writer = NodeHealthWriter(node_api, server=server)
        self.node_health_loop = WriteLoop(
            writer,
            self.node_health.debouncer,
            self._settings,
            self.metrics,
            reconcile_interval_s=NodeHealthWriter.tick_interval(self._settings),
            track_pending=False,
        )
        await self.node_health_loop.run()

    async def _run_loop(self, sink: WriteSink[DesiredState]) -> None:
        self.sink = sink
        self.loop = WriteLoop(
            sink,
            self.debouncer,
            self._settings,
            self.metrics,
            on_status=self._status,
            clock=self._clock,
        )
        await self.loop.run()
