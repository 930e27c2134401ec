"""Small state files on disk: written atomically, and kept aside when corrupt.

Why here
--------
Several services keep a state file of their own (the allocator's checkpoint, the
health service's list of the GPUs a node is expected to have). They all need the same
two things, done once here:

* :func:`write_atomic`: a temporary file in the same directory, fsync, rename over the
  file, fsync the directory. A crash leaves the old or the new file, never a mix.
* :func:`quarantine`: a file that does not decode is kept for a post-mortem under a
  name never used before, ``<name>.corrupt-<UTC time>-<n>``, made with exclusive
  creation (a hard link, or a copy where links are not supported). A second
  corruption never overwrites the copy of the first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CORRUPT_SUFFIX = ".corrupt"
# Copies of one file in one second beyond which quarantining gives up (a bound).
MAX_COPIES_PER_SECOND = 1000


def tmp_prefix(path: Path) -> str:
    """The prefix of :func:`write_atomic`'s temporary files for ``path``."""
    return f".{path.name}."


def write_atomic(path: Path, data: bytes) -> None:
    """Atomically and durably replace ``path`` with ``data``; raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix(path), suffix=".tmp", dir=path.parent)
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
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def quarantine(path: Path, *, now: Callable[[], float] = time.time) -> Path:
    """Keep ``path``'s content under a new name next to it; returns that name.

    The file itself is left in place (the caller replaces or removes it). Raises
    OSError.
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now()))
    for n in range(1, MAX_COPIES_PER_SECOND + 1):
        copy = path.with_name(f"{path.name}{CORRUPT_SUFFIX}-{stamp}-{n}")
        try:
            os.link(path, copy)
        except FileExistsError:
            continue
        except OSError:
            try:
                with path.open("rb") as src, copy.open("xb") as dst:
                    shutil.copyfileobj(src, dst)
                    dst.flush()
                    os.fsync(dst.fileno())
            except FileExistsError:
                continue
        fsync_dir(path.parent)
        return copy
    raise OSError(f"{MAX_COPIES_PER_SECOND} corrupt copies of {path} in one second")
