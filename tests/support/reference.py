"""Reference topologies, as the collector would report them.

Design
------
The allocation engine is judged against a handful of real machine shapes
(docs: allocation reference). Tests, the quality benchmark and the mock NVML all need
the same shapes, so they live here, next to the engine, and are built the way the
collector builds them: an :class:`~gpulet_common.messages.Inventory` whose GPUs carry
one :class:`~gpulet_common.messages.PeerLink` per peer. Going through the wire type
(instead of handing matrices to :class:`~.topology.Topology`) keeps the
inventory-parsing path under test as well.

The layouts follow ``nvidia-smi topo -m`` of the machines they are named after; the
exact PCIe levels inside a NUMA node vary between BIOSes, so each builder documents
the choice it makes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpulet_allocator.decide.engine.topology import (
    LEVEL_HOSTBRIDGE,
    LEVEL_MULTIPLE,
    LEVEL_NODE,
    LEVEL_SINGLE,
    LEVEL_SYSTEM,
)
from gpulet_common.messages import GpuInfo, Inventory, PeerLink
from gpulet_common.nvml.loader import open_mock

GIB = 1024**3


def inventory_from_matrix(
    node: str,
    levels: Sequence[Sequence[int | None]],
    nvlinks: Sequence[Sequence[int]] | None = None,
    numa: Sequence[int | None] | None = None,
    *,
    memory_bytes: int | Sequence[int] = 80 * GIB,
    name: str = "NVIDIA A100-SXM4-80GB",
) -> Inventory:
    """An inventory whose GPU ``i`` reports ``levels[i][j]`` / ``nvlinks[i][j]`` to ``j``."""
    n = len(levels)
    links = nvlinks if nvlinks is not None else [[0] * n for _ in range(n)]
    nodes = numa if numa is not None else [0] * n
    mems = [memory_bytes] * n if isinstance(memory_bytes, int) else list(memory_bytes)
    uuids = [f"GPU-{node}-{i}" for i in range(n)]
    gpus = [
        GpuInfo(
            uuid=uuids[i],
            index=i,
            minor=i,
            name=name,
            memory_total_bytes=mems[i],
            pci_bus_id=f"00000000:{0x10 + i:02X}:00.0",
            numa_node=nodes[i],
            topology=[
                PeerLink(
                    peer_uuid=uuids[j],
                    peer_index=j,
                    level=levels[i][j],
                    nvlinks=links[i][j],
                )
                for j in range(n)
                if j != i
            ],
        )
        for i in range(n)
    ]
    return Inventory(node=node, gpus=gpus, nvml_backend="mock")


def _matrix(n: int, fn: Callable[[int, int], int]) -> list[list[int]]:
    return [[0 if a == b else fn(a, b) for b in range(n)] for a in range(n)]


def pix_phb_7() -> Inventory:
    """gpu-manager's 7-GPU host: GPU0-2 and GPU3-6 are PIX groups, PHB apart."""

    def group(i: int) -> int:
        return 0 if i < 3 else 1

    levels = _matrix(7, lambda a, b: LEVEL_SINGLE if group(a) == group(b) else LEVEL_HOSTBRIDGE)
    return inventory_from_matrix("pix7", levels, memory_bytes=16 * GIB, name="Tesla P100")


