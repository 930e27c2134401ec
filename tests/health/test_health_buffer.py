"""The on-disk buffer: order, durability across reopen, torn lines, limits."""

from __future__ import annotations

from pathlib import Path

from gpulet_common.messages import HealthEvent
from gpulet_health.buffer import DiskBuffer


def ev(i: int) -> HealthEvent:
    return HealthEvent(
        event_id=f"id-{i}",
        node="n1",
        gpu_uuid="GPU-0",
        kind="xid",
        severity="critical",
        healthy=False,
        reason=f"event {i}",
        observed_at=1000.0 + i,
    )


def buf(path: Path, **kw: int) -> DiskBuffer:
    b = DiskBuffer(
        path,
        max_bytes=kw.get("max_bytes", 1 << 20),
        max_events=kw.get("max_events", 1000),
        segment_bytes=kw.get("segment_bytes", 600),
    )
    b.open()
    return b


def drain(b: DiskBuffer, step: int = 3) -> list[str]:
    ids: list[str] = []
    while True:
        batch = b.peek(step)
        if not batch:
            return ids
        ids += [e.event_id for e, _ in batch]
        b.commit(batch[-1][1])


def test_order_across_segments_and_reopen(tmp_path: Path) -> None:
    b = buf(tmp_path)
    for i in range(20):
        assert b.append(ev(i))
    assert b.pending == 20
    assert len(list(tmp_path.glob("seg-*.jsonl"))) > 3  # small segments: several files
    batch = b.peek(1)
    b.commit(batch[-1][1])
    b.close()
    # A restart resumes after the committed event.
    b = buf(tmp_path)
    assert b.pending == 19
    assert drain(b) == [f"id-{i}" for i in range(1, 20)]
    assert b.pending == 0
    assert list(tmp_path.glob("seg-*.jsonl")) == []
    assert b.append(ev(99))
    assert drain(b) == ["id-99"]


def test_torn_last_line_is_cut_off(tmp_path: Path) -> None:
    b = buf(tmp_path, segment_bytes=1 << 20)
    for i in range(3):
        b.append(ev(i))
    b.close()
    [segment] = list(tmp_path.glob("seg-*.jsonl"))
    with segment.open("ab") as f:
        f.write(b'{"event_id": "torn", "node"')
    b = buf(tmp_path, segment_bytes=1 << 20)
    assert b.corrupt_lines == 1
    b.append(ev(3))
    assert drain(b) == ["id-0", "id-1", "id-2", "id-3"]


def test_corrupt_line_is_skipped(tmp_path: Path) -> None:
    b = buf(tmp_path)
    b.append(ev(0))
    b.close()
    [segment] = list(tmp_path.glob("seg-*.jsonl"))
    with segment.open("ab") as f:
        f.write(b"not json\n")
    b = buf(tmp_path)
    b.append(ev(1))
    assert drain(b, step=10) == ["id-0", "id-1"]
    assert b.corrupt_lines == 1


def test_limits_record_the_loss_durably(tmp_path: Path) -> None:
    b = buf(tmp_path, max_events=3)
    assert [b.append(ev(i)) for i in range(5)] == [True, True, True, False, False]
    overflow = b.overflow
    assert overflow is not None
    assert overflow.dropped == 2
    assert (overflow.first_at, overflow.last_at) == (1003.0, 1004.0)
    b.close()
    b = buf(tmp_path, max_events=3)
    assert b.overflow == overflow  # survives a restart
    assert drain(b) == ["id-0", "id-1", "id-2"]
    b.append(ev(7))  # room again
    b.clear_overflow(overflow)
    assert b.overflow is None
    assert not (tmp_path / "overflow.json").exists()


def test_byte_limit(tmp_path: Path) -> None:
    size = 400  # one encoded event is a little less
    b = buf(tmp_path, max_bytes=size * 2)
    results = [b.append(ev(i)) for i in range(10)]
    assert results[0]
    assert not all(results)
    assert b.size_bytes <= size * 2
