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
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any, Final

import grpc.aio

from gpulet_allocator.kubelet.dra.contract import DeviceHealth, HealthSource
from gpulet_common.kubelet_api.dra_health.v1 import api_pb2 as health_v1
from gpulet_common.kubelet_api.dra_health.v1 import api_pb2_grpc as health_v1_grpc
from gpulet_common.kubelet_api.dra_health.v1alpha1 import api_pb2 as health_v1alpha1
from gpulet_common.kubelet_api.dra_health.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from gpulet_common.kubelet_api.dra_health.v1beta1 import api_pb2 as health_v1beta1
from gpulet_common.kubelet_api.dra_health.v1beta1 import api_pb2_grpc as health_v1beta1_grpc

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
