"""The kubelet ``DevicePlugin`` gRPC service of one resource, and its socket.

Why
---
Kubelet talks to one plugin endpoint per resource, so each resource gets its own
grpc.aio server on its own unix socket (``gpulet-<resource>.sock``, mode 0600:
whoever can connect can ask for GPUs). The service itself stays thin:

- ``ListAndWatch`` follows a :class:`~.devicelist.DeviceListSource` and sends the full
  list first and then after every change of that resource's list; it returns (status
  OK) as soon as the server stops instead of being cut off by the grace timeout. The
  list is encoded GPU by GPU and cached (:mod:`.wire`), so a change on one GPU does not
  rebuild the thousands of share devices of the others on the event loop.
- ``Allocate`` and ``GetPreferredAllocation`` are delegated to an
  :class:`~.backend.AllocationBackend` under a deadline, so kubelet never hangs on
  the allocator. Every failure is one of :mod:`gpulet_common.refusal`'s tree and
  becomes, here and only here, the gRPC status its code has in the one table
  (:data:`~gpulet_common.refusal.STATUS`). A ``GetPreferredAllocation`` that fails
  without a refusal (``UNAVAILABLE``, ``INTERNAL``) falls back to a local choice (it
  is only a hint, and an error there fails pod admission for the whole node).
- Device specs are added here, from the GPUs the backend chose, only for device
  files that exist (:mod:`.devnodes`).

Layers
------
:class:`KubeletServicer` is the servicer (protocol translation only),
:class:`ResourceServer` owns the gRPC server and socket file of one resource.
Registration with kubelet and restarts are :mod:`.manager`'s business.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import grpc
import grpc.aio

from gpulet_allocator.kubelet.deviceplugin.backend import AllocationBackend
from gpulet_allocator.kubelet.deviceplugin.config import PluginConfig
from gpulet_allocator.kubelet.deviceplugin.devicelist import DeviceListSource, DeviceSnapshot
from gpulet_allocator.kubelet.deviceplugin.devnodes import DeviceNodes
from gpulet_allocator.kubelet.deviceplugin.metrics import PluginMetrics
from gpulet_allocator.kubelet.deviceplugin.resources import (
    PluginGpu,
    PluginMig,
    build_devices,
)
from gpulet_allocator.kubelet.deviceplugin.wire import ListEncoder
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as pb
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpulet_allocator.protocol import (
    ContainerAllocation,
    DeviceSpec,
    PreferredRequest,
    ResourceSpec,
)
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.refusal import BusError, Refused, RequestTimeout, bounded, one_line, status_of

log = logging.getLogger(__name__)
# Once per kubelet request that fails or falls back: rate-limited.
_rpc_log = RateLimitedLog(log, per_minute=20)

T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]

SOCKET_MODE = 0o600

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def socket_name(prefix: str, resource: str) -> str:
    """``gpulet-nvidia.com-gpu.sock`` for ``nvidia.com/gpu``."""
    return f"{prefix}-{_UNSAFE.sub('-', resource).strip('-')}.sock"


def plugin_options(spec: ResourceSpec) -> pb.DevicePluginOptions:
    return pb.DevicePluginOptions(
        pre_start_required=False,
        get_preferred_allocation_available=spec.preferred_allocation,
    )


def grpc_status(failure: BusError) -> grpc.StatusCode:
    """Kubelet's status for ``failure``: its code's, in the one table."""
    return grpc.StatusCode[status_of(failure.code).grpc]


def _details(rpc: str, failure: BusError) -> str:
    """What kubelet shows: a refusal as ``code: message``, else what went wrong."""
    if isinstance(failure, Refused):
        return str(failure)
    return f"{rpc}: allocator unavailable: {failure}"


_NO_REFUSAL = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL})


@dataclass(slots=True)
class StreamStop:
    """Ends the ``ListAndWatch`` streams of a server that is stopping."""

    stopped: bool = False
    waiting: set[anyio.CancelScope] = field(default_factory=set)

    def stop(self) -> None:
        self.stopped = True
        for scope in list(self.waiting):
            scope.cancel()


@dataclass(frozen=True, slots=True)
class ServerParts:
    """What serving one resource needs: the resource, where its devices come from, who
    decides, the settings, the device files and the metrics."""

    spec: ResourceSpec
    source: DeviceListSource
    backend: AllocationBackend
    config: PluginConfig
    nodes: DeviceNodes
    metrics: PluginMetrics


class KubeletServicer(pb_grpc.DevicePluginServicer):
    """``v1beta1.DevicePlugin`` for one resource."""

    def __init__(self, parts: ServerParts, stop: StreamStop) -> None:
        self._spec = parts.spec
        self._source = parts.source
        self._backend = parts.backend
        self._config = parts.config
        self._nodes = parts.nodes
        self._stop = stop
        self._metrics = parts.metrics
        self._encoder = ListEncoder(parts.spec)
        self._gpus_of: DeviceSnapshot | None = None
        self._gpus_by_uuid: dict[str, PluginGpu] = {}
        self._migs: dict[str, PluginMig] = {}

    # --- kubelet-facing RPCs -------------------------------------------------------

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: Context
    ) -> pb.DevicePluginOptions:
        return plugin_options(self._spec)

    async def ListAndWatch(
        self, request: pb.Empty, context: Context
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        snapshot: DeviceSnapshot | None = self._source.snapshot()
        sent: bytes | None = None
        while snapshot is not None:
            # Encoded GPU by GPU and cached (:mod:`.wire`): a change rebuilds only the
            # devices of the GPU that changed.
            listed = self._encoder.encode(snapshot.gpus)
            # Other resources' changes move the version too; kubelet needs only ours.
            if listed != sent:
                yield pb.ListAndWatchResponse.FromString(listed)
                sent = listed
            snapshot = await self._next_change(snapshot.version)
        log.debug("ListAndWatch of %s ends: plugin stopping", self._spec.name)

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Context
    ) -> pb.PreferredAllocationResponse:
        requests = [
            PreferredRequest(
                available=list(c.available_deviceIDs),
                must_include=list(c.must_include_deviceIDs),
                size=c.allocation_size,
            )
            for c in request.container_requests
        ]
        started = time.perf_counter()
        try:
            answers = await self._call_backend(
                "GetPreferredAllocation",
                lambda: self._backend.preferred(self._spec.name, requests),
            )
            _check_preferences(requests, answers)
        except BusError as failure:
            status = grpc_status(failure)
            details = _details("GetPreferredAllocation", failure)
            if not (status in _NO_REFUSAL and self._config.preferred_fallback):
                self._observe("GetPreferredAllocation", status, started)
                await context.abort(status, details)
            _rpc_log.warning(
                "GetPreferredAllocation for %s answered locally: %s",
                self._spec.name,
                bounded(one_line(details)),
            )
            self._metrics.fallback(self._spec.name)
            answers = self._fallback_preferred(requests)
        self._observe("GetPreferredAllocation", grpc.StatusCode.OK, started)
        return pb.PreferredAllocationResponse(
            container_responses=[
                pb.ContainerPreferredAllocationResponse(deviceIDs=a) for a in answers
            ]
        )

    async def Allocate(self, request: pb.AllocateRequest, context: Context) -> pb.AllocateResponse:
        started = time.perf_counter()
        container_requests = [list(c.devices_ids) for c in request.container_requests]
        try:
            allocations = await self._call_backend(
                "Allocate",
                lambda: self._backend.allocate(self._spec.name, container_requests),
            )
            _check_count(len(allocations), len(container_requests))
            gpus = self._gpus()
            responses = [self._container_response(a, gpus) for a in allocations]
        except BusError as failure:
            # Counts, not the IDs: a request may be megabytes (the caller's, bounded here).
            _rpc_log.warning(
                "Allocate of %s for %d container(s) (%d IDs) failed: %s",
                self._spec.name,
                len(container_requests),
                sum(len(c) for c in container_requests),
                bounded(one_line(str(failure))),
            )
            status = grpc_status(failure)
            self._observe("Allocate", status, started)
            await context.abort(status, _details("Allocate", failure))
        self._observe("Allocate", grpc.StatusCode.OK, started)
        return pb.AllocateResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Context
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    # --- helpers -------------------------------------------------------------------

    def _observe(self, rpc: str, code: grpc.StatusCode, started: float) -> None:
        self._metrics.call(rpc, self._spec.name, code, time.perf_counter() - started)

    def _gpus(self) -> dict[str, PluginGpu]:
        """The node's GPUs by UUID (and by the UUID of each MIG device offered, with the
        MIG device), rebuilt only when the snapshot changed."""
        snapshot = self._source.snapshot()
        if snapshot is not self._gpus_of:
            self._gpus_by_uuid = {g.uuid: g for g in snapshot.gpus}
            self._migs = {m.uuid: m for g in snapshot.gpus for m in g.mig}
            self._gpus_by_uuid.update(
                {
                    m.uuid: g
                    for g in snapshot.gpus
                    for m in g.mig
                    if m.uuid not in self._gpus_by_uuid
                }
            )
            self._gpus_of = snapshot
        return self._gpus_by_uuid

    async def _next_change(self, version: int) -> DeviceSnapshot | None:
        """The next snapshot, or None once the server is stopping.

        Waited for in this task, under a cancel scope the server's stop cancels: no
        helper task per change, whose start and cancellation cost the stream two more
        turns of a busy event loop before kubelet heard of a GPU turning unhealthy.
        """
        stop = self._stop
        if stop.stopped:
            return None
        with anyio.CancelScope() as scope:
            stop.waiting.add(scope)
            try:
                return await self._source.wait_for_change(version)
            finally:
                stop.waiting.discard(scope)
        return None

    async def _call_backend(self, rpc: str, call: Callable[[], Awaitable[list[T]]]) -> list[T]:
        timeout = self._config.backend_timeout_s
        try:
            with anyio.fail_after(timeout):
                return await call()
        except TimeoutError as exc:
            raise RequestTimeout(f"did not answer within {timeout:g} s") from exc
        except BusError:
            raise
        except Exception as exc:
            _rpc_log.exception("%s backend for %s failed", rpc, self._spec.name)
            detail = f"{rpc}: allocator backend error: {type(exc).__name__}: {exc}"
            raise Refused("internal", detail) from exc

    def _container_response(
        self, allocation: ContainerAllocation, gpus: dict[str, PluginGpu]
    ) -> pb.ContainerAllocateResponse:
        minors: list[int] = []
        caps: list[DeviceSpec] = []
        for uuid in allocation.gpus:
            gpu = gpus.get(uuid)
            if gpu is None:
                raise Refused(
                    "inventory_mismatch",
                    f"allocator chose GPU {uuid}, which this node's inventory does not list",
                )
            if gpu.minor is not None:
                minors.append(gpu.minor)
                if (mig := self._migs.get(uuid)) is not None:
                    caps += self._nodes.mig_specs(
                        gpu.minor, mig.gpu_instance_id, mig.compute_instance_id
                    )
        specs: list[DeviceSpec] = []
        if self._config.pass_device_specs:
            specs.extend(self._nodes.specs_for_gpus(minors))
            specs.extend(caps)
        specs.extend(self._nodes.existing(allocation.devices))
        unique: dict[str, DeviceSpec] = {}
        for spec in specs:
            unique.setdefault(spec.container_path, spec)
        return pb.ContainerAllocateResponse(
            envs=allocation.envs,
            mounts=[
                pb.Mount(
                    container_path=m.container_path, host_path=m.host_path, read_only=m.read_only
                )
                for m in allocation.mounts
            ],
            devices=[
                pb.DeviceSpec(
                    container_path=s.container_path,
                    host_path=s.host_path,
                    permissions=s.permissions,
                )
                for s in unique.values()
            ],
            annotations=allocation.annotations,
            cdi_devices=[pb.CDIDevice(name=n) for n in allocation.cdi_devices],
        )

    def _fallback_preferred(self, requests: Sequence[PreferredRequest]) -> list[list[str]]:
        numa = {
            d.id: d.numa_node
            for d in build_devices(self._spec.kind, self._source.snapshot().gpus, self._spec.name)
        }
        return [fallback_preference(r, numa) for r in requests]


def _check_count(answered: int, asked: int) -> None:
    if answered != asked:
        raise Refused("malformed_reply", f"allocator answered {answered} containers for {asked}")


def _check_preferences(requests: Sequence[PreferredRequest], answers: Sequence[list[str]]) -> None:
    _check_count(len(answers), len(requests))
    for request, answer in zip(requests, answers, strict=True):
        if problem := _invalid_preference(request, answer):
            raise Refused(
                "malformed_reply", f"allocator gave an invalid preferred allocation: {problem}"
            )


def _invalid_preference(request: PreferredRequest, answer: Sequence[str]) -> str | None:
    allowed = set(request.available) | set(request.must_include)
    if len(answer) != request.size:
        return f"{len(answer)} devices instead of {request.size}"
    if len(set(answer)) != len(answer):
        return "duplicate devices"
    if unknown := [d for d in answer if d not in allowed]:
        return f"devices not available: {unknown}"
    if missing := [d for d in request.must_include if d not in answer]:
        return f"required devices missing: {missing}"
    return None


def fallback_preference(request: PreferredRequest, numa: dict[str, int | None]) -> list[str]:
    """A local best effort: the required devices, then one NUMA node if possible."""
    chosen = list(dict.fromkeys(request.must_include))[: max(request.size, 0)]
    need = request.size - len(chosen)
    rest = [d for d in dict.fromkeys(request.available) if d not in chosen]
    if need <= 0:
        return chosen
    by_node: dict[int | None, list[str]] = {}
    for d in rest:
        by_node.setdefault(numa.get(d), []).append(d)
    anchor = {numa.get(d) for d in chosen}
    # Prefer the node of the required devices, then the fullest node that fits the
    # rest, so a request that fits in one NUMA node does not span two.
    candidates = sorted(
        by_node.items(),
        key=lambda kv: (kv[0] not in anchor, len(kv[1]) < need, -len(kv[1])),
    )
    ordered = [d for _, devs in candidates for d in devs]
    return chosen + ordered[:need]


class ResourceServer:
    """The gRPC server and socket file of one resource; restartable."""

    def __init__(self, parts: ServerParts) -> None:
        self.spec = spec = parts.spec
        self._parts = parts
        config = parts.config
        self._config = config
        self.endpoint = socket_name(config.socket_prefix, spec.name)
        self.socket_path = Path(config.plugin_dir) / self.endpoint
        self._server: grpc.aio.Server | None = None
        self._stop: StreamStop | None = None
        self._socket_id: tuple[int, int] | None = None

    @property
    def running(self) -> bool:
        return self._server is not None

    def socket_intact(self) -> bool:
        """Whether our socket file is still there (kubelet deletes it on restart)."""
        try:
            st = self.socket_path.lstat()
        except FileNotFoundError:
            return False
        return stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self._socket_id

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError(f"{self.endpoint} is already serving")
        # A leftover from a previous run makes bind fail with EADDRINUSE.
        self.socket_path.unlink(missing_ok=True)
        self._stop = StreamStop()
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(
            KubeletServicer(self._parts, self._stop),
            server,
        )
        server.add_insecure_port(f"unix://{self.socket_path}")
        # gRPC binds in add_insecure_port but accepts only after start(), so nobody
        # can connect before the mode is tightened.
        os.chmod(self.socket_path, SOCKET_MODE)
        st = self.socket_path.lstat()
        self._socket_id = (st.st_dev, st.st_ino)
        await server.start()
        self._server = server
        log.info("serving %s on %s", self.spec.name, self.socket_path)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        if self._stop is not None:
            self._stop.stop()
        await server.stop(self._config.stop_grace_s)
        # gRPC unlinks the path on stop, but only remove what is still ours.
        if self.socket_intact():
            self.socket_path.unlink(missing_ok=True)
        self._socket_id = None
        log.info("stopped serving %s", self.spec.name)

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    def register_request(self) -> pb.RegisterRequest:
        return pb.RegisterRequest(
            version="v1beta1",
            endpoint=self.endpoint,
            resource_name=self.spec.name,
            options=plugin_options(self.spec),
        )
