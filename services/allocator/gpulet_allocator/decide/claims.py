"""DRA claims in the one ledger: the DRA kubelet plugin's reservations.

A ResourceClaim's devices are reserved under the claim's UID, which is their
allocation ID in the same :class:`~gpulet_allocator.decide.engine.Ledger` as the
device plugin's allocations, so the ledger's invariants hold across both adapters: a
GPU never has two owners, whichever asked first.

Rules (:meth:`Claims.reserve`):

* a device is named as DRA names it, ``gpu-<minor>``
  (:func:`gpulet_common.dra.devices.device_name`), or
  ``gpu-<minor>-mig-<profile>-<gi>-<ci>`` for a MIG device
  (:func:`gpulet_common.dra.mig.targets`: held under its MIG UUID, given whole only,
  like the device plugin's MIG devices), and must be in the inventory
  (``unknown_device``);
* a device the claim consumes 100 % of the cores of (or names no share of) is a
  **whole GPU**: one :class:`~.engine.WholeAllocation` under ``(uid, "")`` holds all
  of them. No other allocation can then fit on it: every share asks at least one
  percent of the cores. It must be a card that may go whole now, the ledger's one
  answer (:meth:`~.engine.Ledger.refusal`): a card held by a device-plugin allocation,
  holding shares, or held by another claim is refused ``insufficient_capacity``, an
  unhealthy or lost one ``unhealthy_device``;
* a device with 1-99 % of the cores is a **share**: a
  :class:`~.engine.ShareAllocation` under ``(uid, <device>)`` of that card, its memory
  rounded up to the ledger's 256 MiB units (all of the card's memory when the claim
  names none), refused like the device plugin's shares when it does not fit. A card
  never carries shares of both adapters, the ledger's rule
  (:meth:`~.engine.Ledger.refusal` with ``claim``): a claim's share is refused on a
  card that holds a device-plugin share, and a device-plugin share on one that holds a
  claim's (the scheduler accounts a claim's share in the slice and knows nothing of
  the device plugin's, kubelet the reverse);
* all or nothing: a refusal leaves nothing reserved;
* idempotent: the same UID asking for the same devices and shares gets the recorded
  reservation; the same UID asking for others is refused ``invalid_request``;
* while the record of allocations is lost (``checkpoint_lost``) or before the first
  inventory (``not_ready``) nothing is reserved.

:meth:`Claims.release` frees everything under the UID; a UID that holds nothing
releases nothing (False), so it is idempotent too. The claim records
(:class:`~gpulet_allocator.state.records.ClaimRecord`) are checkpointed with the
allocations (:mod:`.record`); PodResources never releases a claim (kubelet's
Unprepare does).

Synchronous, no I/O; not thread-safe (one event loop).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpulet_allocator.decide.books import Books, Undo
from gpulet_allocator.decide.engine import Owner, WholeAllocation
from gpulet_allocator.protocol import (
    CORES_PER_GPU,
    MAX_CLAIM_DEVICES,
    MEMORY_UNIT_BYTES,
    ClaimDeviceRequest,
    memory_units,
)
from gpulet_allocator.state.records import ClaimDeviceRecord, ClaimRecord
from gpulet_common.dra.devices import device_name
from gpulet_common.dra.mig import Target, targets
from gpulet_common.refusal import Refused

MIB = 1024 * 1024
MAX_UID_CHARS = 128


Asked = list[tuple[str, int | None, int | None]]


def is_whole(request: ClaimDeviceRequest) -> bool:
    return request.cores is None or request.cores >= CORES_PER_GPU


def _memory_mib(request: ClaimDeviceRequest) -> int | None:
    if is_whole(request) or request.memory_bytes is None:
        return None
    return request.memory_bytes // MIB


def _wanted(devices: Sequence[ClaimDeviceRequest]) -> Asked:
    """What a request asks, as a record keeps it (the same request: the same list)."""
    return sorted((d.device, None if is_whole(d) else d.cores, _memory_mib(d)) for d in devices)


def _recorded(record: ClaimRecord) -> Asked:
    return sorted((d.device, d.cores, d.memory_mib) for d in record.devices)


class Claims:
    """Reserve and release DRA claims in the books (see the module docstring)."""

    def __init__(self, books: Books, gate: Callable[[], None] = lambda: None) -> None:
        self._books = books
        # Raises Refused when nothing may be reserved now (the core: a lost record, no
        # inventory).
        self._gate = gate

    def _target(self, name: str, pool: dict[str, Target]) -> Target:
        found = pool.get(name)
        if found is not None:
            return found
        for gpu in self._books.gpus.values():
            if device_name(gpu) == name:
                # A GPU MIG keeps out of the pool: the ledger says why it may not go whole.
                return Target(name, gpu)
        raise Refused("unknown_device", f"no device {name[:64]!r} on this node")

    def reserve(
        self,
        uid: str,
        devices: Sequence[ClaimDeviceRequest],
        *,
        namespace: str = "",
        name: str = "",
    ) -> tuple[ClaimRecord, Undo | None]:
        """Reserve ``devices`` for claim ``uid``; the undo is None when nothing changed."""
        self._gate()
        books = self._books
        if not uid or len(uid) > MAX_UID_CHARS:
            raise Refused("invalid_request", "a claim needs a UID of 1-128 characters")
        if not devices or len(devices) > MAX_CLAIM_DEVICES:
            raise Refused("invalid_request", f"a claim reserves 1 to {MAX_CLAIM_DEVICES} devices")
        if len({d.device for d in devices}) != len(devices):
            raise Refused("invalid_request", "a claim names a device twice")
        wanted = _wanted(devices)
        held = books.claims.get(uid)
        if held is not None:
            if _recorded(held) == wanted:
                return held, None
            raise Refused(
                "invalid_request",
                f"claim {uid} already holds {', '.join(d.device for d in held.devices)}; "
                "release it before reserving other devices",
            )
        if books.ledger.allocations(uid):
            raise Refused("invalid_request", f"{uid} already names an allocation")
        pool = targets(books.gpus.values())
        gpus = {d.device: self._target(d.device, pool) for d in devices}
        whole = [d for d in devices if is_whole(d)]
        shares = [d for d in devices if not is_whole(d)]
        try:
            if whole:
                books.ledger.allocate_whole(
                    Owner(allocation_id=uid, namespace=namespace, name=name),
                    devices=[gpus[d.device].uuid for d in whole],
                )
                books.ledger.mark_claim(uid)  # as a restore marks it
            for d in shares:
                target = gpus[d.device]
                units = memory_units(target.gpu.memory_total_bytes)
                if d.memory_bytes is not None:
                    # Rounded up, but never past the card (its last partial unit).
                    units = min(units, -(-d.memory_bytes // MEMORY_UNIT_BYTES))
                books.ledger.allocate_share(
                    Owner(allocation_id=uid, container=d.device, namespace=namespace, name=name),
                    d.cores or CORES_PER_GPU,
                    units,
                    device=target.uuid,
                    claim=True,
                )
        except Exception:
            books.ledger.release(uid)
            raise
        record = ClaimRecord(
            uid=uid,
            namespace=namespace,
            name=name,
            created_at=books.wall(),
            devices=[
                ClaimDeviceRecord(
                    device=d.device,
                    uuid=gpus[d.device].uuid,
                    minor=gpus[d.device].minor,
                    cores=None if is_whole(d) else d.cores,
                    memory_mib=_memory_mib(d),
                )
                for d in devices
            ],
        )
        books.claims[uid] = record
        books.version += 1

        def undo() -> None:
            self.release(uid)

        return record, undo

    def release(self, uid: str) -> bool:
        """Free what claim ``uid`` holds; False when it held nothing."""
        books = self._books
        record = books.claims.pop(uid, None)
        if record is None:
            return False
        books.ledger.release(uid)
        books.version += 1
        return True

    def restore(self, records: Sequence[ClaimRecord]) -> list[str]:
        """Adopt checkpointed claims whose allocations the ledger holds; one line per
        claim set aside."""
        books = self._books
        problems: list[str] = []
        for record in records:
            held = books.ledger.allocations(record.uid)
            uuids = {
                u
                for a in held
                for u in (a.devices if isinstance(a, WholeAllocation) else (a.device,))
            }
            if not held or uuids != {d.uuid for d in record.devices}:
                problems.append(f"claim {record.uid}: its allocations are not recorded")
                continue
            books.claims[record.uid] = record
            books.ledger.mark_claim(record.uid)
        return problems
