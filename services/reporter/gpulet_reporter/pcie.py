"""The PCI root complex of a GPU, from sysfs, for ``topology.pcieID``.

koordlet resolves ``/sys/bus/pci/devices/<bdf>`` (a symlink) and takes the root
component of the real path, e.g. ``/sys/devices/pci0000:3a/0000:3a:00.0/.../0000:3b:00.0``
→ ``pci0000:3a``. GPUs under one root complex then share a ``pcieID``, which is what
koord-scheduler's topology-aware placement groups by. We do the same so that both
agents describe a node identically.

The lookup is the only file-system access of the Device rendering; it is cached per
bus id (topology does not change while a GPU is present) and falls back to
:func:`gpulet_reporter.desired.fallback_pcie_root` when sysfs is not there (a laptop,
the mock backend, a container without ``/sys``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from gpulet_reporter.desired import bus_id_short, fallback_pcie_root

SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")
_ROOT = re.compile(r"^pci[0-9a-fA-F]{4}:[0-9a-fA-F]{2}$")


def sysfs_pcie_root(bus_id: str, devices_dir: Path = SYSFS_PCI_DEVICES) -> str:
    """``pciDDDD:BB`` of the root complex above ``bus_id``, or "" when unknown."""
    short = bus_id_short(bus_id)
    if not short:
        return ""
    try:
        real = os.path.realpath(devices_dir / short, strict=True)
    except (OSError, ValueError):
        return ""
    for part in Path(real).parts:
        if _ROOT.fullmatch(part):
            return part.lower()
    return ""


def make_resolver(devices_dir: Path = SYSFS_PCI_DEVICES) -> Callable[[str], str]:
    """A cached resolver: sysfs first, the GPU's own bus when sysfs cannot tell."""

    @lru_cache(maxsize=256)
    def resolve(bus_id: str) -> str:
        return sysfs_pcie_root(bus_id, devices_dir) or fallback_pcie_root(bus_id)

    return resolve
