"""The allocator's allocation engine: pure placement logic.

Design
------
Layers, bottom up (each only imports those below it):

Refusals are :class:`gpulet_common.refusal.Refused` with a code of the one table
(:data:`gpulet_common.refusal.STATUS`) and a message for the person reading
``kubectl describe pod``; the units are the allocator contract's
(:mod:`gpulet_allocator.protocol`).

* :mod:`.topology` -- pair levels, NVLinks, scores, tiers and gpu-manager's tree,
  built from the collector's ``Inventory``.
* :mod:`.whole` -- which whole GPUs a request gets (topology- and
  fragmentation-aware); :mod:`.shares` -- gpu-manager units and best-fit packing.
* :mod:`.ledger` -- the allocation state, its invariants and idempotency.

The on-disk copy of the ledger is the service's (:mod:`gpulet_allocator.state.checkpoint`); the
reference machine topologies used by tests and benches are the tests' oracle
(``tests/support/reference.py``). Nothing here knows about gRPC, NATS or asyncio;
the plugin and service layers call in.
"""

from .ledger import (
    Allocation,
    DeviceState,
    Ledger,
    Owner,
    ShareAllocation,
    WholeAllocation,
)
from .shares import CardFree, classify_cores, pick_share
from .topology import Topology, TopologyTree, TreeNode, pair_score
from .whole import Selection, SetKey, fragment_order, preferred_allocation, select_whole

__all__ = [
    "Allocation",
    "CardFree",
    "DeviceState",
    "Ledger",
    "Owner",
    "Selection",
    "SetKey",
    "ShareAllocation",
    "Topology",
    "TopologyTree",
    "TreeNode",
    "WholeAllocation",
    "classify_cores",
    "fragment_order",
    "pair_score",
    "pick_share",
    "preferred_allocation",
    "select_whole",
]
