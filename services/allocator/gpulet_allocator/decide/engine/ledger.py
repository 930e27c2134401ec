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
* unhealthy or lost (absent from the inventory) cards take no *new* allocation, but
  what they already hold stays recorded until released -- the pod still runs there.

**Idempotency.** Allocating again under a key that already holds an equivalent
allocation returns the recorded one and changes nothing. After a restart the
checkpoint is restored first, so a kubelet retry of ``Allocate`` gets the same GPUs
instead of a second set: a restart never double-allocates. A *different* request
under a busy key is refused (``invalid_request``) rather than silently replaced.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from gpulet_allocator.protocol import CORES_PER_GPU
from gpulet_allocator.protocol import memory_units as units_of_bytes
from gpulet_common.messages import GpuInfo, Inventory
from gpulet_common.refusal import Refused

from .shares import CardFree, classify_cores, pick_share, validate_share
from .topology import Topology
from .whole import fragment_order, select_whole

RequestKey = tuple[str, str]


class Owner(msgspec.Struct, frozen=True, kw_only=True):
    """Who holds an allocation. ``(allocation_id, container)`` is the request key.

    ``allocation_id`` is any stable key of the request the caller has: kubelet's
    Allocate names no pod, so the allocator uses the hash of the first grant's device
    IDs (:func:`gpulet_allocator.decide.core.grant_key`), which is also the allocation's ID.
    Namespace and name are informational. On disk the field keeps its first name,
    ``allocation_id``, so that every checkpoint written before still loads.
    """

    allocation_id: str = msgspec.field(name="pod_uid")
    container: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def key(self) -> RequestKey:
        return (self.allocation_id, self.container)

    def describe(self) -> str:
        who = (
            f"{self.namespace}/{self.name} ({self.allocation_id})"
            if self.name
            else self.allocation_id
        )
        return f"pod {who} container {self.container!r}"


class WholeAllocation(msgspec.Struct, frozen=True, kw_only=True, tag="whole"):
    """Whole GPUs, in index order."""

    owner: Owner
    devices: tuple[str, ...]


class ShareAllocation(msgspec.Struct, frozen=True, kw_only=True, tag="share"):
    """``cores`` core units and ``memory_units`` x 256 MiB of one GPU."""

    owner: Owner
    device: str
    cores: int
    memory_units: int


Allocation = WholeAllocation | ShareAllocation


@dataclass(frozen=True)
class DeviceState:
    """A read-only view of one card."""

    uuid: str
    index: int
    healthy: bool
    present: bool
    memory_units: int
    cores_used: int
    memory_used: int
    whole_owner: Owner | None
    shares: tuple[ShareAllocation, ...]

    @property
    def cores_free(self) -> int:
        return 0 if self.whole_owner else CORES_PER_GPU - self.cores_used

    @property
    def memory_free(self) -> int:
        return 0 if self.whole_owner else self.memory_units - self.memory_used

    @property
    def schedulable(self) -> bool:
        return self.healthy and self.present


@dataclass
class _LedgerGpu:
    uuid: str
    index: int
    memory_units: int
    present: bool = True
    healthy: bool = True
    whole: RequestKey | None = None
    shares: dict[RequestKey, ShareAllocation] = field(default_factory=dict)

    @property
    def cores_used(self) -> int:
        return sum(s.cores for s in self.shares.values())

    @property
    def memory_used(self) -> int:
        return sum(s.memory_units for s in self.shares.values())

    @property
    def schedulable(self) -> bool:
        return self.present and self.healthy


def _as_gpus(gpus: Inventory | Iterable[GpuInfo]) -> list[GpuInfo]:
    return list(gpus.gpus if isinstance(gpus, Inventory) else gpus)


