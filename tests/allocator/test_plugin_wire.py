"""The ListAndWatch list encoded GPU by GPU and cached (deviceplugin/wire.py, issue 24).

Every list it sends must be byte for byte the one built the plain way, whatever the
mix of GPUs (MIG, withheld, no NUMA node, unordered input), before and after its cache
holds them; and a change must rebuild only the GPU that changed.
"""

from __future__ import annotations

import msgspec
import pytest

from gpulet_allocator.kubelet.deviceplugin import wire
from gpulet_allocator.kubelet.deviceplugin.resources import (
    PluginDevice,
    PluginGpu,
    PluginMig,
    build_devices,
)
from gpulet_allocator.kubelet.deviceplugin.wire import ListEncoder, encode_devices
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as pb
from gpulet_allocator.protocol import MEMORY_UNIT_BYTES, ResourceKind, ResourceSpec

MIG_RESOURCE = "nvidia.com/mig-1g.10gb"


def node() -> list[PluginGpu]:
    """Given out of index order; one GPU without NUMA node, one withheld, one MIG."""
    mig = PluginMig(
        uuid="MIG-aaaa", resource=MIG_RESOURCE, gpu_instance_id=1, compute_instance_id=0
    )
    return [
        PluginGpu(
            uuid="GPU-2", index=2, minor=2, memory_total_bytes=3 * MEMORY_UNIT_BYTES, numa_node=1
        ),
        PluginGpu(
            uuid="GPU-0",
            index=0,
            minor=0,
            memory_total_bytes=5 * MEMORY_UNIT_BYTES + 7,
            numa_node=0,
            withheld=True,
        ),
        PluginGpu(uuid="GPU-1", index=1, minor=1, memory_total_bytes=2 * MEMORY_UNIT_BYTES),
        PluginGpu(
            uuid="GPU-3",
            index=3,
            minor=3,
            memory_total_bytes=4 * MEMORY_UNIT_BYTES,
            numa_node=1,
            mig_block="MIG mode enabled",
            mig=(mig, msgspec.structs.replace(mig, uuid="MIG-bbbb", healthy=False)),
        ),
    ]


SPECS = [
    ResourceSpec(name="nvidia.com/gpu", kind=ResourceKind.WHOLE),
    ResourceSpec(name="gpulet.io/gpu-core", kind=ResourceKind.CORE),
    ResourceSpec(name="gpulet.io/gpu-memory", kind=ResourceKind.MEMORY),
    ResourceSpec(name="koordinator.sh/gpu-memory-ratio", kind=ResourceKind.RATIO),
    ResourceSpec(name=MIG_RESOURCE, kind=ResourceKind.MIG),
]


def plain(spec: ResourceSpec, gpus: list[PluginGpu]) -> bytes:
    return encode_devices(build_devices(spec.kind, gpus, spec.name))


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_every_list_is_the_plainly_built_one(spec: ResourceSpec) -> None:
    encoder = ListEncoder(spec)
    gpus = node()
    states = [
        gpus,
        [msgspec.structs.replace(gpus[0], healthy=False), *gpus[1:]],
        [*gpus[:3], msgspec.structs.replace(gpus[3], mig=gpus[3].mig[:1])],
        gpus[1:],
        [],
        gpus,
    ]
    for state in states + states:
        assert encoder.encode(state) == plain(spec, state)
    listed = pb.ListAndWatchResponse.FromString(encoder.encode(gpus)).devices
    assert [d.ID for d in listed] == [d.id for d in build_devices(spec.kind, gpus, spec.name)]


def test_topology_is_said_per_device() -> None:
    spec = SPECS[2]
    devices = pb.ListAndWatchResponse.FromString(ListEncoder(spec).encode(node())).devices
    numa = {d.ID.split("::")[0]: [n.ID for n in d.topology.nodes] for d in devices}
    assert numa == {"GPU-0": [0], "GPU-1": [], "GPU-2": [1]}


def test_a_change_rebuilds_only_the_gpu_that_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    encode = wire.encode_devices

    def counted(devices: list[PluginDevice]) -> bytes:
        built.extend(sorted({d.gpu_uuid for d in devices}))
        return encode(devices)

    monkeypatch.setattr(wire, "encode_devices", counted)
    encoder = ListEncoder(SPECS[2])
    gpus = node()
    encoder.encode(gpus)
    assert sorted(built) == ["GPU-0", "GPU-1", "GPU-2"]
    built.clear()
    sick = [msgspec.structs.replace(gpus[0], healthy=False), *gpus[1:]]
    encoder.encode(sick)
    assert built == [gpus[0].uuid]
    built.clear()
    # Back to healthy, then sick again: both states are still cached.
    encoder.encode(gpus)
    encoder.encode(sick)
    assert built == []


def test_the_cache_stays_bounded() -> None:
    encoder = ListEncoder(SPECS[0])
    gpus = node()
    for n in range(200):
        encoder.encode([msgspec.structs.replace(gpus[0], memory_total_bytes=n), *gpus[1:]])
    assert len(encoder._chunks) <= max(wire.MIN_ENTRIES, wire.STATES_PER_GPU * len(gpus))
