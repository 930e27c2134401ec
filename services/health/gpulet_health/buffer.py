"""The on-disk buffer: health events that could not be published, kept in order.

Design
------
While NATS is unreachable, events go to disk and are published, oldest first, once it
is back. The buffer is a directory (``<state_dir>/health-buffer``) of append-only
segment files ``seg-<n>.jsonl``, one JSON-encoded :class:`HealthEvent` per line:

* **durable**: every append is flushed and ``fsync``'d before it returns, so an event
  accepted by the buffer survives a crash of the agent or the node;
* **ordered**: events are drained in append order, segment after segment; a segment
  is deleted once every event in it was acknowledged by JetStream;
* **bounded**: ``max_bytes`` (sum of the segment files) and ``max_events`` (events
  not yet drained). An append beyond either limit is refused, and the refusal is
  *recorded* in ``overflow.json`` (fsync'd): how many events were dropped and when.
  The publisher turns that record into a ``buffer_overflow`` event once it can, so a
  loss is never silent;
* **restartable**: the drain position is kept in ``cursor.json`` (replaced
  atomically).
* **never through a link**: every write goes through :mod:`gpulet_common.safefile`
  (a symlink planted at a segment, ``cursor.json`` or ``overflow.json`` is refused,
  never written through). After a crash between publishing and moving the cursor a few events
  are published again -- with the same event id, which JetStream's de-duplication
  and consumers drop. A torn last line (a crash mid-append) is skipped and counted.

All methods block (file I/O, fsync); the publisher calls them through
``anyio.to_thread.run_sync`` one at a time, so the class needs no lock.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import msgspec

from gpulet_common.codec import HEALTH_EVENT
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import HealthEvent
from gpulet_common.safefile import open_append, open_update, write_atomic
from gpulet_common.untrusted import json_document

log = logging.getLogger("gpulet.health.buffer")

_SEGMENT_PREFIX = "seg-"
_SEGMENT_SUFFIX = ".jsonl"


@dataclass(slots=True)
class _Segment:
    seq: int
    path: Path
    size: int
    events: int


@dataclass(frozen=True, slots=True)
class Overflow:
    dropped: int
    first_at: float
    last_at: float


def _count(value: object) -> int:
    """A count from a state file: a non-negative int, or 0 for anything else (the
    files are ours, but a damaged one must not stop the buffer from opening)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


