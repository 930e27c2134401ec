"""The DRA kubelet plugin, started when ``dra.mode`` is ``dra`` or ``both`` by the
service ``dra.plugin_host`` names.

It is built from the agent's settings (``[dra]``) and runs inside that service's task
group (its process, its node read model), with the decision core the service gives it:

* decisions, in the one ledger either way: by default the allocator service hosts the
  plugin and decides in its ledger directly
  (:class:`~gpulet_allocator.service.claims.LocalClaimCore`: no NATS hop in Prepare);
  with ``plugin_host = "device-plugin"`` the device-plugin service hosts it and
  decides over NATS (:class:`~.nats_core.NatsDecisionCore`, the allocator's
  ``reserve-claim`` / ``release-claim``);
* claims: :class:`~.claims.KubeClaimReader` with the cluster configuration of
  :mod:`gpulet_common.kube` (``dra.kubeconfig``, else in-cluster, else
  ``$KUBECONFIG`` / ``~/.kube/config``). Without one the plugin waits, degraded on the
  status board, and looks again with a back-off: kubelet cannot call a plugin that is
  not registered, so nothing is lost meanwhile. With ``dra.claim_cache`` a
  :class:`~.claim_cache.WatchedClaimReader` in front of it answers from a watch of the
  node's allocated claims;
* what Prepare did, on the claim (``status.devices``) and as Events:
  :class:`~.status.ClaimStatusWriter`, in the background;
* housekeeping: :class:`~.sweep.ClaimSweeper` unprepares the claims the API server
  no longer knows, once kubelet has registered the plugin;
* the driver's user space in the CDI specs: :class:`~.driver.DriverFilesKeeper`;
* health: :class:`~.health.NodeViewHealth` over the service's
  :class:`~gpulet_common.nodeview.NodeView`;
* sockets: ``<plugins_registry>/<driver>-reg.sock`` and
  ``<plugins_dir>/<driver>/dra.sock`` (:class:`~.server.Sockets`); CDI specs in
  ``dra.cdi_dir``; the prepared claims' checkpoint in ``dra.checkpoint_path`` or
  ``<plugins_dir>/<driver>/checkpoint.json``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import anyio.abc

from gpulet_allocator.kubelet.dra.claim_cache import WatchedClaimReader
from gpulet_allocator.kubelet.dra.claims import KubeClaimReader
from gpulet_allocator.kubelet.dra.contract import ClaimReader, DecisionCore, MpsDaemons
from gpulet_allocator.kubelet.dra.driver import DriverFilesKeeper
from gpulet_allocator.kubelet.dra.health import NodeViewHealth
from gpulet_allocator.kubelet.dra.metrics import DraMetrics
from gpulet_allocator.kubelet.dra.plugin import DraPlugin, PluginSettings
from gpulet_allocator.kubelet.dra.server import DraKubeletPlugin, Sockets
from gpulet_allocator.kubelet.dra.status import ClaimStatusWriter
from gpulet_allocator.kubelet.dra.sweep import ClaimSweeper
from gpulet_common import mps as mps_paths
from gpulet_common.bootid import read_boot_id
from gpulet_common.dra.driverfiles import container_edits
from gpulet_common.kube import KubeConfig, KubeConfigError, lookup
from gpulet_common.kubeapi import KubeClient
from gpulet_common.nodeview import NodeView
from gpulet_common.runtime import Runtime
from gpulet_common.settings.dra import DraSettings

log = logging.getLogger("gpulet.dra")

STATUS_NAME = "dra-plugin"
CONFIG_RETRY_MAX_S = 30.0


def checkpoint_path(runtime: Runtime) -> Path:
    """``dra.checkpoint_path``, else beside the DRA socket: the plugin's own hostPath
    directory, writable where the device-plugin container may not write the state
    directory, and kept across restarts as kubelet keeps it."""
    dra = runtime.settings.dra
    if dra.checkpoint_path:
        return Path(dra.checkpoint_path)
    return Path(dra.plugins_dir) / dra.driver / "checkpoint.json"


async def kube_configuration(settings: DraSettings) -> KubeConfig:
    """The cluster configuration to read claims with; raises KubeConfigError."""
    return await lookup(settings.kubeconfig, settings.kube_context)


class DraPluginRunner:
    def __init__(
        self,
        runtime: Runtime,
        view: NodeView,
        core: DecisionCore,
        mps: MpsDaemons | None = None,
    ) -> None:
        self._rt = runtime
        self._view = view
        self._core = core
        # The allocator's MPS daemons, when the plugin shares its process: their faults
        # go into the health stream, and whole GPUs configured for MPS get a daemon.
        self._mps = mps
        #: The health stream's source while the plugin serves (for MPS faults).
        self.health: NodeViewHealth | None = None
        #: The running kubelet plugin (for tests).
        self.server: DraKubeletPlugin | None = None

    async def _configuration(self) -> KubeConfig:
        delay = self._rt.settings.allocator.request_retry_s
        while True:
            try:
                return await kube_configuration(self._rt.settings.dra)
            except KubeConfigError as exc:
                self._rt.status.set(
                    STATUS_NAME, "degraded", f"no cluster to read ResourceClaims from: {exc}"
                )
                await anyio.sleep(delay)
                delay = min(delay * 2, CONFIG_RETRY_MAX_S)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        rt, dra = self._rt, self._rt.settings.dra
        rt.status.set(STATUS_NAME, "degraded", "starting the DRA kubelet plugin")
        task_status.started()
        configuration = await self._configuration()
        core = self._core
        settings = PluginSettings(
            driver=dra.driver,
            pool=rt.node,
            cdi_dir=Path(dra.cdi_dir),
            checkpoint=checkpoint_path(rt),
            dev_root=Path(rt.settings.allocator.plugin.dev_root),
            host_dev=rt.settings.allocator.plugin.host_dev,
            container_dev=rt.settings.allocator.plugin.container_dev or None,
            mig_capabilities_root=Path(rt.settings.allocator.plugin.mig_capabilities_root),
            mps_root=mps_paths.root(rt.settings) if mps_paths.managed(rt.settings) else "",
            mps_pipe_directory=rt.settings.allocator.mps.pipe_directory,
            boot_id=await anyio.to_thread.run_sync(read_boot_id),
        )
        sockets = Sockets.for_driver(dra.driver, dra.plugins_registry, dra.plugins_dir)
        while True:
            try:
                await self._serve(configuration, core, settings, sockets)
            except (OSError, ValueError, RuntimeError) as exc:
                # A socket path too long, a directory we may not write: say so, retry.
                rt.status.set(
                    STATUS_NAME, "degraded", f"cannot serve the DRA kubelet plugin: {exc}"
                )
                await anyio.sleep(CONFIG_RETRY_MAX_S)

    async def _serve(
        self,
        configuration: KubeConfig,
        core: DecisionCore,
        settings: PluginSettings,
        sockets: Sockets,
    ) -> None:
        rt, dra = self._rt, self._rt.settings.dra
        async with KubeClient(configuration) as api:
            reader: ClaimReader = KubeClaimReader(api, timeout_s=dra.api_timeout_s)
            direct = reader  # the sweep asks the API server itself, never a cache
            watched: WatchedClaimReader | None = None
            if dra.claim_cache:
                reader = watched = WatchedClaimReader(api, reader, driver=dra.driver, pool=rt.node)
            status = ClaimStatusWriter(api, dra.driver, rt.node, timeout_s=dra.api_timeout_s)
            plugin = DraPlugin(core, reader, settings, status, DraMetrics(rt.meter))
            keeper = DriverFilesKeeper(
                self._view,
                dra,
                lambda files: plugin.use_driver(container_edits(files), keeper.nvidia_smi(files)),
                mock=rt.settings.nvml.backend == "mock",
                state_dir=rt.settings.state_dir,
            )
            mps = self._mps
            faults = (lambda: mps.faults) if mps is not None else None
            health = self.health = NodeViewHealth(self._view, rt.node, faults)
            if mps is not None:
                plugin.mps = mps
                mps.also_want(plugin.mps_whole)
            plugin.lookup = health.lookup  # admin access: the device as the node has it
            self.server = server = DraKubeletPlugin(plugin, health, sockets, dra.driver)
            try:
                async with anyio.create_task_group() as tg:
                    if watched is not None:
                        await tg.start(watched.run)
                    tg.start_soon(status.run)
                    sweeper = ClaimSweeper(
                        plugin, direct, interval_s=dra.sweep_interval_s, boot_id=settings.boot_id
                    )
                    await tg.start(keeper.run)
                    await tg.start(server.run)
                    rt.status.set(
                        STATUS_NAME,
                        "degraded",
                        f"waiting for kubelet to register DRA driver {dra.driver} "
                        f"({sockets.registration})",
                    )
                    await server.registration.registered.wait()
                    rt.status.set(STATUS_NAME, "ready", f"DRA driver {dra.driver} registered")
                    tg.start_soon(sweeper.run)
            finally:
                self.server = None
