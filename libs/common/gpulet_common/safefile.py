"""The one way gpulet writes a file: never through a symlink, atomically, durably.

Why
---
gpulet's files live in directories that other things can reach (a hostPath state dir,
a fleet store, a CLI's ``--out``). A symlink planted at a path that gpulet writes would
make it write into the link's target; a fixed temporary name (``<name>.tmp``) planted
as a link is worse, because the rename then installs the link itself and every later
save writes there again. Every file that gpulet writes therefore goes through here.

Design
------
* The directory is opened once with ``O_DIRECTORY|O_NOFOLLOW`` and every step is
  taken relative to that descriptor, so the directory cannot be swapped for a link
  between the checks and the writes. A directory that *is* a symlink is refused.
* :func:`write_atomic`: the target must be absent or a regular file (a symlink or
  anything else there is refused, and the error says so). The data goes to a new file
  with a random name in the same directory (``.<name>.<random>.tmp``, created with
  ``O_CREAT|O_EXCL|O_NOFOLLOW``: an existing name, link or not, is never opened), is
  fsync'd, renamed over the target, and the directory is fsync'd. A crash leaves the
  old file or the new one, never a mix. The mode is set exactly (``0600`` unless told
  otherwise), whatever the umask: secrets stay private.
* :func:`open_append` and :func:`open_update`: the files that are appended to or cut in
  place (the health buffer's segments, the embedded NATS server's log) are opened with
  ``O_NOFOLLOW`` (a link is refused) and must be regular files (a FIFO or a device
  planted there is refused without blocking).
* :func:`ensure_dir` (and ``write_atomic(dir_mode=...)``): the directories gpulet
  creates for others to read (the DRA plugin's socket and checkpoint directories, the
  CDI directory) get their mode exactly, whatever the umask: each missing component
  is made ``0700`` (a umask can only take bits away) and then set to the mode, so it
  is never more open than asked, even for an instant. Existing directories are left
  as they are; a component that is a symlink is refused.
* Refusals raise :class:`UnsafePathError`, an :class:`OSError`, so every caller's
  existing handling of a failed write (fail closed, say why) applies unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "UnsafePathError",
    "ensure_dir",
    "fsync_dir",
    "open_append",
    "open_update",
    "tmp_prefix",
    "write_atomic",
]

# Random temporary names tried before giving up (each collision is a 2^-64 event).
_TMP_ATTEMPTS = 16
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePathError(OSError):
    """A path that gpulet refuses to write through (a symlink, or not a regular file)."""


def tmp_prefix(path: Path) -> str:
    """The prefix of :func:`write_atomic`'s temporary files for ``path``."""
    return f".{path.name}."


def ensure_dir(directory: Path, mode: int) -> None:
    """``directory`` and its missing parents, each made with exactly ``mode`` (module
    docstring); existing ones are left as they are. Raises OSError."""
    missing: list[Path] = []
    at = Path(directory)
    while not at.exists():
        if at.is_symlink():  # dangling
            raise UnsafePathError(errno.ELOOP, f"refusing to create {at}: it is a symlink")
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for component in reversed(missing):
        try:
            os.mkdir(component, 0o700)
        except FileExistsError:
            continue  # made meanwhile by someone else: theirs, left as it is
        os.chmod(component, mode, follow_symlinks=False)
    if directory.is_symlink():
        raise UnsafePathError(errno.ELOOP, f"refusing to use {directory}: it is a symlink")


def _open_dir(directory: Path, *, create: bool, mode: int | None = None) -> int:
    if directory.is_symlink():  # a dangling one too: mkdir would only say "exists"
        raise UnsafePathError(errno.ELOOP, f"refusing to write in {directory}: it is a symlink")
    if create and mode is not None:
        ensure_dir(directory, mode)
    elif create:
        directory.mkdir(parents=True, exist_ok=True)
    try:
        return os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and directory.is_symlink():
            raise UnsafePathError(
                errno.ELOOP, f"refusing to write in {directory}: it is a symlink"
            ) from None
        raise


def _check_target(dir_fd: int, path: Path) -> None:
    try:
        st = os.lstat(path.name, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(errno.ELOOP, f"refusing to write {path}: it is a symlink")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(errno.EINVAL, f"refusing to write {path}: not a regular file")


def write_atomic(
    path: Path,
    data: bytes,
    *,
    mode: int = 0o600,
    durable: bool = True,
    dir_mode: int | None = None,
) -> None:
    """Atomically replace ``path`` with ``data`` (see the module docstring).

    ``durable=False`` skips both fsyncs (a file whose loss costs a little repeated
    work, written often). ``dir_mode``: the exact mode of directories made for it
    (:func:`ensure_dir`; None: as ``mkdir`` makes them, under the umask). Raises
    OSError; :class:`UnsafePathError` for a refusal.
    """
    dir_fd = _open_dir(path.parent, create=True, mode=dir_mode)
    try:
        _check_target(dir_fd, path)
        fd, tmp = _create_tmp(dir_fd, path, mode)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                if durable:
                    os.fsync(fh.fileno())
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        if durable:
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _create_tmp(dir_fd: int, path: Path, mode: int) -> tuple[int, str]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_TMP_ATTEMPTS):
        tmp = f"{tmp_prefix(path)}{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
        except FileExistsError:
            continue
        try:
            os.fchmod(fd, mode)  # exact, whatever the umask
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        return fd, tmp
    raise OSError(errno.EEXIST, f"no free temporary name for {path} in {_TMP_ATTEMPTS} tries")


def _open_regular(path: Path, flags: int, mode: int, *, create_dir: bool) -> int:
    dir_fd = _open_dir(path.parent, create=create_dir)
    try:
        try:
            # O_NONBLOCK: a FIFO planted at the path must not block the open.
            fd = os.open(
                path.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(
                    errno.ELOOP, f"refusing to open {path}: it is a symlink"
                ) from None
            if exc.errno == errno.ENXIO:  # a FIFO with no reader
                raise UnsafePathError(
                    errno.EINVAL, f"refusing to open {path}: not a regular file"
                ) from None
            raise
    finally:
        os.close(dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(errno.EINVAL, f"refusing to open {path}: not a regular file")
    os.set_blocking(fd, True)
    return fd


def open_append(path: Path, *, mode: int = 0o600) -> BinaryIO:
    """``path`` opened for appending (created if absent), never through a symlink."""
    fd = _open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode, create_dir=True)
    return os.fdopen(fd, "ab")


def open_update(path: Path) -> BinaryIO:
    """An existing ``path`` opened for reading and writing in place, never through a
    symlink (raises FileNotFoundError when it does not exist)."""
    fd = _open_regular(path, os.O_RDWR, 0, create_dir=False)
    return os.fdopen(fd, "r+b")


def fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
