"""NVLinks that went down, as the allocator's engine sees them (issue 15).

The collector counts only active links in a pair's ``nvlinks`` and the down ones in
``nvlinks_down``: the engine scores what is up, and an inventory from a collector
that predates the field still decodes (the field is an addition with a default).
"""

from __future__ import annotations

import msgspec

from gpulet_allocator.decide.engine.topology import NVLINK_SCORE, Topology
from gpulet_allocator.decide.engine.whole import select_whole
from gpulet_common import codec
from gpulet_common.messages import GpuInfo, Inventory, PeerLink

# Four GPUs behind one PCIe switch: 0-1 four NVLinks, 2-3 two, 0-2 and 1-3 one.
LINKS = {(0, 1): 4, (2, 3): 2, (0, 2): 1, (1, 3): 1}


def gpus(down: dict[tuple[int, int], int] | None = None) -> list[GpuInfo]:
    down = down or {}

    def peer(a: int, b: int) -> PeerLink:
        key = (min(a, b), max(a, b))
        total, gone = LINKS.get(key, 0), down.get(key, 0)
        return PeerLink(
            peer_uuid=f"GPU-{b}", peer_index=b, level=10, nvlinks=total - gone, nvlinks_down=gone
        )

    return [
        GpuInfo(uuid=f"GPU-{a}", index=a, topology=[peer(a, b) for b in range(4) if b != a])
        for a in range(4)
    ]


def best_pair(topology: Topology) -> list[str]:
    return sorted(select_whole(topology, list(topology.uuids), 2).devices)


def test_links_down_are_not_scored() -> None:
    up = Topology.from_gpus(gpus())
    assert up.nvlink_count("GPU-0", "GPU-1") == 4
    assert best_pair(up) == ["GPU-0", "GPU-1"]

    three_down = Topology.from_gpus(gpus({(0, 1): 3}))
    assert three_down.nvlink_count("GPU-0", "GPU-1") == 1
    assert (
        up.pair_score("GPU-0", "GPU-1") - three_down.pair_score("GPU-0", "GPU-1")
        == 3 * NVLINK_SCORE
    )
    assert best_pair(three_down) == ["GPU-2", "GPU-3"]

    # All four down: the pair is PCIe-only, a worse tier than any NVLink pair.
    all_down = Topology.from_gpus(gpus({(0, 1): 4}))
    assert all_down.tier("GPU-0", "GPU-1") > all_down.tier("GPU-2", "GPU-3")
    assert best_pair(all_down) == ["GPU-2", "GPU-3"]


def test_the_new_fields_are_additions() -> None:
    inventory = Inventory(node="n", gpus=gpus({(0, 1): 3}))
    wire = codec.INVENTORY.encode(inventory)
    assert codec.INVENTORY.decode(wire) == inventory
    # A consumer that predates the fields ignores them; a producer that predates them
    # sends none, and the defaults say "nothing down".
    plain = msgspec.json.decode(wire)
    for gpu in plain["gpus"]:
        gpu.pop("nvlinks_up", None)
        gpu.pop("nvlinks_down", None)
        for link in gpu["topology"]:
            link.pop("nvlinks_down", None)
    old = codec.INVENTORY.decode(msgspec.json.encode(plain))
    assert all(p.nvlinks_down == 0 for g in old.gpus for p in g.topology)
    assert all(g.nvlinks_down == [] for g in old.gpus)
    assert Topology.from_gpus(old.gpus).nvlink_count("GPU-0", "GPU-1") == 1
