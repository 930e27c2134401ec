"""What the allocator keeps on disk: the grants and the checkpoint's document.

Plain data, no behaviour: the decision core (:mod:`gpulet_allocator.decide`) fills
them, :mod:`.checkpoint` writes and reads them. A :class:`Grant` is one container's
Allocate of one resource as it was answered; :class:`StoredState` is the checkpoint,
the ledger's allocations and the grants that name them.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from gpulet_allocator.decide.engine import ShareAllocation, WholeAllocation

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


class StoredState(msgspec.Struct, frozen=True, kw_only=True):
    """What the checkpoint holds. Add fields with defaults only; bump version otherwise."""

    version: int = STATE_VERSION
    node: str = ""
    allocations: list[WholeAllocation | ShareAllocation] = []
    grants: list[Grant] = []
    # Not empty: the record of allocations was lost (a corrupt file, why); what is
    # above was rebuilt since. Kept until PodResources rebuilt it or an operator
    # accepted the loss (see :mod:`gpulet_allocator.decide.record`).
    lost: str = ""
