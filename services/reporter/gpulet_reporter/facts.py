"""The node facts behind the labels that the inventory does not carry.

* The machine type, for GFD's ``nvidia.com/gpu.machine``: GFD reads the DMI product
  name, ``/sys/class/dmi/id/product_name`` (``DGXH100``, ``PowerEdge XE9680``), and
  says ``unknown`` when it cannot. We read the same file once, at start: it does not
  change while the machine runs. A file too large or not text reads as unknown.
* How gpulet serves the node, from the ``[allocator]`` settings (which the reporter
  reads but never acts on): whether its device plugin serves ``nvidia.com/gpu`` (then
  the GFD sharing labels describe that resource: no sharing, one replica), and whether
  it serves fractional shares limited by CUDA MPS (``nvidia.com/mps.capable``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

from gpulet_common.settings import Settings
from gpulet_reporter.labels import MACHINE_UNKNOWN, WHOLE_GPU_RESOURCE, NodeFacts

log = logging.getLogger("gpulet.reporter")

DMI_PRODUCT_NAME: Final = Path("/sys/class/dmi/id/product_name")
_MAX_BYTES: Final = 4096


def read_machine_type(path: Path = DMI_PRODUCT_NAME) -> str:
    """The DMI product name, or ``unknown``."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(_MAX_BYTES + 1)
    except OSError as exc:
        log.debug("machine type unknown: %s", exc)
        return MACHINE_UNKNOWN
    if len(raw) > _MAX_BYTES:
        return MACHINE_UNKNOWN
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return MACHINE_UNKNOWN
    return text or MACHINE_UNKNOWN


def node_facts(settings: Settings, machine: str) -> NodeFacts:
    allocator = settings.allocator
    plugin = allocator.plugin
    return NodeFacts(
        machine=machine,
        serves_whole_gpus=allocator.enabled and plugin.resources.gpu == WHOLE_GPU_RESOURCE,
        mps_shares=allocator.enabled and plugin.shares and allocator.mps.enabled,
    )
