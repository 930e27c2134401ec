"""The allocator's checkpoint file and its group commit.

Design
------
**File.** One JSON document, :class:`~gpulet_allocator.state.records.StoredState`: the
ledger's allocations (the engine's tagged union, ``"type": "whole"`` /
``"share"``) plus the grants that map kubelet's requests to them. Both must change
together, so they share one document. It lives in two files: the *snapshot* (the
checkpoint's path) and, next to it, its *journal* (:mod:`.journal`): each write puts
the whole new document in the journal, after the last record, and flushes it once
(``fdatasync``). The journal is preallocated (:data:`COMPACT_BYTES`, or
:data:`COMPACT_FACTOR` records' worth); once it is full, the write is a *compaction*
instead: the snapshot replaced atomically and durably
(:func:`gpulet_common.statefile.write_atomic`: a temporary file in the same directory,
fsync, rename over it, fsync the directory), then a fresh journal the same way. The
first write after a start compacts too, so a torn tail is never written after, and a
clean stop folds the journal into the snapshot (:meth:`CheckpointFile.settle`), so a
rollback to a version that reads only the snapshot finds the state of the stop. A crash
leaves the last state answered or a newer one, never a mix. Loading
(:func:`read_state`) reads the snapshot, then replays the journal (its last good
record); a torn last record is dropped -- only one with the shape a crash leaves
(:mod:`.journal`: its lost sectors are zeros, in a file of its full size). Loading
never raises: a missing file is a first start; an unreadable one is retried by the
service. Both files are written through :mod:`gpulet_common.safefile` (no symlink
followed).

**Sealed.** The snapshot and every journal record are sealed documents
(:mod:`.seal`: a checksum over the document, and decoding that accepts only the
very bytes this build writes, so an unknown or renamed field is damage, not an
empty list). A file of a gpulet before the seal is read as before, once, and
rewritten sealed at once (:meth:`CheckpointFile.load`).

**A corrupt file fails closed.** Starting empty would hand out GPUs that running pods
hold, so a snapshot that fails its seal (or a version this build cannot read), or a
journal that cannot be trusted (a damaged header, a size other than the one it was
made with, a bad record that is not a torn last write, no snapshot to follow, a last
record that fails its seal) is

1. kept for a post-mortem under a name never used before,
   ``<name>.corrupt-<UTC time>-<n>`` (:func:`gpulet_common.statefile.quarantine`:
   created exclusively, so a second corruption never overwrites the first one's
   copy), and
2. replaced by a checkpoint that says the record is lost (``StoredState.lost``, the
   reason). That marker is what the allocator reads back after a restart, so the loss
   is not forgotten by restarting; it stays until the allocator rebuilds the record
   from kubelet's PodResources or an operator accepts the loss
   (``gpulet allocator reset --confirm``), see :mod:`gpulet_allocator.service`.

**Group commit.** An answer to kubelet may only leave once its allocation is durable,
and a flush costs about a millisecond, so writing once per request would queue 50
concurrent requests behind 50 fsyncs. :class:`Committer` instead writes the *latest*
state whenever it is behind: every request changed while a write was in flight is
covered by the next single write. Requests wait for "durable version >= mine"
(:meth:`Committer.wait`). A failed write fails exactly the requests it covered
(:class:`CheckpointError`); they undo their change and report it, and the committer
retries with back-off.

The write (one flush, a fraction of a millisecond on a quiet disk) runs on the event
loop, on purpose: handed to a worker thread, each of its half-dozen system calls has to win the GIL
back from a busy event loop, which takes up to the interpreter's 5 ms switch
interval each, so under a burst a thread write took 10-40 ms instead of 1. Requests
arriving during a write wait for it and are covered by the next one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import anyio
import anyio.abc

from gpulet_allocator.state import seal
from gpulet_allocator.state.journal import JournalCorrupt, frame, header, journal_path, replay
from gpulet_allocator.state.records import StoredState
from gpulet_allocator.state.seal import encode

__all__ = ["CheckpointError", "CheckpointFile", "Committer", "decode", "encode", "read_state"]
from gpulet_common.safefile import open_update
from gpulet_common.statefile import quarantine, tmp_prefix, write_atomic

log = logging.getLogger("gpulet.allocator.store")

RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0
# The journal's preallocated size, the larger of these (bytes; times the record's size):
# full, it is compacted into the snapshot. Its replay reads it whole at the next start.
COMPACT_BYTES = 1 << 20
COMPACT_FACTOR = 16


def decode(data: bytes) -> StoredState:
    """Decode a checkpoint document (:func:`.seal.decode`); ValueError for anything
    this build cannot trust."""
    return seal.decode(data).state


@dataclass(frozen=True, slots=True)
class Loaded:
    """``lost``: a checkpoint whose marker says the record is lost (see the docstring)."""

    status: Literal["ok", "missing", "corrupt", "lost", "unreadable"]
    state: StoredState
    detail: str
    #: Where a corrupt file was kept (status "corrupt").
    corrupt_copy: Path | None = None


class CheckpointFile:
    """The snapshot and its journal (module docstring; :mod:`.journal`).

    Not thread-safe: one writer (the :class:`Committer`, on the event loop).
    """

    def __init__(self, path: Path | str, *, compact_bytes: int = COMPACT_BYTES) -> None:
        self.path = Path(path)
        self.journal_path = journal_path(self.path)
        self._compact_bytes = compact_bytes
        # Open while the journal on disk is known good and follows the snapshot;
        # None: the next write compacts (first write, after a load or a failed append).
        self._journal: BinaryIO | None = None
        self._journal_id = (0, 0)  # its (st_dev, st_ino)
        self._journal_size = 0  # where the next record goes
        self._journal_capacity = 0  # its preallocated size
        self._journal_records = 0  # records appended since the last compaction
        #: Writes appended to the journal and compactions done, for tests and benches.
        self.appends = 0
        self.compactions = 0

    def write(self, data: bytes) -> None:
        """Make ``data`` the durable state: appended to the journal and flushed, or,
        now and then, written as the snapshot with a fresh journal. Raises OSError."""
        record = frame(data)
        journal = self._journal
        if (
            journal is None
            or self._journal_size + len(record) > self._journal_capacity
            or not self._journal_in_place()
        ):
            self._compact(data, len(record))
            return
        try:
            fd, at = journal.fileno(), self._journal_size
            view = memoryview(record)
            while view:
                done = os.pwrite(fd, view, at)
                view, at = view[done:], at + done
            os.fdatasync(fd)
        except OSError:
            # Maybe a part of the record is on disk: never append after it, and put
            # the zeros back where it went (best effort: bytes left there, unflushed,
            # load as damage, not as a torn write, and fail closed).
            with contextlib.suppress(OSError):
                os.pwrite(journal.fileno(), bytes(len(record)), self._journal_size)
            self.close()
            raise
        self._journal_size += len(record)
        self._journal_records += 1
        self.appends += 1

    def _journal_in_place(self) -> bool:
        """Is the open journal still the file at its path? (Not removed, replaced or
        moved with its directory: an append there would not be found at the next start.)"""
        try:
            st = os.lstat(self.journal_path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._journal_id

    def _compact(self, data: bytes, record: int) -> None:
        self.close()
        write_atomic(self.path, data)
        # Preallocated: the appends that follow overwrite zeros (see .journal).
        capacity = max(self._compact_bytes, COMPACT_FACTOR * record)
        head = header(data, capacity)
        write_atomic(self.journal_path, head + bytes(capacity - len(head)))
        self._journal = journal = open_update(self.journal_path)
        st = os.fstat(journal.fileno())
        self._journal_id = (st.st_dev, st.st_ino)
        self._journal_size, self._journal_capacity = len(head), capacity
        self._journal_records = 0
        self.compactions += 1

    def settle(self, state: Callable[[], bytes]) -> None:
        """At a clean stop: fold the journal into the snapshot (``state()``, the state
        now) if it holds records, then close it. A version of gpulet that reads only
        the snapshot (a rollback) then starts from the current state, not from the last
        compaction's. Best effort: a failure is logged and the journal, still good, is
        what the next start replays."""
        if self._journal is not None and self._journal_records:
            data = state()
            try:
                self._compact(data, len(frame(data)))
            except OSError as exc:
                log.warning("checkpoint not folded into its snapshot at stop: %s", exc)
        self.close()

    def close(self) -> None:
        """Close the journal (the next write compacts)."""
        journal, self._journal = self._journal, None
        if journal is not None:
            with contextlib.suppress(OSError):
                journal.close()

    def probe(self) -> None:
        """Raise OSError unless a write could start now: a temporary file of the kind
        :meth:`write` makes is created in the directory and removed (no fsync)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(
            prefix=tmp_prefix(self.path), suffix=".tmp", dir=self.path.parent
        )
        os.close(fd)
        os.unlink(tmp)

    def load(self) -> Loaded:
        """Read the checkpoint; never raises. A corrupt file is quarantined (docstring)."""
        self.close()
        with contextlib.suppress(OSError):
            for entry in self.path.parent.iterdir():
                # Left by a crash between mkstemp and rename; the real file is intact.
                if entry.name.startswith(tmp_prefix(self.path)) and entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        entry.unlink()
        try:
            state, detail, legacy = _read(self.path)
        except FileNotFoundError:
            return Loaded("missing", StoredState(), f"{self.path} does not exist; starting empty")
        except CorruptFile as exc:
            return self._quarantine(exc)
        except OSError as exc:
            return Loaded("unreadable", StoredState(), f"cannot read {self.path}: {exc}")
        if legacy:
            # Written before the seal: rewritten sealed now (a compaction), so that
            # from here on damage is told from data.
            try:
                self.write(encode(state))
                detail += "; rewritten with a checksum"
            except OSError as exc:
                detail += f"; not yet rewritten with a checksum: {exc}"
        if state.lost:
            return Loaded(
                "lost",
                state,
                f"{self.path} records that the allocation record was lost ({state.lost}); "
                f"{len(state.allocations)} allocation(s) rebuilt since",
            )
        return Loaded("ok", state, detail)

    def _quarantine(self, problem: CorruptFile) -> Loaded:
        bad = problem.path
        try:
            copy = quarantine(bad)
        except OSError as exc:
            # The file stays where it is: the next start finds it corrupt again.
            reason = f"{bad} is corrupt ({problem}) and could not be copied aside: {exc}"
            return Loaded("corrupt", StoredState(lost=reason), reason)
        reason = f"{bad} was corrupt ({problem}); kept as {copy.name}"
        if bad == self.path and self.journal_path.exists():
            # The journal followed the corrupt snapshot: kept too, for the post-mortem.
            with contextlib.suppress(OSError):
                reason += f" (its journal as {quarantine(self.journal_path).name})"
        marker = StoredState(lost=reason)
        try:
            self.write(encode(marker))  # a compaction: a fresh journal too
        except OSError as exc:
            detail = f"{reason}; could not mark the loss in {self.path}: {exc}"
            return Loaded("corrupt", marker, detail, copy)
        return Loaded("corrupt", marker, reason, copy)


