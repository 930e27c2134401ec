"""The GPU topology of one node, as the allocator sees it.

Design
------
The collector reports, for every GPU, a :class:`~gpulet_common.messages.PeerLink` per
other GPU: the NVML common-ancestor level of the PCIe path and the number of NVLinks.
This module turns that into immutable matrices indexed by *position* (GPUs sorted by
NVML index), because the selection code in :mod:`.whole` evaluates thousands of
candidate sets per decision and must not hash strings in its inner loop. Building a
:class:`Topology` is linear in the inventory (the links it lists, kept per GPU in a
dict); a matrix row is computed the first time the selection reads it, so an inventory
of ``limits.max_gpus`` GPUs costs milliseconds, not the seconds a dense all-pairs
build took (1.3 s at 1,024 GPUs).

Two views of the same data:

* **Pair scores** (go-gpuallocator's): ``100`` per NVLink *plus* the PCIe score of the
  path -- same board 60, single switch (PIX) 50, multiple switches (PXB) 40, host
  bridge (PHB) 30, same NUMA node (NODE) 20, across CPUs (SYS) 10. Adding the PCIe part
  to the NVLink part (as go-gpuallocator does) keeps every NVLink pair above every
  PCIe-only pair (110 > 60) while still telling NVLink pairs apart by locality.
* **Tiers**, a coarse class per pair: NVLink (any number of links) is tier 0, then one
  tier per PCIe level (board 1, PIX 2, PXB 3, PHB 4, NODE 5, SYS 6). The selection
  minimises the *worst* tier inside a set first, which is the "order of preference"
  NVLink > switch > host bridge > NUMA node > system, and gpu-manager's "closest common
  ancestor" rule.

gpu-manager's topology **tree** (ROOT, then one node per common-ancestor level, then
the GPUs as leaves) is built from the PCIe levels alone; a node counts its free leaves
from a bit mask of free positions. The selection does not walk it -- the damage term
of :mod:`.whole` already prefers the smallest / already broken group, and unlike the
tree it also sees NVLinks -- so the tree serves as the operator's view
(:meth:`TopologyTree.render`) and as a cross-check in tests and benches.

NVLinks that went down: the collector counts only *active* links in a pair's
``nvlinks`` and the ones that went down in ``nvlinks_down`` (re-read on its slow
period, the inventory republished on a change). So a link down leaves the scores and
tiers with the next inventory, and a link back up returns to them; ``nvlinks_down``
itself is not scored.

Data quality: NVML answers each ordered pair separately. When the two directions
disagree the worse answer wins (higher level, fewer links): over-estimating a link
would place a job on a path slower than promised. A missing level falls back to NUMA
affinity (same known NUMA node -> NODE, otherwise SYSTEM).

Pure and synchronous: no NVML, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import overload

from gpulet_common.messages import GpuInfo, Inventory

# NVML common-ancestor levels (nvmlGpuTopologyLevel_t).
LEVEL_INTERNAL = 0
LEVEL_SINGLE = 10
LEVEL_MULTIPLE = 20
LEVEL_HOSTBRIDGE = 30
LEVEL_NODE = 40
LEVEL_SYSTEM = 50
LEVELS: tuple[int, ...] = (
    LEVEL_INTERNAL,
    LEVEL_SINGLE,
    LEVEL_MULTIPLE,
    LEVEL_HOSTBRIDGE,
    LEVEL_NODE,
    LEVEL_SYSTEM,
)
LEVEL_NAMES: dict[int, str] = {
    LEVEL_INTERNAL: "BOARD",
    LEVEL_SINGLE: "PIX",
    LEVEL_MULTIPLE: "PXB",
    LEVEL_HOSTBRIDGE: "PHB",
    LEVEL_NODE: "NODE",
    LEVEL_SYSTEM: "SYS",
}

# go-gpuallocator's pair scores.
NVLINK_SCORE = 100
PCIE_SCORES: dict[int, int] = {
    LEVEL_INTERNAL: 60,
    LEVEL_SINGLE: 50,
    LEVEL_MULTIPLE: 40,
    LEVEL_HOSTBRIDGE: 30,
    LEVEL_NODE: 20,
    LEVEL_SYSTEM: 10,
}

TIER_NVLINK = 0
TIER_NAMES: tuple[str, ...] = ("NV", "BOARD", "PIX", "PXB", "PHB", "NODE", "SYS")

# Pseudo levels of the tree's root and leaves, outside NVML's range on purpose.
ROOT_LEVEL = 100
LEAF_LEVEL = -1


def normalize_level(level: int | None, numa_a: int | None, numa_b: int | None) -> int:
    """Map any reported level onto one of :data:`LEVELS`.

    An unknown value rounds *up* to the next known level: a level we cannot name is
    at best as far as the next one we can.
    """
    if level is None:
        if numa_a is not None and numa_a == numa_b:
            return LEVEL_NODE
        return LEVEL_SYSTEM
    for known in LEVELS:
        if level <= known:
            return known
    return LEVEL_SYSTEM


def pair_score(level: int, nvlinks: int) -> int:
    """go-gpuallocator's score of one pair: 100 per NVLink plus the PCIe score."""
    return NVLINK_SCORE * max(nvlinks, 0) + PCIE_SCORES[level]


