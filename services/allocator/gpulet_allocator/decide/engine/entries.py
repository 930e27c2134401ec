"""The ledger's entries: who holds an allocation, the two kinds of allocation, and the
read-only view of one card (:class:`DeviceState`). Split from :mod:`.ledger` by concern;
:mod:`.ledger` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from gpulet_allocator.protocol import CORES_PER_GPU

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

    def describe(self, *, claim: bool = False) -> str:
        """The holder in words; ``claim``: a DRA ResourceClaim holds it, not a pod's
        container (the ledger knows which: :meth:`~.cards.Cards.is_claim`)."""
        who = (
            f"{self.namespace}/{self.name} ({self.allocation_id})"
            if self.name
            else self.allocation_id
        )
        if claim:
            return f"claim {who}"
        if not self.name:
            # kubelet's Allocate names no pod: the holder is the device plugin's
            # allocation, known by its ID (never a made-up pod and container).
            return f"the device plugin's allocation {self.allocation_id}"
        if not self.container:
            return f"pod {who}"
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
    # A MIG device: its parent GPU's UUID ("" for a GPU).
    parent: str = ""

    @property
    def cores_free(self) -> int:
        return 0 if self.whole_owner else CORES_PER_GPU - self.cores_used

    @property
    def memory_free(self) -> int:
        return 0 if self.whole_owner else self.memory_units - self.memory_used

    @property
    def schedulable(self) -> bool:
        return self.healthy and self.present