class CorruptFile(ValueError):
    """``path`` (the snapshot or the journal) cannot be trusted; the message says why."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(problem)
        self.path = path


def read_state(path: Path) -> tuple[StoredState, str]:
    """The state on disk (the snapshot, then its journal) and a line that says where
    it came from; no side effects. Raises FileNotFoundError (neither exists),
    :class:`CorruptFile` or OSError."""
    state, detail, _legacy = _read(path)
    return state, detail


def _read(path: Path) -> tuple[StoredState, str, bool]:
    journal = journal_path(path)
    try:
        snapshot: bytes | None = path.read_bytes()
    except FileNotFoundError:
        snapshot = None
    try:
        log_data: bytes | None = journal.read_bytes()
    except FileNotFoundError:
        log_data = None
    if snapshot is None and log_data is None:
        raise FileNotFoundError(path)
    return state_from(path, snapshot, log_data)


def state_from(
    path: Path, snapshot: bytes | None, log_data: bytes | None
) -> tuple[StoredState, str, bool]:
    """The state of a snapshot's and a journal's bytes (None: no such file), a line
    that says where it came from, and whether it was written before the seal (to be
    rewritten); :class:`CorruptFile` when they cannot be trusted. Pure."""
    journal = journal_path(path)
    state, legacy = StoredState(), False
    if snapshot is not None:
        try:
            decoded = seal.decode(snapshot)
        except ValueError as exc:
            raise CorruptFile(path, str(exc)) from exc
        state, legacy = decoded.state, decoded.legacy
    notes: list[str] = []
    if log_data is not None:
        try:
            replayed = replay(log_data, snapshot)
        except JournalCorrupt as exc:
            raise CorruptFile(journal, str(exc)) from exc
        if replayed.follows and replayed.legacy and not legacy:
            # Only a gpulet before the seal wrote that header, and it never sealed.
            raise CorruptFile(journal, "an older journal follows a sealed snapshot")
        if legacy and not replayed.legacy:
            # This build seals the snapshot before it makes such a journal: the
            # snapshot's checksum is what went missing.
            raise CorruptFile(path, "no checksum, next to a journal that needs one")
        if not replayed.follows:
            notes.append(f"{journal.name} follows an older snapshot: ignored")
        if replayed.records:
            try:
                decoded = seal.decode(replayed.records[-1])
            except ValueError as exc:
                raise CorruptFile(journal, f"its last record: {exc}") from exc
            if decoded.legacy and not replayed.legacy:
                raise CorruptFile(journal, "its last record has no checksum")
            state, legacy = decoded.state, decoded.legacy
            notes.append(f"{len(replayed.records)} journal record(s) replayed")
        if replayed.torn:
            notes.append(f"a torn last journal record ({replayed.torn} bytes) dropped")
        legacy = legacy or replayed.legacy
    detail = f"{len(state.allocations)} allocation(s), {len(state.grants)} grant(s) from {path}"
    if legacy:
        notes.append("written before checksums")
    return state, "; ".join([detail, *notes]), legacy


class CheckpointError(Exception):
    """The change could not be made durable."""


class Committer:
    """Writes the latest state whenever it is behind; see the module docstring.

    Create it on the event loop (it holds anyio events).
    """

    def __init__(
        self,
        snapshot: Callable[[], bytes],
        write: Callable[[bytes], None],
        *,
        on_error: Callable[[str | None], None] = lambda _detail: None,
    ) -> None:
        self._snapshot = snapshot
        self._write = write
        self._on_error = on_error
        self._wanted = 0
        self._durable = 0
        self._failed_through = 0
        self._error = ""
        self._wake = anyio.Event()
        self._written = anyio.Event()
        #: Writes done, for metrics and tests.
        self.writes = 0

    @property
    def durable(self) -> int:
        return self._durable

    def request(self, version: int) -> None:
        """Ask for ``version`` (or later) to be written."""
        if version > self._wanted:
            self._wanted = version
            self._wake.set()

    async def wait(self, version: int) -> None:
        """Return once ``version`` is durable; raise CheckpointError if its write failed."""
        self.request(version)
        while self._durable < version:
            if self._failed_through >= version:
                raise CheckpointError(self._error)
            await self._written.wait()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        delay = RETRY_MIN_S
        while True:
            while self._durable >= self._wanted:
                self._wake = anyio.Event()
                await self._wake.wait()
            target = self._wanted
            data = self._snapshot()
            try:
                self._write(data)
            except OSError as exc:
                self._failed_through = target
                self._error = f"cannot write the allocation checkpoint: {exc}"
                log.error("%s (retrying in %.1f s)", self._error, delay)  # noqa: TRY400
                self._on_error(self._error)
                self._notify()
                await anyio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            if delay > RETRY_MIN_S:
                self._on_error(None)
            delay = RETRY_MIN_S
            self._durable = max(self._durable, target)
            self.writes += 1
            self._notify()

    def _notify(self) -> None:
        written, self._written = self._written, anyio.Event()
        written.set()
