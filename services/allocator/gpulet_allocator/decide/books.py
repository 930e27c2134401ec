"""The decision core's books: the ledger, the grants that name its allocations, and the
inventory and health they follow.

Every piece of :mod:`gpulet_allocator.decide` reads and writes the same books; this is
their one copy and the only place that changes them besides the ledger's own rules:

* **ledger access**: :attr:`Books.ledger` (who holds which GPU, whole or in shares)
  and :attr:`Books.grants` (kubelet's requests, keyed by :func:`grant_key`, each naming
  an allocation of the ledger), with :meth:`Books.new_grant` recording one;
* **health gating**: :meth:`Books.update_inventory` and :meth:`Books.set_health` keep
  the ledger's health in step with the node's read model, and
  :meth:`Books.withheld` says which cards kubelet must not count as whole GPUs. Whether
  a card may take an allocation is the ledger's one answer
  (:meth:`~gpulet_allocator.decide.engine.Ledger.refusal`);
* **version**: bumped on every change that must reach the checkpoint.

Synchronous, no I/O; not thread-safe (one event loop).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from typing import Final

from gpulet_allocator.decide.engine import Ledger, ShareAllocation, WholeAllocation
from gpulet_allocator.protocol import memory_units
from gpulet_allocator.state.records import ClaimRecord, Grant, GrantKind
from gpulet_common.messages import GpuInfo, Inventory
from gpulet_common.refusal import Refused

log = logging.getLogger("gpulet.allocator")

Allocation = WholeAllocation | ShareAllocation
Undo = Callable[[], None]

ALLOCATION_ANNOTATION: Final = "gpulet.io/allocation"
ALLOCATION_ENV: Final = "GPULET_ALLOCATION_ID"


def grant_key(kind: GrantKind, resource: str, device_ids: Iterable[str]) -> str:
    """The stable key of one container's request (see :mod:`gpulet_allocator.decide`)."""
    digest = hashlib.blake2b(digest_size=10)
    digest.update(resource.encode())
    for device_id in sorted(device_ids):
        digest.update(b"\0" + device_id.encode())
    return f"{kind}-{digest.hexdigest()}"


