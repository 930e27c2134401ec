"""The allocator checkpoint's journal: appends, compaction, replay, torn tails, corruption.

Each state written is a StoredState whose ``node`` names the write (``s1``, ``s2``...),
so the state loaded says which write it is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from gpulet_allocator.state import checkpoint as cp
from gpulet_allocator.state.checkpoint import CheckpointFile, encode, read_state
from gpulet_allocator.state.journal import (
    MAGIC,
    SECTOR,
    JournalCorrupt,
    digest,
    frame,
    header,
    replay,
)
from gpulet_allocator.state.records import StoredState
from gpulet_common.safefile import UnsafePathError


def state(n: int) -> bytes:
    return encode(StoredState(node=f"s{n}"))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointFile]:
    f = CheckpointFile(tmp_path / "allocator" / "allocations.json")
    yield f
    f.close()


def on_disk(store: CheckpointFile) -> str:
    return read_state(store.path)[0].node


def records_end(store: CheckpointFile) -> int:
    """Where the journal's records end (the preallocated zeros start)."""
    return len(store.journal_path.read_bytes().rstrip(b"\0"))


def put_after_records(store: CheckpointFile, data: bytes) -> None:
    """``data`` where the next record would go, as a write cut short leaves it."""
    with store.journal_path.open("r+b") as f:
        f.seek(records_end(store))
        f.write(data)


def test_writes_append_one_record_each_and_compact_when_the_journal_grows(
    tmp_path: Path,
) -> None:
    store = CheckpointFile(tmp_path / "allocations.json", compact_bytes=1)
    try:
        store.write(state(1))  # the first write compacts: snapshot and a fresh journal
        assert (store.compactions, store.appends) == (1, 0)
        assert store.path.read_bytes() == state(1)
        # Preallocated: the header, then zeros (compact_bytes=1: COMPACT_FACTOR records).
        capacity = cp.COMPACT_FACTOR * len(frame(state(1)))
        journal = store.journal_path.read_bytes()
        head = header(state(1), capacity)
        assert journal == head + bytes(capacity - len(head))
        for n in range(2, 40):
            compactions, size = store.compactions, store.journal_path.stat().st_size
            store.write(state(n))
            assert on_disk(store) == f"s{n}"
            if store.compactions == compactions:
                # Records overwrite the zeros: the file never grows.
                assert store.journal_path.stat().st_size == size
        assert store.compactions == 3  # 15 records fit after the header each time
        assert store.appends == 39 - store.compactions
        assert (store.path.stat().st_mode & 0o777, store.journal_path.stat().st_mode & 0o777) == (
            0o600,
            0o600,
        )
    finally:
        store.close()


def test_load_replays_the_journal_and_the_next_write_compacts(store: CheckpointFile) -> None:
    for n in range(1, 5):
        store.write(state(n))
    assert store.path.read_bytes() == state(1)  # the snapshot lags; the journal has the rest
    loaded = store.load()
    assert (loaded.status, loaded.state.node) == ("ok", "s4")
    assert "3 journal record(s) replayed" in loaded.detail
    store.write(state(5))
    assert store.compactions == 2
    assert store.path.read_bytes() == state(5)
    assert read_state(store.path)[1].endswith("from " + str(store.path))


def test_a_clean_stop_folds_the_journal_into_the_snapshot(store: CheckpointFile) -> None:
    """A rollback to a version that reads only the snapshot starts from the state at the
    stop, not from the last compaction's."""
    asked: list[int] = []

    def now() -> bytes:
        asked.append(1)
        return state(4)

    for n in range(1, 5):
        store.write(state(n))
    assert store.path.read_bytes() == state(1)  # the journal holds s2..s4
    store.settle(now)
    assert store.path.read_bytes() == state(4)  # the snapshot alone is the state now
    assert replay(store.journal_path.read_bytes(), state(4)).records == []
    assert (read_state(store.path)[0].node, store.compactions) == ("s4", 2)
    # Nothing appended since: settling again neither asks for the state nor writes.
    store.settle(now)
    assert (len(asked), store.compactions) == (1, 2)


