"""Restoring the ledger from the allocator's checkpoint: restart recovery, invariants."""

from __future__ import annotations

from gpulet_allocator.decide.engine.ledger import (
    Allocation,
    Ledger,
    Owner,
    ShareAllocation,
    WholeAllocation,
)
from gpulet_allocator.state import checkpoint as store
from gpulet_allocator.state.records import StoredState
from support.reference import pix_phb_7


def owner(pod: str, container: str = "main") -> Owner:
    return Owner(allocation_id=pod, container=container, namespace="ns", name=pod)


def busy_ledger() -> Ledger:
    ledger = Ledger(pix_phb_7())
    ledger.allocate_whole(owner("w"), 3)
    ledger.allocate_share(owner("s1"), 30, 8)
    ledger.allocate_share(owner("s2"), 50, 16)
    return ledger


def test_restart_recovers_without_double_allocation() -> None:
    first = busy_ledger()
    data = store.encode(StoredState(allocations=first.snapshot()))

    # A new process: same inventory, empty ledger, recover from the checkpoint.
    second = Ledger(pix_phb_7())
    assert second.restore(store.decode(data).allocations) == []
    assert second.snapshot() == first.snapshot()

    # kubelet retries Allocate for the same containers: same answers, nothing new.
    w = second.allocate_whole(owner("w"), 3)
    assert w == first.get("w", "main")
    s1 = second.allocate_share(owner("s1"), 30, 8)
    assert s1 == first.get("s1", "main")
    assert len(second.allocations()) == 3

    # A new pod never gets what the old ones hold.
    fresh = second.allocate_whole(owner("new"), 3)
    held = set(w.devices) | {s1.device}
    assert not held & set(fresh.devices)
    for dev in second.devices():
        assert dev.cores_used <= 100
        assert dev.memory_used <= dev.memory_units


def test_restore_refuses_entries_that_break_invariants() -> None:
    ledger = Ledger(pix_phb_7())
    u = ledger.topology.uuids
    entries: list[Allocation] = [
        WholeAllocation(owner=owner("a"), devices=(u[0], u[1])),
        WholeAllocation(owner=owner("b"), devices=(u[1],)),  # GPU1 held twice
        ShareAllocation(owner=owner("c"), device=u[0], cores=10, memory_units=1),  # held whole
        ShareAllocation(owner=owner("d"), device=u[2], cores=60, memory_units=1),
        ShareAllocation(owner=owner("e"), device=u[2], cores=60, memory_units=1),  # > 100
        ShareAllocation(owner=owner("f"), device=u[3], cores=10, memory_units=65),  # > 64
        ShareAllocation(owner=owner("g"), device=u[3], cores=150, memory_units=1),
        WholeAllocation(owner=owner("a"), devices=(u[0], u[1])),  # exact duplicate: fine
        WholeAllocation(owner=owner("a"), devices=(u[5],)),  # same key, different
        WholeAllocation(owner=owner("h"), devices=()),
    ]
    problems = ledger.restore(entries)
    assert [p.split(":")[0] for p in problems] == [
        f"pod ns/{p} ({p}) container 'main'" for p in ("b", "c", "e", "f", "g", "a", "h")
    ]
    assert [a.owner.allocation_id for a in ledger.allocations()] == ["a", "d"]


def test_allocations_on_gpus_missing_from_the_inventory_stay_recorded() -> None:
    ledger = Ledger(pix_phb_7())
    gone = WholeAllocation(owner=owner("a"), devices=("GPU-gone",))
    share = ShareAllocation(owner=owner("b"), device="GPU-gone2", cores=10, memory_units=4)
    assert ledger.restore([gone, share]) == []
    assert ledger.get("a", "main") == gone
    assert not ledger.device("GPU-gone").present
    assert "GPU-gone" not in ledger.free_whole()
    assert len(ledger.free_whole()) == 7
