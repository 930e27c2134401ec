"""The card book under the ledger: what each card is, holds and may still take.

:class:`CardBook` keeps the cards of the node (whole GPUs and MIG devices, from the
inventory and health), the allocations recorded on them, and the one answer to "may
this card take a new allocation, whole or shared?" (:meth:`CardBook.refusal`), which
every allocation path asks. :class:`~.ledger.Ledger` builds the decisions on top of it:
allocate, release, prefer, snapshot and restore (see its module docstring for the
invariants).

Time-slicing replicas (:mod:`gpulet_allocator.timeslicing`, :meth:`CardBook.set_replicas`)
are cards too, like MIG devices: ``<uuid>::<n>`` with ``parent`` its GPU, each taken by
one allocation at most. One owner model: a GPU is time-sliced, or held whole, or in
shares; never two at once (:meth:`CardBook.refusal` says which holds it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpulet_allocator.protocol import (
    CORES_PER_GPU,
    ResourceKind,
    parse_device_id,
    replica_device_id,
)
from gpulet_allocator.protocol import memory_units as units_of_bytes
from gpulet_common.messages import GpuInfo, Inventory
from gpulet_common.migrules import parent_block
from gpulet_common.refusal import Refused

from .entries import Allocation, DeviceState, RequestKey, ShareAllocation, WholeAllocation
from .shares import CardFree
from .topology import Topology
from .whole import fragment_order


@dataclass
class _LedgerGpu:
    uuid: str
    index: int
    memory_units: int
    present: bool = True
    healthy: bool = True
    whole: RequestKey | None = None
    shares: dict[RequestKey, ShareAllocation] = field(default_factory=dict)
    # A MIG device: its parent GPU's UUID ("" for a GPU).
    parent: str = ""
    # A MIG device: its (GPU instance, compute instance) on its parent. Kept with the
    # parent while it is held, after it leaves the inventory too (:meth:`mig_links`).
    placement: tuple[int, int] | None = None
    # A GPU that MIG keeps out of the whole and share pools: (refusal code, why).
    mig_block: tuple[str, str] | None = None
    # A time-slicing replica: its number (``parent`` is its GPU); None otherwise.
    replica: int | None = None
    # A GPU: how many replicas it is offered as now (0: not time-sliced).
    replicas: int = 0

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


class CardBook:
    """The cards of one node and what they hold (not thread-safe)."""

    def __init__(self, gpus: Inventory | Iterable[GpuInfo] = ()) -> None:
        self._gpus: dict[str, _LedgerGpu] = {}
        self._allocs: dict[RequestKey, Allocation] = {}
        # The allocation IDs that are DRA claims (the kubelet DRA plugin's); every other
        # allocation is the device plugin's. A card never carries shares of both.
        self._claim_ids: set[str] = set()
        self._topology = Topology.from_gpus(())
        # NVIDIA's failRequestsGreaterThanOne, of the time-slicing config in force.
        self._fail_over_one = False
        self.update_inventory(gpus)

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
        migs = {
            d.uuid: (info, d)
            for info in infos
            if info.mig_mode == "enabled"
            for d in info.mig_devices
            if d.uuid not in unique
        }
        seen = set(unique) | set(migs)
        for g in self._gpus.values():
            # A replica is present when its GPU is (checked through ``parent``).
            if g.uuid not in seen and g.replica is None:
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
            self._gpus[info.uuid].mig_block = parent_block(info)
        for uuid, (parent, mig) in migs.items():
            state = self._gpus.get(uuid)
            units = units_of_bytes(mig.memory_total_bytes)
            if state is None:
                state = self._gpus[uuid] = _LedgerGpu(
                    uuid=uuid, index=parent.index, memory_units=units
                )
            state.present, state.index, state.memory_units = True, parent.index, units
            state.parent = parent.uuid
            state.placement = (mig.gpu_instance_id, mig.compute_instance_id)
        self._topology = Topology.from_gpus(infos)

    def mig_links(self) -> list[tuple[str, str, int, int]]:
        """``(MIG device, parent GPU, GPU instance, compute instance)`` of every held MIG
        device, present or not: what the checkpoint keeps so that, after a restart
        too, the parent stays refused and a device re-created in the same place is
        not given to a second owner (:meth:`_mig_conflict`)."""
        return [
            (g.uuid, g.parent, *g.placement)
            for g in sorted(self._gpus.values(), key=lambda g: g.uuid)
            if g.whole is not None and g.parent and g.replica is None and g.placement
        ]

    def restore_mig_links(self, links: Iterable[tuple[str, str, int, int]]) -> None:
        """Adopt checkpointed :meth:`mig_links`; the inventory's word wins where it has one."""
        for uuid, parent, gi, ci in links:
            g = self._placeholder(uuid)
            if not g.parent and g.replica is None:
                g.parent, g.placement = parent, (gi, ci)

    def set_replicas(self, replicas: Mapping[str, int], *, fail_over_one: bool = False) -> None:
        """Offer each GPU of ``replicas`` as that many time-slicing replicas (the others:
        none). Replica ``n`` keeps its card, so what is held stays valid; a replica held
        above the new count stays until released, one not held goes."""
        self._fail_over_one = fail_over_one
        for g in [g for g in self._gpus.values() if g.replica is None and not g.parent]:
            count = replicas.get(g.uuid, 0)
            g.replicas = count if count > 1 else 0
            for n in range(g.replicas):
                rid = replica_device_id(g.uuid, n)
                if rid not in self._gpus:
                    self._gpus[rid] = _LedgerGpu(
                        uuid=rid, index=g.index, memory_units=0, parent=g.uuid, replica=n
                    )
        for g in list(self._gpus.values()):
            if g.replica is None:
                continue
            parent = self._gpus.get(g.parent)
            offered = parent is not None and g.replica < parent.replicas
            if not offered and g.whole is None:
                del self._gpus[g.uuid]

    def replicas_held(self, uuid: str) -> int:
        """How many replicas of GPU ``uuid`` are held."""
        return sum(
            1 for g in self._gpus.values() if g.parent == uuid and g.replica is not None and g.whole
        )

    def replica_count(self, uuid: str) -> int:
        """How many replicas GPU ``uuid`` is offered as now (0: not time-sliced)."""
        g = self._gpus.get(uuid)
        return g.replicas if g is not None else 0

    def is_replica(self, uuid: str) -> bool:
        g = self._gpus.get(uuid)
        return g is not None and g.replica is not None

    def gpu_of(self, uuid: str) -> str:
        """The GPU a container is given for a card: a replica's GPU, else the card."""
        g = self._gpus.get(uuid)
        return g.parent if g is not None and g.replica is not None else uuid

    def set_health(self, uuid: str, healthy: bool) -> bool:
        """Mark a known card (un)healthy; returns whether that changed."""
        gpu = self._known(uuid)
        changed, gpu.healthy = gpu.healthy != healthy, healthy
        return changed

    @property
    def topology(self) -> Topology:
        return self._topology

    def get(self, allocation_id: str, container: str = "") -> Allocation | None:
        return self._allocs.get((allocation_id, container))

    def count(self) -> int:
        """How many allocations are held (without building the sorted list)."""
        return len(self._allocs)

    def allocations(self, allocation_id: str | None = None) -> list[Allocation]:
        return [a for k, a in sorted(self._allocs.items()) if allocation_id in (None, k[0])]

    def free_whole(self) -> list[str]:
        """The GPUs (not MIG devices) that may go whole now (:meth:`refusal`), in index order."""
        return [
            g.uuid
            for g in self._ordered()
            if not g.parent and self.refusal(g.uuid, whole=True) is None
        ]

    def free_mig(self) -> list[str]:
        """The MIG devices that may be given now, in index order."""
        return [
            g.uuid for g in self._ordered() if g.parent and self.refusal(g.uuid, whole=True) is None
        ]

    def is_mig(self, uuid: str) -> bool:
        g = self._gpus.get(uuid)
        return g is not None and bool(g.parent) and g.replica is None

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
            parent=g.parent,
        )

    def devices(self) -> list[DeviceState]:
        return [self.device(g.uuid) for g in self._ordered()]

    def device_count(self) -> int:
        """``len(devices())`` without building them."""
        return len(self._gpus)

    def mark_claim(self, allocation_id: str) -> None:
        """Say that ``allocation_id`` is a DRA claim's (a restored claim, a claim's whole
        GPUs; a claim's share is marked by :meth:`~.ledger.Ledger.allocate_share`'s
        ``claim``)."""
        self._claim_ids.add(allocation_id)

    def is_claim(self, allocation_id: str) -> bool:
        return allocation_id in self._claim_ids

    def refusal(self, uuid: str, *, whole: bool, claim: bool | None = None) -> Refused | None:
        """Why a known card may not take a new allocation now (None: it may).

        ``whole``: the card as a whole GPU. This is the one answer to "may this card go
        whole?": Allocate (:meth:`_check_named`), :meth:`preferred`, :meth:`free_whole`,
        koord-scheduler's decisions and what the device plugin lists all ask it. A GPU
        that MIG keeps out (``mig_enabled``, ``mig_pending``) is refused here too, whole
        and shared; a MIG device goes whole only.

        ``claim``: who asks for a share, a DRA claim (True) or the device plugin
        (False); None asks for either. A card never carries shares of both adapters:
        the scheduler accounts a claim's share in the slice and knows nothing of the
        device plugin's, and kubelet's device manager knows nothing of a claim's.
        """
        g = self._known(uuid)
        if not g.present:
            return Refused("unhealthy_device", f"{uuid} is lost (missing from the inventory)")
        if not g.healthy:
            return Refused("unhealthy_device", f"{uuid} is unhealthy")
        if g.mig_block is not None:
            return Refused(*g.mig_block)
        if (conflict := self._mig_conflict(g)) is not None:
            return conflict
        if g.parent:
            parent = self._gpus.get(g.parent)
            if parent is None or not parent.present:
                return Refused("unhealthy_device", f"{uuid}: its GPU {g.parent} is lost")
            if not parent.healthy:
                return Refused("unhealthy_device", f"{uuid}: its GPU {g.parent} is unhealthy")
            if g.replica is not None and (refused := _replica_refusal(g, parent)) is not None:
                return refused
            if not whole:
                what = "a MIG device" if g.replica is None else "a time-slicing replica"
                return Refused(
                    "invalid_request", f"{uuid} is {what}: it is given whole, never shared"
                )
        elif (held := self.replicas_held(uuid)) or g.replicas:
            why = f"{held} of its time-slicing replicas are held" if held else ""
            why = why or f"it is time-sliced ({g.replicas} replicas): given as replicas only"
            return Refused("time_sliced", f"{uuid} is not given whole nor shared: {why}")
        if g.whole is not None:
            owner = self._allocs[g.whole].owner
            holder = owner.describe(claim=self.is_claim(owner.allocation_id))
            return Refused("insufficient_capacity", f"{uuid} is allocated whole to {holder}")
        if whole and g.shares:
            return Refused(
                "insufficient_capacity",
                f"{uuid} holds {len(g.shares)} share(s) and is not offered whole",
            )
        if not whole and claim is not None:
            return self._mixed_share(g, claim=claim)
        return None

    def _mig_conflict(self, g: _LedgerGpu) -> Refused | None:
        """A held MIG device keeps its parent from going whole or shared (MIG disabled
        under it, say), and its (GPU instance, compute instance) from going to another
        owner as a re-created device under a new UUID (same DRA name, same
        ``/dev/nvidia-caps`` nodes) -- until it is released."""
        if g.replica is not None:
            return None
        for m in self._gpus.values():
            if m is g or m.whole is None or not m.parent or m.replica is not None:
                continue
            same_place = (
                g.placement is not None and m.parent == g.parent and m.placement == g.placement
            )
            if m.parent != g.uuid and not same_place:
                continue
            owner = self._allocs[m.whole].owner
            holder = owner.describe(claim=self.is_claim(owner.allocation_id))
            if same_place and m.placement is not None:
                gi, ci = m.placement
                return Refused(
                    "insufficient_capacity",
                    f"{g.uuid}: GPU instance {gi}, compute instance {ci} of {g.parent} "
                    f"is still held as {m.uuid} by {holder}",
                )
            return Refused(
                "insufficient_capacity", f"{g.uuid}: its MIG device {m.uuid} is held by {holder}"
            )
        return None

    def _mixed_share(self, g: _LedgerGpu, *, claim: bool) -> Refused | None:
        for key in sorted(g.shares):
            if (key[0] in self._claim_ids) != claim:
                holder = "a device-plugin share" if claim else "a DRA claim's share"
                return Refused("insufficient_capacity", f"{g.uuid} holds {holder} ({key[0]})")
        return None

    def _ordered(self) -> list[_LedgerGpu]:
        return sorted(self._gpus.values(), key=lambda g: (not g.present, g.index, g.uuid))

    def _placeholder(self, uuid: str) -> _LedgerGpu:
        g = self._gpus.get(uuid)
        if g is None:
            g = self._gpus[uuid] = _LedgerGpu(uuid=uuid, index=-1, memory_units=0, present=False)
            parsed = _replica_of(uuid)
            if parsed is not None:
                # A replica held before a restart: its GPU says whether it is usable.
                g.parent, g.replica, g.present = parsed[0], parsed[1], True
        return g

    def _known(self, uuid: str) -> _LedgerGpu:
        g = self._gpus.get(uuid)
        if g is None:
            raise Refused("unknown_device", f"unknown GPU ID: {uuid}")
        return g

    def _check_named(self, uuids: Sequence[str], *, whole: bool, claim: bool | None = None) -> None:
        unknown = sorted(u for u in uuids if u not in self._gpus)
        if unknown:
            raise Refused("unknown_device", f"unknown GPU IDs: {', '.join(unknown)}")
        for uuid in uuids:
            if (refused := self.refusal(uuid, whole=whole, claim=claim)) is not None:
                raise refused

    def _largest_card(self) -> tuple[str, int] | None:
        present = [g for g in self._ordered() if g.present and not g.parent]
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
        if not any(k[0] == key[0] for k in self._allocs):
            self._claim_ids.discard(key[0])
        if isinstance(alloc, WholeAllocation):
            for uuid in alloc.devices:
                self._gpus[uuid].whole = None
        else:
            self._gpus[alloc.device].shares.pop(key, None)


