"""Topology model: levels, NVLinks, scores, tiers and gpu-manager's tree."""

from __future__ import annotations

import pytest

from gpulet_allocator.decide.engine.topology import (
    LEAF_LEVEL,
    LEVEL_HOSTBRIDGE,
    LEVEL_MULTIPLE,
    LEVEL_NODE,
    LEVEL_SINGLE,
    LEVEL_SYSTEM,
    ROOT_LEVEL,
    TIER_NVLINK,
    Topology,
    normalize_level,
    pair_score,
    pair_tier,
)
from gpulet_common.messages import GpuInfo, PeerLink
from support.reference import (
    dgx1_cube_mesh_8,
    inventory_from_matrix,
    nvlink_islands,
    nvlink_pairs_8,
    pix_phb_7,
)


def test_pair_scores_follow_go_gpuallocator() -> None:
    assert [pair_score(lv, 0) for lv in (0, 10, 20, 30, 40, 50)] == [60, 50, 40, 30, 20, 10]
    # NVLink adds 100 per link on top of the PCIe path, so any NVLink pair beats any
    # PCIe-only pair.
    assert pair_score(LEVEL_SYSTEM, 1) == 110
    assert pair_score(LEVEL_SINGLE, 2) == 250
    assert pair_tier(LEVEL_SYSTEM, 1) == TIER_NVLINK
    assert [pair_tier(lv, 0) for lv in (0, 10, 20, 30, 40, 50)] == [1, 2, 3, 4, 5, 6]


def test_normalize_level_rounds_unknown_values_up_and_falls_back_to_numa() -> None:
    assert normalize_level(15, 0, 0) == LEVEL_MULTIPLE
    assert normalize_level(99, 0, 0) == LEVEL_SYSTEM
    assert normalize_level(None, 1, 1) == LEVEL_NODE
    assert normalize_level(None, 0, 1) == LEVEL_SYSTEM
    assert normalize_level(None, None, None) == LEVEL_SYSTEM


def test_seven_gpu_host_matrix() -> None:
    topo = Topology.from_inventory(pix_phb_7())
    assert len(topo) == 7
    u = topo.uuids
    assert topo.level(u[0], u[2]) == LEVEL_SINGLE
    assert topo.level(u[2], u[3]) == LEVEL_HOSTBRIDGE
    assert topo.pair_score(u[3], u[6]) == 50
    assert topo.pair_score(u[0], u[6]) == 30
    assert topo.set_score(u[:3]) == 150
    assert topo.set_tier(u[:3]) == pair_tier(LEVEL_SINGLE, 0)
    assert topo.set_tier(u[2:4]) == pair_tier(LEVEL_HOSTBRIDGE, 0)
    assert topo.numa_span(u) == 1


def test_nvlink_counts_and_numa() -> None:
    topo = Topology.from_inventory(nvlink_pairs_8())
    u = topo.uuids
    assert topo.nvlink_count(u[0], u[1]) == 2
    assert topo.nvlink_count(u[1], u[2]) == 1
    assert topo.pair_score(u[0], u[1]) == 250
    assert topo.pair_score(u[0], u[4]) == 110
    assert topo.numa_span(u[3:5]) == 2

    cube = Topology.from_inventory(dgx1_cube_mesh_8())
    c = cube.uuids
    assert cube.nvlink_count(c[0], c[5]) == 0
    assert cube.tier(c[0], c[5]) == pair_tier(LEVEL_SYSTEM, 0)
    assert cube.tier(c[0], c[4]) == TIER_NVLINK


def test_gpus_are_ordered_by_index_and_peers_matched_by_index_without_uuid() -> None:
    gpus = [
        GpuInfo(uuid="GPU-b", index=1, topology=[PeerLink(peer_uuid="", peer_index=0, level=10)]),
        GpuInfo(uuid="GPU-a", index=0),
    ]
    topo = Topology.from_gpus(gpus)
    assert topo.uuids == ("GPU-a", "GPU-b")
    assert topo.level("GPU-a", "GPU-b") == LEVEL_SINGLE


def test_disagreeing_directions_take_the_worse_report() -> None:
    gpus = [
        GpuInfo(
            uuid="GPU-a",
            index=0,
            topology=[PeerLink(peer_uuid="GPU-b", peer_index=1, level=10, nvlinks=4)],
        ),
        GpuInfo(
            uuid="GPU-b",
            index=1,
            topology=[PeerLink(peer_uuid="GPU-a", peer_index=0, level=30, nvlinks=2)],
        ),
    ]
    topo = Topology.from_gpus(gpus)
    assert topo.level("GPU-a", "GPU-b") == LEVEL_HOSTBRIDGE
    assert topo.nvlink_count("GPU-a", "GPU-b") == 2


