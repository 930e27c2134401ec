"""The device-plugin service: kubelet's device plugin, fed from the bus, deciding over NATS.

Flow
----
1. Follow the node's inventory and health (:class:`~gpulet_common.nodeview.NodeView`,
   the health service's KV state) into a :class:`~.devicelist.DeviceList`: every
   ``ListAndWatch`` stream then sends the new list when a GPU turns unhealthy *and*
   when it recovers.
2. Wait for kubelet's device-plugin directory. Where there is none (``gpulet run`` on
   a laptop, a node without kubelet) the service stays up, *degraded*, saying why on
   the status board (``/readyz``), and checks again every few seconds instead of
   crashing the agent.
3. Follow which cards hold shares and so may not go whole (the allocator's
   ``withheld`` long poll): their whole-GPU device is listed ``Unhealthy`` while they
   do (see :mod:`.resources`). Without an answer the last known set stays.
4. Run the :class:`~.manager.DevicePluginManager` with the NATS backend
   (:class:`~.nats_backend.NatsAllocationBackend`): it serves one
   socket per resource, registers with kubelet and re-registers after kubelet
   restarts. The status says whether kubelet accepted the registration.
5. With ``dra.mode`` ``dra`` or ``both`` and ``dra.plugin_host = "device-plugin"``, run
   the DRA kubelet plugin beside it
   (:class:`~gpulet_allocator.kubelet.dra.service.DraPluginRunner`), over the same
   NATS connection (:class:`~gpulet_allocator.kubelet.dra.nats_core.NatsDecisionCore`)
   and read model (by default the allocator service runs it); with ``dra`` the device
   plugin itself stays off.
6. MIG (:mod:`gpulet_allocator.mig`, ``allocator.mig_strategy``): a MIG-enabled GPU
   is not listed (said once per change in the log); the strategy's MIG devices are.
   Under ``mixed`` each profile is a resource of its own: when the set of profiles on
   the node changes, the manager is started again with the new set.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from gpulet_allocator.kubelet.deviceplugin.devicelist import DeviceList
from gpulet_allocator.kubelet.deviceplugin.manager import DevicePluginManager
from gpulet_allocator.kubelet.deviceplugin.metrics import PluginMetrics
from gpulet_allocator.kubelet.deviceplugin.nats_backend import NatsAllocationBackend
from gpulet_allocator.kubelet.deviceplugin.resources import (
    mig_resource_specs,
    plugin_gpus_from_inventory,
)
from gpulet_allocator.mig import MigPlan, mig_plan, parent_block
from gpulet_allocator.protocol import MAX_WITHHELD_WAIT_S, ResourceSpec, WithheldReply
from gpulet_common.bus.longpoll import follow_versions
from gpulet_common.lifecycle import idle_disabled
from gpulet_common.messages import GpuInfo
from gpulet_common.nodeview import NodeChange, NodeView
from gpulet_common.runtime import Runtime, RuntimeService
from gpulet_common.settings import AllocatorSettings

if TYPE_CHECKING:
    from gpulet_allocator.kubelet.dra.service import DraPluginRunner

log = logging.getLogger("gpulet.device-plugin")

# Kubelet's dir is looked for this many watch intervals apart (2 s by default).
DIR_POLL_INTERVALS = 4
RESTART_DELAY_S = 5.0
# sun_path holds 108 bytes, the terminating NUL included.
MAX_SOCKET_PATH = 107
# The withheld long poll: how long one request waits, and the back-off when it fails.
WITHHELD_WAIT_S = MAX_WITHHELD_WAIT_S / 2
WITHHELD_RETRY_MAX_S = 5.0


class DevicePluginService(RuntimeService[AllocatorSettings]):
    name = "device-plugin"

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime, runtime.settings.allocator)
        self._config = self._settings.plugin
        self.state = DeviceList()
        self._gpus: list[GpuInfo] = []
        self._have_inventory = False
        # Cards holding shares (the allocator's answer): not offered whole.
        self._withheld: frozenset[str] = frozenset()
        # Time-slicing replicas of each GPU (the allocator's answer, same long poll).
        self._replicas: dict[str, int] = {}
        self.view = NodeView(
            runtime.bus,
            runtime.node,
            retry_s=self._settings.request_retry_s,
            who="device-plugin",
        )
        self.view.listen(self._on_view)
        self._metrics = PluginMetrics(runtime.meter)
        self._mig = MigPlan(strategy=self._settings.mig_strategy)
        self._mig_said: dict[str, str] = {}
        self._mig_invalid_said = ""
        #: The mixed strategy's MIG resources the inventory needs (set on change).
        self.mig_specs: tuple[ResourceSpec, ...] = ()
        # Set when mig_specs change while a manager serves (created by the run loop).
        self._specs_changed: anyio.Event | None = None
        #: The DRA kubelet plugin (``dra.mode`` dra or both; for tests).
        self.dra: DraPluginRunner | None = None
        #: The running manager, once kubelet's directory exists (for tests).
        self.manager: DevicePluginManager | None = None

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        if not self._settings.enabled:
            await idle_disabled(self.name, "allocator.enabled", self._rt.status, task_status)
        backend = NatsAllocationBackend(
            self._rt.bus, self._rt.node, timeout_s=self._settings.request_timeout_s
        )
        async with anyio.create_task_group() as tg:
            await tg.start(self.view.run)
            if self._rt.settings.dra.plugin_runs_in("device-plugin"):
                await tg.start(self._run_dra)
            if self._rt.settings.dra.mode == "dra":
                self._rt.status.set(self.name, "ready", "off: dra.mode is dra")
                task_status.started()
                return
            await tg.start(backend.run)
            tg.start_soon(self._follow_withheld, backend)
            # Said before "started", so the status board never shows a ready plugin
            # that kubelet cannot see.
            if not await self._plugin_dir_exists():
                self._dir_missing()
            else:
                self._waiting_for_kubelet()
            task_status.started()
            while True:
                await self._wait_for_plugin_dir()
                self._specs_changed = anyio.Event()
                manager = DevicePluginManager(
                    self._config,
                    self.state,
                    backend,
                    metrics=self._metrics,
                    mig_specs=self.mig_specs,
                )
                self.manager = manager
                failure: str | None = None
                try:
                    async with anyio.create_task_group() as inner:
                        inner.start_soon(self._report, manager)
                        inner.start_soon(self._restart_on_new_specs, inner.cancel_scope)
                        try:
                            await manager.run()
                        except (OSError, RuntimeError) as exc:
                            # The dir is not writable by us, or gRPC cannot bind there.
                            failure = self._cannot_serve(manager, exc)
                        inner.cancel_scope.cancel()
                finally:
                    self.manager = None
                if failure is not None:
                    self._rt.status.set(self.name, "degraded", failure)
                    await anyio.sleep(RESTART_DELAY_S)

    async def _run_dra(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        from gpulet_allocator.kubelet.dra.nats_core import NatsDecisionCore
        from gpulet_allocator.kubelet.dra.service import DraPluginRunner  # its extras

        rt = self._rt
        timeout_s = rt.settings.allocator.plugin.backend_timeout_s
        core = NatsDecisionCore(rt.bus, rt.node, timeout_s=timeout_s)
        self.dra = DraPluginRunner(rt, self.view, core)
        await self.dra.run(task_status=task_status)

    def _cannot_serve(self, manager: DevicePluginManager, exc: Exception) -> str:
        detail = f"cannot serve in {self._config.plugin_dir}: {exc}"
        too_long = [str(p) for p in manager.socket_paths if len(os.fsencode(p)) > MAX_SOCKET_PATH]
        if too_long:
            detail = (
                f"socket path {too_long[0]} is longer than the {MAX_SOCKET_PATH} bytes a unix "
                "socket allows (shorten plugin_dir or socket_prefix)"
            )
        return f"{detail}; retrying in {RESTART_DELAY_S:g} s"

    async def _plugin_dir_exists(self) -> bool:
        return await anyio.Path(self._config.plugin_dir).is_dir()

    def _dir_missing(self) -> None:
        self._rt.status.set(
            self.name,
            "degraded",
            f"kubelet's device-plugin directory {self._config.plugin_dir} does not exist "
            "(not a Kubernetes node?); waiting for it",
        )

    def _waiting_for_kubelet(self) -> None:
        socket = f"{self._config.plugin_dir.rstrip('/')}/{self._config.kubelet_socket}"
        self._rt.status.set(
            self.name, "degraded", f"waiting for kubelet to accept the registration at {socket}"
        )

    async def _wait_for_plugin_dir(self) -> None:
        while not await self._plugin_dir_exists():
            self._dir_missing()
            await anyio.sleep(self._config.watch_interval_s * DIR_POLL_INTERVALS)

    async def _report(self, manager: DevicePluginManager) -> None:
        """Keep the status board in step with the registration and the GPUs."""
        while True:
            # Sleep first: a manager that fails at once reports its own reason.
            await anyio.sleep(self._config.watch_interval_s)
            if manager.all_registered():
                gpus = self.state.snapshot().gpus
                unhealthy = sum(1 for g in gpus if not g.healthy)
                names = ", ".join(s.spec.name for s in manager.servers)
                detail = f"registered {names}; {len(gpus)} GPUs"
                if unhealthy:
                    detail += f" ({unhealthy} unhealthy)"
                self._rt.status.set(self.name, "ready", detail)
            else:
                self._waiting_for_kubelet()

    async def _restart_on_new_specs(self, scope: anyio.CancelScope) -> None:
        assert self._specs_changed is not None
        await self._specs_changed.wait()
        log.info(
            "MIG resources now %s: serving them anew",
            ", ".join(s.name for s in self.mig_specs) or "none",
        )
        scope.cancel()

    def _follow_mig(self, gpus: list[GpuInfo]) -> None:
        """Work out the MIG plan; say why a GPU is not offered, once per change."""
        names = self._config.resources
        self._mig = mig_plan(gpus, self._settings.mig_strategy, names.gpu)
        said: dict[str, str] = {}
        for g in gpus:
            if (block := parent_block(g)) is not None:
                said[g.uuid] = block[1]
                if self._mig_said.get(g.uuid) != block[1]:
                    log.warning("GPU %s not offered (%s): %s", g.index, block[0], block[1])
        self._mig_said = said
        if self._mig.invalid != self._mig_invalid_said and self._mig.invalid:
            log.warning(
                "MIG strategy single: invalid layout, no MIG device offered: %s",
                self._mig.invalid,
            )
        self._mig_invalid_said = self._mig.invalid
        specs = mig_resource_specs(self._mig, names.gpu)
        if specs != self.mig_specs:
            self.mig_specs = specs
            if self._specs_changed is not None:
                self._specs_changed.set()

    async def _follow_withheld(self, backend: NatsAllocationBackend) -> None:
        """Keep the withheld cards in step with the allocator (a long poll)."""
        await follow_versions(
            lambda epoch, version: backend.withheld(epoch, version, WITHHELD_WAIT_S),
            self._on_withheld,
            retry_s=self._settings.request_retry_s,
            retry_max_s=WITHHELD_RETRY_MAX_S,
            what="withheld cards",
            log=log,
        )

    def _on_withheld(self, reply: WithheldReply) -> None:
        withheld = frozenset(reply.withheld)
        if withheld != self._withheld or reply.replicas != self._replicas:
            for uuid in sorted(withheld - self._withheld):
                log.info("GPU %s not offered whole: %s", uuid, reply.withheld[uuid])
            if reply.replicas != self._replicas:
                log.info("time-slicing replicas now %s", reply.replicas or "none")
            self._withheld, self._replicas = withheld, dict(reply.replicas)
            self._publish()

    def _on_view(self, change: NodeChange) -> None:
        inventory = self.view.inventory
        if change.inventory and inventory is not None:
            if inventory.degraded_reason and not inventory.gpus and self._have_inventory:
                # NVML failed: that says nothing about the GPUs, so kubelet keeps the list.
                log.warning(
                    "keeping the GPU list: inventory degraded (%s)", inventory.degraded_reason
                )
            else:
                self._have_inventory = True
                self._gpus = list(inventory.gpus)
                self._follow_mig(self._gpus)
        self._publish()

    def _publish(self) -> None:
        gpus = self._gpus
        if self._have_inventory:
            # A GPU the health service reports not present (lost, or missing since the
            # agent started) stays in kubelet's list as Unhealthy: kubelet then keeps
            # counting it in the node's capacity and the operator sees a broken GPU,
            # not one GPU fewer.
            listed = {g.uuid for g in gpus}
            gpus = gpus + [
                h.info
                for u, h in sorted(self.view.healths().items())
                if not h.present and h.info is not None and h.info.uuid == u and u not in listed
            ]
        plugin_gpus = plugin_gpus_from_inventory(
            gpus, self.view.unhealthy(), self._withheld, self._mig, self._replicas
        )
        if self.state.publish(plugin_gpus):
            log.debug("device list version %d", self.state.snapshot().version)
