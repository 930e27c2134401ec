"""The kubelet-facing device plugin of gpulet (v1beta1): one kubelet adapter.

Where kubelet's device-plugin calls enter. It decides nothing: every placement is the
decision core's (:mod:`gpulet_allocator.decide`), asked over NATS through
:class:`AllocationBackend`. DRA's kubelet plugin will be its sibling
(``gpulet_allocator/kubelet/dra/``), over the same core and the same ledger.

Why and layers
--------------
Split the way NVIDIA's k8s-device-plugin splits its concerns, so each part can be
tested and replaced alone:

- :mod:`.resources`: the devices of each resource (whole GPUs, core shares, memory
  shares); pure data. The units, device IDs and the request/answer types are the
  allocator contract's (:mod:`gpulet_allocator.protocol`), which the allocator uses
  too; nothing here is imported by the allocator's decision layer.
- :mod:`.devicelist`: where GPU inventory and health come from (:class:`DeviceListSource`).
- :mod:`.backend`: the allocation decisions, delegated (:class:`AllocationBackend`).
  The device-plugin service passes :class:`~.nats_backend.NatsAllocationBackend`,
  which asks the allocator service on the :class:`~gpulet_common.bus.Bus`; failures are
  :mod:`gpulet_common.refusal`'s one exception tree.
- :mod:`.devnodes`: device specs for device files that exist.
- :mod:`.server`: kubelet's ``DevicePlugin`` gRPC service, one server and socket per
  resource; :mod:`.wire` encodes its ``ListAndWatch`` lists GPU by GPU, cached.
- :mod:`.manager`: registration with kubelet, kubelet restarts, start/stop of all.

Node labels are not the plugin's business; the reporter owns them.
"""

from gpulet_allocator.kubelet.deviceplugin.backend import AllocationBackend
from gpulet_allocator.kubelet.deviceplugin.config import PluginConfig
from gpulet_allocator.kubelet.deviceplugin.devicelist import (
    DeviceList,
    DeviceListSource,
    DeviceSnapshot,
)
from gpulet_allocator.kubelet.deviceplugin.devnodes import DeviceNodes
from gpulet_allocator.kubelet.deviceplugin.manager import DevicePluginManager
from gpulet_allocator.kubelet.deviceplugin.resources import (
    PluginDevice,
    PluginGpu,
    build_devices,
    build_inventory,
    plugin_gpus_from_inventory,
)
from gpulet_allocator.kubelet.deviceplugin.server import (
    KubeletServicer,
    ResourceServer,
    socket_name,
)

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
