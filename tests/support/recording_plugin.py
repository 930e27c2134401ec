"""A device plugin that records every call it gets, in order: the probe of the
differential test between the real kubelet and the project's fake one
(tests/node/test_node_differential.py).

It serves ``v1beta1.DevicePlugin`` on ``<plugin_dir>/<socket>`` with the stubs generated
from kubelet's own proto, registers ``resource`` with ``pre_start_required`` and
``get_preferred_allocation_available`` (so a kubelet has every call to make), offers
``devices`` healthy devices ``dev-0``..., prefers the first ones offered, and answers
Allocate with one env per container (``RECORDED_DEVICES``: the IDs, sorted). Each call
is recorded as ``(name, detail)``: the detail is what the kubelet asked (sizes and IDs),
so two kubelets can be compared on what they asked, not only on the order.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import grpc
import grpc.aio

from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as dp
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc

Context = grpc.aio.ServicerContext[Any, Any]
ENV = "RECORDED_DEVICES"


class RecordingPlugin(dp_grpc.DevicePluginServicer):
    def __init__(self, devices: int) -> None:
        self.devices = [f"dev-{i}" for i in range(devices)]
        self.calls: list[tuple[str, str]] = []
        self.changed = anyio.Event()
        self._stop = anyio.Event()

    def _record(self, name: str, detail: str = "") -> None:
        self.calls.append((name, detail))
        changed, self.changed = self.changed, anyio.Event()
        changed.set()

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    async def GetDevicePluginOptions(
        self, request: dp.Empty, context: Context
    ) -> dp.DevicePluginOptions:
        self._record("GetDevicePluginOptions")
        return dp.DevicePluginOptions(
            pre_start_required=True, get_preferred_allocation_available=True
        )

    async def ListAndWatch(
        self, request: dp.Empty, context: Context
    ) -> AsyncIterator[dp.ListAndWatchResponse]:
        self._record("ListAndWatch")
        yield dp.ListAndWatchResponse(
            devices=[dp.Device(ID=d, health="Healthy") for d in self.devices]
        )
        await self._stop.wait()

    async def GetPreferredAllocation(
        self, request: dp.PreferredAllocationRequest, context: Context
    ) -> dp.PreferredAllocationResponse:
        out = []
        for req in request.container_requests:
            self._record(
                "GetPreferredAllocation",
                f"size={req.allocation_size} available={sorted(req.available_deviceIDs)} "
                f"must={sorted(req.must_include_deviceIDs)}",
            )
            chosen = list(req.must_include_deviceIDs)
            for device in sorted(req.available_deviceIDs):
                if len(chosen) >= req.allocation_size:
                    break
                if device not in chosen:
                    chosen.append(device)
            out.append(dp.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return dp.PreferredAllocationResponse(container_responses=out)

    async def Allocate(self, request: dp.AllocateRequest, context: Context) -> dp.AllocateResponse:
        out = []
        for req in request.container_requests:
            ids = sorted(req.devices_ids)
            self._record("Allocate", f"devices={ids}")
            out.append(dp.ContainerAllocateResponse(envs={ENV: ",".join(ids)}))
        return dp.AllocateResponse(container_responses=out)

    async def PreStartContainer(
        self, request: dp.PreStartContainerRequest, context: Context
    ) -> dp.PreStartContainerResponse:
        self._record("PreStartContainer", f"devices={sorted(request.devices_ids)}")
        return dp.PreStartContainerResponse()

    async def wait_for(self, name: str, count: int = 1, timeout_s: float = 30.0) -> None:
        with anyio.fail_after(timeout_s):
            while self.names().count(name) < count:
                await self.changed.wait()

    def stop(self) -> None:
        self._stop.set()


@contextlib.asynccontextmanager
async def recording_plugin(
    plugin_dir: Path, resource: str, *, socket: str = "recording.sock", devices: int = 4
) -> AsyncIterator[RecordingPlugin]:
    """The plugin served and registered with the kubelet of ``plugin_dir``."""
    plugin = RecordingPlugin(devices)
    server = grpc.aio.server()
    dp_grpc.add_DevicePluginServicer_to_server(plugin, server)
    path = plugin_dir / socket
    path.unlink(missing_ok=True)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{plugin_dir / 'kubelet.sock'}") as channel:
            await dp_grpc.RegistrationStub(channel).Register(
                dp.RegisterRequest(
                    version="v1beta1",
                    endpoint=socket,
                    resource_name=resource,
                    options=dp.DevicePluginOptions(
                        pre_start_required=True, get_preferred_allocation_available=True
                    ),
                ),
                timeout=10,
            )
        yield plugin
    finally:
        plugin.stop()
        await server.stop(0)
        path.unlink(missing_ok=True)
