"""What the allocator keeps on disk: the grants and the checkpoint's document.

Plain data, no behaviour: the decision core (:mod:`gpulet_allocator.decide`) fills
them, :mod:`.checkpoint` writes and reads them. A :class:`Grant` is one container's
Allocate of one resource as it was answered; a :class:`ClaimRecord` is one DRA
ResourceClaim's reservation (the DRA kubelet plugin's ``reserve-claim``);
:class:`StoredState` is the checkpoint, the ledger's allocations and the grants and
claims that name them.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from gpulet_allocator.decide.engine import ShareAllocation, WholeAllocation
from gpulet_allocator.protocol import ReservedClaimDevice

STATE_VERSION: Final = 1

GrantKind = Literal["whole", "core", "memory", "ratio"]


class Grant(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One container's Allocate of one resource, as answered."""

    key: str
    resource: str
    kind: GrantKind
    units: int
    allocation: str
    created_at: float
    # Learnt from PodResources (or the pod watch): "namespace/name" and the container.
    pod: str = ""
    container: str = ""
    # Shares placed by koord-scheduler's decision: the MPS limits it accounted (the
    # ledger's memory is in 256 MiB units, the limit is the annotated MiB).
    mps_cores: int = 0
    mps_memory_mib: int = 0
    # The pod's UID, once known (the pod watch, directly or for a pod PodResources
    # named): a pod re-created under the same name is another pod, and an eviction
    # for this grant names this UID as its precondition.
    pod_uid: str = ""


# One device a claim holds: its DRA name, the GPU, and the share (None: whole). The
# record is what the allocator answers a reservation with: one Struct for both.
ClaimDeviceRecord = ReservedClaimDevice


class ClaimRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A DRA claim's reservation; its UID is its allocation ID in the ledger."""

    uid: str
    devices: list[ClaimDeviceRecord]
    created_at: float
    namespace: str = ""
    name: str = ""


class MigLink(msgspec.Struct, frozen=True, kw_only=True):
    """A held MIG device's parent GPU and place on it, kept while it is held: after MIG
    is disabled under it or the device is re-created, the inventory no longer says."""

    device: str
    parent: str
    gpu_instance_id: int
    compute_instance_id: int


class StoredState(msgspec.Struct, frozen=True, kw_only=True):
    """What the checkpoint holds. Add fields with defaults only; bump version otherwise."""

    version: int = STATE_VERSION
    node: str = ""
    allocations: list[WholeAllocation | ShareAllocation] = []
    grants: list[Grant] = []
    # DRA claims, each naming the ledger allocations under its UID.
    claims: list[ClaimRecord] = []
    # Every held MIG device's parent and placement (the ledger's mig_links).
    mig_links: list[MigLink] = []
    # Not empty: the record of allocations was lost (a corrupt file, why); what is
    # above was rebuilt since. Kept until PodResources rebuilt it or an operator
    # accepted the loss (see :mod:`gpulet_allocator.decide.record`).
    lost: str = ""
    # BLAKE2b (128 bits, hex) of this document's encoding with checksum "" (written
    # by :mod:`gpulet_allocator.state.seal`); "" in a file of an older gpulet. Last, so
    # that an older file is this encoding without it.
    checksum: str = ""
