"""Fractional GPU shares: gpu-manager's units and best-fit packing.

Design
------
A request is expressed in gpu-manager's units (``tencent.com/vcuda-*``):

* **core units**, 100 per card. Below 100 is a *share* of one card; a multiple of 100
  is that many *whole* cards (handled by :mod:`.whole`); anything else, such as 150,
  is refused -- half a card on one GPU plus a whole other one has no sensible
  placement or isolation. Zero and negative are refused.
* **memory units** of 256 MiB. A share must ask for at least one and never for more
  than the largest card holds (that could never fit, so it is refused up front with
  ``memory_exceeds_card`` rather than waiting forever as ``insufficient_capacity``).
  For whole-card requests the memory is the cards' and the units are ignored.

Placement is **best fit**: among the cards that fit both the cores and the memory, the
one with the fewest free core units, then the least free memory, then -- only between
untouched cards -- the caller's fragmentation rank, then the lowest index. Packing
onto already-shared cards keeps untouched cards available for whole-card requests
(a card holding shares is never offered whole, and a whole-allocated card never takes
shares; the ledger enforces both by what it passes in here).

Pure and synchronous.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from gpulet_allocator.protocol import CORES_PER_GPU, MEMORY_UNIT_BYTES
from gpulet_common.refusal import Refused


def format_units(units: int) -> str:
    """``40`` -> ``"40 units (10 GiB)"``, for messages people read."""
    gib = units * MEMORY_UNIT_BYTES / 1024**3
    return f"{units} units ({gib:g} GiB)"


@dataclass(frozen=True)
class CoreRequest:
    """A classified core request: ``share`` of ``cores`` units, or ``whole`` cards."""

    kind: Literal["share", "whole"]
    cores: int
    count: int


def classify_cores(cores: int) -> CoreRequest:
    """Split gpu-manager core units into a share or a number of whole cards."""
    if cores <= 0:
        raise Refused("invalid_core_units", f"core units must be positive, got {cores}")
    if cores < CORES_PER_GPU:
        return CoreRequest(kind="share", cores=cores, count=1)
    if cores % CORES_PER_GPU:
        raise Refused(
            "invalid_core_units",
            f"core units must be below {CORES_PER_GPU} (a share) or a multiple of "
            f"{CORES_PER_GPU} (whole cards), got {cores}",
        )
    return CoreRequest(kind="whole", cores=cores, count=cores // CORES_PER_GPU)


@dataclass(frozen=True)
class CardFree:
    """What one card still has for shares (the ledger fills this in)."""

    uuid: str
    index: int
    cores_free: int
    memory_free: int
    memory_total: int

    @property
    def untouched(self) -> bool:
        return self.cores_free >= CORES_PER_GPU and self.memory_free >= self.memory_total


def validate_share(cores: int, memory: int, largest_card: tuple[str, int] | None) -> None:
    """Refuse a share that is malformed or could never fit on any card of the node.

    ``largest_card`` is ``(uuid, memory units)`` of the node's largest card, whatever
    it holds now; ``None`` when the node has no card.
    """
    if cores <= 0:
        raise Refused("invalid_core_units", f"core units must be positive, got {cores}")
    if cores >= CORES_PER_GPU:
        raise Refused(
            "too_many_units",
            f"a share takes less than one card: asks {cores} core units, a card has "
            f"{CORES_PER_GPU}; ask for whole cards in multiples of {CORES_PER_GPU}",
        )
    if memory <= 0:
        raise Refused(
            "invalid_request",
            f"a share needs at least one memory unit of 256 MiB, got {memory}",
        )
    if largest_card is None:
        raise Refused("insufficient_capacity", "the node has no GPU to share")
    uuid, units = largest_card
    if memory > units:
        raise Refused(
            "memory_exceeds_card",
            f"the share asks for {format_units(memory)} of memory but the largest card, "
            f"{uuid}, has {format_units(units)}",
        )


def pick_share(
    cards: Sequence[CardFree],
    cores: int,
    memory: int,
    *,
    rank: Mapping[str, int] | None = None,
    largest_card: tuple[str, int] | None = None,
) -> CardFree:
    """Best-fit placement of a share of ``cores`` units and ``memory`` units.

    ``cards`` are the cards that may take shares (healthy, not whole-allocated).
    ``rank`` orders untouched cards (lower first), e.g. by how little taking them
    fragments the whole-card topology; cards missing from it come after ranked ones.
    ``largest_card`` defaults to the largest of ``cards``; the ledger passes the
    node's largest so that a card busy right now does not turn "wait" into "never".
    """
    if largest_card is None and cards:
        top = max(cards, key=lambda c: (c.memory_total, -c.index))
        largest_card = (top.uuid, top.memory_total)
    validate_share(cores, memory, largest_card)
    fits = [c for c in cards if c.cores_free >= cores and c.memory_free >= memory]
    if not fits:
        most_cores = max(cards, key=lambda c: (c.cores_free, c.memory_free), default=None)
        most_memory = max(cards, key=lambda c: (c.memory_free, c.cores_free), default=None)
        detail = "no card takes shares"
        if most_cores is not None and most_memory is not None:
            detail = (
                f"most free cores: {most_cores.uuid} with {most_cores.cores_free} core units "
                f"and {format_units(most_cores.memory_free)}; most free memory: "
                f"{most_memory.uuid} with {most_memory.cores_free} core units and "
                f"{format_units(most_memory.memory_free)}"
            )
        raise Refused(
            "insufficient_capacity",
            f"no GPU has {cores} core units and {format_units(memory)} free ({detail})",
        )
    order = rank or {}
    unranked = len(order)

    def fit_key(c: CardFree) -> tuple[int, int, int, int]:
        tie = order.get(c.uuid, unranked) if c.untouched else 0
        return (c.cores_free, c.memory_free, tie, c.index)

    return min(fits, key=fit_key)