def pair_tier(level: int, nvlinks: int) -> int:
    """0 for any NVLink, else 1 + level/10 (board 1 ... system 6)."""
    if nvlinks > 0:
        return TIER_NVLINK
    return 1 + level // 10


@dataclass(frozen=True)
class TreeNode:
    """A node of gpu-manager's topology tree.

    ``level`` is the NVML level of the common ancestor of its GPUs (``ROOT_LEVEL`` for
    the root, ``LEAF_LEVEL`` for a GPU); ``mask`` holds their positions as bits.
    """

    level: int
    mask: int
    children: tuple[TreeNode, ...] = ()

    @property
    def size(self) -> int:
        return self.mask.bit_count()

    @property
    def is_leaf(self) -> bool:
        return self.level == LEAF_LEVEL

    def free_leaves(self, free_mask: int) -> int:
        """How many of this node's GPUs are completely free."""
        return (self.mask & free_mask).bit_count()

    def positions(self) -> list[int]:
        return [p for p in range(self.mask.bit_length()) if self.mask >> p & 1]

    def walk(self) -> Iterator[TreeNode]:
        yield self
        for child in self.children:
            yield from child.walk()


@dataclass(frozen=True)
class TopologyTree:
    root: TreeNode
    topology: Topology

    def nodes(self) -> Iterator[TreeNode]:
        return self.root.walk()

    def render(self, free: Iterable[str] | None = None) -> str:
        """An indented view, e.g. ``ROOT / PHB 7/7 / PIX 3/3: GPU0 GPU1 GPU2``."""
        topo = self.topology
        free_mask = topo.mask_of(free) if free is not None else (1 << len(topo)) - 1
        lines: list[str] = []

        def visit(node: TreeNode, depth: int) -> None:
            pad = "  " * depth
            if node.is_leaf:
                return
            name = "ROOT" if node.level == ROOT_LEVEL else LEVEL_NAMES[node.level]
            leaves = [c for c in node.children if c.is_leaf]
            gpus = " ".join(f"GPU{topo.gpu_indices[c.positions()[0]]}" for c in leaves)
            counts = f"{node.free_leaves(free_mask)}/{node.size}"
            lines.append(f"{pad}{name} {counts}" + (f": {gpus}" if gpus else ""))
            for child in node.children:
                visit(child, depth + 1)

        visit(self.root, 0)
        return "\n".join(lines)


Report = tuple[int | None, int]


class _Rows(Sequence[tuple[int, ...]]):
    """A square matrix whose rows are computed on first use and kept.

    Building a node's topology must cost what its inventory costs (the links it
    lists), not the square of its GPU count: a 1,024-GPU inventory took 1.3 s to turn
    into dense matrices, and a hostile 10,000-GPU one held the agent for minutes.
    The selection reads the rows of the GPUs it considers; only those are built.
    """

    __slots__ = ("_make", "_rows")

    def __init__(self, n: int, make: Callable[[int], tuple[int, ...]]) -> None:
        self._rows: list[tuple[int, ...] | None] = [None] * n
        self._make = make

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, a: int) -> tuple[int, ...]: ...
    @overload
    def __getitem__(self, a: slice) -> Sequence[tuple[int, ...]]: ...
    def __getitem__(self, a: int | slice) -> tuple[int, ...] | Sequence[tuple[int, ...]]:
        if isinstance(a, slice):
            return [self[i] for i in range(len(self._rows))[a]]
        row = self._rows[a]
        if row is None:
            row = self._rows[a] = self._make(a)
        return row


