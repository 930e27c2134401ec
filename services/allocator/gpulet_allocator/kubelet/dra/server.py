"""The DRA kubelet plugin on the sockets kubelet expects: registration and DRAPlugin.

Sockets (``/var/lib/kubelet`` by default, both configurable):

* ``plugins_registry/<driver>-reg.sock``: ``pluginregistration.Registration``.
  kubelet's plugin watcher finds it, calls ``GetInfo`` (we answer type
  ``DRAPlugin``, our driver name, the DRA socket's path, the gRPC services
  ``v1.DRAPlugin`` and ``DRAResourceHealth`` in v1, v1beta1 and v1alpha1) and
  then ``NotifyRegistrationStatus``. kubelet opens the health stream only for a
  driver that lists a DRAResourceHealth service there (1.37 picks the newest it knows:
  v1, else v1alpha1; it has no v1beta1); without it the pods' ``allocatedResourcesStatus``
  stays ``Unknown`` (tests/node/test_node_health.py, on a real kubelet);
* ``plugins/<driver>/dra.sock``: ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin``
  (NodePrepareResources, NodeUnprepareResources) and ``DRAResourceHealth`` in
  v1alpha1, v1beta1 and v1.

A stale socket from a previous run is removed before binding; a path longer than a
unix socket allows (107 bytes) is refused at start, with the path in the message.
Each socket is mode 0600 before the server accepts. :meth:`DraKubeletPlugin.run`
serves until cancelled, then stops both servers with a short grace and removes the
sockets. The registration socket is served last, once the DRA socket is up, so kubelet
never dials an endpoint that is not there yet.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
import grpc.aio

from gpulet_allocator.kubelet.dra.contract import HealthSource
from gpulet_allocator.kubelet.dra.health import HealthServicer, add_health_servicers
from gpulet_allocator.kubelet.dra.plugin import ClaimRef, DraPlugin
from gpulet_common.kubelet_api.dra.v1 import api_pb2 as dra_pb
from gpulet_common.kubelet_api.dra.v1 import api_pb2_grpc as dra_grpc
from gpulet_common.kubelet_api.pluginregistration.v1 import api_pb2 as reg_pb
from gpulet_common.kubelet_api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from gpulet_common.safefile import ensure_dir

log = logging.getLogger("gpulet.dra.server")

MAX_SOCKET_PATH: Final = 107
SOCKET_MODE: Final = 0o600
# The socket directories (plugins/<driver>/, plugins_registry) when the plugin makes
# them: exactly this, whatever the umask, as kubelet makes its own.
SOCKET_DIR_MODE: Final = 0o750
PLUGIN_TYPE: Final = "DRAPlugin"
# The gRPC services kubelet may use, as "<package>.<service>": the DRA plugin, then every
# health service served (kubelet picks the first of its own list that we name: 1.37
# knows v1 and v1alpha1).
SUPPORTED_VERSIONS: Final = (
    "v1.DRAPlugin",
    "v1.DRAResourceHealth",
    "v1beta1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
)
STOP_GRACE_S: Final = 0.5
MAX_CLAIMS_PER_CALL: Final = 1024
Context = grpc.aio.ServicerContext[Any, Any]


@dataclass(frozen=True)
class Sockets:
    registration: Path
    endpoint: Path

    @classmethod
    def for_driver(cls, driver: str, registry: str | Path, plugins: str | Path) -> Sockets:
        return cls(
            registration=Path(registry) / f"{driver}-reg.sock",
            endpoint=Path(plugins) / driver / "dra.sock",
        )


class RegistrationServicer(reg_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: Path) -> None:
        super().__init__()
        self._driver = driver
        self._endpoint = endpoint
        self.registered = anyio.Event()
        self.status: tuple[bool, str] | None = None

    async def GetInfo(self, request: reg_pb.InfoRequest, context: Context) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self._driver,
            endpoint=str(self._endpoint),
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    async def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: Context
    ) -> reg_pb.RegistrationStatusResponse:
        self.status = (bool(request.plugin_registered), str(request.error)[:500])
        if request.plugin_registered:
            log.info("kubelet registered DRA driver %s", self._driver)
            self.registered.set()
        else:
            log.error("kubelet refused DRA driver %s: %s", self._driver, self.status[1])
        return reg_pb.RegistrationStatusResponse()


async def _claims(request: Any, context: Context) -> list[ClaimRef]:
    """The call's claims; a call with too many is refused (INVALID_ARGUMENT)."""
    if len(request.claims) > MAX_CLAIMS_PER_CALL:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "too many claims in one call")
    return [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]


class DraServicer(dra_grpc.DRAPluginServicer):
    def __init__(self, plugin: DraPlugin) -> None:
        super().__init__()
        self._plugin = plugin

    async def NodePrepareResources(
        self, request: dra_pb.NodePrepareResourcesRequest, context: Context
    ) -> dra_pb.NodePrepareResourcesResponse:
        results = await self._plugin.prepare(await _claims(request, context))
        answer = dra_pb.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = answer.claims[uid]
            entry.error = result.error
            if not result.error:
                entry.devices.extend(
                    dra_pb.Device(
                        request_names=d.requests,
                        pool_name=d.pool,
                        device_name=d.device,
                        cdi_device_ids=d.cdi_ids,
                        share_id=d.share_id or None,
                    )
                    for d in result.devices
                )
        return answer

    async def NodeUnprepareResources(
        self, request: dra_pb.NodeUnprepareResourcesRequest, context: Context
    ) -> dra_pb.NodeUnprepareResourcesResponse:
        errors = await self._plugin.unprepare(await _claims(request, context))
        return dra_pb.NodeUnprepareResourcesResponse(
            claims={uid: dra_pb.NodeUnprepareResourceResponse(error=e) for uid, e in errors.items()}
        )


def _check_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes")


def _clear(path: Path) -> None:
    ensure_dir(path.parent, SOCKET_DIR_MODE)
    path.unlink(missing_ok=True)  # a stale socket makes bind fail


async def _serve_on(server: grpc.aio.Server, path: Path) -> None:
    _check_path(path)
    await anyio.to_thread.run_sync(_clear, path)
    server.add_insecure_port(f"unix://{path}")
    os.chmod(path, SOCKET_MODE)  # bound, not yet accepting
    await server.start()


class DraKubeletPlugin:
    def __init__(
        self, plugin: DraPlugin, health: HealthSource, sockets: Sockets, driver: str
    ) -> None:
        self.plugin = plugin
        self.sockets = sockets
        self.registration = RegistrationServicer(driver, sockets.endpoint)
        self._health = health
        self.health_servicers: list[HealthServicer] = []

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        for path in (self.sockets.endpoint, self.sockets.registration):
            _check_path(path)
        await anyio.to_thread.run_sync(self.plugin.load)
        dra_server = grpc.aio.server()
        dra_grpc.add_DRAPluginServicer_to_server(DraServicer(self.plugin), dra_server)
        self.health_servicers = add_health_servicers(dra_server, self._health)
        reg_server = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(self.registration, reg_server)
        try:
            await _serve_on(dra_server, self.sockets.endpoint)
            await _serve_on(reg_server, self.sockets.registration)
            log.info(
                "DRA plugin serving on %s, registration on %s",
                self.sockets.endpoint,
                self.sockets.registration,
            )
            task_status.started()
            await self.plugin.write_checkpoint()
        finally:
            with anyio.CancelScope(shield=True):
                await reg_server.stop(STOP_GRACE_S)
                await dra_server.stop(STOP_GRACE_S)
                for path in (self.sockets.registration, self.sockets.endpoint):
                    path.unlink(missing_ok=True)
