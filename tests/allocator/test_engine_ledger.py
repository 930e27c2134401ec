"""The allocation ledger: whole and shared allocations, health, idempotency, errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpulet_allocator.decide.engine.ledger import (
    Ledger,
    Owner,
    ShareAllocation,
    WholeAllocation,
)
from gpulet_common.messages import Inventory
from gpulet_common.refusal import STATUS, Refused
from support.reference import (
    GIB,
    inventory_from_matrix,
    nvlink_pairs_8,
    pix_phb_7,
)


def owner(pod: str, container: str = "main") -> Owner:
    return Owner(allocation_id=pod, container=container, namespace="ns", name=f"name-{pod}")


def two_cards(mem_gib: tuple[int, int] = (16, 16)) -> Inventory:
    return inventory_from_matrix("two", [[0, 10], [10, 0]], memory_bytes=[m * GIB for m in mem_gib])


def uuid(ledger: Ledger, index: int) -> str:
    return ledger.topology.uuids[index]


def indices(ledger: Ledger, uuids: tuple[str, ...]) -> set[int]:
    return {ledger.topology.position(u) for u in uuids}


def code_of(exc: pytest.ExceptionInfo[Refused]) -> str:
    return exc.value.code


# --- whole cards ----------------------------------------------------------------------


def test_whole_allocation_is_topology_aware() -> None:
    ledger = Ledger(pix_phb_7())
    a = ledger.allocate_whole(owner("p1"), 3)
    assert indices(ledger, a.devices) == {0, 1, 2}
    b = ledger.allocate_whole(owner("p2"), 4)
    assert indices(ledger, b.devices) == {3, 4, 5, 6}
    assert ledger.free_whole() == []


def test_single_gpu_requests_fill_broken_groups() -> None:
    ledger = Ledger(nvlink_pairs_8())
    got = [
        next(iter(indices(ledger, ledger.allocate_whole(owner(f"p{i}"), 1).devices)))
        for i in range(4)
    ]
    assert got == [0, 1, 2, 3]
    ledger.release("p1")
    ledger.release("p2")
    # GPU1 and GPU2 are free again, both widowed (partners 0 and 3 held): no intact
    # pair is broken either way, so the lower index wins.
    pick = ledger.allocate_whole(owner("p9"), 1).devices
    assert indices(ledger, pick) == {1}


def test_too_many_units_names_the_counts() -> None:
    ledger = Ledger(pix_phb_7())
    ledger.allocate_whole(owner("p1"), 5)
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(owner("p2"), 3)
    assert code_of(err) == "too_many_units"
    assert err.value.message == (
        "pod ns/name-p2 (p2) container 'main' asks for 3 whole GPUs but only 2 are free "
        "(7 healthy on the node)"
    )


def test_explicit_devices_kubelet_chose() -> None:
    ledger = Ledger(pix_phb_7())
    devs = (uuid(ledger, 5), uuid(ledger, 0))
    a = ledger.allocate_whole(owner("p1"), devices=devs)
    assert set(a.devices) == set(devs)
    assert a.devices == tuple(sorted(devs, key=ledger.topology.position))
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(owner("p2"), devices=[uuid(ledger, 5)])
    assert code_of(err) == "insufficient_capacity"
    assert "allocated whole to pod ns/name-p1 (p1)" in err.value.message
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(owner("p3"), 2, devices=[uuid(ledger, 1)])
    assert code_of(err) == "invalid_request"
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(owner("p3"), devices=[uuid(ledger, 1), uuid(ledger, 1)])
    assert code_of(err) == "invalid_request"


def test_must_include() -> None:
    ledger = Ledger(pix_phb_7())
    a = ledger.allocate_whole(owner("p1"), 2, must_include=[uuid(ledger, 4)])
    assert indices(ledger, a.devices) == {3, 4}
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(owner("p2"), 1, must_include=[uuid(ledger, 0), uuid(ledger, 1)])
    assert code_of(err) == "invalid_request"


def test_unknown_devices_are_named() -> None:
    ledger = Ledger(pix_phb_7())
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(owner("p1"), 2, must_include=["GPU-x", "GPU-y"])
    assert code_of(err) == "unknown_device"
    assert err.value.message == "unknown GPU IDs: GPU-x, GPU-y"
    with pytest.raises(Refused) as err:
        ledger.set_health("GPU-z", False)
    assert code_of(err) == "unknown_device"
    with pytest.raises(Refused) as err:
        ledger.allocate_share(owner("p1"), 10, 1, device="GPU-q")
    assert "GPU-q" in err.value.message


# --- health ---------------------------------------------------------------------------


def test_unhealthy_gpus_take_no_new_allocations_but_keep_old_ones() -> None:
    ledger = Ledger(pix_phb_7())
    a = ledger.allocate_whole(owner("p1"), 1)
    ledger.set_health(a.devices[0], False)
    assert ledger.get("p1", "main") == a
    assert ledger.device(a.devices[0]).whole_owner == owner("p1")
    ledger.set_health(uuid(ledger, 3), False)
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(owner("p2"), 1, must_include=[uuid(ledger, 3)])
    assert code_of(err) == "unhealthy_device"
    assert err.value.message == f"{uuid(ledger, 3)} is unhealthy"
    b = ledger.allocate_whole(owner("p3"), 5)
    assert 3 not in indices(ledger, b.devices)
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(owner("p4"), 1)
    assert code_of(err) == "too_many_units"
    assert "(5 healthy on the node)" in err.value.message
    ledger.set_health(uuid(ledger, 3), True)
    assert indices(ledger, ledger.allocate_whole(owner("p4"), 1).devices) == {3}


def test_lost_gpus_keep_their_holders_and_come_back() -> None:
    inv = pix_phb_7()
    ledger = Ledger(inv)
    a = ledger.allocate_whole(owner("p1"), 1)
    lost = a.devices[0]
    ledger.update_inventory([g for g in inv.gpus if g.uuid != lost])
    assert not ledger.device(lost).present
    assert ledger.get("p1", "main") == a
    with pytest.raises(Refused) as err:
        ledger.allocate_share(owner("p2"), 10, 1, device=lost)
    assert code_of(err) == "unhealthy_device"
    assert "lost" in err.value.message
    ledger.release("p1")
    assert lost not in ledger.free_whole()
    ledger.update_inventory(inv)
    assert lost in ledger.free_whole()


# --- shares ---------------------------------------------------------------------------


def test_shares_pack_best_fit_and_never_oversubscribe() -> None:
    ledger = Ledger(two_cards())
    a = ledger.allocate_share(owner("a"), 50, 8)
    b = ledger.allocate_share(owner("b"), 30, 8)
    assert a.device == b.device == uuid(ledger, 0)
    c = ledger.allocate_share(owner("c"), 30, 8)  # 20 left on GPU0: opens GPU1
    assert c.device == uuid(ledger, 1)
    d = ledger.allocate_share(owner("d"), 20, 8)  # exactly fills GPU0
    assert d.device == uuid(ledger, 0)
    assert ledger.device(uuid(ledger, 0)).cores_free == 0
    e = ledger.allocate_share(owner("e"), 70, 8)
    assert e.device == uuid(ledger, 1)
    with pytest.raises(Refused) as err:
        ledger.allocate_share(owner("f"), 1, 1)
    assert code_of(err) == "insufficient_capacity"
    for dev in ledger.devices():
        assert dev.cores_used <= 100
        assert dev.memory_used <= dev.memory_units


def test_share_memory_is_enforced() -> None:
    ledger = Ledger(two_cards((16, 8)))
    assert ledger.device(uuid(ledger, 0)).memory_units == 64
    a = ledger.allocate_share(owner("a"), 10, 60)
    assert a.device == uuid(ledger, 0)
    b = ledger.allocate_share(owner("b"), 10, 10)  # GPU0 has 4 units left
    assert b.device == uuid(ledger, 1)
    with pytest.raises(Refused) as err:
        ledger.allocate_share(owner("c"), 10, 65)
    assert code_of(err) == "memory_exceeds_card"
    assert f"the largest card, {uuid(ledger, 0)}, has 64 units (16 GiB)" in err.value.message


def test_shared_cards_are_not_offered_whole_and_whole_cards_take_no_shares() -> None:
    ledger = Ledger(two_cards())
    s = ledger.allocate_share(owner("s"), 10, 1)
    assert s.device not in ledger.free_whole()
    w = ledger.allocate_whole(owner("w"), 1)
    assert w.devices != (s.device,)
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(owner("x"), 1)
    assert code_of(err) == "too_many_units"
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(owner("x"), 1, must_include=[s.device])
    assert code_of(err) == "insufficient_capacity"
    assert "holds 1 share(s) and is not offered whole" in err.value.message
    with pytest.raises(Refused) as err:
        ledger.allocate_share(owner("y"), 10, 1, device=w.devices[0])
    assert code_of(err) == "insufficient_capacity"
    # The only shareable card is GPU s.device; it still has room.
    assert ledger.allocate_share(owner("z"), 10, 1).device == s.device


def test_a_card_never_carries_shares_of_both_adapters() -> None:
    ledger = Ledger(two_cards())
    # A DRA claim's share first: the device plugin's share goes to the other card,
    # though best fit alone would pack it beside the claim's ...
    claim = ledger.allocate_share(owner("claim-uid", "gpu-0"), 30, 4, claim=True)
    plugin = ledger.allocate_share(owner("dp"), 30, 4)
    assert plugin.device != claim.device
    # ... and is refused on the claim's card by name.
    with pytest.raises(Refused) as err:
        ledger.allocate_share(owner("dp2"), 10, 1, device=claim.device)
    assert code_of(err) == "insufficient_capacity"
    assert err.value.message == f"{claim.device} holds a DRA claim's share (claim-uid)"
    # The reverse: a claim's share is refused on the device plugin's card.
    with pytest.raises(Refused) as err:
        ledger.allocate_share(owner("claim-2", "gpu-1"), 10, 1, device=plugin.device, claim=True)
    assert code_of(err) == "insufficient_capacity"
    assert err.value.message == f"{plugin.device} holds a device-plugin share (dp)"
    # Each adapter still packs beside its own shares.
    assert ledger.allocate_share(owner("claim-uid", "gpu-x"), 10, 1).device == claim.device
    assert ledger.allocate_share(owner("dp3"), 10, 1).device == plugin.device
    # With every share released the card takes either adapter again.
    ledger.release("claim-uid")
    assert not ledger.is_claim("claim-uid")
    assert ledger.allocate_share(owner("dp4"), 10, 1, device=claim.device).device == claim.device


def test_a_restored_claim_is_marked_again() -> None:
    ledger = Ledger(two_cards())
    claim = ledger.allocate_share(owner("claim-uid", "gpu-0"), 30, 4, claim=True)
    restored = Ledger(two_cards())
    assert restored.restore(ledger.snapshot()) == []
    restored.mark_claim("claim-uid")
    with pytest.raises(Refused) as err:
        restored.allocate_share(owner("dp"), 10, 1, device=claim.device)
    assert "DRA claim's share" in err.value.message


def test_a_fresh_shared_card_is_chosen_like_a_single_gpu() -> None:
    ledger = Ledger(nvlink_pairs_8())
    ledger.allocate_whole(owner("w"), 1, must_include=[uuid(ledger, 2)])
    # Opening a card for shares takes it out of whole-card use: take GPU3, whose
    # partner is gone, rather than GPU0 and breaking the (0, 1) pair.
    assert ledger.allocate_share(owner("s"), 10, 1).device == uuid(ledger, 3)


def test_allocate_dispatches_on_core_units() -> None:
    ledger = Ledger(pix_phb_7())
    with pytest.raises(Refused) as err:
        ledger.allocate(owner("p"), 150, 4)
    assert code_of(err) == "invalid_core_units"
    assert err.value.message == (
        "core units must be below 100 (a share) or a multiple of 100 (whole cards), got 150"
    )
    whole = ledger.allocate(owner("w"), 300)
    assert isinstance(whole, WholeAllocation)
    assert indices(ledger, whole.devices) == {0, 1, 2}
    share = ledger.allocate(owner("s"), 25, 4)
    assert isinstance(share, ShareAllocation)
    pinned = ledger.allocate(owner("t"), 25, 4, must_include=[uuid(ledger, 6)])
    assert isinstance(pinned, ShareAllocation)
    assert pinned.device == uuid(ledger, 6)
    for bad in (0, -100):
        with pytest.raises(Refused) as err:
            ledger.allocate(owner("q"), bad, 1)
        assert code_of(err) == "invalid_core_units"
    with pytest.raises(Refused) as err:
        ledger.allocate(owner("q"), 50, 0)
    assert code_of(err) == "invalid_request"
    with pytest.raises(Refused) as err:
        ledger.allocate(owner("q"), 100, -1)
    assert code_of(err) == "invalid_request"
    with pytest.raises(Refused) as err:
        ledger.allocate(owner("q"), 50, 1, must_include=[uuid(ledger, 5), uuid(ledger, 6)])
    assert code_of(err) == "invalid_request"


def test_share_above_a_card_is_too_many_units() -> None:
    ledger = Ledger(two_cards())
    with pytest.raises(Refused) as err:
        ledger.allocate_share(owner("p"), 120, 4)
    assert code_of(err) == "too_many_units"


# --- idempotency and release -----------------------------------------------------------


def test_allocating_twice_returns_the_existing_allocation() -> None:
    ledger = Ledger(pix_phb_7())
    a = ledger.allocate_whole(owner("p1"), 2)
    assert ledger.allocate_whole(owner("p1"), 2) is a
    assert ledger.allocate_whole(owner("p1"), 2, must_include=[a.devices[1]]) is a
    assert ledger.allocate_whole(owner("p1"), devices=list(reversed(a.devices))) is a
    assert ledger.allocate(owner("p1"), 200) is a
    s = ledger.allocate_share(owner("p2"), 30, 4)
    assert ledger.allocate_share(owner("p2"), 30, 4) is s
    assert ledger.allocate_share(owner("p2"), 30, 4, device=s.device) is s
    assert len(ledger.allocations()) == 2
    assert len(ledger.free_whole()) == 4


def test_a_different_request_under_a_busy_key_is_refused() -> None:
    ledger = Ledger(pix_phb_7())
    ledger.allocate_whole(owner("p1"), 2)
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(owner("p1"), 3)
    assert code_of(err) == "invalid_request"
    assert "already holds whole GPUs" in err.value.message
    assert "release it before asking for 3 whole GPU(s)" in err.value.message
    with pytest.raises(Refused) as err:
        ledger.allocate_share(owner("p1"), 10, 1)
    assert code_of(err) == "invalid_request"
    ledger.allocate_share(owner("p2"), 10, 1)
    with pytest.raises(Refused) as err:
        ledger.allocate_share(owner("p2"), 20, 1)
    assert code_of(err) == "invalid_request"
    assert "already holds a share of" in err.value.message


def test_the_same_pod_may_hold_one_allocation_per_container() -> None:
    ledger = Ledger(pix_phb_7())
    a = ledger.allocate_whole(owner("p1", "a"), 1)
    b = ledger.allocate_whole(owner("p1", "b"), 1)
    assert a.devices != b.devices
    assert ledger.allocations("p1") == [a, b]
    assert ledger.release("p1", "a") == [a]
    assert ledger.release("p1") == [b]
    assert ledger.release("p1") == []
    assert len(ledger.free_whole()) == 7


def test_release_frees_capacity() -> None:
    ledger = Ledger(two_cards())
    s = ledger.allocate_share(owner("s"), 90, 60)
    assert ledger.device(s.device).cores_free == 10
    assert ledger.release("s") == [s]
    assert ledger.device(s.device).cores_free == 100
    assert ledger.device(s.device).memory_free == 64
    assert s.device in ledger.free_whole()
    assert ledger.get("s", "main") is None


def test_reconcile_releases_pods_that_no_longer_exist() -> None:
    ledger = Ledger(pix_phb_7())
    ledger.allocate_whole(owner("alive"), 1)
    gone = ledger.allocate_whole(owner("gone"), 1)
    assert ledger.reconcile(["alive"]) == [gone]
    assert [a.owner.allocation_id for a in ledger.allocations()] == ["alive"]


def test_owner_needs_an_allocation_id() -> None:
    ledger = Ledger(pix_phb_7())
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(Owner(allocation_id=""), 1)
    assert code_of(err) == "invalid_request"
    with pytest.raises(Refused) as err:
        ledger.allocate_whole(owner("p"), 0)
    assert code_of(err) == "invalid_request"


def test_preferred_offers_only_cards_that_may_go_whole() -> None:
    ledger = Ledger(pix_phb_7())
    ledger.allocate_whole(owner("p"), 1, must_include=[uuid(ledger, 4)])
    everything = list(ledger.topology.uuids)
    got = ledger.preferred(everything, [], 4)
    assert {ledger.topology.position(u) for u in got} == {0, 1, 2, 3}
    # kubelet offers a busy card among too few others: refused, saying why, rather
    # than a preference the Allocate after it would refuse.
    with pytest.raises(Refused) as err:
        ledger.preferred([uuid(ledger, 4), uuid(ledger, 5)], [], 2)
    assert code_of(err) == "insufficient_capacity"
    assert f"{uuid(ledger, 4)} is allocated whole" in err.value.message
    with pytest.raises(Refused) as err:
        ledger.preferred(["GPU-x"], [], 1)
    assert code_of(err) == "unknown_device"


# The engine's codes (the service adds its own): each has a row in the one table.
ENGINE_CODES = {
    "unknown_device",
    "too_many_units",
    "invalid_core_units",
    "memory_exceeds_card",
    "unhealthy_device",
    "insufficient_capacity",
    "invalid_request",
}


def test_every_error_code_is_reachable() -> None:
    seen: set[str] = set()
    ledger = Ledger(two_cards())
    attempts: list[Callable[[], object]] = [
        lambda: ledger.allocate_whole(owner("a"), 1, must_include=["GPU-x"]),
        lambda: ledger.allocate_whole(owner("a"), 3),
        lambda: ledger.allocate(owner("a"), 150, 1),
        lambda: ledger.allocate_share(owner("a"), 10, 65),
        lambda: ledger.allocate_share(owner("a"), 10, 1, device=uuid(ledger, 1)),
        lambda: ledger.allocate_share(owner("a"), 99, 64),
        lambda: ledger.allocate_whole(owner("a"), 0),
    ]
    ledger.set_health(uuid(ledger, 1), False)
    ledger.allocate_share(owner("b"), 2, 1)
    for attempt in attempts:
        with pytest.raises(Refused) as err:
            attempt()
        seen.add(err.value.code)
    assert seen == ENGINE_CODES
    assert STATUS.keys() >= ENGINE_CODES
