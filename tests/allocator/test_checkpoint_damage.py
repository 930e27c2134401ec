"""Damage to the allocator checkpoint is told from a torn write: every bit of a real
checkpoint (snapshot and journal, zeros included) flipped, and both files cut at every
offset, each load ends with the exact state before the damage or fails closed (the
loss marked, the files kept aside, the rebuild from PodResources and the claims) --
never silently an older state or fewer allocations.

The sweep reads bytes in memory (:func:`~gpulet_allocator.state.checkpoint.state_from`,
the pure half of a load) so that it stays a few seconds on two busy cores; a sample of
cases goes through :meth:`CheckpointFile.load` on disk, where "fails closed" means the
quarantine and the loss marker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from gpulet_allocator.decide.engine.ledger import Ledger, Owner
from gpulet_allocator.state.checkpoint import CheckpointFile, CorruptFile, encode, state_from
from gpulet_allocator.state.journal import header
from gpulet_allocator.state.records import ClaimDeviceRecord, ClaimRecord, Grant, StoredState
from support.reference import pix_phb_7


def owner(pod: str) -> Owner:
    return Owner(allocation_id=pod, container="main", namespace="ns", name=pod)


def states() -> list[StoredState]:
    """Three successive states of a busy node: whole GPUs, shares, grants, a claim."""
    ledger = Ledger(pix_phb_7())
    out: list[StoredState] = []
    grants: list[Grant] = []
    for n, (pod, whole) in enumerate([("w", 2), ("s1", 0), ("s2", 0)]):
        if whole:
            ledger.allocate_whole(owner(pod), whole)
        else:
            ledger.allocate_share(owner(pod), 30, 8)
        grants.append(
            Grant(
                key=f"k{n}",
                resource="nvidia.com/gpu",
                kind="whole" if whole else "core",
                units=whole or 30,
                allocation=pod,
                created_at=1_700_000_000.25 + n,
                pod=f"ns/{pod}",
                container="main",
            )
        )
        claim = ClaimRecord(
            uid="3f0c1c2e-claim",
            devices=[ClaimDeviceRecord(device="gpu-6", uuid=ledger.topology.uuids[6], minor=6)],
            created_at=1_700_000_100.5,
            namespace="ns",
            name="c",
        )
        out.append(
            StoredState(
                node="gpu-node-1",
                allocations=ledger.snapshot(),
                grants=list(grants),
                claims=[claim],
            )
        )
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes, bytes]:
    """The files after three writes (a compaction, two appends): path, snapshot, journal."""
    path = tmp_path_factory.mktemp("cp") / "allocations.json"
    store = CheckpointFile(path, compact_bytes=1)
    for state in states():
        store.write(encode(state))
    store.close()
    assert (store.compactions, store.appends) == (1, 2)
    return path, path.read_bytes(), store.journal_path.read_bytes()


def outcome(path: Path, snapshot: bytes | None, journal: bytes | None) -> str:
    try:
        state, _detail, _legacy = state_from(path, snapshot, journal)
    except CorruptFile:
        return "fails closed"
    exact = msgspec.structs.replace(state, checksum="") == states()[-1]
    return "exact" if exact else f"WRONG: {len(state.allocations)} allocations"


def flips(data: bytes) -> Iterator[tuple[int, bytes]]:
    damaged = bytearray(data)
    for bit in range(len(data) * 8):
        damaged[bit // 8] ^= 1 << (bit % 8)
        yield bit, bytes(damaged)
        damaged[bit // 8] ^= 1 << (bit % 8)


def test_the_undamaged_files_load_the_last_state(written: tuple[Path, bytes, bytes]) -> None:
    path, snapshot, journal = written
    assert outcome(path, snapshot, journal) == "exact"
    assert len(states()[-1].allocations) == 3


def test_every_bit_flipped_in_the_snapshot_fails_closed(
    written: tuple[Path, bytes, bytes],
) -> None:
    path, snapshot, journal = written
    wrong = {
        bit: result
        for bit, damaged in flips(snapshot)
        if (result := outcome(path, damaged, journal)) != "fails closed"
    }
    assert wrong == {}


def test_every_bit_flipped_in_the_journal_is_exact_or_fails_closed(
    written: tuple[Path, bytes, bytes],
) -> None:
    path, snapshot, journal = written
    counts: dict[str, int] = {}
    wrong: dict[int, str] = {}
    for bit, damaged in flips(journal):
        result = outcome(path, snapshot, damaged)
        counts[result] = counts.get(result, 0) + 1
        if result not in ("exact", "fails closed"):
            wrong[bit] = result
    assert wrong == {}
    # Every flip in the header and the records is caught; only flips in the zeros
    # after the last record (at a sector boundary) read as a torn, unanswered write.
    used = len(journal.rstrip(b"\0"))
    assert counts["fails closed"] >= used * 8


def test_every_cut_of_either_file_fails_closed(written: tuple[Path, bytes, bytes]) -> None:
    path, snapshot, journal = written
    wrong = {
        ("snapshot", n): result
        for n in range(len(snapshot))
        if (result := outcome(path, snapshot[:n], journal)) != "fails closed"
    }
    wrong |= {
        ("journal", n): result
        for n in range(len(journal))
        if (result := outcome(path, snapshot, journal[:n])) != "fails closed"
    }
    assert wrong == {}


@pytest.mark.parametrize("where", ["snapshot-value", "journal-last-record", "journal-cut"])
def test_damage_on_disk_is_kept_aside_and_marked_lost(
    tmp_path: Path, written: tuple[Path, bytes, bytes], where: str
) -> None:
    """Through the real load: the damaged file is kept aside, the loss marked (the
    allocator's rebuild from PodResources and the claims starts from that marker)."""
    _, snapshot, journal = written
    store = CheckpointFile(tmp_path / "allocations.json")
    store.path.write_bytes(snapshot)
    used = len(journal.rstrip(b"\0"))
    if where == "snapshot-value":
        at = snapshot.index(b'"units":2') + len(b'"units":')
        store.path.write_bytes(snapshot[:at] + b"3" + snapshot[at + 1 :])
        store.journal_path.write_bytes(journal)
    elif where == "journal-last-record":
        damaged = bytearray(journal)
        damaged[used - 40] ^= 0x04
        store.journal_path.write_bytes(bytes(damaged))
    else:
        store.journal_path.write_bytes(journal[: used - 100])
    loaded = store.load()
    assert loaded.status == "corrupt"
    assert loaded.state.allocations == []
    assert loaded.state.lost
    assert loaded.corrupt_copy is not None
    assert loaded.corrupt_copy.exists()
    again = store.load()
    assert (again.status, again.state.lost) == ("lost", loaded.state.lost)
    store.close()


def test_the_journal_header_names_its_capacity(written: tuple[Path, bytes, bytes]) -> None:
    _, snapshot, journal = written
    assert journal.startswith(header(snapshot, len(journal)))