def nvlink_pairs_8() -> Inventory:
    """8 GPUs, every pair NVLinked; (0,1) (2,3) (4,5) (6,7) have two links, others one.

    PCIe: each best pair shares a switch (PIX), a quad shares a host bridge through
    several switches (PXB), GPU0-3 are on NUMA node 0 and GPU4-7 on node 1 (SYS).
    """

    def links(a: int, b: int) -> int:
        return 2 if a // 2 == b // 2 else 1

    def level(a: int, b: int) -> int:
        if a // 2 == b // 2:
            return LEVEL_SINGLE
        return LEVEL_MULTIPLE if a // 4 == b // 4 else LEVEL_SYSTEM

    numa = [i // 4 for i in range(8)]
    return inventory_from_matrix("nvpairs8", _matrix(8, level), _matrix(8, links), numa)


def dgx_nv18_8() -> Inventory:
    """DGX H100-like: all pairs NV18 through NVSwitch.

    PCIe: pairs (0,1) (2,3) ... share a switch tree (PXB), the rest of a NUMA node is
    NODE, GPU0-3 on NUMA node 0 and GPU4-7 on node 1 (SYS).
    """

    def level(a: int, b: int) -> int:
        if a // 2 == b // 2:
            return LEVEL_MULTIPLE
        return LEVEL_NODE if a // 4 == b // 4 else LEVEL_SYSTEM

    numa = [i // 4 for i in range(8)]
    links = _matrix(8, lambda a, b: 18)
    return inventory_from_matrix(
        "dgx18", _matrix(8, level), links, numa, name="NVIDIA H100 80GB HBM3"
    )


def numa_2x4() -> Inventory:
    """Two NUMA nodes with 4 GPUs each, each node under its own host bridge.

    Inside a node, (0,1) and (2,3) share a switch (PIX), the others meet at the host
    bridge (PHB); nodes are SYS apart. No NVLink.
    """

    def level(a: int, b: int) -> int:
        if a // 4 != b // 4:
            return LEVEL_SYSTEM
        return LEVEL_SINGLE if a // 2 == b // 2 else LEVEL_HOSTBRIDGE

    numa = [i // 4 for i in range(8)]
    return inventory_from_matrix("numa2x4", _matrix(8, level), None, numa, name="NVIDIA L40S")


# DGX-1V hybrid cube-mesh NVLink counts (nvidia-smi topo -m): two fully linked quads
# with cross links 0-4, 1-5, 2-6, 3-7; not every pair is NVLinked.
_CUBE_MESH = [
    [0, 1, 1, 2, 2, 0, 0, 0],
    [1, 0, 2, 1, 0, 2, 0, 0],
    [1, 2, 0, 2, 0, 0, 1, 0],
    [2, 1, 2, 0, 0, 0, 0, 1],
    [2, 0, 0, 0, 0, 1, 1, 2],
    [0, 2, 0, 0, 1, 0, 2, 1],
    [0, 0, 1, 0, 1, 2, 0, 2],
    [0, 0, 0, 1, 2, 1, 2, 0],
]


def dgx1_cube_mesh_8() -> Inventory:
    """DGX-1V: hybrid cube-mesh NVLink; PIX pairs, PHB quads, SYS across NUMA nodes."""

    def level(a: int, b: int) -> int:
        if a // 4 != b // 4:
            return LEVEL_SYSTEM
        return LEVEL_SINGLE if a // 2 == b // 2 else LEVEL_HOSTBRIDGE

    numa = [i // 4 for i in range(8)]
    return inventory_from_matrix(
        "dgx1v", _matrix(8, level), _CUBE_MESH, numa, memory_bytes=32 * GIB, name="Tesla V100"
    )


def nvswitch_16() -> Inventory:
    """HGX-2-like: 16 GPUs, all pairs NV6 through NVSwitch.

    PCIe: pairs PIX, quads PXB, eight per NUMA node (NODE), SYS across.
    """

    def level(a: int, b: int) -> int:
        if a // 2 == b // 2:
            return LEVEL_SINGLE
        if a // 4 == b // 4:
            return LEVEL_MULTIPLE
        return LEVEL_NODE if a // 8 == b // 8 else LEVEL_SYSTEM

    numa = [i // 8 for i in range(16)]
    links = _matrix(16, lambda a, b: 6)
    return inventory_from_matrix(
        "hgx16", _matrix(16, level), links, numa, memory_bytes=32 * GIB, name="Tesla V100"
    )


def nvlink_islands(count: int, island: int = 8) -> list[GpuInfo]:
    """``count`` GPUs in NVLink islands of ``island`` (4 links a pair, one PCIe switch),
    listing only their own island's peers: a big node whose topology must be built in
    time linear in what it lists (a dense build of 4,096 fills 16.7 million pairs)."""
    return [
        GpuInfo(
            uuid=f"GPU-{i}",
            index=i,
            topology=[
                PeerLink(peer_uuid=f"GPU-{j}", peer_index=j, level=10, nvlinks=4)
                for j in range(i // island * island, min(count, (i // island + 1) * island))
                if j != i
            ],
        )
        for i in range(count)
    ]


REFERENCE_TOPOLOGIES: dict[str, Callable[[], Inventory]] = {
    "7-GPU PIX/PHB": pix_phb_7,
    "8-GPU NVLink pairs": nvlink_pairs_8,
    "8-GPU DGX NV18": dgx_nv18_8,
    "2x4 NUMA": numa_2x4,
    "8-GPU DGX-1V cube-mesh": dgx1_cube_mesh_8,
    "16-GPU NVSwitch": nvswitch_16,
}


def mock_inventory(scenario: str, node: str = "n") -> Inventory:
    """The inventory the mock NVML's ``scenario`` reports (GPU names, MIG layouts)."""
    adapter = open_mock(scenario)
    try:
        return adapter.inventory(node, 1)
    finally:
        adapter.shutdown()
