"""The whole allocation path, for tests and benches: fake kubelet, plugin, NATS, allocator.

Why
---
The allocator is only right if kubelet's calls come out right at the other end, so
tests run the real services the way ``gpulet`` runs them in sidecars: a real
nats-server, the real :class:`~gpulet_allocator.service.AllocatorService` and
:class:`~gpulet_allocator.kubelet.deviceplugin.service.DevicePluginService`, each with its own NATS
connection, and the fake kubelet driving the plugin's sockets. A stand-in collector
answers inventory requests and publishes inventories; each GPU's health state is
written into the ``gpu_health`` KV bucket as the health service would
(:mod:`support.health_kv`).

Layers
------
:func:`allocator_stack` owns one task group; every service runs in its own cancel
scope so a test can stop and restart the allocator alone (:meth:`Stack.stop_allocator`,
:meth:`Stack.start_allocator`). Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import grpc
import msgspec

from gpulet_allocator import protocol as p
from gpulet_allocator.kubelet.deviceplugin.service import DevicePluginService
from gpulet_allocator.protocol import ResourceKind, ResourceSpec, resource_specs
from gpulet_allocator.service import AllocatorService
from gpulet_collector.service import CollectorService
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, Delivery
from gpulet_common.codec import Codec
from gpulet_common.lifecycle import Service
from gpulet_common.messages import Inventory, InventoryRequest
from gpulet_common.mock_control import MockControlService
from gpulet_common.nvml.adapter import NvmlAdapter
from gpulet_common.runtime import Runtime
from gpulet_common.settings import Settings
from gpulet_common.settings.allocator import AllocatorSettings, PluginConfig
from gpulet_common.settings.nats import NatsSettings
from gpulet_common.telemetry import StatusBoard
from support.agent import runtime_for
from support.fake_kubelet import FakeKubelet, FakePod, running_fake_kubelet
from support.health_kv import gpu_health, health_bucket, put_health
from support.metrics import MetricsProbe

NODE = "node-a.example"
GPU = "nvidia.com/gpu"
CORE = "gpulet.io/gpu-core"
MEM = "gpulet.io/gpu-memory"
RESOURCES = (GPU, CORE, MEM)

Q = TypeVar("Q")
R = TypeVar("R")


def make_settings(
    nats_url: str,
    state_dir: Path,
    plugin_dir: Path,
    dev_root: Path,
    *,
    pod_resources_socket: Path | None = None,
    allocator: dict[str, Any] | None = None,
    plugin: dict[str, Any] | None = None,
) -> Settings:
    plugin_config = PluginConfig(
        plugin_dir=str(plugin_dir),
        dev_root=str(dev_root),
        backend_timeout_s=2.0,
        watch_interval_s=0.05,
        register_backoff_initial_s=0.05,
        register_backoff_max_s=0.2,
        register_timeout_s=1.0,
        stop_grace_s=0.2,
    )
    if plugin:
        plugin_config = msgspec.structs.replace(plugin_config, **plugin)
    allocator_settings = AllocatorSettings(
        request_timeout_s=1.0,
        pod_resources_socket=str(pod_resources_socket or state_dir / "no-pod-resources.sock"),
        release_interval_s=0.1,
        release_grace_s=0.3,
        request_retry_s=0.1,
        plugin=plugin_config,
    )
    if allocator:
        allocator_settings = msgspec.structs.replace(allocator_settings, **allocator)
    return Settings(
        node_name=NODE,
        state_dir=str(state_dir),
        nats=NatsSettings(url=nats_url, reconnect_wait_s=0.05, request_timeout_s=1.0),
        allocator=allocator_settings,
    )


def served(settings: Settings) -> list[ResourceSpec]:
    """The resources the plugin registers with these settings."""
    plugin = settings.allocator.plugin
    return resource_specs(plugin.resources, shares=plugin.shares, profile=plugin.profile)


def dev_root_with(path: Path, gpus: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in ["nvidiactl", "nvidia-uvm", *(f"nvidia{i}" for i in range(gpus))]:
        (path / name).touch()
    return path


def ids(stack: Stack, resource: str) -> list[str]:
    """The device IDs kubelet was last told of for ``resource``."""
    return [d.ID for d in stack.kubelet.devices(resource)]


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, *, timeout_s: float = 5.0
) -> None:
    """Poll an async condition (conditions spread over services share no event)."""
    deadline = anyio.current_time() + timeout_s
    while anyio.current_time() < deadline:
        if await check():
            return
        await anyio.sleep(0.02)
    if not await check():
        raise AssertionError(f"timed out waiting for {what}")


@dataclass
class _Running:
    service: Service
    scope: anyio.CancelScope
    done: anyio.Event = field(default_factory=anyio.Event)


class Stack:
    def __init__(
        self,
        settings: Settings,
        tg: anyio.abc.TaskGroup,
        bus: Bus,
        kubelet: FakeKubelet,
        exit_stack: contextlib.AsyncExitStack,
    ) -> None:
        self.settings = settings
        self.node = settings.node_name
        self.bus = bus
        self.kubelet = kubelet
        self.inventory: Inventory | None = None
        self.status = StatusBoard()
        #: Every service's metrics.
        self.metrics = MetricsProbe()
        self._tg = tg
        self._exits = exit_stack
        self._running: dict[str, _Running] = {}
        self.allocator: AllocatorService | None = None
        self.plugin: DevicePluginService | None = None

    # --- services ------------------------------------------------------------------------

    async def _runtime(self, name: str) -> Runtime:
        return await self._exits.enter_async_context(
            runtime_for(
                self.settings, meter=self.metrics.meter, status=self.status, name=f"test-{name}"
            )
        )

    async def _start(self, name: str, service: Service) -> None:
        running = _Running(service, anyio.CancelScope())

        async def run(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            try:
                with running.scope:
                    await service.run(task_status=task_status)
            finally:
                running.done.set()

        self._running[name] = running
        with anyio.fail_after(10):
            await self._tg.start(run)

    async def _stop(self, name: str) -> None:
        running = self._running.pop(name)
        running.scope.cancel()
        with anyio.fail_after(5):
            await running.done.wait()

    async def start_allocator(self) -> AllocatorService:
        service = AllocatorService(await self._runtime("allocator"))
        await self._start("allocator", service)
        self.allocator = service
        return service

    async def stop_allocator(self) -> None:
        await self._stop("allocator")
        self.allocator = None

    async def start_collector(self, adapter: NvmlAdapter) -> CollectorService:
        """The real collector (and the mock control endpoint) on ``adapter``'s NVML."""
        runtime = await self._exits.enter_async_context(
            runtime_for(
                self.settings,
                adapter=adapter,
                meter=self.metrics.meter,
                status=self.status,
                name="test-collector",
            )
        )
        await self._start("mock-control", MockControlService(runtime))
        service = CollectorService(runtime)
        await self._start("collector", service)
        return service

    async def start_plugin(self) -> DevicePluginService:
        service = DevicePluginService(await self._runtime("plugin"))
        await self._start("plugin", service)
        self.plugin = service
        return service

    # --- the world around them -------------------------------------------------------------

    async def publish_inventory(self, inventory: Inventory) -> None:
        self.inventory = msgspec.structs.replace(
            inventory, node=self.node, published_at=time.time()
        )
        await self.bus.publish(subjects.inventory(self.node), self.inventory, codec.INVENTORY)
        await self.bus.flush()

    async def serve_inventory(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """The collector's inventory endpoint, answering with the last inventory."""

        async def answer(_request: Delivery[InventoryRequest]) -> Inventory:
            if self.inventory is None:
                raise RuntimeError("no inventory yet")
            return self.inventory

        await self.bus.serve(
            subjects.inventory_request(self.node),
            answer,
            codec.INVENTORY_REQUEST,
            codec.INVENTORY,
            task_status=task_status,
        )

    async def publish_health(self, gpu_uuid: str, *, healthy: bool) -> None:
        """The GPU's state in the health service's KV bucket (an XID 79, or none)."""
        await put_health(self.bus, self.node, gpu_health(gpu_uuid, healthy=healthy))

    async def ask(
        self, endpoint: str, value: Q, request: Codec[Q], reply: Codec[R], *, timeout_s: float = 2.0
    ) -> R:
        return await self.bus.request(
            subjects.allocator_endpoint(self.node, endpoint),
            value,
            request,
            reply,
            timeout_s=timeout_s,
        )

    async def state(self) -> p.StateReply:
        return await self.ask(p.ENDPOINT_STATE, p.StateRequest(), p.STATE_REQUEST, p.STATE_REPLY)

    async def wait_for(
        self, predicate: Callable[[], bool], what: str, *, timeout_s: float = 5.0
    ) -> None:
        # Polling: the conditions live in several services with no common event.
        deadline = anyio.current_time() + timeout_s
        while anyio.current_time() < deadline:
            if predicate():
                return
            await anyio.sleep(0.01)
        if not predicate():
            raise AssertionError(f"timed out waiting for {what}")

    async def wait_listed(self, inventory: Inventory) -> None:
        """Until kubelet has the device lists of ``inventory`` for every resource."""
        n = len(inventory.gpus)
        for spec in served(self.settings):
            if spec.kind is ResourceKind.WHOLE:
                await self.kubelet.wait_devices(spec.name, lambda d: len(d) == n, timeout_s=5)
            elif spec.kind is ResourceKind.MEMORY:
                await self.kubelet.wait_devices(
                    spec.name, lambda d: len(d) > 0 or n == 0, timeout_s=5
                )
            else:
                await self.kubelet.wait_devices(spec.name, lambda d: len(d) == 100 * n, timeout_s=5)

    async def wait_allocator_ready(self) -> None:
        await self.wait_for(
            lambda: self.allocator is not None and self.allocator.core.ready,
            "the allocator to have an inventory",
        )


@contextlib.asynccontextmanager
async def allocator_stack(
    settings: Settings,
    *,
    inventory: Inventory | None,
    pods: Sequence[FakePod] = (),
    pod_resources: bool = False,
    start_allocator: bool = True,
    start_plugin: bool = True,
    stand_in_collector: bool = True,
) -> AsyncIterator[Stack]:
    """Everything running, the plugin registered for every resource.

    ``stand_in_collector=False``: nothing answers inventory requests; the test runs the
    real collector (:meth:`Stack.start_collector`) before the allocator.
    """
    plugin_dir = Path(settings.allocator.plugin.plugin_dir)
    socket = Path(settings.allocator.pod_resources_socket) if pod_resources else None
    async with (
        contextlib.AsyncExitStack() as exits,
        Bus.connect(settings.nats, name="test-world", max_initial_attempts=5) as bus,
        running_fake_kubelet(plugin_dir, pod_resources_socket=socket, pods=pods) as kubelet,
        anyio.create_task_group() as tg,
    ):
        stack = Stack(settings, tg, bus, kubelet, exits)
        try:
            await health_bucket(bus)  # as a running health service would have it
            if stand_in_collector:
                await tg.start(stack.serve_inventory)
            if inventory is not None:
                await stack.publish_inventory(inventory)
            if start_allocator:
                await stack.start_allocator()
                if inventory is not None:
                    await stack.wait_allocator_ready()
            if start_plugin:
                await stack.start_plugin()
                for spec in served(settings):
                    await kubelet.wait_registered(spec.name, timeout_s=5)
                if inventory is not None:
                    await stack.wait_listed(inventory)
            yield stack
        finally:
            for name in list(stack._running):
                with anyio.CancelScope(shield=True):
                    await stack._stop(name)
            tg.cancel_scope.cancel()


async def rpc_error(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    """The gRPC error a call that must be refused ends with."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call succeeded")
