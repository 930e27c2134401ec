"""``DRAResourceHealth.NodeWatchResources`` (KEP-4680), in every version kubelet dials.

kubelet opens the stream on the plugin's DRA socket and keeps it open; each message
is the complete list of the driver's devices with their health (``HEALTHY``,
``UNHEALTHY`` or ``UNKNOWN``), the time it was last determined and a message. A
device missing from the list turns ``Unknown`` after kubelet's timeout, so every
message lists every device. We send the list when the stream opens and again on every
change of the :class:`~.contract.HealthSource`, and never end the stream ourselves
(kubelet retries a closed stream every 5 s; an Unimplemented answer makes it retry
for ever). The same servicer serves ``v1alpha1`` (what the Go helper advertises),
``v1beta1`` and ``v1``: their messages differ only in the fields v1alpha1 lacks.

:class:`NodeViewHealth` is the production source: the node read model, the one the
device plugin's ListAndWatch and the slices' taints read too.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from types import ModuleType
from typing import Any, Final

import anyio
import grpc.aio

from gpulet_allocator.kubelet.dra.contract import (
    DeviceHealth,
    Health,
    HealthSource,
    ReservedDevice,
)
from gpulet_common.dra.mig import targets
from gpulet_common.kubelet_api.dra_health.v1 import api_pb2 as health_v1
from gpulet_common.kubelet_api.dra_health.v1 import api_pb2_grpc as health_v1_grpc
from gpulet_common.kubelet_api.dra_health.v1alpha1 import api_pb2 as health_v1alpha1
from gpulet_common.kubelet_api.dra_health.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from gpulet_common.kubelet_api.dra_health.v1beta1 import api_pb2 as health_v1beta1
from gpulet_common.kubelet_api.dra_health.v1beta1 import api_pb2_grpc as health_v1beta1_grpc
from gpulet_common.nodeview import NodeChange, NodeView

MAX_MESSAGE: Final = 1024
VERSIONS: Final = (
    (health_v1alpha1, health_v1alpha1_grpc),
    (health_v1beta1, health_v1beta1_grpc),
    (health_v1, health_v1_grpc),
)
_STATUS: Final = {"healthy": "HEALTHY", "unhealthy": "UNHEALTHY", "unknown": "UNKNOWN"}


def to_message(pb: ModuleType, devices: list[DeviceHealth]) -> Any:
    rich = "message" in pb.DeviceHealth.DESCRIPTOR.fields_by_name
    out = []
    for d in devices:
        fields: dict[str, Any] = {
            "device": pb.DeviceIdentifier(pool_name=d.pool, device_name=d.device),
            "health": pb.HealthStatus.Value(_STATUS.get(d.health, "UNKNOWN")),
            "last_updated_time": int(d.since or time.time()),
        }
        if rich and d.message:
            fields["message"] = d.message[:MAX_MESSAGE]
        out.append(pb.DeviceHealth(**fields))
    return pb.NodeWatchResourcesResponse(devices=out)


class HealthServicer:
    """One per version; all read the same source."""

    def __init__(self, pb: ModuleType, source: HealthSource) -> None:
        self._pb = pb
        self._source = source
        self.streams = 0

    async def NodeWatchResources(
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        self.streams += 1
        version = await self._source.wait_changed(-1)
        while True:
            yield to_message(self._pb, list(self._source.device_health()))
            version = await self._source.wait_changed(version)


def add_health_servicers(server: grpc.aio.Server, source: HealthSource) -> list[HealthServicer]:
    servicers = []
    for pb, pb_grpc in VERSIONS:
        servicer = HealthServicer(pb, source)
        pb_grpc.add_DRAResourceHealthServicer_to_server(servicer, server)
        servicers.append(servicer)
    return servicers


class NodeViewHealth:
    """:class:`~.contract.HealthSource` from the node read model: every device of the
    pool (:func:`gpulet_common.dra.mig.targets`: the GPUs that may go whole as
    ``gpu-<minor>``, the MIG devices; a MIG device is unhealthy with its GPU or on its
    own) of ``pool``, healthy unless the health service says
    otherwise (the same rule as :meth:`NodeView.healthy`), the active conditions'
    reasons as the message, the health service's ``updated_at`` as the time."""

    def __init__(
        self,
        view: NodeView,
        pool: str,
        faults: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        self._view = view
        self._pool = pool
        # GPU UUID -> a fault the health service does not know of (a dead MPS daemon).
        self._faults = faults or (dict)
        self.version = 0
        self._changed = anyio.Event()
        view.listen(self._on_change)

    def changed(self) -> None:
        """Something besides the node view changed (an MPS fault): stream again."""
        self._on_change(NodeChange())

    def _on_change(self, _change: NodeChange) -> None:
        self.version += 1
        self._changed.set()
        self._changed = anyio.Event()

    def device_health(self) -> list[DeviceHealth]:
        inventory = self._view.inventory
        if inventory is None:
            return []
        out = []
        faults = self._faults()
        for target in targets(inventory.gpus).values():
            gpu, own = target.gpu, target.mig.uuid if target.mig is not None else ""
            health = self._view.health(gpu.uuid)
            healthy = self._view.healthy(gpu.uuid) and (not own or self._view.healthy(own))
            state: Health = "healthy" if healthy else "unhealthy"
            message = ""
            since = 0.0
            if health is not None:
                since = health.updated_at
                # A MIG device: its GPU's conditions and its own, never another's.
                message = "; ".join(
                    f"{c.condition or c.kind}: {c.reason}"
                    for c in health.conditions
                    if c.mig_device in ("", own)
                )
                if not health.present:
                    message = "GPU not present" + (f"; {message}" if message else "")
            fault = faults.get(gpu.uuid)
            if fault and target.mig is None:
                state, message = "unhealthy", f"MPS: {fault}" + (f"; {message}" if message else "")
            out.append(DeviceHealth(self._pool, target.name, state, since, message))
        return out

    def lookup(self, name: str) -> ReservedDevice | None:
        """The device ``name`` of the pool as it is now, for admin access (which is
        prepared without a reservation); None when the node has no such device."""
        inventory = self._view.inventory
        if inventory is None:
            return None
        target = targets(inventory.gpus).get(name)
        if target is None:
            return None
        gpu = target.gpu
        minor = gpu.minor if gpu.minor is not None else gpu.index
        uuid = target.mig.uuid if target.mig is not None else gpu.uuid
        return ReservedDevice(name, uuid, minor)

    async def wait_changed(self, version: int) -> int:
        while version >= 0 and version == self.version:
            await self._changed.wait()
        return self.version
