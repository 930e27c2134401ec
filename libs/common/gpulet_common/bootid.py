"""The node's boot ID: which boot of the kernel a fact belongs to.

Linux draws a random UUID at every boot (``/proc/sys/kernel/random/boot_id``); a
container sees its host's, since the kernel is shared. gpulet puts it in every health
event (``HealthEvent.node_boot_id``) and in the Node's ``GpuletGPUHealthy`` condition
message, so that a fault is tied to the boot it happened in, and the health service
compares it to end a hold until a reboot.

The path can be moved for tests (and odd hosts) with ``GPULET_BOOT_ID_PATH``; a file
that cannot be read gives ``"unknown"``, never an error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

BOOT_ID_PATH: Final = "/proc/sys/kernel/random/boot_id"
BOOT_ID_PATH_ENV: Final = "GPULET_BOOT_ID_PATH"
UNKNOWN: Final = "unknown"
# A boot ID is a UUID (36 characters); anything longer is not believed whole.
_MAX_CHARS: Final = 64


def boot_id_path() -> Path:
    return Path(os.environ.get(BOOT_ID_PATH_ENV) or BOOT_ID_PATH)


def read_boot_id(path: Path | None = None) -> str:
    """The boot ID at ``path`` (default: :func:`boot_id_path`), or ``"unknown"``."""
    try:
        with (path or boot_id_path()).open("rb") as f:
            raw = f.read(_MAX_CHARS + 1)
    except OSError:
        return UNKNOWN
    text = raw.decode("ascii", errors="replace").strip()
    if not text or len(text) > _MAX_CHARS or not text.isprintable():
        return UNKNOWN
    return text