class DiskBuffer:
    def __init__(
        self, directory: Path, *, max_bytes: int, max_events: int, segment_bytes: int
    ) -> None:
        self.directory = directory
        self._max_bytes = max_bytes
        self._max_events = max_events
        self._segment_bytes = segment_bytes
        self._segments: list[_Segment] = []
        # Drain position: in the first segment, byte offset and events already drained.
        self._offset = 0
        self._consumed = 0
        self._tail: IO[bytes] | None = None
        self._overflow: Overflow | None = None
        self.corrupt_lines = 0
        self.write_errors = 0
        self._error_log = RateLimitedLog(log, per_minute=6)
        self._opened = False

    # --- lifecycle -------------------------------------------------------------------

    def open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        segments: list[_Segment] = []
        for path in sorted(self.directory.glob(f"{_SEGMENT_PREFIX}*{_SEGMENT_SUFFIX}")):
            digits = path.name[len(_SEGMENT_PREFIX) : -len(_SEGMENT_SUFFIX)]
            if not digits.isdigit():
                continue
            if path.is_symlink() or not path.is_file():
                # Never read or written through: planted, not ours.
                log.error("ignoring %s in the health buffer: not a regular file", path.name)
                continue
            data = path.read_bytes()
            segments.append(_Segment(int(digits), path, len(data), data.count(b"\n")))
        segments.sort(key=lambda s: s.seq)
        if segments:
            # A crash mid-append leaves a torn last line; cut it off so that the next
            # append starts on a line of its own.
            last = segments[-1]
            data = last.path.read_bytes()
            keep = data.rfind(b"\n") + 1
            if keep < len(data):
                self.corrupt_lines += 1
                log.error(
                    "dropping a torn last line of %s (%d bytes)", last.path.name, len(data) - keep
                )
                with open_update(last.path) as f:
                    f.truncate(keep)
                    os.fsync(f.fileno())
                last.size = keep
        self._segments = segments
        cursor = self._read_json("cursor.json")
        self._offset = self._consumed = 0
        if cursor and segments and cursor.get("segment") == segments[0].seq:
            self._offset = _count(cursor.get("offset", 0))
            self._consumed = _count(cursor.get("consumed", 0))
        overflow = self._read_json("overflow.json")
        if overflow and _count(overflow.get("dropped", 0)) > 0:
            first, final = overflow.get("first_at"), overflow.get("last_at")
            if isinstance(first, int | float) and isinstance(final, int | float):
                self._overflow = Overflow(_count(overflow["dropped"]), float(first), float(final))
        self._opened = True
        if self.pending:
            log.warning(
                "health event buffer holds %d unpublished event(s) from a previous run",
                self.pending,
            )

    def close(self) -> None:
        if self._tail is not None:
            self._tail.close()
            self._tail = None

    # --- state -----------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Events appended and not yet drained."""
        return sum(s.events for s in self._segments) - self._consumed

    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    @property
    def overflow(self) -> Overflow | None:
        return self._overflow

    # --- append ----------------------------------------------------------------------

    def append(self, event: HealthEvent) -> bool:
        """Store one event durably; False (and the drop recorded) when full."""
        line = HEALTH_EVENT.encode(event) + b"\n"
        if self.pending >= self._max_events or self.size_bytes + len(line) > self._max_bytes:
            self._record_drop(event.observed_at)
            return False
        tail = self._segments[-1] if self._segments else None
        if tail is None or tail.size >= self._segment_bytes:
            self.close()
            seq = tail.seq + 1 if tail is not None else 1
            tail = _Segment(
                seq, self.directory / f"{_SEGMENT_PREFIX}{seq:012d}{_SEGMENT_SUFFIX}", 0, 0
            )
            self._segments.append(tail)
        try:
            if self._tail is None:
                self._tail = open_append(tail.path)
            self._tail.write(line)
            self._tail.flush()
            os.fsync(self._tail.fileno())
        except OSError as exc:
            # Fail closed (a symlink planted at the segment, a full or read-only
            # disk): the event is dropped, and the drop recorded like a full buffer's.
            self.close()
            self.write_errors += 1
            self._error_log.error("cannot append to %s: %s", tail.path, exc)
            self._record_drop(event.observed_at)
            return False
        tail.size += len(line)
        tail.events += 1
        return True

    def _record_drop(self, at: float) -> None:
        previous = self._overflow
        self._overflow = Overflow(
            dropped=(previous.dropped if previous else 0) + 1,
            first_at=previous.first_at if previous else at,
            last_at=at,
        )
        try:
            self._write_json(
                "overflow.json",
                {
                    "dropped": self._overflow.dropped,
                    "first_at": self._overflow.first_at,
                    "last_at": self._overflow.last_at,
                },
                sync=True,
            )
        except OSError as exc:
            # Kept in memory: the buffer_overflow event still reports it.
            self._error_log.error("cannot record the drop in overflow.json: %s", exc)

    def clear_overflow(self, reported: Overflow) -> None:
        """The overflow was reported; forget the drops it covered."""
        current = self._overflow
        if current is None:
            return
        left = current.dropped - reported.dropped
        if left <= 0:
            self._overflow = None
            (self.directory / "overflow.json").unlink(missing_ok=True)
            return
        self._overflow = Overflow(left, reported.last_at, current.last_at)
        self._write_json(
            "overflow.json",
            {"dropped": left, "first_at": reported.last_at, "last_at": current.last_at},
            sync=True,
        )

    # --- drain -----------------------------------------------------------------------

    def peek(self, limit: int) -> list[tuple[HealthEvent, int]]:
        """Up to ``limit`` oldest events, each with its position token for :meth:`commit`.

        The token is how many *lines* (good or corrupt) the event ends; committing it
        moves past every line up to and including it.
        """
        out: list[tuple[HealthEvent, int]] = []
        if not self._segments:
            return out
        segment = self._segments[0]
        with segment.path.open("rb") as f:
            f.seek(self._offset)
            lines = 0
            while len(out) < limit:
                raw = f.readline()
                if not raw:
                    break
                lines += 1
                if not raw.endswith(b"\n"):
                    break  # a torn append: only the tail of the last segment can be one
                try:
                    out.append((HEALTH_EVENT.decode(raw), lines))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    self.corrupt_lines += 1
                    # A data loss, not a bug: no traceback.
                    self._error_log.error(
                        "skipping a corrupt line of %s: %s", segment.path.name, exc
                    )
                    if not out:
                        # Move past it at once so a corrupt line never blocks the drain.
                        self._advance(len(raw), 1)
                        return self.peek(limit)
        return out

    def commit(self, lines: int) -> None:
        """Mark the first ``lines`` lines after the drain position as published."""
        if not self._segments or lines <= 0:
            return
        segment = self._segments[0]
        with segment.path.open("rb") as f:
            f.seek(self._offset)
            size = 0
            for _ in range(lines):
                size += len(f.readline())
        self._advance(size, lines)

    def _advance(self, size: int, lines: int) -> None:
        segment = self._segments[0]
        self._offset += size
        self._consumed += lines
        if self._consumed >= segment.events and self._offset >= segment.size:
            is_tail = len(self._segments) == 1
            if is_tail:
                self.close()
            segment.path.unlink(missing_ok=True)
            self._segments.pop(0)
            self._offset = self._consumed = 0
        if self._segments:
            self._write_json(
                "cursor.json",
                {
                    "segment": self._segments[0].seq,
                    "offset": self._offset,
                    "consumed": self._consumed,
                },
                sync=False,
            )
        else:
            (self.directory / "cursor.json").unlink(missing_ok=True)

    # --- small files -----------------------------------------------------------------

    def _read_json(self, name: str) -> dict[str, float] | None:
        path = self.directory / name
        try:
            data = json_document(path.read_bytes(), max_bytes=1 << 16, what=str(path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.error("ignoring unreadable %s: %s", path, exc)  # noqa: TRY400
            return None
        return data if isinstance(data, dict) else None

    def _write_json(self, name: str, value: dict[str, float], *, sync: bool) -> None:
        write_atomic(self.directory / name, json.dumps(value).encode(), durable=sync)
