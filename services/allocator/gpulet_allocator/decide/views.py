"""How the books look from outside: allocations and GPUs as the ``state`` endpoint,
``gpulet allocator state`` and the release answers show them."""

from __future__ import annotations

from gpulet_allocator.decide.books import Books
from gpulet_allocator.decide.engine import ShareAllocation
from gpulet_allocator.protocol import CORES_PER_GPU, AllocationView, GpuView, GrantView


def allocation_view(books: Books, allocation: str) -> AllocationView:
    alloc = books.ledger.get(allocation)
    grants = sorted(
        (g for g in books.grants.values() if g.allocation == allocation),
        key=lambda g: (g.created_at, g.key),
    )
    grant_views = [
        GrantView(
            key=g.key,
            resource=g.resource,
            kind=g.kind,
            units=g.units,
            created_at=g.created_at,
            pod=g.pod,
            container=g.container,
        )
        for g in grants
    ]
    if isinstance(alloc, ShareAllocation):
        return AllocationView(
            id=allocation,
            kind="share",
            gpus=[alloc.device],
            cores=alloc.cores,
            memory_units=alloc.memory_units,
            grants=grant_views,
        )
    devices = list(alloc.devices) if alloc is not None else []
    return AllocationView(
        id=allocation,
        kind="whole",
        gpus=devices,
        cores=CORES_PER_GPU * len(devices),
        grants=grant_views,
    )


def allocation_views(books: Books) -> list[AllocationView]:
    return [allocation_view(books, a.owner.allocation_id) for a in books.ledger.allocations()]


def gpu_views(books: Books) -> list[GpuView]:
    return [
        GpuView(
            uuid=d.uuid,
            index=d.index,
            healthy=d.healthy,
            present=d.present,
            cores_used=d.cores_used,
            memory_units=d.memory_units,
            memory_used=d.memory_used,
            whole=d.whole_owner.allocation_id if d.whole_owner else "",
            shares=[s.owner.allocation_id for s in d.shares],
        )
        for d in books.ledger.devices()
    ]


def pods_of(view: AllocationView) -> str:
    pods = sorted({g.pod for g in view.grants if g.pod})
    return ", ".join(pods) if pods else "pod unknown"
