"""kubelet's side of a DRA plugin, over the real sockets and the real stubs.

As kubelet's plugin watcher and DRA manager do it: wait for ``<driver>-reg.sock`` in a
plugins_registry dir, call ``GetInfo`` and check it, call
``NotifyRegistrationStatus``, dial the endpoint it named, then send
``NodePrepareResources`` / ``NodeUnprepareResources`` and consume
``NodeWatchResources`` on demand. For the plugin tests now and the end-to-end test and
``bench/dra.py`` later. Every wait is bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import grpc.aio

from gpulet_common.kubelet_api.dra.v1 import api_pb2 as dra
from gpulet_common.kubelet_api.dra.v1 import api_pb2_grpc as dra_grpc
from gpulet_common.kubelet_api.pluginregistration.v1 import api_pb2 as reg
from gpulet_common.kubelet_api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from support.waiting import wait_until


@dataclass
class FakeDraKubelet:
    info: reg.PluginInfo
    channel: grpc.aio.Channel
    stub: dra_grpc.DRAPluginAsyncStub

    async def prepare(self, *claims: tuple[str, str, str]) -> dra.NodePrepareResourcesResponse:
        """``claims``: (namespace, uid, name) each."""
        request = dra.NodePrepareResourcesRequest(
            claims=[dra.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]
        )
        with anyio.fail_after(45):  # kubelet's budget
            return await self.stub.NodePrepareResources(request)

    async def unprepare(self, *claims: tuple[str, str, str]) -> dra.NodeUnprepareResourcesResponse:
        request = dra.NodeUnprepareResourcesRequest(
            claims=[dra.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]
        )
        with anyio.fail_after(45):
            return await self.stub.NodeUnprepareResources(request)

    def health_stream(self, pb: ModuleType, pb_grpc: ModuleType) -> Any:
        """The health stream of ``pb``'s version. As the real kubelet (v1.37.2), only
        for a plugin whose GetInfo names that service (``<package>.DRAResourceHealth``):
        kubelet opens no stream for a driver that does not (tests/node/test_node_health)."""
        service = pb.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name
        advertised = service.rsplit(".", 2)[-2] + ".DRAResourceHealth"
        if advertised not in self.info.supported_versions:
            raise AssertionError(
                f"GetInfo names {list(self.info.supported_versions)}, not {advertised}: "
                "a real kubelet would never open this stream"
            )
        stub = pb_grpc.DRAResourceHealthStub(self.channel)
        return stub.NodeWatchResources(pb.NodeWatchResourcesRequest())


async def wait_for_socket(path: Path, timeout_s: float = 5.0) -> None:
    await wait_until(path.exists, timeout_s=timeout_s, interval_s=0.01, what=f"{path}")


@asynccontextmanager
async def registered(
    registry: Path, driver: str, *, accept: bool = True
) -> AsyncIterator[FakeDraKubelet]:
    socket = registry / f"{driver}-reg.sock"
    await wait_for_socket(socket)
    async with grpc.aio.insecure_channel(f"unix://{socket}") as reg_channel:
        registration = reg_grpc.RegistrationStub(reg_channel)
        with anyio.fail_after(5):
            info = await registration.GetInfo(reg.InfoRequest())
        await registration.NotifyRegistrationStatus(
            reg.RegistrationStatus(plugin_registered=accept, error="" if accept else "refused")
        )
    async with grpc.aio.insecure_channel(f"unix://{info.endpoint}") as channel:
        yield FakeDraKubelet(info, channel, dra_grpc.DRAPluginStub(channel))
