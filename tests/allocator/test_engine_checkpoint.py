"""Checkpoint: round trip, crash safety, corrupt files and restart recovery."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpulet_allocator.engine.checkpoint import (
    CHECKPOINT_VERSION,
    CheckpointStore,
    load_checkpoint,
    save_checkpoint,
)
from gpulet_allocator.engine.ledger import (
    Allocation,
    Ledger,
    Owner,
    ShareAllocation,
    WholeAllocation,
)
from gpulet_allocator.engine.reference import pix_phb_7


def owner(pod: str, container: str = "main") -> Owner:
    return Owner(pod_uid=pod, container=container, namespace="ns", name=pod)


def busy_ledger() -> Ledger:
    ledger = Ledger(pix_phb_7())
    ledger.allocate_whole(owner("w"), 3)
    ledger.allocate_share(owner("s1"), 30, 8)
    ledger.allocate_share(owner("s2"), 50, 16)
    return ledger


def test_round_trip(tmp_path: Path) -> None:
    ledger = busy_ledger()
    path = tmp_path / "state" / "allocations.json"
    save_checkpoint(path, ledger.snapshot(), node="n1")
    doc = json.loads(path.read_bytes())
    assert doc["version"] == CHECKPOINT_VERSION
    assert doc["node"] == "n1"
    assert {a["type"] for a in doc["allocations"]} == {"whole", "share"}

    result = load_checkpoint(path)
    assert result.status == "ok"
    assert result.clean
    assert result.node == "n1"
    assert list(result.allocations) == ledger.snapshot()
    assert not list(tmp_path.glob("state/.*.tmp"))


def test_missing_file_is_an_empty_start(tmp_path: Path) -> None:
    result = load_checkpoint(tmp_path / "nope.json")
    assert result.status == "missing"
    assert result.clean
    assert result.allocations == ()


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b'{"version": 1, "allocations": [{"type": "whole"',
        b'{"version": 1, "allocations": [{"type": "bogus"}]}',
        b'{"version": 1, "allocations": "nope"}',
        b'{"allocations": []}',
        b'{"version": 99, "allocations": []}',
        b"\x00\xff\xfe",
    ],
)
def test_corrupt_file_is_kept_aside_and_reported(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "allocations.json"
    path.write_bytes(content)
    result = load_checkpoint(path)
    assert result.status == "corrupt"
    assert not result.clean
    assert result.allocations == ()
    assert result.corrupt_copy == tmp_path / "allocations.json.corrupt"
    assert result.corrupt_copy.read_bytes() == content
    assert not path.exists()
    assert "starting empty" in result.detail
    if b"99" in content:
        assert "unsupported checkpoint version 99" in result.detail


def test_recover_from_corrupt_rewrites_a_clean_file(tmp_path: Path) -> None:
    path = tmp_path / "allocations.json"
    path.write_bytes(b"garbage")
    store = CheckpointStore(path)
    ledger = Ledger(pix_phb_7())
    recovery = store.recover(ledger)
    assert recovery.load.status == "corrupt"
    assert not recovery.clean
    assert ledger.allocations() == []
    assert load_checkpoint(path).status == "ok"


def test_a_crash_before_the_rename_leaves_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "allocations.json"
    old = busy_ledger()
    save_checkpoint(path, old.snapshot())
    before = path.read_bytes()

    def crash(src: object, dst: object) -> None:
        raise OSError("power lost")

    monkeypatch.setattr("gpulet_allocator.engine.checkpoint.os.replace", crash)
    with pytest.raises(OSError, match="power lost"):
        save_checkpoint(path, [])
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp"))


def test_stale_temporary_files_are_removed_at_load(tmp_path: Path) -> None:
    path = tmp_path / "allocations.json"
    save_checkpoint(path, busy_ledger().snapshot())
    stale = tmp_path / ".allocations.json.abc123.tmp"
    stale.write_bytes(b'{"version": 1, "allocations": []}')
    other = tmp_path / ".something-else.tmp"
    other.write_bytes(b"keep")
    assert load_checkpoint(path).status == "ok"
    assert not stale.exists()
    assert other.exists()


def test_save_fsyncs_file_and_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr("gpulet_allocator.engine.checkpoint.os.fsync", spy)
    save_checkpoint(tmp_path / "a.json", [])
    assert len(synced) == 2  # the temporary file, then the directory


def test_restart_recovers_without_double_allocation(tmp_path: Path) -> None:
    path = tmp_path / "allocations.json"
    first = busy_ledger()
    CheckpointStore(path).save(first)

    # A new process: same inventory, empty ledger, recover from the file.
    second = Ledger(pix_phb_7())
    recovery = CheckpointStore(path).recover(second)
    assert recovery.clean
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
    assert [a.owner.pod_uid for a in ledger.allocations()] == ["a", "d"]


def test_allocations_on_gpus_missing_from_the_inventory_stay_recorded() -> None:
    ledger = Ledger(pix_phb_7())
    gone = WholeAllocation(owner=owner("a"), devices=("GPU-gone",))
    share = ShareAllocation(owner=owner("b"), device="GPU-gone2", cores=10, memory_units=4)
    assert ledger.restore([gone, share]) == []
    assert ledger.get("a", "main") == gone
    assert not ledger.device("GPU-gone").present
    assert "GPU-gone" not in ledger.free_whole()
    assert len(ledger.free_whole()) == 7