def big_state(n: int) -> bytes:
    """A state whose record spans several sectors (the node name pads it)."""
    return encode(StoredState(node=f"s{n}" + "-" * 1400))


def lost_sectors(at: int, record: bytes, lost: list[int]) -> bytes:
    """``record`` written at file offset ``at`` by a write that a crash cut short:
    the sectors numbered in ``lost`` (0: the one holding its first byte) never reached
    the disk, so they hold the preallocated zeros."""
    torn = bytearray(record)
    first = at // SECTOR
    for k in lost:
        start = max((first + k) * SECTOR - at, 0)
        torn[start : (first + k + 1) * SECTOR - at] = bytes(
            len(torn[start : (first + k + 1) * SECTOR - at])
        )
    return bytes(torn)


@pytest.mark.parametrize(
    "lost",
    [
        pytest.param([3], id="the-last-sector"),
        pytest.param([2, 3], id="the-last-two"),
        pytest.param([0], id="the-first-sector"),
        pytest.param([1], id="a-middle-sector"),
        pytest.param([0, 2], id="two-apart"),
    ],
)
def test_a_write_torn_by_a_crash_is_dropped_and_never_appended_after(
    store: CheckpointFile, lost: list[int]
) -> None:
    """A crash keeps or loses a write by whole sectors: whatever sectors of the last
    record were lost, it loads as the state before it (that write was never answered)."""
    store.write(big_state(1))
    store.write(big_state(2))
    at = records_end(store)
    record = frame(big_state(3))
    assert (at + len(record)) // SECTOR - at // SECTOR == 3  # four sectors
    put_after_records(store, lost_sectors(at, record, lost))
    loaded = store.load()
    assert (loaded.status, loaded.state.node) == ("ok", big_state_node(2))
    assert "torn last journal record" in loaded.detail
    # The torn bytes are gone with the first write after the load (a compaction).
    store.write(state(4))
    journal = store.journal_path.read_bytes()
    assert journal.rstrip(b"\0") == header(state(4), len(journal))
    store.write(state(5))
    assert store.load().state.node == "s5"


def big_state_node(n: int) -> str:
    return f"s{n}" + "-" * 1400


@pytest.mark.parametrize(
    "tail",
    [
        pytest.param(lambda rec: rec[:-7], id="cut-mid-sector"),
        pytest.param(lambda rec: rec[:3], id="length-only"),
        pytest.param(lambda rec: rec[:-3] + b"XX\n", id="checksum"),
        pytest.param(lambda rec: rec[:20] + b"\0" * 20 + rec[40:], id="a-hole-mid-sector"),
        pytest.param(lambda rec: rec[:-1] + b"\0", id="newline-lost-mid-sector"),
    ],
)
def test_a_last_record_damaged_otherwise_fails_closed(store: CheckpointFile, tail: object) -> None:
    """A last record that no crash can leave (cut or zeroed inside a sector, a wrong
    checksum) is damage to an answered write: fail closed, never the older state."""
    store.write(state(1))
    store.write(state(2))
    assert callable(tail)
    at = records_end(store)
    record = frame(state(3))
    assert at // SECTOR == (at + len(record)) // SECTOR, "the record sits in one sector"
    put_after_records(store, tail(record))
    loaded = store.load()
    assert loaded.status == "corrupt"
    assert "not as a crash leaves a write" in loaded.state.lost


def test_a_journal_cut_short_or_grown_fails_closed(store: CheckpointFile) -> None:
    """Its size never changes after it is made: a shorter one lost answered records."""
    store.write(state(1))
    store.write(state(2))
    store.write(state(3))
    data = store.journal_path.read_bytes()
    for damaged in (data[: records_end(store)], data + b"\0"):
        store.journal_path.write_bytes(damaged)
        loaded = store.load()
        assert loaded.status == "corrupt"
        assert "which no crash does" in loaded.state.lost
        store.write(state(3))


