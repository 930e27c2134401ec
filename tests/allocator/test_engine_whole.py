"""Whole-GPU selection on the reference topologies, plus brute-force equivalence."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulet_allocator.decide.engine import whole
from gpulet_allocator.decide.engine.topology import Topology
from gpulet_allocator.decide.engine.whole import evaluate, fragment_order, select_whole
from gpulet_common.refusal import Refused
from support.reference import (
    dgx1_cube_mesh_8,
    dgx_nv18_8,
    inventory_from_matrix,
    numa_2x4,
    nvlink_pairs_8,
    nvswitch_16,
    pix_phb_7,
)

PIX7 = Topology.from_inventory(pix_phb_7())
NVPAIRS = Topology.from_inventory(nvlink_pairs_8())
DGX = Topology.from_inventory(dgx_nv18_8())
NUMA = Topology.from_inventory(numa_2x4())
CUBE = Topology.from_inventory(dgx1_cube_mesh_8())


def ids(topo: Topology, indices: Iterable[int]) -> list[str]:
    return [topo.uuids[i] for i in indices]


def pick(topo: Topology, size: int, used: Iterable[int] = (), must: Iterable[int] = ()) -> set[int]:
    taken = set(used)
    free = [u for p, u in enumerate(topo.uuids) if p not in taken]
    chosen = select_whole(topo, free, size, ids(topo, must)).devices
    return {topo.position(u) for u in chosen}


def run_sequence(topo: Topology, sizes: Iterable[int], used: Iterable[int] = ()) -> list[set[int]]:
    taken = set(used)
    picks = []
    for size in sizes:
        got = pick(topo, size, taken)
        picks.append(got)
        taken |= got
    return picks


# --- 7-GPU PIX/PHB host -------------------------------------------------------------


def test_seven_gpu_three_takes_the_three_group() -> None:
    assert pick(PIX7, 3) == {0, 1, 2}


def test_seven_gpu_four_takes_the_four_group() -> None:
    assert pick(PIX7, 4) == {3, 4, 5, 6}


def test_seven_gpu_one_takes_the_smallest_group() -> None:
    assert pick(PIX7, 1) == {0}


def test_seven_gpu_one_fills_the_broken_group_first() -> None:
    assert pick(PIX7, 1, used={0}) == {1}
    assert pick(PIX7, 1, used={3}) == {0}  # both groups now have 3 free: lowest index
    assert pick(PIX7, 1, used={3, 4}) == {5}
    assert pick(PIX7, 1, used={3, 4, 5}) == {6}


def test_seven_gpu_sequences_keep_the_big_group_whole() -> None:
    assert run_sequence(PIX7, [1, 2]) == [{0}, {1, 2}]
    assert run_sequence(PIX7, [1, 4]) == [{0}, {3, 4, 5, 6}]
    assert run_sequence(PIX7, [1, 1, 1, 4]) == [{0}, {1}, {2}, {3, 4, 5, 6}]
    assert run_sequence(PIX7, [2, 4]) == [{0, 1}, {3, 4, 5, 6}]
    assert run_sequence(PIX7, [3, 4]) == [{0, 1, 2}, {3, 4, 5, 6}]


def test_seven_gpu_must_include_is_honoured() -> None:
    assert pick(PIX7, 3, must={4}) == {3, 4, 5}
    assert pick(PIX7, 2, must={0, 6}) == {0, 6}


# --- 8-GPU NVLink pairs ---------------------------------------------------------------


def test_nvlink_pairs_two_takes_a_best_pair() -> None:
    got = pick(NVPAIRS, 2)
    assert got in ({0, 1}, {2, 3}, {4, 5}, {6, 7})
    assert got == {0, 1}


def test_nvlink_pairs_single_gpus_take_widowed_gpus_first() -> None:
    assert pick(NVPAIRS, 1, used={0}) == {1}
    assert pick(NVPAIRS, 1, used={5}) == {4}
    assert pick(NVPAIRS, 1, used={0, 1, 6}) == {7}
    # A stream of single-GPU requests never breaks a pair while a widowed GPU is free.
    picks = run_sequence(NVPAIRS, [1] * 8)
    order = [next(iter(p)) for p in picks]
    for step, gpu in enumerate(order):
        before = set(order[:step])
        widowed = {g for g in range(8) if g not in before and (g ^ 1) in before}
        if widowed:
            assert gpu in widowed


def test_nvlink_pairs_four_stays_on_one_numa_node_with_two_pairs() -> None:
    assert pick(NVPAIRS, 4) == {0, 1, 2, 3}
    assert pick(NVPAIRS, 4, used={0}) == {4, 5, 6, 7}
    assert pick(NVPAIRS, 2, used={0, 2}) == {4, 5}


# --- DGX NV18 -------------------------------------------------------------------------


def test_dgx_all_nvlink_prefers_pcie_locality() -> None:
    assert pick(DGX, 2) == {0, 1}
    assert pick(DGX, 4) == {0, 1, 2, 3}
    assert pick(DGX, 4, used={1}) == {4, 5, 6, 7}
    assert pick(DGX, 3, used={0}) == {1, 2, 3}
    assert pick(DGX, 1, used={0}) == {1}


def test_dgx_never_spans_numa_when_it_fits() -> None:
    for mask in range(256):
        used = {i for i in range(8) if mask >> i & 1}
        free_per_node = [sum(1 for i in range(4 * n, 4 * n + 4) if i not in used) for n in (0, 1)]
        for size in range(1, max(free_per_node) + 1):
            got = pick(DGX, size, used)
            assert len({i // 4 for i in got}) == 1, (used, size, got)


# --- 2 x 4 NUMA -------------------------------------------------------------------------


def test_numa_requests_that_fit_one_node_never_span_two() -> None:
    for mask in range(256):
        used = {i for i in range(8) if mask >> i & 1}
        free_per_node = [sum(1 for i in range(4 * n, 4 * n + 4) if i not in used) for n in (0, 1)]
        for size in range(1, 9 - len(used)):
            got = pick(NUMA, size, used)
            assert len(got) == size
            if size <= max(free_per_node):
                assert len({i // 4 for i in got}) == 1, (used, size, got)


def test_numa_pairs_and_fragmentation() -> None:
    assert pick(NUMA, 2) == {0, 1}
    assert pick(NUMA, 3, used={0, 1}) == {4, 5, 6}
    assert pick(NUMA, 1, used={0}) == {1}
    assert run_sequence(NUMA, [3, 3]) == [{0, 1, 2}, {4, 5, 6}]
    assert run_sequence(NUMA, [1, 4]) == [{0}, {4, 5, 6, 7}]


# --- DGX-1V hybrid cube-mesh ------------------------------------------------------------


def test_cube_mesh_four_takes_a_fully_linked_quad() -> None:
    got = pick(CUBE, 4)
    assert got in ({0, 1, 2, 3}, {4, 5, 6, 7})
    got = pick(CUBE, 2)
    assert CUBE.nvlink_count(*ids(CUBE, sorted(got))) == 2


# --- API, errors ----------------------------------------------------------------------


def test_selection_reports_its_key() -> None:
    sel = select_whole(PIX7, PIX7.uuids, 3)
    assert sel.exhaustive
    assert sel.score == 150
    assert sel.tier == 2
    assert sel.devices == tuple(ids(PIX7, [0, 1, 2]))
    assert sel.key == evaluate(PIX7, sel.devices, PIX7.uuids)
    assert whole.preferred_allocation(PIX7, PIX7.uuids, [], 3) == list(sel.devices)


def test_fragment_order_puts_the_smallest_group_first() -> None:
    assert fragment_order(PIX7, PIX7.uuids)[:3] == ids(PIX7, [0, 1, 2])


def test_errors() -> None:
    u = PIX7.uuids
    with pytest.raises(Refused) as err:
        select_whole(PIX7, [*u[:2], "GPU-nope"], 1)
    assert err.value.code == "unknown_device"
    assert "GPU-nope" in err.value.message

    with pytest.raises(Refused) as err:
        select_whole(PIX7, u[:2], 3)
    assert err.value.code == "too_many_units"
    assert err.value.message == "asks 3 whole GPUs but only 2 are available"

    with pytest.raises(Refused) as err:
        select_whole(PIX7, u[:2], 0)
    assert err.value.code == "invalid_request"

    with pytest.raises(Refused) as err:
        select_whole(PIX7, u[:2], 1, must_include=[u[5]])
    assert err.value.code == "invalid_request"
    assert u[5] in err.value.message

    with pytest.raises(Refused) as err:
        select_whole(PIX7, u, 1, must_include=u[:2])
    assert err.value.code == "invalid_request"


def test_duplicates_in_available_are_ignored() -> None:
    u = PIX7.uuids
    assert select_whole(PIX7, [u[3], u[3], u[4]], 2).devices == (u[3], u[4])


def test_heuristic_path_matches_exhaustive_on_reference_boxes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expected = {
        (name, size): select_whole(topo, topo.uuids, size).key
        for name, topo in (("pix", PIX7), ("nv", NVPAIRS), ("numa", NUMA), ("dgx", DGX))
        for size in range(1, len(topo) + 1)
    }
    monkeypatch.setattr(whole, "EXHAUSTIVE_LIMIT", 0)
    for name, topo in (("pix", PIX7), ("nv", NVPAIRS), ("numa", NUMA), ("dgx", DGX)):
        for size in range(1, len(topo) + 1):
            sel = select_whole(topo, topo.uuids, size)
            assert not sel.exhaustive or size == len(topo)
            assert sel.key[:3] == expected[name, size][:3], (name, size)


def test_sixteen_gpus_exhaustive_search_stays_small() -> None:
    """The search's work, not its wall time (bench/allocation_quality.py times it): it
    scores 305 partial sets for 8 of 16 NVSwitch GPUs; 1,533 without the collapse of
    interchangeable GPUs; there are 39,202 partial sets of up to 8 in all."""
    topo = Topology.from_inventory(nvswitch_16())
    sel = select_whole(topo, topo.uuids, 8)
    assert sel.exhaustive
    assert {topo.position(u) for u in sel.devices} == set(range(8))
    assert 0 < sel.visited <= 1000


# --- brute-force equivalence ------------------------------------------------------------


def brute_force(topo: Topology, free: list[str], size: int, must: list[str]) -> whole.SetKey:
    rest = [u for u in free if u not in must]
    return min(
        evaluate(topo, [*must, *combo], free)
        for combo in itertools.combinations(rest, size - len(must))
    )


@st.composite
def random_case(draw: st.DrawFn) -> tuple[Topology, list[str], int, list[str]]:
    n = draw(st.integers(min_value=1, max_value=7))
    levels = [[0] * n for _ in range(n)]
    links = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            levels[a][b] = levels[b][a] = draw(st.sampled_from([0, 10, 20, 30, 40, 50]))
            links[a][b] = links[b][a] = draw(st.sampled_from([0, 0, 0, 1, 2]))
    numa = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    topo = Topology.from_inventory(inventory_from_matrix("rnd", levels, links, numa))
    free = draw(st.lists(st.sampled_from(topo.uuids), min_size=1, unique=True))
    size = draw(st.integers(min_value=1, max_value=len(free)))
    must = draw(st.lists(st.sampled_from(free), max_size=size, unique=True))
    return topo, free, size, must


@settings(max_examples=300, deadline=None)
@given(random_case())
def test_exhaustive_search_equals_brute_force(
    case: tuple[Topology, list[str], int, list[str]],
) -> None:
    topo, free, size, must = case
    sel = select_whole(topo, free, size, must)
    assert set(must) <= set(sel.devices)
    assert set(sel.devices) <= set(free)
    assert sel.key == brute_force(topo, free, size, must)
