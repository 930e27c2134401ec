"""The kubelet-facing device plugin of gpulet.

Why and layers
--------------
Split the way NVIDIA's k8s-device-plugin splits its concerns, so each part can be
tested and replaced alone:

- :mod:`.resources`: the devices of each resource (whole GPUs, core shares, memory
  shares); pure data. The units, device IDs and the request/answer types are the
  allocator contract's (:mod:`gpulet_allocator.protocol`), which the allocator uses
  too; nothing here is imported by the allocator's decision layer.
- :mod:`.state`: where GPU inventory and health come from (:class:`DeviceListSource`).
- :mod:`.backend`: the allocation decisions, delegated (:class:`AllocationBackend`).
  The device-plugin service passes
  :class:`~gpulet_allocator.nats_backend.NatsAllocationBackend`, which asks the
  allocator service on the :class:`~gpulet_common.bus.Bus`; failures are
  :mod:`gpulet_common.refusal`'s one exception tree.
- :mod:`.devnodes`: device specs for device files that exist.
- :mod:`.server`: kubelet's ``DevicePlugin`` gRPC service, one server and socket per
  resource.
- :mod:`.manager`: registration with kubelet, kubelet restarts, start/stop of all.

Node labels are not the plugin's business; the reporter owns them.
"""

from gpulet_allocator.plugin.backend import AllocationBackend
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
    "DeviceList",
    "DeviceListSource",
    "DeviceNodes",
    "DevicePluginManager",
    "DeviceSnapshot",
    "KubeletServicer",
    "PluginConfig",
    "PluginDevice",
    "PluginGpu",
    "ResourceServer",
    "build_devices",
    "build_inventory",
    "plugin_gpus_from_inventory",
    "socket_name",
]
