"""Resource model of the device plugin: which kubelet resources exist and their devices.

Why
---
Kubelet counts *devices*: a pod asking for ``gpulet.io/gpu-core: 30`` gets 30 device
IDs of that resource. Fractional sharing is therefore modelled as many small devices
per physical GPU, the way time-slicing replicas are in NVIDIA's plugin:

- ``nvidia.com/gpu`` (whole GPUs): one device per GPU, ID = the GPU UUID;
- ``gpulet.io/gpu-core``: :data:`CORE_UNITS_PER_GPU` devices per GPU,
  ID ``<uuid>::core-<n>``;
- ``gpulet.io/gpu-memory``: one device per :data:`MEMORY_UNIT_BYTES` of GPU memory,
  ID ``<uuid>::mem-<n>``.

Under the ``koordinator`` profile (``allocator.plugin.profile``) the shares are
Koordinator's: ``koordinator.sh/gpu-core`` (100 devices per GPU, like gpulet's core
units) and ``koordinator.sh/gpu-memory-ratio`` (100 devices per GPU, percent of its
memory, ID ``<uuid>::ratio-<n>``). ``koordinator.sh/gpu-memory`` is counted in bytes,
which no device plugin can serve (kubelet would need one device per byte); the
amount comes from koord-scheduler's annotation instead (docs/koordinator.md).

Every device carries its GPU's health and NUMA node, so a GPU turning unhealthy
withdraws all of its shares too (NVIDIA #1929 is about replicas that did not).

Layers
------
Pure data and functions, no gRPC and no I/O: :mod:`.server` turns
:class:`PluginDevice` into kubelet's ``Device`` messages, the allocator backend uses
:func:`parse_device_id` to map IDs back to GPUs.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Sequence
from typing import Final

import msgspec

from gpulet_allocator.koordinator import RES_GPU_CORE, RES_GPU_MEMORY_RATIO
from gpulet_common.messages import GpuInfo
from gpulet_common.podresources import SHARE_SEPARATOR
from gpulet_common.settings.allocator import ResourceNames as ResourceNames  # settings

CORE_UNITS_PER_GPU: Final = 100
MEMORY_UNIT_BYTES: Final = 256 * 1024 * 1024

HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"

_CORE_TAG: Final = "core"
_MEM_TAG: Final = "mem"
_RATIO_TAG: Final = "ratio"
RATIO_UNITS_PER_GPU: Final = 100
_SEPARATOR: Final = SHARE_SEPARATOR


class ResourceKind(enum.StrEnum):
    WHOLE = "whole"
    CORE = "core"
    MEMORY = "memory"
    RATIO = "ratio"


class ResourceSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One resource the plugin serves."""

    name: str
    kind: ResourceKind
    # Kubelet asks GetPreferredAllocation only when this is advertised. Shares get
    # their physical GPU picked by the allocator in Allocate, so a hint is useless.
    preferred_allocation: bool = False


class PluginGpu(msgspec.Struct, frozen=True, kw_only=True):
    """What the plugin needs to know about one physical GPU."""

    uuid: str
    index: int
    # None when the inventory could not tell; such a GPU gets no /dev/nvidiaN spec.
    minor: int | None
    memory_total_bytes: int
    numa_node: int | None = None
    healthy: bool = True


class PluginDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One kubelet device of one resource."""

    id: str
    gpu_uuid: str
    healthy: bool
    numa_node: int | None

    @property
    def health(self) -> str:
        return HEALTHY if self.healthy else UNHEALTHY


class ParsedDeviceId(msgspec.Struct, frozen=True, kw_only=True):
    gpu_uuid: str
    kind: ResourceKind
    unit: int | None = None


def resource_specs(
    names: ResourceNames, *, shares: bool = True, profile: str = "gpulet"
) -> list[ResourceSpec]:
    """The resources to serve: whole GPUs always, shares unless disabled (gpulet's
    core/memory, or Koordinator's core/memory-ratio under the koordinator profile)."""
    specs = [ResourceSpec(name=names.gpu, kind=ResourceKind.WHOLE, preferred_allocation=True)]
    if shares and profile == "koordinator":
        specs.append(ResourceSpec(name=RES_GPU_CORE, kind=ResourceKind.CORE))
        specs.append(ResourceSpec(name=RES_GPU_MEMORY_RATIO, kind=ResourceKind.RATIO))
    elif shares:
        specs.append(ResourceSpec(name=names.core, kind=ResourceKind.CORE))
        specs.append(ResourceSpec(name=names.memory, kind=ResourceKind.MEMORY))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"resource names must be distinct: {[s.name for s in specs]}")
    return specs