class Topology:
    """Pairwise levels, NVLink counts, scores and tiers of a node's GPUs.

    Positions ``0..n-1`` follow the NVML index, so "lower positions" is "lower GPU
    indices" everywhere in the engine. Built in time linear in the inventory (GPUs
    plus the peer links they list); the pair matrices (``levels``, ``nvlinks``,
    ``scores``, ``tiers``) are indexed ``m[a][b]`` and build a row on its first use.
    """

    def __init__(
        self,
        uuids: Sequence[str],
        gpu_indices: Sequence[int],
        numa: Sequence[int | None],
        reports: Sequence[Mapping[int, Report]],
    ) -> None:
        n = len(uuids)
        if len(set(uuids)) != n:
            raise ValueError("duplicate GPU UUIDs in topology")
        if not (len(gpu_indices) == len(numa) == len(reports) == n):
            raise ValueError("topology vectors must all have one entry per GPU")
        self.uuids: tuple[str, ...] = tuple(uuids)
        self.gpu_indices: tuple[int, ...] = tuple(gpu_indices)
        self.numa: tuple[int | None, ...] = tuple(numa)
        # reports[a][b]: what GPU a says about GPU b, as (level or None, nvlinks).
        self._reports: tuple[Mapping[int, Report], ...] = tuple(reports)
        # The reverse: which GPUs said something about GPU b (linear to build).
        reported_by: list[list[int]] = [[] for _ in range(n)]
        for a, said in enumerate(self._reports):
            for b in said:
                if 0 <= b < n:
                    reported_by[b].append(a)
        self._reported_by: tuple[tuple[int, ...], ...] = tuple(tuple(r) for r in reported_by)
        self._pair_rows: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.positions: dict[str, int] = {u: p for p, u in enumerate(self.uuids)}
        self.levels: Sequence[tuple[int, ...]] = _Rows(n, self._level_row)
        self.nvlinks: Sequence[tuple[int, ...]] = _Rows(n, self._nvlink_row)
        self.scores: Sequence[tuple[int, ...]] = _Rows(n, self._score_row)
        self.tiers: Sequence[tuple[int, ...]] = _Rows(n, self._tier_row)

    # --- construction ----------------------------------------------------------------

    @classmethod
    def from_inventory(cls, inventory: Inventory) -> Topology:
        return cls.from_gpus(inventory.gpus)

    @classmethod
    def from_gpus(cls, gpus: Iterable[GpuInfo]) -> Topology:
        """The topology of the GPUs, linear in the GPUs and the links they list.

        A UUID listed twice keeps its first entry (the bus refuses such an inventory;
        the engine must still never die of one).
        """
        unique: dict[str, GpuInfo] = {}
        for g in gpus:
            unique.setdefault(g.uuid, g)
        ordered = sorted(unique.values(), key=lambda g: (g.index, g.uuid))
        n = len(ordered)
        by_uuid = {g.uuid: p for p, g in enumerate(ordered)}
        by_index: dict[int, int] = {}
        for p, g in enumerate(ordered):
            by_index.setdefault(g.index, p)
        reports: list[dict[int, Report]] = [{} for _ in range(n)]
        for a, g in enumerate(ordered):
            said = reports[a]
            for link in g.topology:
                b = by_uuid.get(link.peer_uuid)
                if b is None and not link.peer_uuid:
                    b = by_index.get(link.peer_index)
                if b is None or b == a:
                    continue
                said[b] = (link.level, link.nvlinks)
        return cls(
            uuids=[g.uuid for g in ordered],
            gpu_indices=[g.index for g in ordered],
            numa=[g.numa_node for g in ordered],
            reports=reports,
        )

    def rows_built(self) -> int:
        """How many matrix rows have been computed so far (for tests and benches)."""
        return sum(
            row is not None
            for rows in (self.levels, self.nvlinks, self.scores, self.tiers)
            if isinstance(rows, _Rows)
            for row in rows._rows
        )

    # --- pair matrices, one row at a time ---------------------------------------------

    def _pair(self, a: int, b: int) -> tuple[int, int]:
        """(level, nvlinks) of a pair: the worse of the two directions' answers."""
        if a == b:
            return LEVEL_INTERNAL, 0
        ab = self._reports[a].get(b)
        ba = self._reports[b].get(a)
        if ab is None and ba is None:
            return normalize_level(None, self.numa[a], self.numa[b]), 0
        if ab is None or ba is None:
            only = ab if ab is not None else ba
            assert only is not None
            level, nv = only
        else:
            known = [lv for lv in (ab[0], ba[0]) if lv is not None]
            level = max(known) if known else None
            nv = min(ab[1], ba[1])
        return normalize_level(level, self.numa[a], self.numa[b]), max(nv, 0)

    def _pair_row(self, a: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Row ``a`` of the levels and of the NVLink counts: the NUMA fallback for
        every pair, then the pairs either GPU reported. O(GPUs + links of ``a``)."""
        cached = self._pair_rows.get(a)
        if cached is not None:
            return cached
        numa_a = self.numa[a]
        if numa_a is None:
            levels = [LEVEL_SYSTEM] * len(self.uuids)
        else:
            levels = [LEVEL_NODE if x == numa_a else LEVEL_SYSTEM for x in self.numa]
        links = [0] * len(self.uuids)
        for b in {*self._reports[a], *self._reported_by[a]}:
            levels[b], links[b] = self._pair(a, b)
        levels[a], links[a] = LEVEL_INTERNAL, 0
        row = (tuple(levels), tuple(links))
        self._pair_rows[a] = row
        return row

    def _level_row(self, a: int) -> tuple[int, ...]:
        return self._pair_row(a)[0]

    def _nvlink_row(self, a: int) -> tuple[int, ...]:
        return self._pair_row(a)[1]

    def _score_row(self, a: int) -> tuple[int, ...]:
        levels, links = self._pair_row(a)
        row = [PCIE_SCORES[lv] + NVLINK_SCORE * nv for lv, nv in zip(levels, links, strict=True)]
        row[a] = 0
        return tuple(row)

    def _tier_row(self, a: int) -> tuple[int, ...]:
        levels, links = self._pair_row(a)
        row = [
            TIER_NVLINK if nv > 0 else 1 + lv // 10 for lv, nv in zip(levels, links, strict=True)
        ]
        row[a] = TIER_NVLINK
        return tuple(row)

    # --- queries ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.uuids)

    def __contains__(self, uuid: object) -> bool:
        return uuid in self.positions

    def position(self, uuid: str) -> int:
        """The dense position of a GPU; ``KeyError`` for an unknown UUID."""
        return self.positions[uuid]

    def mask_of(self, uuids: Iterable[str]) -> int:
        mask = 0
        for u in uuids:
            mask |= 1 << self.positions[u]
        return mask

    def level(self, a: str, b: str) -> int:
        return self.levels[self.positions[a]][self.positions[b]]

    def nvlink_count(self, a: str, b: str) -> int:
        return self.nvlinks[self.positions[a]][self.positions[b]]

    def pair_score(self, a: str, b: str) -> int:
        return self.scores[self.positions[a]][self.positions[b]]

    def tier(self, a: str, b: str) -> int:
        return self.tiers[self.positions[a]][self.positions[b]]

    def set_score(self, uuids: Iterable[str]) -> int:
        """Sum of the pair scores inside a set (go-gpuallocator's set score)."""
        ps = [self.positions[u] for u in uuids]
        return sum(self.scores[a][b] for i, a in enumerate(ps) for b in ps[i + 1 :])

    def set_tier(self, uuids: Iterable[str]) -> int:
        """The worst pair tier inside a set (0 for fewer than two GPUs)."""
        ps = [self.positions[u] for u in uuids]
        return max((self.tiers[a][b] for i, a in enumerate(ps) for b in ps[i + 1 :]), default=0)

    def numa_span(self, uuids: Iterable[str]) -> int:
        """How many NUMA nodes a set touches (an unknown node counts as one)."""
        return len({self.numa[self.positions[u]] for u in uuids})

    @cached_property
    def tree(self) -> TopologyTree:
        n = len(self)
        top = self._build(frozenset(range(n))) if n else TreeNode(level=LEAF_LEVEL, mask=0)
        children = (top,) if n else ()
        root = TreeNode(level=ROOT_LEVEL, mask=(1 << n) - 1, children=children)
        return TopologyTree(root=root, topology=self)

    def _build(self, members: frozenset[int]) -> TreeNode:
        mask = sum(1 << p for p in members)
        if len(members) == 1:
            return TreeNode(level=LEAF_LEVEL, mask=mask)
        ps = sorted(members)
        lca = max(self.levels[a][b] for i, a in enumerate(ps) for b in ps[i + 1 :])
        if lca == LEVEL_INTERNAL:
            leaves = tuple(TreeNode(level=LEAF_LEVEL, mask=1 << p) for p in ps)
            return TreeNode(level=lca, mask=mask, children=leaves)
        # Components of "closer than the common ancestor": for NVML's tree-shaped
        # levels these are exactly the subtrees below it.
        seen: set[int] = set()
        groups: list[frozenset[int]] = []
        for start in ps:
            if start in seen:
                continue
            stack, group = [start], {start}
            while stack:
                a = stack.pop()
                for b in ps:
                    if b not in group and self.levels[a][b] < lca:
                        group.add(b)
                        stack.append(b)
            seen |= group
            groups.append(frozenset(group))
        children = tuple(self._build(g) for g in groups)
        return TreeNode(level=lca, mask=mask, children=children)