def test_missing_levels_fall_back_to_numa_affinity() -> None:
    inv = inventory_from_matrix(
        "unk", [[0, None, None], [None, 0, None], [None, None, 0]], numa=[0, 0, 1]
    )
    topo = Topology.from_inventory(inv)
    u = topo.uuids
    assert topo.level(u[0], u[1]) == LEVEL_NODE
    assert topo.level(u[0], u[2]) == LEVEL_SYSTEM


def test_a_duplicate_uuid_keeps_its_first_entry_instead_of_ending_the_allocator() -> None:
    # The bus refuses such an inventory (gpulet_common.validate); the engine, fed by
    # other paths too, must still not raise on one: it used to end the whole agent.
    topo = Topology.from_gpus(
        [
            GpuInfo(uuid="GPU-a", index=0),
            GpuInfo(uuid="GPU-a", index=1),
            GpuInfo(uuid="GPU-b", index=2),
        ]
    )
    assert topo.uuids == ("GPU-a", "GPU-b")
    assert topo.gpu_indices == (0, 2)


def test_direct_construction_with_duplicate_uuids_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        Topology(["GPU-a", "GPU-a"], [0, 1], [None, None], [{}, {}])


class CountingTopology(Topology):
    """Counts the pairs whose level and NVLinks are worked out from the reports."""

    pairs = 0

    def _pair(self, a: int, b: int) -> tuple[int, int]:
        self.pairs += 1
        return super()._pair(a, b)


def test_building_is_linear_in_what_the_inventory_lists() -> None:
    gpus = nvlink_islands(4096)
    # Work counted, not timed (the dense build took over 20 s here): the pairs worked
    # out, and the matrix rows built.
    topo = CountingTopology.from_gpus(gpus)
    assert isinstance(topo, CountingTopology)
    assert topo.rows_built() == 0
    assert topo.pairs == 0
    assert topo.level("GPU-0", "GPU-7") == LEVEL_SINGLE
    assert topo.nvlink_count("GPU-0", "GPU-7") == 4
    assert topo.level("GPU-0", "GPU-8") == LEVEL_SYSTEM  # nothing listed, no NUMA
    # One row of levels and one of NVLink counts, from GPU-0's 7 listed peers (the
    # other 4,088 pairs of the row are its NUMA fallback).
    assert topo.rows_built() == 2
    assert topo.pairs == 7


def test_tree_of_the_seven_gpu_host_matches_gpu_manager() -> None:
    topo = Topology.from_inventory(pix_phb_7())
    root = topo.tree.root
    assert root.level == ROOT_LEVEL
    (phb,) = root.children
    assert phb.level == LEVEL_HOSTBRIDGE
    assert phb.size == 7
    groups = sorted(tuple(c.positions()) for c in phb.children)
    assert groups == [(0, 1, 2), (3, 4, 5, 6)]
    assert all(c.level == LEVEL_SINGLE for c in phb.children)
    assert all(leaf.level == LEAF_LEVEL for c in phb.children for leaf in c.children)

    free = [topo.uuids[p] for p in (1, 2, 6)]
    counts = {tuple(c.positions()): c.free_leaves(topo.mask_of(free)) for c in phb.children}
    assert counts == {(0, 1, 2): 2, (3, 4, 5, 6): 1}
    assert topo.tree.render(free).splitlines() == [
        "ROOT 3/7",
        "  PHB 3/7",
        "    PIX 2/3: GPU0 GPU1 GPU2",
        "    PIX 1/4: GPU3 GPU4 GPU5 GPU6",
    ]


def test_tree_has_three_levels_on_the_nvlink_pairs_box() -> None:
    topo = Topology.from_inventory(nvlink_pairs_8())
    levels = sorted({n.level for n in topo.tree.nodes()})
    assert levels == [LEAF_LEVEL, LEVEL_SINGLE, LEVEL_MULTIPLE, LEVEL_SYSTEM, ROOT_LEVEL]


def test_empty_topology() -> None:
    topo = Topology.from_gpus([])
    assert len(topo) == 0
    assert topo.tree.root.children == ()
    assert topo.set_tier([]) == 0
