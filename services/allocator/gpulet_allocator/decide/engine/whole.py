"""Whole-GPU selection: which free GPUs a multi-GPU (or single-GPU) request gets.

Design
------
Used for the device plugin's ``GetPreferredAllocation`` and whenever ``Allocate`` is
free to choose. The answer is the set of ``size`` GPUs (containing ``must_include``)
that is smallest under one lexicographic key, :class:`SetKey`:

1. **worst tier** inside the set (:mod:`.topology`): all-NVLink beats a set whose worst
   hop is a PCIe switch, which beats host bridge, NUMA node, system. This is the
   "order of preference" and gpu-manager's closest-common-ancestor rule. It goes
   before the score because a sum can be bought with one great pair: on two NUMA nodes
   a PIX pair plus a far GPU outscores three host-bridge neighbours, yet the job then
   spans sockets although it fits in one.
2. **NUMA nodes spanned**: among all-NVLink sets (NVSwitch boxes) keep the job on one
   socket when it fits.
3. **internal score**, maximised: go-gpuallocator's sum of pair scores, so more NVLinks
   and closer switches win.
4. **damage**, minimised: the summed score of the pairs between the set and the GPUs
   that stay free. Taking a GPU whose partner is already gone costs little; breaking
   an intact well-connected group costs a lot. This is the fragmentation rule: a
   1-GPU request lands in the smallest / already broken group, a 3-GPU request on the
   7-GPU host takes the 3-group and leaves the 4-group whole. (Minimising damage is
   maximising the total score of what remains free, for a fixed set score.)
5. **lowest GPU indices**, for determinism.

Search: when the number of candidate sets is at most :data:`EXHAUSTIVE_LIMIT` (C(16,8)
= 12,870 fits) the search is exhaustive and returns exactly the brute-force optimum.
It is a depth-first enumeration with incremental keys (adding a GPU costs O(size)),
started from a greedy incumbent and pruned on the monotone parts of the key (the worst
tier and the NUMA span only grow; the score is bounded above). Interchangeable GPUs --
same scores and tiers to every other GPU, same NUMA node -- are only taken in index
order, which collapses the symmetric boxes (NVSwitch) where nothing else prunes. Beyond
the limit a greedy build from every seed plus 1-swap hill climbing gives a good set.

Pure and synchronous: the caller passes the free GPUs; health and ownership are the
ledger's business.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import comb
from typing import NamedTuple

from gpulet_common.refusal import Refused

from .topology import Topology

EXHAUSTIVE_LIMIT = 20_000


class SetKey(NamedTuple):
    """The selection key of a set; smaller is better (see the module docstring)."""

    tier: int
    numa_span: int
    neg_score: int
    damage: int
    positions: tuple[int, ...]

    @property
    def score(self) -> int:
        return -self.neg_score


@dataclass(frozen=True)
class Selection:
    """A chosen set of GPUs (UUIDs in index order) and why it won."""

    devices: tuple[str, ...]
    key: SetKey
    exhaustive: bool
    # Partial sets the exhaustive search scored (0 for the heuristic): its work, which
    # the tests bound instead of a wall-clock time.
    visited: int = 0

    @property
    def score(self) -> int:
        return self.key.score

    @property
    def tier(self) -> int:
        return self.key.tier

    @property
    def damage(self) -> int:
        return self.key.damage


class _Ctx:
    """Per-decision arrays, indexed by topology position."""

    def __init__(self, topo: Topology, free: Sequence[int]) -> None:
        self.topo = topo
        self.scores = topo.scores
        self.tiers = topo.tiers
        n = len(topo)
        free_set = set(free)
        # Each NUMA node (None included) gets its own bit so that the span is a popcount.
        numa_ids: dict[int | None, int] = {}
        self.numa_bit = [1 << numa_ids.setdefault(topo.numa[p], len(numa_ids)) for p in range(n)]
        self.deg = [0] * n
        for p in free_set:
            row = self.scores[p]
            self.deg[p] = sum(row[q] for q in free_set if q != p)
        self.free = sorted(free_set)
        self.max_pair = max(
            (self.scores[a][b] for a in self.free for b in self.free if a != b), default=0
        )

    def key(self, positions: Iterable[int]) -> SetKey:
        ps = sorted(positions)
        tier = 0
        score = 0
        numa = 0
        degsum = 0
        for i, a in enumerate(ps):
            numa |= self.numa_bit[a]
            degsum += self.deg[a]
            srow, trow = self.scores[a], self.tiers[a]
            for b in ps[i + 1 :]:
                score += srow[b]
                if trow[b] > tier:
                    tier = trow[b]
        return SetKey(tier, numa.bit_count(), -score, degsum - 2 * score, tuple(ps))

    def predecessors(self, cand: Sequence[int]) -> list[int]:
        """For each position, the previous interchangeable candidate (or -1)."""
        pred = [-1] * len(self.topo)
        free = self.free
        last_of_class: list[int] = []
        for p in cand:
            for i, rep in enumerate(last_of_class):
                if self._interchangeable(p, rep, free):
                    pred[p] = rep
                    last_of_class[i] = p
                    break
            else:
                last_of_class.append(p)
        return pred

    def _interchangeable(self, p: int, q: int, free: Sequence[int]) -> bool:
        if self.numa_bit[p] != self.numa_bit[q]:
            return False
        sp, sq, tp, tq = self.scores[p], self.scores[q], self.tiers[p], self.tiers[q]
        return all(sp[r] == sq[r] and tp[r] == tq[r] for r in free if r != p and r != q)


def _validate(
    topo: Topology, available: Iterable[str], size: int, must_include: Iterable[str]
) -> tuple[list[int], list[int]]:
    avail = list(dict.fromkeys(available))
    must = list(dict.fromkeys(must_include))
    unknown = sorted({u for u in (*avail, *must) if u not in topo})
    if unknown:
        raise Refused("unknown_device", f"unknown GPU IDs: {', '.join(unknown)}")
    if size <= 0:
        raise Refused("invalid_request", f"the request size must be positive, got {size}")
    avail_set = set(avail)
    missing = [u for u in must if u not in avail_set]
    if missing:
        raise Refused(
            "invalid_request",
            f"must-include GPUs are not available: {', '.join(sorted(missing))}",
        )
    if len(must) > size:
        raise Refused(
            "invalid_request",
            f"must-include lists {len(must)} GPUs but the request is for {size}",
        )
    if size > len(avail):
        raise Refused(
            "too_many_units",
            f"asks {size} whole GPUs but only {len(avail)} are available",
        )
    must_pos = sorted(topo.position(u) for u in must)
    must_set = set(must_pos)
    cand = sorted(topo.position(u) for u in avail if topo.position(u) not in must_set)
    return must_pos, cand


def select_whole(
    topology: Topology,
    available: Iterable[str],
    size: int,
    must_include: Iterable[str] = (),
) -> Selection:
    """Pick ``size`` GPUs out of ``available`` (all of them free), including ``must_include``.

    Raises :class:`Refused`: ``unknown_device`` for IDs not in the topology,
    ``invalid_request`` for a non-positive size or a must-include that is not
    available or larger than the size, ``too_many_units`` when fewer than ``size``
    GPUs are available.
    """
    must, cand = _validate(topology, available, size, must_include)
    ctx = _Ctx(topology, must + cand)
    need = size - len(must)
    if need == 0:
        return _selection(ctx, must, exhaustive=True)
    if comb(len(cand), need) <= EXHAUSTIVE_LIMIT:
        positions, visited = _exhaustive(ctx, must, cand, size)
        return _selection(ctx, positions, exhaustive=True, visited=visited)
    return _selection(ctx, _heuristic(ctx, must, cand, size), exhaustive=False)


def preferred_allocation(
    topology: Topology,
    available: Iterable[str],
    must_include: Iterable[str],
    size: int,
) -> list[str]:
    """``GetPreferredAllocation`` semantics: the device IDs to prefer, in index order."""
    return list(select_whole(topology, available, size, must_include).devices)


def evaluate(topology: Topology, chosen: Iterable[str], free: Iterable[str]) -> SetKey:
    """The :class:`SetKey` of ``chosen`` when ``free`` (a superset) are the free GPUs."""
    chosen_pos = [topology.position(u) for u in chosen]
    free_pos = {topology.position(u) for u in free} | set(chosen_pos)
    return _Ctx(topology, sorted(free_pos)).key(chosen_pos)


def fragment_order(topology: Topology, free: Iterable[str]) -> list[str]:
    """Free GPUs from the best to the worst single-GPU choice (least damage first)."""
    ctx = _Ctx(topology, [topology.position(u) for u in free])
    order = sorted(ctx.free, key=lambda p: (ctx.deg[p], p))
    return [topology.uuids[p] for p in order]


def _selection(
    ctx: _Ctx, positions: Sequence[int], *, exhaustive: bool, visited: int = 0
) -> Selection:
    key = ctx.key(positions)
    devices = tuple(ctx.topo.uuids[p] for p in key.positions)
    return Selection(devices=devices, key=key, exhaustive=exhaustive, visited=visited)


def _exhaustive(ctx: _Ctx, must: list[int], cand: list[int], size: int) -> tuple[list[int], int]:
    """The optimum's positions and the number of partial sets scored on the way."""
    scores, tiers, numa_bit, deg = ctx.scores, ctx.tiers, ctx.numa_bit, ctx.deg
    pred = ctx.predecessors(cand)
    max_pair = ctx.max_pair
    total_pairs = size * (size - 1) // 2

    incumbent = _greedy(ctx, must, cand, size)
    best = ctx.key(incumbent)
    best_tier, best_numa, best_neg, best_damage = best[:4]
    best_pos = best.positions

    base = ctx.key(must)
    chosen = list(must)
    chosen_mask = sum(1 << p for p in must)
    ncand = len(cand)
    visited = 0

    def rec(start: int, tier: int, numa: int, score: int, degsum: int, left: int) -> None:
        nonlocal best_tier, best_numa, best_neg, best_damage, best_pos, chosen_mask, visited
        size_now = len(chosen) + 1
        for i in range(start, ncand - left + 1):
            p = cand[i]
            q = pred[p]
            # Swapping p for its skipped twin q gives the same key with lower indices.
            if q >= 0 and not chosen_mask >> q & 1:
                continue
            visited += 1
            srow, trow = scores[p], tiers[p]
            t = tier
            s = score
            for c in chosen:
                s += srow[c]
                if trow[c] > t:
                    t = trow[c]
            # The worst tier and the NUMA span only grow as GPUs are added, and the
            # score can grow by at most max_pair per missing pair: prune on all three.
            if t > best_tier:
                continue
            nm = numa | numa_bit[p]
            span = nm.bit_count()
            if t == best_tier:
                if span > best_numa:
                    continue
                if span == best_numa:
                    pairs_left = total_pairs - size_now * (size_now - 1) // 2
                    if s + pairs_left * max_pair < -best_neg:
                        continue
            d = degsum + deg[p]
            if left == 1:
                cand_key = (t, span, -s, d - 2 * s)
                best_head = (best_tier, best_numa, best_neg, best_damage)
                if cand_key < best_head or (
                    cand_key == best_head and tuple(sorted((*chosen, p))) < best_pos
                ):
                    best_tier, best_numa, best_neg, best_damage = cand_key
                    best_pos = tuple(sorted((*chosen, p)))
                continue
            chosen.append(p)
            chosen_mask |= 1 << p
            rec(i + 1, t, nm, s, d, left - 1)
            chosen_mask &= ~(1 << p)
            chosen.pop()

    base_numa = 0
    for p in must:
        base_numa |= numa_bit[p]
    base_deg = sum(deg[p] for p in must)
    rec(0, base.tier, base_numa, base.score, base_deg, size - len(must))
    return list(best_pos), visited


