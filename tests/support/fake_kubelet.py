"""A fake kubelet that speaks the real device plugin and pod resources gRPC APIs.

Why
---
The device plugin is only correct if a kubelet accepts it, so tests drive it the way
kubelet's device manager does, over unix sockets in a temporary plugin dir, with the
stubs generated from kubelet's own protos:

- serve ``v1beta1.Registration`` on ``<dir>/kubelet.sock`` and record each Register;
- for every registration dial ``<dir>/<endpoint>``, ask ``GetDevicePluginOptions`` and
  consume ``ListAndWatch``
  (latest device list per resource, number of updates, how the stream ended);
- call ``GetDevicePluginOptions``, ``GetPreferredAllocation``, ``Allocate`` and
  ``PreStartContainer`` on demand;
- :meth:`FakeKubelet.restart` does what a kubelet restart does to the dir: the
  registration server goes away, ``kubelet.sock`` and every plugin socket are
  deleted, a new ``kubelet.sock`` appears, and plugins must register again;
- optionally serve ``v1.PodResourcesLister`` (List, GetAllocatableResources, Get) on
  a second socket from a configurable list of :class:`FakePod`.

Layers
------
:func:`running_fake_kubelet` owns an anyio task group for the ListAndWatch
consumers and the gRPC servers; leaving it cancels the consumers and stops the
servers. Every wait is bounded by a timeout.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import grpc
import grpc.aio
from anyio.abc import TaskGroup

from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as dp
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.kubelet_api.podresources.v1 import api_pb2_grpc as pr_grpc

Context = grpc.aio.ServicerContext[Any, Any]
KUBELET_SOCKET = "kubelet.sock"
SUPPORTED_VERSIONS = ("v1beta1",)


@dataclass(frozen=True)
class Registration:
    version: str
    endpoint: str
    resource_name: str
    pre_start_required: bool
    get_preferred_allocation_available: bool


@dataclass
class PluginEndpoint:
    """Kubelet's connection to one registered plugin."""

    registration: Registration
    channel: grpc.aio.Channel
    stub: dp_grpc.DevicePluginAsyncStub
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    devices: list[dp.Device] = field(default_factory=list)
    updates: int = 0
    # time.monotonic_ns() when the latest list arrived (a system-wide clock on Linux,
    # so another process can compare it with its own readings).
    received_ns: int = 0
    # None while the stream runs; OK when the plugin ended it cleanly.
    stream_status: grpc.StatusCode | None = None
    stream_details: str = ""


@dataclass
class FakeContainer:
    name: str
    # resource name -> device IDs
    devices: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class FakePod:
    name: str
    namespace: str = "default"
    containers: list[FakeContainer] = field(default_factory=list)


class _RegistrationService(dp_grpc.RegistrationServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self._kubelet = kubelet

    async def Register(self, request: dp.RegisterRequest, context: Context) -> dp.Empty:
        if request.version not in SUPPORTED_VERSIONS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unsupported device plugin API version {request.version!r}",
            )
        if "/" in request.endpoint or not request.endpoint:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "endpoint must be a file name")
        self._kubelet._on_register(request)
        return dp.Empty()


class _PodResourcesService(pr_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self._kubelet = kubelet

    async def List(
        self, request: pr.ListPodResourcesRequest, context: Context
    ) -> pr.ListPodResourcesResponse:
        self._kubelet.pod_lists += 1  # counted as the answer is made: it holds ``pods`` now
        return pr.ListPodResourcesResponse(
            pod_resources=[_pod_resources(p) for p in self._kubelet.pods]
        )

    async def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: Context
    ) -> pr.AllocatableResourcesResponse:
        return pr.AllocatableResourcesResponse(
            devices=[
                pr.ContainerDevices(
                    resource_name=resource,
                    device_ids=[d.ID for d in ep.devices if d.health == "Healthy"],
                )
                for resource, ep in sorted(self._kubelet.endpoints.items())
            ]
        )

    async def Get(
        self, request: pr.GetPodResourcesRequest, context: Context
    ) -> pr.GetPodResourcesResponse:
        for pod in self._kubelet.pods:
            if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=_pod_resources(pod))
        await context.abort(
            grpc.StatusCode.NOT_FOUND,
            f"pod {request.pod_namespace}/{request.pod_name} not found",
        )


def _pod_resources(pod: FakePod) -> pr.PodResources:
    return pr.PodResources(
        name=pod.name,
        namespace=pod.namespace,
        containers=[
            pr.ContainerResources(
                name=c.name,
                devices=[
                    pr.ContainerDevices(resource_name=r, device_ids=ids)
                    for r, ids in sorted(c.devices.items())
                ],
            )
            for c in pod.containers
        ],
    )


