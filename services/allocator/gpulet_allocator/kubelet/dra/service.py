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
from gpulet_allocator.kubelet.dra.contract import ClaimReader, DecisionCore
from gpulet_allocator.kubelet.dra.health import NodeViewHealth
from gpulet_allocator.kubelet.dra.plugin import DraPlugin, PluginSettings
from gpulet_allocator.kubelet.dra.server import DraKubeletPlugin, Sockets
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
    def __init__(self, runtime: Runtime, view: NodeView, core: DecisionCore) -> None:
        self._rt = runtime
        self._view = view
        self._core = core
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
            watched: WatchedClaimReader | None = None
            if dra.claim_cache:
                reader = watched = WatchedClaimReader(api, reader, driver=dra.driver, pool=rt.node)
            plugin = DraPlugin(core, reader, settings)
            health = NodeViewHealth(self._view, rt.node)
            self.server = server = DraKubeletPlugin(plugin, health, sockets, dra.driver)
            try:
                async with anyio.create_task_group() as tg:
                    if watched is not None:
                        await tg.start(watched.run)
                    await tg.start(server.run)
                    rt.status.set(
                        STATUS_NAME,
                        "degraded",
                        f"waiting for kubelet to register DRA driver {dra.driver} "
                        f"({sockets.registration})",
                    )
                    await server.registration.registered.wait()
                    rt.status.set(STATUS_NAME, "ready", f"DRA driver {dra.driver} registered")
            finally:
                self.server = None