class Ledger:
    """Allocation state of one node. See the module docstring for the rules."""

    def __init__(self, gpus: Inventory | Iterable[GpuInfo] = ()) -> None:
        self._gpus: dict[str, _LedgerGpu] = {}
        self._allocs: dict[RequestKey, Allocation] = {}
        self._topology = Topology.from_gpus(())
        self.update_inventory(gpus)

    # --- inventory and health ------------------------------------------------------

    def update_inventory(self, gpus: Inventory | Iterable[GpuInfo]) -> None:
        """Adopt a new inventory: new cards appear, missing ones become *lost*.

        A lost card keeps its recorded allocations (the pods still reference it) but
        takes no new ones until it is reported again.
        """
        # A UUID listed twice keeps its first entry, as in Topology.from_gpus (the bus
        # refuses such inventories; the ledger must still agree with its topology).
        unique: dict[str, GpuInfo] = {}
        for info in _as_gpus(gpus):
            unique.setdefault(info.uuid, info)
        infos = list(unique.values())
        seen = set(unique)
        for g in self._gpus.values():
            if g.uuid not in seen:
                g.present = False
        for info in infos:
            state = self._gpus.get(info.uuid)
            units = units_of_bytes(info.memory_total_bytes)
            if state is None:
                self._gpus[info.uuid] = _LedgerGpu(
                    uuid=info.uuid, index=info.index, memory_units=units
                )
            else:
                state.present, state.index, state.memory_units = True, info.index, units
        self._topology = Topology.from_gpus(infos)

    def set_health(self, uuid: str, healthy: bool) -> bool:
        """Mark a known card (un)healthy; returns whether that changed."""
        gpu = self._known(uuid)
        changed, gpu.healthy = gpu.healthy != healthy, healthy
        return changed

    @property
    def topology(self) -> Topology:
        return self._topology

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

    def allocate_share(
        self,
        owner: Owner,
        cores: int,
        memory_units: int,
        *,
        device: str | None = None,
    ) -> ShareAllocation:
        """A share of one card, best-fit (see :mod:`.shares`), or on ``device``."""
        _check_owner(owner)
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
            self._check_named([device], whole=False)
            cards = [_card(self._gpus[device])]
        else:
            cards = [_card(g) for g in self._ordered() if self.refusal(g.uuid, whole=False) is None]
        rank = self._untouched_rank(cards)
        card = pick_share(cards, cores, memory_units, rank=rank, largest_card=self._largest_card())
        alloc = ShareAllocation(
            owner=owner, device=card.uuid, cores=cores, memory_units=memory_units
        )
        self._record(alloc)
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

    def get(self, allocation_id: str, container: str = "") -> Allocation | None:
        return self._allocs.get((allocation_id, container))

    def count(self) -> int:
        """How many allocations are held (without building the sorted list)."""
        return len(self._allocs)

    def allocations(self, allocation_id: str | None = None) -> list[Allocation]:
        return [a for k, a in sorted(self._allocs.items()) if allocation_id in (None, k[0])]

    def free_whole(self) -> list[str]:
        """The cards that may go whole now (:meth:`refusal`), in index order."""
        return [g.uuid for g in self._ordered() if self.refusal(g.uuid, whole=True) is None]

    def device(self, uuid: str) -> DeviceState:
        g = self._known(uuid)
        owner = self._allocs[g.whole].owner if g.whole else None
        return DeviceState(
            uuid=g.uuid,
            index=g.index,
            healthy=g.healthy,
            present=g.present,
            memory_units=g.memory_units,
            cores_used=CORES_PER_GPU if g.whole else g.cores_used,
            memory_used=g.memory_units if g.whole else g.memory_used,
            whole_owner=owner,
            shares=tuple(s for _, s in sorted(g.shares.items())),
        )

    def devices(self) -> list[DeviceState]:
        return [self.device(g.uuid) for g in self._ordered()]

    def refusal(self, uuid: str, *, whole: bool) -> Refused | None:
        """Why a known card may not take a new allocation now (None: it may).

        ``whole``: the card as a whole GPU. This is the one answer to "may this card go
        whole?": Allocate (:meth:`_check_named`), :meth:`preferred`, :meth:`free_whole`,
        koord-scheduler's decisions and what the device plugin lists all ask it.
        """
        g = self._known(uuid)
        if not g.present:
            return Refused("unhealthy_device", f"{uuid} is lost (missing from the inventory)")
        if not g.healthy:
            return Refused("unhealthy_device", f"{uuid} is unhealthy")
        if g.whole is not None:
            holder = self._allocs[g.whole].owner.describe()
            return Refused("insufficient_capacity", f"{uuid} is allocated whole to {holder}")
        if whole and g.shares:
            return Refused(
                "insufficient_capacity",
                f"{uuid} holds {len(g.shares)} share(s) and is not offered whole",
            )
        return None

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

    def _ordered(self) -> list[_LedgerGpu]:
        return sorted(self._gpus.values(), key=lambda g: (not g.present, g.index, g.uuid))

    def _placeholder(self, uuid: str) -> _LedgerGpu:
        g = self._gpus.get(uuid)
        if g is None:
            g = self._gpus[uuid] = _LedgerGpu(uuid=uuid, index=-1, memory_units=0, present=False)
        return g

    def _known(self, uuid: str) -> _LedgerGpu:
        g = self._gpus.get(uuid)
        if g is None:
            raise Refused("unknown_device", f"unknown GPU ID: {uuid}")
        return g

    def _check_named(self, uuids: Sequence[str], *, whole: bool) -> None:
        unknown = sorted(u for u in uuids if u not in self._gpus)
        if unknown:
            raise Refused("unknown_device", f"unknown GPU IDs: {', '.join(unknown)}")
        for uuid in uuids:
            if (refused := self.refusal(uuid, whole=whole)) is not None:
                raise refused

    def _largest_card(self) -> tuple[str, int] | None:
        present = [g for g in self._ordered() if g.present]
        if not present:
            return None
        top = max(present, key=lambda g: (g.memory_units, -g.index))
        return (top.uuid, top.memory_units)

    def _untouched_rank(self, cards: Sequence[CardFree]) -> dict[str, int]:
        # Opening a fresh card for shares removes it from whole-card use, exactly
        # like a 1-GPU whole request, so untouched cards are ordered the same way.
        untouched = [c.uuid for c in cards if c.untouched]
        if len(untouched) < 2:
            return {}
        free = [u for u in self.free_whole() if u in self._topology]
        order = fragment_order(self._topology, free)
        return {u: i for i, u in enumerate(order)}

    def _record(self, alloc: Allocation) -> None:
        # The checks are unreachable by construction (callers validated first); they
        # stay so that a future bug refuses instead of silently corrupting the state.
        key = alloc.owner.key
        if isinstance(alloc, WholeAllocation):
            cards = [self._gpus[uuid] for uuid in alloc.devices]
            busy = [g.uuid for g in cards if g.whole is not None or g.shares]
            if busy:
                raise RuntimeError(f"ledger invariant: {busy} would be double-allocated")
            for g in cards:
                g.whole = key
        else:
            g = self._gpus[alloc.device]
            if g.whole is not None or g.cores_used + alloc.cores > CORES_PER_GPU:
                raise RuntimeError(f"ledger invariant: {alloc.device} over-allocated")
            g.shares[key] = alloc
        self._allocs[key] = alloc

    def _unrecord(self, alloc: Allocation) -> None:
        key = alloc.owner.key
        del self._allocs[key]
        if isinstance(alloc, WholeAllocation):
            for uuid in alloc.devices:
                self._gpus[uuid].whole = None
        else:
            self._gpus[alloc.device].shares.pop(key, None)


def _check_owner(owner: Owner) -> None:
    if not owner.allocation_id:
        raise Refused("invalid_request", "the owner needs an allocation ID (request key)")


def _card(g: _LedgerGpu) -> CardFree:
    return CardFree(
        uuid=g.uuid,
        index=g.index,
        cores_free=CORES_PER_GPU - g.cores_used,
        memory_free=g.memory_units - g.memory_used,
        memory_total=g.memory_units,
    )


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