class FakeKubelet:
    """Create with :func:`running_fake_kubelet`."""

    def __init__(
        self,
        plugin_dir: Path,
        tg: TaskGroup,
        *,
        pod_resources_socket: Path | None = None,
        pods: Sequence[FakePod] = (),
    ) -> None:
        self.plugin_dir = plugin_dir
        self.socket_path = plugin_dir / KUBELET_SOCKET
        self.pod_resources_socket = pod_resources_socket
        self.pods: list[FakePod] = list(pods)
        self.registrations: list[Registration] = []
        self.endpoints: dict[str, PluginEndpoint] = {}
        self.restarts = 0
        # PodResources List calls answered (a test waits on it rather than on time).
        self.pod_lists = 0
        self._tg = tg
        self._changed = anyio.Event()
        self._registration_server: grpc.aio.Server | None = None
        self._pod_resources_server: grpc.aio.Server | None = None

    # --- lifecycle -------------------------------------------------------------------

    async def _start(self) -> None:
        await self._start_registration()
        if self.pod_resources_socket is not None:
            server = grpc.aio.server()
            pr_grpc.add_PodResourcesListerServicer_to_server(_PodResourcesService(self), server)
            self.pod_resources_socket.unlink(missing_ok=True)
            server.add_insecure_port(f"unix://{self.pod_resources_socket}")
            await server.start()
            self._pod_resources_server = server

    async def _start_registration(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        server = grpc.aio.server()
        dp_grpc.add_RegistrationServicer_to_server(_RegistrationService(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._registration_server = server

    async def _stop_registration(self) -> None:
        server, self._registration_server = self._registration_server, None
        if server is not None:
            await server.stop(0)
        for ep in self.endpoints.values():
            ep.scope.cancel()
        self.endpoints.clear()

    async def _close(self) -> None:
        await self._stop_registration()
        if self._pod_resources_server is not None:
            await self._pod_resources_server.stop(0)
            self._pod_resources_server = None

    async def restart(self, *, timeout_s: float = 10.0, delete_plugin_sockets: bool = True) -> None:
        """Restart like kubelet does, then wait until every plugin registered again."""
        expected = {r: self.registration_count(r) + 1 for r in self.endpoints}
        await self._stop_registration()
        self.socket_path.unlink(missing_ok=True)
        if delete_plugin_sockets:
            # Kubelet's device manager empties its dir on start, plugin sockets included.
            for path in self.plugin_dir.iterdir():
                if path.name != KUBELET_SOCKET and path.is_socket():
                    path.unlink(missing_ok=True)
        await self._start_registration()
        self.restarts += 1
        self._notify()
        await self._wait(
            lambda: all(self.registration_count(r) >= n for r, n in expected.items()),
            timeout_s,
            f"re-registration of {sorted(expected)}",
        )

    # --- registration and ListAndWatch -------------------------------------------------

    def _on_register(self, request: dp.RegisterRequest) -> None:
        reg = Registration(
            version=request.version,
            endpoint=request.endpoint,
            resource_name=request.resource_name,
            pre_start_required=request.options.pre_start_required,
            get_preferred_allocation_available=request.options.get_preferred_allocation_available,
        )
        self.registrations.append(reg)
        old = self.endpoints.pop(reg.resource_name, None)
        if old is not None:
            # Kubelet drops the previous endpoint of a resource that registers again.
            old.scope.cancel()
        channel = grpc.aio.insecure_channel(f"unix://{self.plugin_dir / reg.endpoint}")
        ep = PluginEndpoint(
            registration=reg, channel=channel, stub=dp_grpc.DevicePluginStub(channel)
        )
        self.endpoints[reg.resource_name] = ep
        self._tg.start_soon(self._list_and_watch, ep)
        self._notify()

    async def _list_and_watch(self, ep: PluginEndpoint) -> None:
        try:
            with ep.scope:
                # As the real kubelet's device manager does on connecting (v1.37.2,
                # tests/node/test_node_differential.py): the options first, then the
                # stream. A plugin that cannot answer them is not listed.
                try:
                    await ep.stub.GetDevicePluginOptions(dp.Empty(), timeout=10)
                except grpc.aio.AioRpcError as exc:
                    ep.stream_status = exc.code()
                    ep.stream_details = exc.details() or ""
                    return
                call = ep.stub.ListAndWatch(dp.Empty())
                try:
                    async for response in call:
                        ep.received_ns = time.monotonic_ns()
                        ep.devices = list(response.devices)
                        ep.updates += 1
                        self._notify()
                    ep.stream_status = await call.code()
                    ep.stream_details = await call.details() or ""
                except grpc.aio.AioRpcError as exc:
                    ep.stream_status = exc.code()
                    ep.stream_details = exc.details() or ""
                finally:
                    call.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await ep.channel.close(None)
            self._notify()

    # --- queries -----------------------------------------------------------------------

    def registration_count(self, resource: str) -> int:
        return sum(1 for r in self.registrations if r.resource_name == resource)

    def endpoint(self, resource: str) -> PluginEndpoint:
        try:
            return self.endpoints[resource]
        except KeyError:
            raise AssertionError(f"{resource} is not registered") from None

    def devices(self, resource: str) -> list[dp.Device]:
        return list(self.endpoint(resource).devices)

    async def wait_registered(
        self, resource: str, *, count: int = 1, timeout_s: float = 5.0
    ) -> Registration:
        await self._wait(
            lambda: self.registration_count(resource) >= count and resource in self.endpoints,
            timeout_s,
            f"registration #{count} of {resource}",
        )
        return self.endpoints[resource].registration

    async def wait_devices(
        self,
        resource: str,
        predicate: Callable[[list[dp.Device]], bool] = lambda devices: True,
        *,
        timeout_s: float = 5.0,
    ) -> list[dp.Device]:
        """Wait for a ListAndWatch list of ``resource`` that satisfies ``predicate``."""

        def ready() -> bool:
            ep = self.endpoints.get(resource)
            return ep is not None and ep.updates > 0 and predicate(ep.devices)

        await self._wait(ready, timeout_s, f"a matching device list of {resource}")
        return self.devices(resource)

    async def wait_stream_end(self, resource: str, *, timeout_s: float = 5.0) -> grpc.StatusCode:
        ep = self.endpoint(resource)
        await self._wait(
            lambda: ep.stream_status is not None, timeout_s, f"end of {resource} ListAndWatch"
        )
        assert ep.stream_status is not None
        return ep.stream_status

    # --- kubelet -> plugin calls -------------------------------------------------------

    async def options(self, resource: str, *, timeout_s: float = 5.0) -> dp.DevicePluginOptions:
        return await self.endpoint(resource).stub.GetDevicePluginOptions(
            dp.Empty(), timeout=timeout_s
        )

    async def preferred(
        self,
        resource: str,
        requests: Sequence[tuple[Sequence[str], Sequence[str], int]],
        *,
        timeout_s: float = 5.0,
    ) -> list[list[str]]:
        """``requests``: (available, must_include, size) per container."""
        response = await self.endpoint(resource).stub.GetPreferredAllocation(
            dp.PreferredAllocationRequest(
                container_requests=[
                    dp.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available,
                        must_include_deviceIDs=must,
                        allocation_size=size,
                    )
                    for available, must, size in requests
                ]
            ),
            timeout=timeout_s,
        )
        return [list(c.deviceIDs) for c in response.container_responses]

    async def allocate(
        self, resource: str, container_requests: Sequence[Sequence[str]], *, timeout_s: float = 30.0
    ) -> dp.AllocateResponse:
        return await self.endpoint(resource).stub.Allocate(
            dp.AllocateRequest(
                container_requests=[
                    dp.ContainerAllocateRequest(devices_ids=ids) for ids in container_requests
                ]
            ),
            timeout=timeout_s,
        )

    async def pre_start(
        self, resource: str, device_ids: Sequence[str], *, timeout_s: float = 30.0
    ) -> dp.PreStartContainerResponse:
        return await self.endpoint(resource).stub.PreStartContainer(
            dp.PreStartContainerRequest(devices_ids=device_ids), timeout=timeout_s
        )

    async def admit(
        self, resource: str, count: int, *, timeout_s: float = 30.0
    ) -> dp.AllocateResponse:
        """One container of a new pod asking ``count`` devices of ``resource``, as the
        real kubelet's device manager admits and starts it (v1.37.2, recorded by
        tests/node/test_node_differential.py): GetPreferredAllocation over the healthy
        devices when the plugin registered it available, Allocate of the devices chosen,
        then PreStartContainer of them when the plugin registered it required."""
        ep = self.endpoint(resource)
        healthy = sorted(d.ID for d in self.devices(resource) if d.health == "Healthy")
        chosen = healthy[:count]
        if ep.registration.get_preferred_allocation_available:
            [chosen] = await self.preferred(resource, [(healthy, [], count)], timeout_s=timeout_s)
        answer = await self.allocate(resource, [chosen], timeout_s=timeout_s)
        if ep.registration.pre_start_required:
            await self.pre_start(resource, chosen, timeout_s=timeout_s)
        return answer

    # --- waiting -----------------------------------------------------------------------

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    async def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        try:
            with anyio.fail_after(timeout_s):
                while True:
                    changed = self._changed
                    if ready():
                        return
                    await changed.wait()
        except TimeoutError:
            raise AssertionError(f"fake kubelet: no {what} within {timeout_s} s") from None


@contextlib.asynccontextmanager
async def running_fake_kubelet(
    plugin_dir: Path,
    *,
    pod_resources_socket: Path | None = None,
    pods: Sequence[FakePod] = (),
) -> AsyncIterator[FakeKubelet]:
    async with anyio.create_task_group() as tg:
        kubelet = FakeKubelet(plugin_dir, tg, pod_resources_socket=pod_resources_socket, pods=pods)
        try:
            await kubelet._start()
            yield kubelet
        finally:
            with anyio.CancelScope(shield=True):
                await kubelet._close()
            tg.cancel_scope.cancel()
