"""gpulet's shares: placing a share and joining the core and memory halves of one.

Kubelet admits one pod at a time and, for each container, calls ``Allocate`` once per
resource, one call after the other, in no fixed order. A container's ``gpu-core`` and
``gpu-memory`` calls are therefore adjacent, and the rule is:

* a share call with no *open half* places a share best fit, taking the dimension it
  does not know proportionally (memory: cores/100 of the node's smallest card; cores:
  memory's fraction of the largest card, 1..99) -- or, when no card has that much
  left, the least (one memory unit, one core unit) -- and leaves it open;
* the next call, if it is of the *other* share resource and arrives within
  ``join_window_s``, joins: the share is resized to the real numbers on the same card,
  so both answers name the same GPU (kubelet merges their environments and keeps the
  first value of a duplicated variable). If the card cannot take the resized share the
  call fails with ``insufficient_capacity`` naming the card, and the first half stays
  as it was;
* any other call, and any call that fails, closes the open half, which keeps its
  guessed amount.

Core units that are a multiple of 100 are that many whole cards (the engine picks
them; they come with all their memory, so a ``gpu-memory`` request in the same
container is refused). A half that is never joined keeps its guessed amount in the
accounting but is not limited in the other dimension: ask for both resources in every
share container (gpu-manager requires it too). The one sequence this cannot tell apart
is a core-only container followed directly by a memory-first container; the core's
:meth:`~gpulet_allocator.decide.core.AllocatorCore.reconcile` detects it from
PodResources and reports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gpulet_allocator.decide.books import Allocation, Books, Undo
from gpulet_allocator.decide.engine import Owner, ShareAllocation, WholeAllocation, classify_cores
from gpulet_allocator.protocol import CORES_PER_GPU, MEMORY_UNIT_MIB
from gpulet_allocator.state.records import Grant, GrantKind
from gpulet_common.refusal import Refused

Half = Literal["core", "memory"]

# Kubelet asks for a container's resources in random order, and a memory answer
# given first could not name the whole cards a later core answer gets: refused in
# both orders, so that such a pod fails the same way every time.
_WHOLE_WITH_MEMORY = (
    "{} core units are whole cards, which come with all their memory: do not ask for "
    "gpulet.io/gpu-memory next to them (or ask nvidia.com/gpu for whole cards)"
)


@dataclass(slots=True)
class OpenHalf:
    allocation: str
    kind: Half
    at: float


class ShareJoiner:
    """Places gpulet's shares and joins their halves (the rule in the module docstring)."""

    def __init__(self, books: Books, join_window_s: float) -> None:
        self._books = books
        self.window_s = join_window_s
        #: The half waiting for its other resource, if any.
        self.open: OpenHalf | None = None

    def close(self) -> None:
        self.open = None

    def forget(self, allocation: str) -> None:
        """The allocation is gone (released or reverted): it is no open half."""
        if self.open is not None and self.open.allocation == allocation:
            self.open = None

    def after_revert(self) -> None:
        if self.open is not None and self._books.ledger.get(self.open.allocation) is None:
            self.open = None

    def place(
        self, key: str, resource: str, kind: GrantKind, units: int, undo: list[Undo]
    ) -> Grant:
        """One gpulet share call (``kind`` core or memory) of ``units`` device IDs."""
        books = self._books
        now = books.clock()
        if kind == "core":
            return self._core(key, resource, units, now, undo)
        self._check_memory(units)
        partner = self._joinable("core", now)
        if partner is not None:
            self._resize(partner, memory=units, half="memory", undo=undo)
            self.open = None
            grant = books.grant(key, resource, kind, units, partner.owner.allocation_id)
            return books.new_grant(grant, undo)
        whole = self._joinable_any("core", now)
        if whole is not None:
            cores = CORES_PER_GPU * len(whole.devices) if isinstance(whole, WholeAllocation) else 0
            raise Refused("invalid_request", _WHOLE_WITH_MEMORY.format(cores))
        cores = self._proportional_cores(units)
        self._place_half(key, cores, units, least=(1, units), asked=f"{units} memory units")
        self.open = OpenHalf(allocation=key, kind="memory", at=now)
        return books.new_grant(books.grant(key, resource, kind, units, key), undo, own=True)

    def _core(self, key: str, resource: str, units: int, now: float, undo: list[Undo]) -> Grant:
        books = self._books
        request = classify_cores(units)
        if request.kind == "whole":
            if self._joinable("memory", now) is not None:
                raise Refused("invalid_request", _WHOLE_WITH_MEMORY.format(units))
            books.ledger.allocate_whole(Owner(allocation_id=key), request.count)
            grant = books.new_grant(books.grant(key, resource, "core", units, key), undo, own=True)
            self.open = OpenHalf(allocation=key, kind="core", at=now)
            return grant
        partner = self._joinable("memory", now)
        if partner is not None:
            self._resize(partner, cores=request.cores, half="core", undo=undo)
            self.open = None
            grant = books.grant(key, resource, "core", units, partner.owner.allocation_id)
            return books.new_grant(grant, undo)
        memory = self._proportional_memory(request.cores)
        self._place_half(
            key,
            request.cores,
            memory,
            least=(request.cores, 1),
            asked=f"{request.cores} core units",
        )
        self.open = OpenHalf(allocation=key, kind="core", at=now)
        return books.new_grant(books.grant(key, resource, "core", units, key), undo, own=True)

    # --- sizes ---------------------------------------------------------------------------

    def _check_memory(self, units: int) -> None:
        sizes = self._books.card_sizes()
        if sizes and units > max(sizes):
            gpus = self._books.gpus.values()
            largest = max(gpus, key=lambda g: (g.memory_total_bytes, -g.index))
            raise Refused(
                "memory_exceeds_card",
                f"the share asks for {units} memory units ({units * MEMORY_UNIT_MIB} MiB) "
                f"but the largest card, {largest.uuid}, has {max(sizes)} "
                f"({max(sizes) * MEMORY_UNIT_MIB} MiB)",
            )

    def _proportional_memory(self, cores: int) -> int:
        sizes = self._books.card_sizes()
        if not sizes:
            return 1
        return max(1, math.ceil(cores * min(sizes) / CORES_PER_GPU))

    def _proportional_cores(self, units: int) -> int:
        sizes = self._books.card_sizes()
        if not sizes:
            return 1
        return min(CORES_PER_GPU - 1, max(1, math.ceil(units * CORES_PER_GPU / max(sizes))))

    # --- placing and joining -------------------------------------------------------------

    def _place_half(
        self, key: str, cores: int, memory: int, *, least: tuple[int, int], asked: str
    ) -> None:
        """Place a first half; if the proportional guess does not fit, the least share."""
        ledger = self._books.ledger
        try:
            ledger.allocate_share(Owner(allocation_id=key), cores, memory)
        except Refused as exc:
            if exc.code != "insufficient_capacity" or (cores, memory) == least:
                raise
        else:
            return
        try:
            ledger.allocate_share(Owner(allocation_id=key), *least)
        except Refused as exc:
            if exc.code != "insufficient_capacity":
                raise
            raise Refused(
                exc.code, f"no card has {asked} free for a share: {exc.message}"
            ) from None

    def _joinable_any(self, half: Half, now: float) -> Allocation | None:
        open_half = self.open
        if open_half is None or open_half.kind != half or now - open_half.at > self.window_s:
            return None
        return self._books.ledger.get(open_half.allocation)

    def _joinable(self, half: Half, now: float) -> ShareAllocation | None:
        alloc = self._joinable_any(half, now)
        return alloc if isinstance(alloc, ShareAllocation) else None

    def _resize(
        self,
        share: ShareAllocation,
        *,
        half: Half,
        undo: list[Undo],
        cores: int | None = None,
        memory: int | None = None,
    ) -> None:
        ledger = self._books.ledger
        new_cores = share.cores if cores is None else cores
        new_memory = share.memory_units if memory is None else memory
        if (new_cores, new_memory) == (share.cores, share.memory_units):
            return
        owner = share.owner
        ledger.release(owner.allocation_id)
        try:
            ledger.allocate_share(owner, new_cores, new_memory, device=share.device)
        except Refused as exc:
            # Restore skips the health check: the first half must come back as it was.
            ledger.restore([share])
            other = "memory" if half == "core" else "core"
            raise Refused(
                exc.code,
                f"this container's {other} request already placed its share on "
                f"{share.device}, which cannot take {new_cores} core units and "
                f"{new_memory} memory units: {exc.message}",
            ) from None

        def revert() -> None:
            ledger.release(owner.allocation_id)
            ledger.restore([share])

        undo.append(revert)