def _greedy(ctx: _Ctx, start: Sequence[int], pool: Sequence[int], size: int) -> list[int]:
    """Grow ``start`` one GPU at a time, each time by the GPU that keeps the key best."""
    if not start:
        # Seed with the best single GPU (least damage): it is where the exhaustive
        # optimum of fragmentation-sensitive requests usually lives.
        first = min(pool, key=lambda p: (ctx.deg[p], p))
        return _grow(ctx, [first], [p for p in pool if p != first], size)
    return _grow(ctx, list(start), list(pool), size)


def _grow(ctx: _Ctx, chosen: list[int], pool: list[int], size: int) -> list[int]:
    scores, tiers, numa_bit, deg = ctx.scores, ctx.tiers, ctx.numa_bit, ctx.deg
    key = ctx.key(chosen)
    tier, score = key.tier, key.score
    numa = 0
    for p in chosen:
        numa |= numa_bit[p]
    degsum = sum(deg[p] for p in chosen)
    remaining = list(pool)
    while len(chosen) < size:
        best: tuple[int, int, int, int, int] | None = None
        for p in remaining:
            t, s = tier, score
            srow, trow = scores[p], tiers[p]
            for c in chosen:
                s += srow[c]
                if trow[c] > t:
                    t = trow[c]
            nm = numa | numa_bit[p]
            k = (t, nm.bit_count(), -s, degsum + deg[p] - 2 * s, p)
            if best is None or k < best:
                best = k
        assert best is not None  # pool is large enough: checked by _validate
        p = best[4]
        tier, score = best[0], -best[2]
        numa |= numa_bit[p]
        degsum += deg[p]
        chosen.append(p)
        remaining.remove(p)
    return chosen


def _heuristic(ctx: _Ctx, must: list[int], cand: list[int], size: int) -> list[int]:
    """Greedy from every seed, then 1-swap hill climbing on the full key."""
    seeds = [[*must]] if must else [[p] for p in cand]
    best: SetKey | None = None
    for seed in seeds:
        pool = [p for p in cand if p not in seed]
        key = ctx.key(_grow(ctx, list(seed), pool, size))
        if best is None or key < best:
            best = key
    assert best is not None
    current = best
    must_set = set(must)
    improved = True
    while improved:
        improved = False
        members = set(current.positions)
        inside = [p for p in current.positions if p not in must_set]
        outside = [p for p in cand if p not in members]
        for a in inside:
            for b in outside:
                trial = ctx.key([*(p for p in current.positions if p != a), b])
                if trial < current:
                    current = trial
                    improved = True
                    break
            if improved:
                break
    return list(current.positions)