def _replica_of(card: str) -> tuple[str, int] | None:
    try:
        parsed = parse_device_id(card)
    except ValueError:
        return None
    if parsed.kind is not ResourceKind.REPLICA or parsed.unit is None:
        return None
    return (parsed.gpu_uuid, parsed.unit)


def _replica_refusal(g: _LedgerGpu, parent: _LedgerGpu) -> Refused | None:
    """Why a replica may not be given, by its GPU (None: its GPU allows it)."""
    if parent.mig_block is not None:
        return Refused(*parent.mig_block)
    assert g.replica is not None
    if g.replica >= parent.replicas:
        now = f"{parent.replicas} replicas" if parent.replicas else "no replicas"
        return Refused("time_sliced", f"{g.uuid} is not offered: {g.parent} has {now} now")
    if parent.whole is not None:
        return Refused("time_sliced", f"{g.uuid}: its GPU {g.parent} is allocated whole")
    if parent.shares:
        return Refused("time_sliced", f"{g.uuid}: its GPU {g.parent} holds shares")
    return None


def card_free(g: _LedgerGpu) -> CardFree:
    return CardFree(
        uuid=g.uuid,
        index=g.index,
        cores_free=CORES_PER_GPU - g.cores_used,
        memory_free=g.memory_units - g.memory_used,
        memory_total=g.memory_units,
    )
