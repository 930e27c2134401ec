"""Resource model of the device plugin: which kubelet resources exist and their devices.

Why
---
Kubelet counts *devices*: a pod asking for ``gpulet.io/gpu-core: 30`` gets 30 device
IDs of that resource. Fractional sharing is therefore modelled as many small devices
per physical GPU, the way time-slicing replicas are in NVIDIA's plugin:

- ``nvidia.com/gpu`` (whole GPUs): one device per GPU, ID = the GPU UUID;
- ``gpulet.io/gpu-core``: :data:`~gpulet_allocator.protocol.CORES_PER_GPU` devices per GPU,
  ID ``<uuid>::core-<n>``;
- ``gpulet.io/gpu-memory``: one device per
  :data:`~gpulet_allocator.protocol.MEMORY_UNIT_BYTES` of GPU memory,
  ID ``<uuid>::mem-<n>``.

Under the ``koordinator`` profile (``allocator.plugin.profile``) the shares are
Koordinator's: ``koordinator.sh/gpu-core`` (100 devices per GPU, like gpulet's core
units) and ``koordinator.sh/gpu-memory-ratio`` (100 devices per GPU, percent of its
memory, ID ``<uuid>::ratio-<n>``). ``koordinator.sh/gpu-memory`` is counted in bytes,
which no device plugin can serve (kubelet would need one device per byte); the
amount comes from koord-scheduler's annotation instead (docs/koordinator.md).

Every device carries its GPU's health and NUMA node, so a GPU turning unhealthy
withdraws all of its shares too (NVIDIA #1929 is about replicas that did not).

A card holding shares may not go whole (the allocator's one answer,
:meth:`~gpulet_allocator.decide.engine.Ledger.refusal`). Kubelet has no "busy" state, so
such a card's whole-GPU device is listed ``Unhealthy`` while it holds shares: kubelet
then stops counting it as an allocatable ``nvidia.com/gpu`` and the scheduler does not
send a pod there that admission would refuse. Its share devices stay ``Healthy``.

A GPU with MIG enabled or a pending MIG mode change (``mig_block``) is not listed at
all, under any resource and any strategy (:mod:`gpulet_allocator.mig`). Its MIG devices
that the strategy offers (``mig``) are listed under their resource (the whole-GPU one
under ``single``, ``nvidia.com/mig-<profile>`` under ``mixed``), ID = the MIG UUID,
healthy while both the MIG device and its GPU are.

A time-sliced GPU (``replicas`` > 1, the allocator's plan of ``sharing.time_slicing``,
:mod:`gpulet_allocator.timeslicing`) is listed under the whole-GPU resource as its
replicas ``<uuid>::<n>``, n < replicas, instead of its UUID, and not under the share
resources (one owner per GPU). Each replica carries its GPU's health, so a faulty GPU
withdraws all of its replicas; while the allocator withholds the GPU (held whole or
shared when it became time-sliced) its replicas are listed ``Unhealthy``.

Layers
------
Pure data and functions, no gRPC and no I/O: :mod:`.server` turns
:class:`PluginDevice` into kubelet's ``Device`` messages. The units, the device IDs
and the resources served are the allocator contract's (:mod:`gpulet_allocator.protocol`),
so the allocator maps IDs back to GPUs (``parse_device_id``) by the same rules.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Final

import msgspec

from gpulet_allocator.mig import MigPlan, parent_block
from gpulet_allocator.protocol import (
    CORES_PER_GPU,
    RATIO_UNITS_PER_GPU,
    ResourceKind,
    ResourceSpec,
    core_device_id,
    memory_device_id,
    memory_units,
    ratio_device_id,
    replica_device_id,
)
from gpulet_common.messages import GpuInfo

HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"


class PluginMig(msgspec.Struct, frozen=True, kw_only=True):
    """One MIG device the strategy offers, under ``resource``."""

    uuid: str
    resource: str
    gpu_instance_id: int
    compute_instance_id: int
    healthy: bool = True


class PluginGpu(msgspec.Struct, frozen=True, kw_only=True):
    """What the plugin needs to know about one physical GPU."""

    uuid: str
    index: int
    # None when the inventory could not tell; such a GPU gets no /dev/nvidiaN spec.
    minor: int | None
    memory_total_bytes: int
    numa_node: int | None = None
    healthy: bool = True
    # Holds shares, so it may not go whole (the allocator says; ``withheld``): listed
    # Unhealthy for the whole-GPU resource only, Healthy for its shares.
    withheld: bool = False
    # MIG enabled or a mode change pending (why): the GPU itself is not listed.
    mig_block: str = ""
    # Its MIG devices the strategy offers.
    mig: tuple[PluginMig, ...] = ()
    # Time-slicing replicas it is offered as (0 or 1: not time-sliced).
    replicas: int = 0


class PluginDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One kubelet device of one resource."""

    id: str
    gpu_uuid: str
    healthy: bool
    numa_node: int | None

    @property
    def health(self) -> str:
        return HEALTHY if self.healthy else UNHEALTHY