def test_a_damaged_journal_header_fails_closed(store: CheckpointFile) -> None:
    """A bit flipped in the digest must not read as "follows another snapshot", which
    would drop every record."""
    store.write(state(1))
    store.write(state(2))
    data = bytearray(store.journal_path.read_bytes())
    data[len(MAGIC) + 3] ^= 0x01
    store.journal_path.write_bytes(bytes(data))
    loaded = store.load()
    assert loaded.status == "corrupt"
    assert "header is damaged" in loaded.state.lost


def test_a_corrupt_record_in_the_middle_fails_closed_and_says_why(
    store: CheckpointFile,
) -> None:
    for n in range(1, 5):
        store.write(state(n))
    data = bytearray(store.journal_path.read_bytes())
    second = data.index(frame(state(3)))
    data[second + 20] ^= 0x01  # a bit flipped inside record 2 of 3
    store.journal_path.write_bytes(bytes(data))
    loaded = store.load()
    assert loaded.status == "corrupt"
    assert loaded.state.allocations == []
    assert "record 2 at byte" in loaded.state.lost
    assert "checksum mismatch" in loaded.state.lost
    assert loaded.corrupt_copy is not None
    assert loaded.corrupt_copy.name.startswith("allocations.json.journal.corrupt-")
    assert loaded.corrupt_copy.read_bytes() == bytes(data)
    # The loss is on disk: a restart reads it back, not the journal.
    again = store.load()
    assert (again.status, again.state.lost) == ("lost", loaded.state.lost)


def test_a_journal_without_its_snapshot_fails_closed(store: CheckpointFile) -> None:
    store.write(state(1))
    store.write(state(2))
    store.path.unlink()
    loaded = store.load()
    assert loaded.status == "corrupt"
    assert "follows a snapshot that does not exist" in loaded.state.lost


def test_a_last_record_that_does_not_decode_fails_closed(store: CheckpointFile) -> None:
    store.write(state(1))
    put_after_records(store, frame(b'{"version": 99}'))
    loaded = store.load()
    assert loaded.status == "corrupt"
    assert "its last record: unsupported checkpoint version 99" in loaded.state.lost


def test_a_corrupt_snapshot_keeps_its_journal_aside_too(store: CheckpointFile) -> None:
    store.write(state(1))
    store.write(state(2))
    journal = store.journal_path.read_bytes()
    store.path.write_bytes(b"{not json")
    loaded = store.load()
    assert loaded.status == "corrupt"
    assert "its journal as allocations.json.journal.corrupt-" in loaded.state.lost
    [kept] = store.path.parent.glob("allocations.json.journal.corrupt-*")
    assert kept.read_bytes() == journal


def test_a_journal_that_follows_another_snapshot_is_ignored(store: CheckpointFile) -> None:
    """A compaction cut short after the snapshot (or a snapshot put back by hand)."""
    store.write(state(1))
    store.write(state(2))
    store.write(state(3))
    store.path.write_bytes(state(7))  # as _compact leaves it before the fresh journal
    loaded = store.load()
    assert (loaded.status, loaded.state.node) == ("ok", "s7")
    assert "follows an older snapshot: ignored" in loaded.detail


def test_a_compaction_cut_short_with_identical_bytes_keeps_the_last_answered_state(
    store: CheckpointFile,
) -> None:
    """The state went back to the snapshot's bytes: the old journal still names it, and
    its last record (the last answered state) is loaded; the cut write was never answered."""
    store.write(state(1))
    store.write(state(2))
    store.path.write_bytes(state(1))
    assert store.load().state.node == "s2"


def test_a_failed_append_is_never_appended_after(
    store: CheckpointFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.write(state(1))
    store.write(state(2))

    real_write = os.pwrite

    calls = 0

    def full(fd: int, data: bytes | memoryview, at: int) -> int:
        nonlocal calls
        calls += 1
        if calls > 1:
            return real_write(fd, data, at)  # the writer puts the zeros back
        real_write(fd, bytes(data[:10]), at)  # a part lands, then the disk fails
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="Input/output"):
        store.write(state(3))
    monkeypatch.undo()
    # The last good state stands on disk; the next write compacts over the torn bytes.
    assert on_disk(store) == "s2"
    store.write(state(4))
    assert store.compactions == 2
    store.write(state(5))
    assert store.load().state.node == "s5"


