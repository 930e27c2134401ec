"""Property tests: the ledger never over-allocates, whatever the sequence of calls."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpulet_allocator.decide.engine.ledger import Allocation, Ledger, Owner, WholeAllocation
from gpulet_allocator.protocol import CORES_PER_GPU
from gpulet_allocator.state import checkpoint as store
from gpulet_allocator.state.records import StoredState
from gpulet_common.messages import Inventory
from gpulet_common.refusal import STATUS, Refused
from support.reference import GIB, inventory_from_matrix

Op = tuple[str, int, int, int]


@st.composite
def node(draw: st.DrawFn) -> Inventory:
    n = draw(st.integers(min_value=1, max_value=5))
    levels = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            levels[a][b] = levels[b][a] = draw(st.sampled_from([10, 20, 30, 50]))
    mems = draw(st.lists(st.sampled_from([4, 8, 16]), min_size=n, max_size=n))
    return inventory_from_matrix("prop", levels, memory_bytes=[m * GIB for m in mems])


pods = st.integers(min_value=0, max_value=9)
# Mostly valid requests, so that cards fill up; sometimes anything at all.
share_cores = st.one_of(st.integers(1, 99), st.integers(1, 60), st.integers(-5, 130))
share_memory = st.one_of(st.integers(1, 16), st.integers(1, 8), st.integers(-1, 70))
allocation = st.one_of(
    st.tuples(st.just("share"), pods, share_cores, share_memory),
    st.tuples(st.just("whole"), pods, st.one_of(st.integers(1, 2), st.integers(-1, 6)), st.just(0)),
    st.tuples(
        st.just("alloc"),
        pods,
        st.sampled_from([0, 10, 25, 50, 99, 100, 150, 200, 300]),
        share_memory,
    ),
)
ops: st.SearchStrategy[list[Op]] = st.lists(
    st.one_of(
        allocation,
        allocation,
        allocation,
        st.tuples(st.just("release"), pods, st.just(0), st.just(0)),
        st.tuples(st.just("health"), st.integers(0, 4), st.integers(0, 1), st.just(0)),
        st.tuples(st.just("lose"), st.integers(0, 5), st.just(0), st.just(0)),
        st.tuples(st.just("restart"), st.just(0), st.just(0), st.just(0)),
    ),
    max_size=60,
)


def check_invariants(ledger: Ledger) -> None:
    holders: dict[str, set[tuple[str, str]]] = {}
    for alloc in ledger.allocations():
        devs = alloc.devices if isinstance(alloc, WholeAllocation) else (alloc.device,)
        for d in devs:
            holders.setdefault(d, set()).add(alloc.owner.key)
    free = set(ledger.free_whole())
    for dev in ledger.devices():
        assert dev.cores_used <= CORES_PER_GPU
        if dev.present:
            assert dev.memory_used <= dev.memory_units
        assert not (dev.whole_owner and dev.shares), dev
        if dev.whole_owner:
            assert holders[dev.uuid] == {dev.whole_owner.key}
        assert {s.owner.key for s in dev.shares} | (
            {dev.whole_owner.key} if dev.whole_owner else set()
        ) == holders.get(dev.uuid, set())
        if dev.uuid in free:
            assert dev.healthy
            assert dev.present
            assert dev.uuid not in holders


def apply(ledger: Ledger, inv: Inventory, op: Op) -> Allocation | None:
    kind, a, b, c = op
    who = Owner(allocation_id=f"pod{a}", container="c")
    uuids = [g.uuid for g in inv.gpus]
    if kind == "share":
        return ledger.allocate_share(who, b, c)
    if kind == "whole":
        return ledger.allocate_whole(who, b)
    if kind == "alloc":
        return ledger.allocate(who, b, c)
    if kind == "release":
        ledger.release(who.allocation_id)
    elif kind == "health" and a < len(uuids):
        ledger.set_health(uuids[a], bool(b))
    elif kind == "lose":
        ledger.update_inventory([g for i, g in enumerate(inv.gpus) if i != a])
    return None


@settings(max_examples=400, deadline=None)
@given(node(), ops)
def test_random_sequences_never_over_allocate(inv: Inventory, sequence: list[Op]) -> None:
    ledger = Ledger(inv)
    for op in sequence:
        if op[0] == "restart":
            health = {d.uuid: d.healthy for d in ledger.devices()}
            alive = {d.uuid for d in ledger.devices() if d.present}
            present = [g for g in inv.gpus if g.uuid in alive]
            before = ledger.snapshot()
            ledger = Ledger(present)
            for uuid, ok in health.items():
                if uuid in ledger.topology:
                    ledger.set_health(uuid, ok)
            stored = store.decode(store.encode(StoredState(allocations=before)))
            assert ledger.restore(stored.allocations) == []
            assert ledger.snapshot() == before
            check_invariants(ledger)
            continue
        schedulable = {d.uuid for d in ledger.devices() if d.healthy and d.present}
        existed = ledger.get(f"pod{op[1]}", "c")
        refused: Refused | None = None
        got: Allocation | None = None
        try:
            got = apply(ledger, inv, op)
        except Refused as exc:
            refused = exc
        if refused is not None:
            assert refused.code in STATUS
            assert refused.message
        elif got is not None:
            snapshot = ledger.snapshot()
            assert got in snapshot
            if existed is None:
                devs = got.devices if isinstance(got, WholeAllocation) else (got.device,)
                assert set(devs) <= schedulable
            else:
                assert got == existed
            # Idempotent: the same request again returns it and changes nothing.
            assert apply(ledger, inv, op) == got
            assert ledger.snapshot() == snapshot
        check_invariants(ledger)


seen_ok: set[Op] = set()