def build_devices(
    kind: ResourceKind, gpus: Iterable[PluginGpu], resource: str = ""
) -> list[PluginDevice]:
    """The devices of one resource, in GPU index order (kubelet shows them that way)."""
    devices: list[PluginDevice] = []
    for gpu in in_index_order(gpus):
        devices.extend(gpu_devices(kind, gpu, resource))
    return devices


def in_index_order(gpus: Iterable[PluginGpu]) -> list[PluginGpu]:
    return sorted(gpus, key=lambda g: (g.index, g.uuid))


def gpu_devices(kind: ResourceKind, gpu: PluginGpu, resource: str = "") -> list[PluginDevice]:
    """The devices one GPU gives one resource: its MIG devices offered under it, then
    its own (none when MIG blocks it)."""
    devices = [
        PluginDevice(
            id=m.uuid,
            gpu_uuid=gpu.uuid,
            healthy=m.healthy and gpu.healthy,
            numa_node=gpu.numa_node,
        )
        for m in gpu.mig
        if m.resource == resource
    ]
    if gpu.mig_block or kind is ResourceKind.MIG:
        return devices
    if gpu.replicas > 1:
        devices.extend(_replicas(kind, gpu))
        return devices
    if kind is ResourceKind.WHOLE:
        ids = [gpu.uuid]
    elif kind is ResourceKind.CORE:
        ids = [core_device_id(gpu.uuid, n) for n in range(CORES_PER_GPU)]
    elif kind is ResourceKind.RATIO:
        ids = [ratio_device_id(gpu.uuid, n) for n in range(RATIO_UNITS_PER_GPU)]
    else:
        ids = [memory_device_id(gpu.uuid, n) for n in range(memory_units(gpu.memory_total_bytes))]
    healthy = gpu.healthy and not (kind is ResourceKind.WHOLE and gpu.withheld)
    devices.extend(
        PluginDevice(id=i, gpu_uuid=gpu.uuid, healthy=healthy, numa_node=gpu.numa_node) for i in ids
    )
    return devices


def _replicas(kind: ResourceKind, gpu: PluginGpu) -> list[PluginDevice]:
    """A time-sliced GPU's devices: its replicas under the whole-GPU resource only."""
    if kind is not ResourceKind.WHOLE:
        return []
    healthy = gpu.healthy and not gpu.withheld
    return [
        PluginDevice(
            id=replica_device_id(gpu.uuid, n),
            gpu_uuid=gpu.uuid,
            healthy=healthy,
            numa_node=gpu.numa_node,
        )
        for n in range(gpu.replicas)
    ]


def build_inventory(
    specs: Sequence[ResourceSpec], gpus: Sequence[PluginGpu]
) -> dict[str, list[PluginDevice]]:
    """Device lists of every served resource, keyed by resource name."""
    return {spec.name: build_devices(spec.kind, gpus, spec.name) for spec in specs}


def mig_resource_specs(plan: MigPlan, gpu_resource: str) -> tuple[ResourceSpec, ...]:
    """The resources the mixed strategy's MIG devices need beside the whole-GPU one."""
    return tuple(
        ResourceSpec(name=n, kind=ResourceKind.MIG, preferred_allocation=True)
        for n in plan.resources(gpu_resource)
    )


def plugin_gpus_from_inventory(
    gpus: Iterable[GpuInfo],
    unhealthy: Collection[str] = (),
    withheld: Collection[str] = (),
    mig: MigPlan | None = None,
    replicas: Mapping[str, int] | None = None,
) -> list[PluginGpu]:
    """Adapt the collector's inventory plus the unhealthy and the withheld UUIDs, the
    MIG devices ``mig`` offers (unhealthy ones by their MIG UUID) and the time-slicing
    ``replicas`` of each GPU (the allocator's plan)."""
    offers: dict[str, list[PluginMig]] = {}
    for o in (mig.offers if mig is not None else {}).values():
        offers.setdefault(o.parent_uuid, []).append(
            PluginMig(
                uuid=o.uuid,
                resource=o.resource,
                gpu_instance_id=o.gpu_instance_id,
                compute_instance_id=o.compute_instance_id,
                # Withheld: a DRA claim holds it (dra.mode both).
                healthy=o.uuid not in unhealthy and o.uuid not in withheld,
            )
        )
    return [
        PluginGpu(
            uuid=g.uuid,
            index=g.index,
            minor=g.minor,
            memory_total_bytes=g.memory_total_bytes,
            # NVML reports -1 when the platform has no NUMA information.
            numa_node=g.numa_node if g.numa_node is not None and g.numa_node >= 0 else None,
            healthy=g.uuid not in unhealthy,
            withheld=g.uuid in withheld,
            mig_block=block[1] if (block := parent_block(g)) else "",
            mig=tuple(offers.get(g.uuid, ())),
            replicas=(replicas or {}).get(g.uuid, 0),
        )
        for g in gpus
    ]