def test_a_journal_moved_or_removed_underneath_is_not_appended_to(
    store: CheckpointFile, tmp_path: Path
) -> None:
    store.write(state(1))
    store.write(state(2))
    store.journal_path.unlink()
    store.write(state(3))  # a compaction: found at the next start
    assert store.compactions == 2
    assert on_disk(store) == "s3"
    # The directory moved away and a file in its place: the write fails (and says so).
    store.write(state(4))
    directory = store.path.parent
    directory.rename(tmp_path / "aside")
    directory.write_text("not a directory")
    with pytest.raises(FileExistsError):
        store.write(state(5))
    directory.unlink()
    (tmp_path / "aside").rename(directory)
    store.write(state(6))
    assert store.load().state.node == "s6"


def test_symlinks_are_refused_for_the_journal(store: CheckpointFile, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    store.path.parent.mkdir(parents=True)
    store.journal_path.symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="symlink"):
        store.write(state(1))
    assert not elsewhere.exists()


def test_replay_reads_records_and_names_what_is_wrong() -> None:
    snap = state(0)
    records = [state(1), state(2)]
    body = b"".join(frame(r) for r in records)

    def journal(data: bytes, capacity: int = 4096, of: bytes = snap) -> bytes:
        head = header(of, capacity)
        return head + data + bytes(capacity - len(head) - len(data))

    assert replay(journal(body), snap).records == records
    assert replay(journal(body), state(9)).follows is False
    assert replay(journal(b""), snap).records == []
    with pytest.raises(JournalCorrupt, match="not a journal header"):
        replay(b"gpulet-allocator-journal 2 x\n", snap)
    with pytest.raises(JournalCorrupt, match="not a journal header"):
        replay(b"", snap)
    with pytest.raises(JournalCorrupt, match="which no crash does"):
        replay(journal(body)[:-1], snap)
    with pytest.raises(JournalCorrupt, match="does not exist"):
        replay(journal(body), None)
    bad = journal(b"x" + body)
    with pytest.raises(JournalCorrupt, match=r"record 1 at byte \d+ is corrupt \(no length\)"):
        replay(bad, snap)
    bad = journal(frame(state(1))[:-1] + b"!" + frame(state(2)))
    with pytest.raises(JournalCorrupt, match=r"record 1 .*announced"):
        replay(bad, snap)


def test_a_journal_of_a_gpulet_before_the_seal_is_read_once_and_rewritten(
    store: CheckpointFile,
) -> None:
    """Unsealed documents and a digest-only header (what gpulet wrote before): loaded
    by the older rules, then rewritten sealed at once."""
    old = [
        msgspec.json.encode(StoredState(node=f"s{n}"))[: -len(b',"checksum":""}')] + b"}"
        for n in range(3)
    ]
    store.path.parent.mkdir(parents=True)
    store.path.write_bytes(old[0])
    head = MAGIC + digest(old[0]) + b"\n"
    store.journal_path.write_bytes(head + frame(old[1]) + frame(old[2]) + bytes(500))
    loaded = store.load()
    assert (loaded.status, loaded.state.node) == ("ok", "s2")
    assert "rewritten with a checksum" in loaded.detail
    assert store.path.read_bytes() == state(2)
    assert b'"checksum":"' in store.path.read_bytes()
    assert store.load().detail.count("before checksums") == 0


def test_an_older_file_with_a_value_named_checksum_is_still_older_not_damaged() -> None:
    """Only the key makes a document sealed: a container named "checksum" in an
    unsealed file is a value, and the file loads (to be rewritten sealed)."""
    from gpulet_allocator.state import seal
    from gpulet_allocator.state.records import Grant

    grant = Grant(
        key="k", resource="nvidia.com/gpu", kind="whole", units=1, allocation="a",
        created_at=1.0, container="checksum",
    )  # fmt: skip
    body = msgspec.json.encode(StoredState(grants=[grant]))
    old = body[: -len(b',"checksum":""}')] + b"}"
    decoded = seal.decode(old)
    assert decoded.legacy
    assert decoded.state.grants[0].container == "checksum"