def core_device_id(gpu_uuid: str, unit: int) -> str:
    # A UUID is 40 characters, so "<uuid>::core-99" stays under kubelet's 63.
    return f"{gpu_uuid}{_SEPARATOR}{_CORE_TAG}-{unit}"


def memory_device_id(gpu_uuid: str, unit: int) -> str:
    return f"{gpu_uuid}{_SEPARATOR}{_MEM_TAG}-{unit}"


def ratio_device_id(gpu_uuid: str, unit: int) -> str:
    return f"{gpu_uuid}{_SEPARATOR}{_RATIO_TAG}-{unit}"


def memory_units(memory_total_bytes: int) -> int:
    """Memory shares of a GPU; a partial last unit is not offered."""
    return max(memory_total_bytes, 0) // MEMORY_UNIT_BYTES


def parse_device_id(device_id: str) -> ParsedDeviceId:
    """Map a device ID of any resource back to its GPU; ValueError if malformed."""
    uuid, sep, suffix = device_id.partition(_SEPARATOR)
    if not uuid:
        raise ValueError(f"malformed device id {device_id!r}")
    if not sep:
        return ParsedDeviceId(gpu_uuid=uuid, kind=ResourceKind.WHOLE)
    tag, dash, number = suffix.rpartition("-")
    if not dash or not number.isdigit():
        raise ValueError(f"malformed device id {device_id!r}")
    if tag == _CORE_TAG:
        return ParsedDeviceId(gpu_uuid=uuid, kind=ResourceKind.CORE, unit=int(number))
    if tag == _MEM_TAG:
        return ParsedDeviceId(gpu_uuid=uuid, kind=ResourceKind.MEMORY, unit=int(number))
    if tag == _RATIO_TAG:
        return ParsedDeviceId(gpu_uuid=uuid, kind=ResourceKind.RATIO, unit=int(number))
    raise ValueError(f"malformed device id {device_id!r}")


def build_devices(kind: ResourceKind, gpus: Iterable[PluginGpu]) -> list[PluginDevice]:
    """The devices of one resource, in GPU index order (kubelet shows them that way)."""
    devices: list[PluginDevice] = []
    for gpu in sorted(gpus, key=lambda g: (g.index, g.uuid)):
        if kind is ResourceKind.WHOLE:
            ids = [gpu.uuid]
        elif kind is ResourceKind.CORE:
            ids = [core_device_id(gpu.uuid, n) for n in range(CORE_UNITS_PER_GPU)]
        elif kind is ResourceKind.RATIO:
            ids = [ratio_device_id(gpu.uuid, n) for n in range(RATIO_UNITS_PER_GPU)]
        else:
            ids = [
                memory_device_id(gpu.uuid, n) for n in range(memory_units(gpu.memory_total_bytes))
            ]
        devices.extend(
            PluginDevice(id=i, gpu_uuid=gpu.uuid, healthy=gpu.healthy, numa_node=gpu.numa_node)
            for i in ids
        )
    return devices


def build_inventory(
    specs: Sequence[ResourceSpec], gpus: Sequence[PluginGpu]
) -> dict[str, list[PluginDevice]]:
    """Device lists of every served resource, keyed by resource name."""
    return {spec.name: build_devices(spec.kind, gpus) for spec in specs}


def plugin_gpus_from_inventory(
    gpus: Iterable[GpuInfo], unhealthy: Collection[str] = ()
) -> list[PluginGpu]:
    """Adapt the collector's inventory plus the set of unhealthy UUIDs."""
    return [
        PluginGpu(
            uuid=g.uuid,
            index=g.index,
            minor=g.minor,
            memory_total_bytes=g.memory_total_bytes,
            # NVML reports -1 when the platform has no NUMA information.
            numa_node=g.numa_node if g.numa_node is not None and g.numa_node >= 0 else None,
            healthy=g.uuid not in unhealthy,
        )
        for g in gpus
    ]
