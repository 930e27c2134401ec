"""Crash-safe checkpoint of the allocation ledger.

Design
------
The allocator writes the ledger after every change and reads it back at start, so a
restarted allocator knows which GPUs its pods hold and answers kubelet's retries with
the same devices (see :mod:`.ledger`, idempotency). This is the only module of the
engine that touches the file system.

Format: one JSON document, a versioned msgspec :class:`Checkpoint` holding the
ledger's allocations (a tagged union, ``"type": "whole"`` / ``"share"``). A reader
checks ``version`` before decoding the body, so a future format is recognised as such
instead of being misread.

Writing is atomic and durable: the bytes go to a temporary file *in the same
directory* (a rename across file systems is not atomic), which is fsynced, renamed
over the checkpoint, and then the directory is fsynced so that the rename itself
survives a power loss. A crash leaves either the old or the new checkpoint, never a
mix; stray temporary files are removed at the next load.

Loading never raises. A missing file (first start, or a fresh node -- gpu-manager
#148 failed here) is an empty ledger. A corrupt or unsupported file is renamed to
``<name>.corrupt`` for a post-mortem, the allocator starts empty, and the result says
so, for the service to log and to report as an event. Writing errors are raised: the
caller must know that an allocation is not durable.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from .ledger import Allocation, Ledger, ShareAllocation, WholeAllocation

CHECKPOINT_VERSION = 1
CORRUPT_SUFFIX = ".corrupt"


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    """The checkpoint file. Add fields with defaults only; bump ``version`` otherwise."""

    version: int = CHECKPOINT_VERSION
    node: str = ""
    allocations: list[WholeAllocation | ShareAllocation] = []


class _Header(msgspec.Struct):
    version: int


LoadStatus = Literal["ok", "missing", "corrupt", "unreadable"]


@dataclass(frozen=True)
class LoadResult:
    """What :func:`load_checkpoint` found. ``status`` other than ok/missing is news."""

    status: LoadStatus
    allocations: tuple[Allocation, ...] = ()
    node: str = ""
    detail: str = ""
    corrupt_copy: Path | None = None

    @property
    def clean(self) -> bool:
        return self.status in ("ok", "missing")


@dataclass(frozen=True)
class Recovery:
    """The outcome of :meth:`CheckpointStore.recover`."""

    load: LoadResult
    refused: tuple[str, ...]
    # Set when the clean-up rewrite failed; the in-memory ledger is still right.
    save_error: str | None = None

    @property
    def clean(self) -> bool:
        return self.load.clean and not self.refused and self.save_error is None


_encoder = msgspec.json.Encoder()
_header_decoder = msgspec.json.Decoder(_Header)
_decoder = msgspec.json.Decoder(Checkpoint)


def encode(allocations: Iterable[Allocation], *, node: str = "") -> bytes:
    return _encoder.encode(Checkpoint(node=node, allocations=list(allocations)))


def decode(data: bytes) -> Checkpoint:
    """Decode a checkpoint; ``ValueError`` for anything this build cannot read."""
    try:
        version = _header_decoder.decode(data).version
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a checkpoint: {exc}") from exc
    if version != CHECKPOINT_VERSION:
        raise ValueError(
            f"unsupported checkpoint version {version} (this build reads {CHECKPOINT_VERSION})"
        )
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"invalid checkpoint: {exc}") from exc


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_prefix(path: Path) -> str:
    return f".{path.name}."


def save_checkpoint(path: Path, allocations: Iterable[Allocation], *, node: str = "") -> None:
    """Atomically replace ``path`` with a checkpoint of ``allocations``."""
    data = encode(allocations, node=node)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def load_checkpoint(path: Path) -> LoadResult:
    """Read ``path``; never raises (see the module docstring)."""
    _remove_stale_tmp(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return LoadResult(status="missing", detail=f"{path} does not exist; starting empty")
    except OSError as exc:
        return LoadResult(status="unreadable", detail=f"cannot read {path}: {exc}")
    try:
        checkpoint = decode(data)
    except ValueError as exc:
        copy = path.with_name(path.name + CORRUPT_SUFFIX)
        try:
            os.replace(path, copy)
        except OSError as move_exc:
            return LoadResult(
                status="corrupt",
                detail=f"{path}: {exc}; could not keep a copy: {move_exc}; starting empty",
            )
        return LoadResult(
            status="corrupt",
            detail=f"{path}: {exc}; kept as {copy}; starting empty",
            corrupt_copy=copy,
        )
    return LoadResult(
        status="ok",
        allocations=tuple(checkpoint.allocations),
        node=checkpoint.node,
        detail=f"{len(checkpoint.allocations)} allocation(s) from {path}",
    )


def _remove_stale_tmp(path: Path) -> None:
    # Left behind by a crash between mkstemp and rename; the real file is intact.
    prefix = _tmp_prefix(path)
    with contextlib.suppress(OSError):
        for entry in path.parent.iterdir():
            if entry.name.startswith(prefix) and entry.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    entry.unlink()


class CheckpointStore:
    """A checkpoint file bound to one ledger's life: recover at start, save on change."""

    def __init__(self, path: Path | str, *, node: str = "") -> None:
        self.path = Path(path)
        self.node = node

    def save(self, ledger: Ledger) -> None:
        save_checkpoint(self.path, ledger.snapshot(), node=self.node)

    def load(self) -> LoadResult:
        return load_checkpoint(self.path)

    def recover(self, ledger: Ledger) -> Recovery:
        """Load into ``ledger`` and rewrite the file when anything was set aside.

        The rewrite makes the file match what the ledger now holds, so a refused entry
        or a corrupt file is reported once, not at every start.
        """
        result = self.load()
        refused = tuple(ledger.restore(result.allocations))
        save_error = None
        if refused or result.status == "corrupt":
            try:
                self.save(ledger)
            except OSError as exc:
                save_error = f"cannot rewrite {self.path}: {exc}"
        return Recovery(load=result, refused=refused, save_error=save_error)
