"""The kubelet-facing device plugin of gpulet.

Why and layers
--------------
Split the way NVIDIA's k8s-device-plugin splits its concerns, so each part can be
tested and replaced alone:

- :mod:`.resources`: the resource model (whole GPUs, core shares, memory shares) and
  device IDs; pure data.
- :mod:`.state`: where GPU inventory and health come from (:class:`DeviceListSource`).
- :mod:`.backend`: the allocation decisions, delegated (:class:`AllocationBackend`,
  later forwarded over NATS to the allocator service) and their typed failures.
- :mod:`.devnodes`: device specs for device files that exist.
- :mod:`.server`: kubelet's ``DevicePlugin`` gRPC service, one server and socket per
  resource.
- :mod:`.manager`: registration with kubelet, kubelet restarts, start/stop of all.

Node labels are not the plugin's business; the reporter owns them.
"""

from gpulet_allocator.plugin.backend import (
    AllocationBackend,
    AllocationRejected,
    AllocatorUnavailable,
    RejectCode,
)
from gpulet_allocator.plugin.config import PluginConfig
from gpulet_allocator.plugin.devnodes import DeviceNodes
from gpulet_allocator.plugin.manager import DevicePluginManager
from gpulet_allocator.plugin.resources import (
    PluginDevice,
    PluginGpu,
    build_devices,
    build_inventory,
    plugin_gpus_from_inventory,
)
from gpulet_allocator.plugin.server import KubeletServicer, ResourceServer, socket_name
from gpulet_allocator.plugin.state import DeviceList, DeviceListSource, DeviceSnapshot

__all__ = [
    "AllocationBackend",
    "AllocationRejected",
    "AllocatorUnavailable",
    "DeviceList",
    "DeviceListSource",
    "DeviceNodes",
    "DevicePluginManager",
    "DeviceSnapshot",
    "KubeletServicer",
    "PluginConfig",
    "PluginDevice",
    "PluginGpu",
    "RejectCode",
    "ResourceServer",
    "build_devices",
    "build_inventory",
    "plugin_gpus_from_inventory",
    "socket_name",
]
