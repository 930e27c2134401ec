"""The allocator's checkpoint file and its group commit.

Design
------
**File.** One JSON document, :class:`~gpulet_allocator.state.records.StoredState`: the
ledger's allocations (the engine's tagged union, ``"type": "whole"`` /
``"share"``) plus the grants that map kubelet's requests to them. Both must change
together, so they share one file. Writing is atomic and durable
(:func:`gpulet_common.statefile.write_atomic`): a temporary file in the same
directory, fsync, rename over the checkpoint, fsync the directory. A crash leaves the
old or the new file, never a mix. Loading never raises: a missing
file is a first start; an unreadable one is retried by the service.

**A corrupt file fails closed.** Starting empty would hand out GPUs that running pods
hold, so a file that does not decode (or a version this build cannot read) is

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
and an fsync costs about a millisecond, so writing once per request would queue 50
concurrent requests behind 50 fsyncs. :class:`Committer` instead writes the *latest*
state whenever it is behind: every request changed while a write was in flight is
covered by the next single write. Requests wait for "durable version >= mine"
(:meth:`Committer.wait`). A failed write fails exactly the requests it covered
(:class:`CheckpointError`); they undo their change and report it, and the committer
retries with back-off.

The write (about a millisecond, mostly fsync) runs on the event loop, on purpose:
handed to a worker thread, each of its half-dozen system calls has to win the GIL
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
from typing import Literal

import anyio
import anyio.abc
import msgspec

from gpulet_allocator.state.records import STATE_VERSION, StoredState
from gpulet_common.statefile import quarantine, tmp_prefix, write_atomic

log = logging.getLogger("gpulet.allocator.store")

RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0


class _CheckpointHeader(msgspec.Struct):
    version: int


_encoder = msgspec.json.Encoder()
_header_decoder = msgspec.json.Decoder(_CheckpointHeader)
_decoder = msgspec.json.Decoder(StoredState)


def encode(state: StoredState) -> bytes:
    return _encoder.encode(state)


def decode(data: bytes) -> StoredState:
    """Decode a checkpoint; ValueError for anything this build cannot read."""
    try:
        version = _header_decoder.decode(data).version
    except Exception as exc:  # total: any failure means "not one" (RecursionError...)
        raise ValueError(f"not an allocator checkpoint: {exc}") from exc
    if version != STATE_VERSION:
        raise ValueError(
            f"unsupported checkpoint version {version} (this build reads {STATE_VERSION})"
        )
    try:
        return _decoder.decode(data)
    except Exception as exc:  # total, as above
        raise ValueError(f"invalid allocator checkpoint: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Loaded:
    """``lost``: a checkpoint whose marker says the record is lost (see the docstring)."""

    status: Literal["ok", "missing", "corrupt", "lost", "unreadable"]
    state: StoredState
    detail: str
    #: Where a corrupt file was kept (status "corrupt").
    corrupt_copy: Path | None = None


class CheckpointFile:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def write(self, data: bytes) -> None:
        """Atomically and durably replace the file with ``data``; raises OSError."""
        write_atomic(self.path, data)

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
        with contextlib.suppress(OSError):
            for entry in self.path.parent.iterdir():
                # Left by a crash between mkstemp and rename; the real file is intact.
                if entry.name.startswith(tmp_prefix(self.path)) and entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        entry.unlink()
        empty = StoredState()
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return Loaded("missing", empty, f"{self.path} does not exist; starting empty")
        except OSError as exc:
            return Loaded("unreadable", empty, f"cannot read {self.path}: {exc}")
        try:
            state = decode(data)
        except ValueError as exc:
            return self._quarantine(exc)
        if state.lost:
            return Loaded(
                "lost",
                state,
                f"{self.path} records that the allocation record was lost ({state.lost}); "
                f"{len(state.allocations)} allocation(s) rebuilt since",
            )
        return Loaded(
            "ok",
            state,
            f"{len(state.allocations)} allocation(s), {len(state.grants)} grant(s) "
            f"from {self.path}",
        )

    def _quarantine(self, problem: ValueError) -> Loaded:
        try:
            copy = quarantine(self.path)
        except OSError as exc:
            # The file stays where it is: the next start finds it corrupt again.
            reason = f"{self.path} is corrupt ({problem}) and could not be copied aside: {exc}"
            return Loaded("corrupt", StoredState(lost=reason), reason)
        reason = f"{self.path} was corrupt ({problem}); kept as {copy.name}"
        marker = StoredState(lost=reason)
        try:
            self.write(encode(marker))
        except OSError as exc:
            detail = f"{reason}; could not mark the loss in {self.path}: {exc}"
            return Loaded("corrupt", marker, detail, copy)
        return Loaded("corrupt", marker, reason, copy)


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
