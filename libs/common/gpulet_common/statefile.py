"""Small state files on disk: written atomically, and kept aside when corrupt.

Why here
--------
Several services keep a state file of their own (the allocator's checkpoint, the
health service's list of the GPUs a node is expected to have). They all need the same
two things, done once here:

* :func:`write_atomic` (from :mod:`gpulet_common.safefile`, the one writer of every
  file gpulet writes): a random temporary file in the same directory, created without
  following links, fsync, rename over the file, fsync the directory. A crash leaves the
  old or the new file, never a mix; a symlink at the path is refused.
* :func:`quarantine`: a file that does not decode is kept for a post-mortem under a
  name never used before, ``<name>.corrupt-<UTC time>-<n>``, made with exclusive
  creation (a hard link, or a copy where links are not supported). A second
  corruption never overwrites the copy of the first.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from gpulet_common.safefile import fsync_dir, tmp_prefix, write_atomic

__all__ = ["CORRUPT_SUFFIX", "fsync_dir", "quarantine", "tmp_prefix", "write_atomic"]

CORRUPT_SUFFIX = ".corrupt"
# Copies of one file in one second beyond which quarantining gives up (a bound).
MAX_COPIES_PER_SECOND = 1000


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