class Books:
    """Ledger, grants, inventory and the change version. See the module docstring."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        health_of: Callable[[str], bool],
    ) -> None:
        self.ledger = Ledger()
        self.grants: dict[str, Grant] = {}
        # DRA claims by UID (:mod:`.claims`), each its own allocation ID in the ledger.
        self.claims: dict[str, ClaimRecord] = {}
        self.gpus: dict[str, GpuInfo] = {}
        self.inventory: Inventory | None = None
        self.clock = clock
        self.wall = wall_clock
        # Where each GPU's health is read (the service's NodeView): the ledger holds
        # the only copy here, taken from it when a GPU arrives and on every change.
        self.health_of = health_of
        #: Bumped on every change that must reach the checkpoint.
        self.version = 0

    # --- health gating ------------------------------------------------------------------

    def update_inventory(self, inventory: Inventory) -> bool:
        """Adopt an inventory; returns False when it is ignored.

        A degraded inventory without GPUs (NVML failed) says nothing about the GPUs,
        so the last known one is kept rather than every GPU being declared lost.
        """
        if inventory.degraded_reason and not inventory.gpus and self.inventory is not None:
            log.warning("ignoring a degraded inventory: %s", inventory.degraded_reason)
            return False
        self.inventory = inventory
        self.gpus = {g.uuid: g for g in inventory.gpus}
        self.ledger.update_inventory(inventory.gpus)
        for uuid in self.gpus:
            self.ledger.set_health(uuid, self.health_of(uuid))
        for g in inventory.gpus:
            for mig in g.mig_devices if g.mig_mode == "enabled" else ():
                if self.ledger.is_mig(mig.uuid):
                    self.ledger.set_health(mig.uuid, self.health_of(mig.uuid))
        return True

    def set_health(self, uuid: str, healthy: bool) -> bool:
        """Record a GPU's health; returns whether it changed.

        A GPU not in the inventory yet is left alone: ``health_of`` gives its health
        when it arrives.
        """
        try:
            return self.ledger.set_health(uuid, healthy)
        except Refused:
            return False

    def withheld(self) -> dict[str, str]:
        """Cards kubelet must not count as whole GPUs, and why: healthy, present, not
        held whole (kubelet knows of those), yet the ledger refuses them whole -- they
        hold shares -- or held whole by a DRA claim (kubelet's device manager does not
        know of those). The device plugin lists them ``Unhealthy`` for the whole-GPU
        resource."""
        out: dict[str, str] = {}
        for d in self.ledger.devices():
            claim = d.whole_owner.allocation_id if d.whole_owner is not None else ""
            if d.present and d.healthy and claim in self.claims:
                out[d.uuid] = f"{d.uuid} is held whole by DRA claim {claim}"
            elif d.present and self.ledger.refusal(d.uuid, whole=False) is None:
                refused = self.ledger.refusal(d.uuid, whole=True)
                if refused is not None:
                    out[d.uuid] = refused.message
            elif d.present and d.healthy and not d.parent:
                self._withheld_time_sliced(d.uuid, d.whole_owner is not None or bool(d.shares), out)
        return out

    def _withheld_time_sliced(self, uuid: str, held: bool, out: dict[str, str]) -> None:
        # Time-sliced but held whole or shared: its replicas are listed Unhealthy. Not
        # time-sliced but replicas of it still held: it is not offered whole.
        sliced = self.ledger.replica_count(uuid) > 0
        if sliced and held:
            out[uuid] = f"{uuid} is held whole or shared: its replicas wait for its release"
        elif not sliced and (replicas := self.ledger.replicas_held(uuid)):
            out[uuid] = f"{uuid}: {replicas} of its time-slicing replicas are still held"

    def device_plugin_held(self) -> dict[str, str]:
        """Each GPU an allocation of the device plugin holds (not a DRA claim's), with
        the allocation: in ``dra.mode`` both the slices taint them."""
        out: dict[str, str] = {}
        for alloc in self.ledger.allocations():
            holder = alloc.owner.allocation_id
            if holder in self.claims:
                continue
            uuids = alloc.devices if isinstance(alloc, WholeAllocation) else (alloc.device,)
            for uuid in uuids:
                out.setdefault(self.ledger.gpu_of(uuid), holder)
        return out

    # --- ledger access ------------------------------------------------------------------

    def known_gpu(self, uuid: str) -> bool:
        if uuid in self.gpus:
            return True
        try:
            self.ledger.device(uuid)
        except Refused:
            return False
        return True

    def minors(self) -> dict[str, int]:
        # The reporter writes the NVML index where NVML has no minor; so do we.
        return {u: g.minor if g.minor is not None else g.index for u, g in self.gpus.items()}

    def describe(self, uuids: Iterable[str]) -> str:
        minors = self.minors()
        parts = [f"minor {minors[u]} ({u})" if u in minors else u for u in sorted(uuids, key=str)]
        return ", ".join(parts) or "no GPU"

    def card_sizes(self) -> list[int]:
        """Memory units of each card that has any."""
        return [u for g in self.gpus.values() if (u := memory_units(g.memory_total_bytes)) > 0]

    def new_grant(
        self,
        grant: Grant,
        undo: list[Undo],
        *,
        own: bool = False,
    ) -> Grant:
        """Record ``grant``; ``own``: its allocation is its own and goes with the undo."""
        self.grants[grant.key] = grant
        self.version += 1
        key, allocation = grant.key, grant.allocation

        def revert() -> None:
            self.grants.pop(key, None)
            if own:
                self.ledger.release(allocation)

        undo.append(revert)
        return grant

    def grant(
        self,
        key: str,
        resource: str,
        kind: GrantKind,
        units: int,
        allocation: str,
        *,
        pod: str = "",
        container: str = "",
        limits: tuple[int, int] = (0, 0),
        pod_uid: str = "",
    ) -> Grant:
        """A new :class:`Grant` made now (not recorded: :meth:`new_grant` does)."""
        return Grant(
            key=key,
            resource=resource,
            kind=kind,
            units=units,
            allocation=allocation,
            created_at=self.wall(),
            pod=pod,
            container=container,
            mps_cores=limits[0],
            mps_memory_mib=limits[1],
            pod_uid=pod_uid,
        )

    def release(self, allocation: str) -> None:
        """Forget an allocation and every grant (or DRA claim) that names it."""
        self.ledger.release(allocation)
        self.claims.pop(allocation, None)
        for key in [k for k, g in self.grants.items() if g.allocation == allocation]:
            del self.grants[key]
        self.version += 1
