"""The allocation ledger: who holds which GPU, whole or in shares.

Design
------
The ledger is the allocator's single source of truth. It records, per request key
``(allocation_id, container)``, either a :class:`WholeAllocation` (a set of whole GPUs) or a
:class:`ShareAllocation` (core and memory units of one GPU), and derives from those
the free capacity of every card. Layers:

* :mod:`.topology`, :mod:`.whole`, :mod:`.shares` decide *where*; they are pure
  functions of what the ledger hands them.
* The ledger decides *whether*: it validates the request, enforces the invariants and
  records the result. It never does I/O; the service's :mod:`gpulet_allocator.state.checkpoint`
  persists what it holds (through :mod:`gpulet_allocator.decide.core`) and restores it at start.
* The service around it (gRPC device plugin, NATS API) serialises calls; the ledger
  is not thread-safe by itself.

Invariants, checked on every mutation (and property-tested):

* a card holds either one whole allocation or shares, never both;
* the shares of a card never exceed 100 core units nor the card's memory units;
* a card's shares are all the device plugin's or all DRA claims' (``claim``), never
  both: each side's scheduler knows only its own;
* unhealthy or lost (absent from the inventory) cards take no *new* allocation, but
  what they already hold stays recorded until released -- the pod still runs there;
* a MIG-enabled GPU, or one with a pending MIG mode change, takes no new allocation,
  whole or shared (:func:`gpulet_common.migrules.parent_block`: ``mig_enabled`` /
  ``mig_pending``); its MIG devices are cards of their own (``parent`` set), each
  taken whole by one allocation at most (a :class:`WholeAllocation` naming MIG UUIDs),
  never shared, and unusable while their parent is unhealthy or lost. A held MIG
  device keeps its parent and its (GPU instance, compute instance) after it leaves the
  inventory, in the checkpoint too (``mig_links``): while it is held, the parent is
  refused whole and shared (MIG disabled under a holder) and a device re-created in
  the same place under a new UUID is refused (the same DRA name and
  ``/dev/nvidia-caps`` nodes as the holder's).
* a GPU is time-sliced, or held whole, or in shares, never two at once: its replicas
  (cards ``<uuid>::<n>``, ``parent`` set, like MIG devices, each taken whole once) are
  refused while it is held whole or shared, and it is refused whole and shared while
  it is time-sliced or any replica of it is held (code ``time_sliced``; rules:
  :mod:`gpulet_allocator.timeslicing`).

**Idempotency.** Allocating again under a key that already holds an equivalent
allocation returns the recorded one and changes nothing. After a restart the
checkpoint is restored first, so a kubelet retry of ``Allocate`` gets the same GPUs
instead of a second set: a restart never double-allocates. A *different* request
under a busy key is refused (``invalid_request``) rather than silently replaced.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gpulet_allocator.protocol import CORES_PER_GPU
from gpulet_common.refusal import Refused

from .cards import CardBook, card_free
from .entries import Allocation, DeviceState, Owner, RequestKey, ShareAllocation, WholeAllocation
from .shares import classify_cores, pick_share, validate_share
from .whole import select_whole

# The entries live in .entries; importers of this module find them here too.
__all__ = [
    "Allocation",
    "DeviceState",
    "Ledger",
    "Owner",
    "RequestKey",
    "ShareAllocation",
    "WholeAllocation",
]


class Ledger(CardBook):
    """Allocation state of one node. See the module docstring for the rules."""

    # --- inventory and health ------------------------------------------------------

    # --- allocation ----------------------------------------------------------------

    def allocate(
        self,
        owner: Owner,
        cores: int,
        memory_units: int = 0,
        *,
        must_include: Iterable[str] = (),
    ) -> Allocation:
        """gpu-manager style: ``cores`` < 100 is a share, multiples of 100 whole cards.

        ``memory_units`` is required for a share and ignored for whole cards (they come
        with all their memory). A share's ``must_include`` names its one card.
        """
        request = classify_cores(cores)
        if memory_units < 0:
            raise Refused(
                "invalid_request", f"memory units must not be negative, got {memory_units}"
            )
        if request.kind == "whole":
            return self.allocate_whole(owner, request.count, must_include=must_include)
        named = list(dict.fromkeys(must_include))
        if len(named) > 1:
            raise Refused(
                "invalid_request",
                f"a share lives on one GPU but must-include names {len(named)}: {', '.join(named)}",
            )
        return self.allocate_share(
            owner, request.cores, memory_units, device=named[0] if named else None
        )

    def allocate_whole(
        self,
        owner: Owner,
        count: int | None = None,
        *,
        must_include: Iterable[str] = (),
        devices: Sequence[str] | None = None,
    ) -> WholeAllocation:
        """``count`` whole GPUs: the given ``devices``, or the best set containing
        ``must_include`` (see :mod:`.whole`)."""
        _check_owner(owner)
        must = list(dict.fromkeys(must_include))
        if devices is not None:
            if len(set(devices)) != len(devices):
                raise Refused("invalid_request", f"duplicate GPU IDs in {', '.join(devices)}")
            if count is not None and count != len(devices):
                raise Refused(
                    "invalid_request",
                    f"count {count} does not match the {len(devices)} GPUs named",
                )
            count = len(devices)
            must = list(dict.fromkeys([*devices, *must]))
        if count is None or count <= 0:
            raise Refused(
                "invalid_request", f"the number of whole GPUs must be positive, got {count}"
            )
        if len(must) > count:
            raise Refused(
                "invalid_request",
                f"must-include names {len(must)} GPUs but the request is for {count}",
            )

        existing = self._allocs.get(owner.key)
        if existing is not None:
            if (
                isinstance(existing, WholeAllocation)
                and len(existing.devices) == count
                and set(must) <= set(existing.devices)
            ):
                return existing
            raise _conflict(owner, existing, f"{count} whole GPU(s)")

        self._check_named(must, whole=True)
        if any(self._gpus[u].parent for u in must):
            return self._allocate_mig(owner, must, count)
        free = [u for u in self.free_whole() if u in self._topology]
        if count > len(free):
            healthy = sum(1 for g in self._gpus.values() if g.schedulable)
            raise Refused(
                "too_many_units",
                f"{owner.describe()} asks for {count} whole GPUs but only {len(free)} "
                f"are free ({healthy} healthy on the node)",
            )
        chosen = select_whole(self._topology, free, count, must).devices
        alloc = WholeAllocation(owner=owner, devices=chosen)
        self._record(alloc)
        return alloc

    def _allocate_mig(self, owner: Owner, named: list[str], count: int) -> WholeAllocation:
        # MIG devices have no topology between them: kubelet's pick (or the named
        # ones) is taken as it is, and a MIG device never goes with a GPU.
        if any(not self._gpus[u].parent for u in named):
            raise Refused(
                "invalid_request", "a request takes MIG devices or GPUs, never both at once"
            )
        if len(named) != count:
            raise Refused(
                "invalid_request",
                f"MIG devices are named one by one: {count} asked, {len(named)} named",
            )
        replicas = [u for u in named if self._gpus[u].replica is not None]
        if len(replicas) > 1 and self._fail_over_one:
            raise Refused(
                "invalid_request",
                f"asks for {len(replicas)} time-slicing replicas; the config in force gives "
                "at most 1 per container (fail_requests_greater_than_one)",
            )
        alloc = WholeAllocation(owner=owner, devices=tuple(named))
        self._record(alloc)
        return alloc

    def allocate_share(
        self,
        owner: Owner,
        cores: int,
        memory_units: int,
        *,
        device: str | None = None,
        claim: bool = False,
    ) -> ShareAllocation:
        """A share of one card, best-fit (see :mod:`.shares`), or on ``device``.

        ``claim``: the share is a DRA claim's (else the device plugin's); it goes only
        to a card without shares of the other adapter (:meth:`refusal`)."""
        _check_owner(owner)
        claim = claim or self.is_claim(owner.allocation_id)
        validate_share(cores, memory_units, self._largest_card())
        existing = self._allocs.get(owner.key)
        if existing is not None:
            if (
                isinstance(existing, ShareAllocation)
                and existing.cores == cores
                and existing.memory_units == memory_units
                and device in (None, existing.device)
            ):
                return existing
            raise _conflict(
                owner, existing, f"a share of {cores} core units and {memory_units} memory units"
            )

        if device is not None:
            self._check_named([device], whole=False, claim=claim)
            cards = [card_free(self._gpus[device])]
        else:
            cards = [
                card_free(g)
                for g in self._ordered()
                if self.refusal(g.uuid, whole=False, claim=claim) is None
            ]
        rank = self._untouched_rank(cards)
        card = pick_share(cards, cores, memory_units, rank=rank, largest_card=self._largest_card())
        alloc = ShareAllocation(
            owner=owner, device=card.uuid, cores=cores, memory_units=memory_units
        )
        self._record(alloc)
        if claim:
            self.mark_claim(owner.allocation_id)
        return alloc

    def release(self, allocation_id: str, container: str | None = None) -> list[Allocation]:
        """Free what an allocation ID (or one of its containers) holds; unknown IDs free nothing."""
        keys = [
            k
            for k in self._allocs
            if k[0] == allocation_id and (container is None or k[1] == container)
        ]
        released = [self._allocs[k] for k in sorted(keys)]
        for alloc in released:
            self._unrecord(alloc)
        return released

    def reconcile(self, live_pods: Iterable[str]) -> list[Allocation]:
        """Release every pod not in ``live_pods`` (gpu-manager's start-up clean-up)."""
        live = set(live_pods)
        released: list[Allocation] = []
        for pod in sorted({k[0] for k in self._allocs} - live):
            released += self.release(pod)
        return released

    # --- queries -------------------------------------------------------------------

    def preferred(
        self, available: Iterable[str], must_include: Iterable[str], size: int
    ) -> list[str]:
        """``GetPreferredAllocation``: ``size`` of kubelet's ``available`` IDs.

        Only cards that may go whole (:meth:`refusal`) are offered: a preference that
        the Allocate after it refuses fails the pod all the same, so too few of them
        is refused here, saying why the others cannot go.
        """
        avail = list(dict.fromkeys(available))
        must = list(dict.fromkeys(must_include))
        unknown = sorted({u for u in (*avail, *must) if u not in self._gpus})
        if unknown:
            raise Refused("unknown_device", f"unknown GPU IDs: {', '.join(unknown)}")
        for uuid in must:
            if (refused := self.refusal(uuid, whole=True)) is not None:
                raise refused
        if any(self._gpus[u].parent for u in (*avail, *must)):
            return self._preferred_mig(avail, must, size)
        verdicts = {u: self.refusal(u, whole=True) for u in avail if u in self._topology}
        pool = [u for u, refused in verdicts.items() if refused is None]
        blocked = [r for r in verdicts.values() if r is not None]
        if size > 0 and len(pool) < size:
            why = "; ".join(r.message for r in blocked[:3])
            raise Refused(
                "insufficient_capacity",
                f"asks for {size} whole GPUs but only {len(pool)} of the {len(avail)} "
                f"offered may go whole" + (f": {why}" if why else ""),
            )
        return list(select_whole(self._topology, pool, size, must).devices)

    def _preferred_mig(self, avail: list[str], must: list[str], size: int) -> list[str]:
        # MIG devices: the required ones, then the free ones in index order.
        pool = [u for u in avail if u not in must and self.refusal(u, whole=True) is None]
        chosen = must + pool
        if len(chosen) < size:
            raise Refused(
                "insufficient_capacity",
                f"asks for {size} MIG devices but only {len(chosen)} of the {len(avail)} "
                "offered may be given",
            )
        return chosen[: max(size, 0)]

    # --- persistence ---------------------------------------------------------------

    def snapshot(self) -> list[Allocation]:
        """Every allocation, for the checkpoint (:mod:`gpulet_allocator.state.checkpoint`)."""
        return self.allocations()

    def restore(self, allocations: Iterable[Allocation]) -> list[str]:
        """Re-record checkpointed allocations; returns one line per entry refused.

        Cards not in the inventory are kept as *lost* so that their holders stay
        recorded. An entry that would break an invariant (a card held twice, shares
        past 100 core units or the card's memory) is refused rather than trusted.
        """
        problems: list[str] = []
        for alloc in allocations:
            problem = self._restore_one(alloc)
            if problem:
                problems.append(f"{alloc.owner.describe()}: {problem}")
        return problems

    def _restore_one(self, alloc: Allocation) -> str | None:
        existing = self._allocs.get(alloc.owner.key)
        if existing is not None:
            return None if existing == alloc else "a different allocation is already recorded"
        if isinstance(alloc, WholeAllocation):
            if not alloc.devices or len(set(alloc.devices)) != len(alloc.devices):
                return f"invalid device list {list(alloc.devices)}"
            for uuid in alloc.devices:
                g = self._gpus.get(uuid)
                if g is not None and (g.whole or g.shares):
                    return f"{uuid} is already held"
            for uuid in alloc.devices:
                self._placeholder(uuid)
            self._record(alloc)
            return None
        if not 0 < alloc.cores < CORES_PER_GPU or alloc.memory_units <= 0:
            return f"invalid share of {alloc.cores} core units and {alloc.memory_units} units"
        g = self._gpus.get(alloc.device) or self._placeholder(alloc.device)
        if g.whole:
            return f"{g.uuid} is held whole"
        if g.cores_used + alloc.cores > CORES_PER_GPU:
            return f"{g.uuid} would exceed {CORES_PER_GPU} core units"
        if g.present and g.memory_used + alloc.memory_units > g.memory_units:
            return f"{g.uuid} would exceed its {g.memory_units} memory units"
        self._record(alloc)
        return None

    # --- internals -----------------------------------------------------------------


def _check_owner(owner: Owner) -> None:
    if not owner.allocation_id:
        raise Refused("invalid_request", "the owner needs an allocation ID (request key)")


def _conflict(owner: Owner, existing: Allocation, wanted: str) -> Refused:
    if isinstance(existing, WholeAllocation):
        held = f"whole GPUs {', '.join(existing.devices)}"
    else:
        held = (
            f"a share of {existing.device} ({existing.cores} core units, "
            f"{existing.memory_units} memory units)"
        )
    return Refused(
        "invalid_request",
        f"{owner.describe()} already holds {held}; release it before asking for {wanted}",
    )
