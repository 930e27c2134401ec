"""How the books look from outside: allocations and GPUs as the ``state`` endpoint,
``gpulet allocator state`` and the release answers show them."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from gpulet_allocator.decide.books import Books
from gpulet_allocator.decide.engine import Allocation, ShareAllocation
from gpulet_allocator.protocol import CORES_PER_GPU, AllocationView, GpuView, GrantView

V = TypeVar("V", bound=msgspec.Struct)


def _view(view: type[V], source: object, **rest: Any) -> V:
    """A ``view`` of ``source``: its fields not in ``rest`` are ``source``'s attributes of
    the same names (the ledger's records and their views share their names)."""
    same = {name: getattr(source, name) for name in view.__struct_fields__ if name not in rest}
    return view(**same, **rest)


def allocation_view(
    books: Books, allocation: str, alloc: Allocation | None = None
) -> AllocationView:
    """``alloc``: the entry to show (a DRA claim's share is not under ``(id, "")``)."""
    alloc = alloc or books.ledger.get(allocation)
    grants = sorted(
        (g for g in books.grants.values() if g.allocation == allocation),
        key=lambda g: (g.created_at, g.key),
    )
    grant_views = [_view(GrantView, g) for g in grants]
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
    return [allocation_view(books, a.owner.allocation_id, a) for a in books.ledger.allocations()]


def gpu_views(books: Books) -> list[GpuView]:
    return [
        _view(
            GpuView,
            d,
            whole=d.whole_owner.allocation_id if d.whole_owner else "",
            shares=[s.owner.allocation_id for s in d.shares],
        )
        for d in books.ledger.devices()
    ]


def pods_of(view: AllocationView) -> str:
    pods = sorted({g.pod for g in view.grants if g.pod})
    return ", ".join(pods) if pods else "pod unknown"
