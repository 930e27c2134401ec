"""Kubelet's device list of one resource in protobuf form, built GPU by GPU and cached.

Why
---
A GPU that turns unhealthy changes the list of every resource it gives devices to, so
every ``ListAndWatch`` stream sends its whole list again. The share resources are
large: an 80 GB card gives 100 core devices and about 318 memory devices, so a node
of five such cards lists some 2,100 devices across its resources. Building them as
``Device`` messages in Python costs 1-13 microseconds each (the more with a NUMA node
and under load): 4-7 ms per change on a quiet 2-core machine, 10-25 ms on a busy one,
spent on the event loop that also carries the whole-GPU stream, the bus and kubelet's
other calls. That, not a poll or a thread hop, was most of the fault-to-kubelet time
(bench/listandwatch_latency.py).

A change touches one GPU; the others' devices are as they were. So the list is kept as
one encoded chunk per GPU: a repeated field's encoding is the concatenation of its
elements, so the list is the chunks joined in GPU index order. A chunk is built only
for a GPU state not seen recently (the cache holds a few states per GPU, so a GPU
going unhealthy and back costs nothing the second time), and a miss builds the
messages of that one GPU, sharing one ``TopologyInfo`` per NUMA node. The cache is
bounded (:data:`STATES_PER_GPU` entries per GPU, at least :data:`MIN_ENTRIES`): an
80 GB card's memory devices take about 21 kB, so even eight cards in every state cost
the memory resource under a megabyte, and a node that never changes keeps one entry
per GPU.

Layers
------
Pure functions and one small cache, no I/O: :mod:`.server` keeps one
:class:`ListEncoder` per resource (shared by its streams) and compares the encoded
lists to tell whether its resource changed at all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from gpulet_allocator.kubelet.deviceplugin.resources import (
    PluginDevice,
    PluginGpu,
    gpu_devices,
    in_index_order,
)
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as pb
from gpulet_allocator.protocol import ResourceSpec

# States kept per GPU of the node: healthy, unhealthy, withheld, and one to spare.
STATES_PER_GPU: Final = 4
MIN_ENTRIES: Final = 16


def to_pb_devices(devices: Sequence[PluginDevice]) -> list[pb.Device]:
    topologies: dict[int, pb.TopologyInfo] = {}
    out: list[pb.Device] = []
    for d in devices:
        # No topology rather than a made-up node: kubelet then places the pod freely.
        topology = None
        if d.numa_node is not None:
            topology = topologies.get(d.numa_node)
            if topology is None:
                topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=d.numa_node)])
                topologies[d.numa_node] = topology
        out.append(pb.Device(ID=d.id, health=d.health, topology=topology))
    return out


def encode_devices(devices: Sequence[PluginDevice]) -> bytes:
    """``devices`` as an encoded ``ListAndWatchResponse``."""
    return pb.ListAndWatchResponse(devices=to_pb_devices(devices)).SerializeToString()


class ListEncoder:
    """The encoded ``ListAndWatchResponse`` of one resource, from the node's GPUs."""

    def __init__(self, spec: ResourceSpec) -> None:
        self._spec = spec
        self._chunks: OrderedDict[PluginGpu, bytes] = OrderedDict()

    def encode(self, gpus: Sequence[PluginGpu]) -> bytes:
        """The list of ``gpus``' devices, exactly what
        ``encode_devices(build_devices(kind, gpus, name))`` gives."""
        chunks = [self._chunk(g) for g in in_index_order(gpus)]
        limit = max(MIN_ENTRIES, STATES_PER_GPU * len(gpus))
        while len(self._chunks) > limit:
            self._chunks.popitem(last=False)
        return b"".join(chunks)

    def _chunk(self, gpu: PluginGpu) -> bytes:
        chunk = self._chunks.get(gpu)
        if chunk is None:
            chunk = encode_devices(gpu_devices(self._spec.kind, gpu, self._spec.name))
            self._chunks[gpu] = chunk
        else:
            self._chunks.move_to_end(gpu)
        return chunk
