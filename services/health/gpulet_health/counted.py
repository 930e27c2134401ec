"""The health service's own GPU scan: what NVML counts, what answers, what does not.

A scan reads NVML's count (``nvmlDeviceGetCount``) and then each GPU's identity. Real
NVML keeps counting a GPU that is lost; such a GPU, or one whose identity fails for
another reason, is not dropped: it is kept as an
:class:`~gpulet_common.messages.UnreadableGpu` (its index and whatever identity could
still be read, :meth:`NvmlAdapter.unreadable`) for the rule engine to raise
(:mod:`gpulet_health.rules.unreadable`). Blocking: the service runs it in a thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gpulet_common.messages import GpuInfo, UnreadableGpu
from gpulet_common.nvml.adapter import NvmlAdapter
from gpulet_common.nvml.errors import GpuLostError, NvmlCallError

log = logging.getLogger("gpulet.health")


@dataclass(frozen=True, slots=True)
class GpuScan:
    count: int
    found: list[GpuInfo]
    unreadable: list[UnreadableGpu]

    @property
    def lost(self) -> list[tuple[int, str | None]]:
        """The lost GPUs: (index, UUID when it could be read)."""
        return [(g.index, g.uuid) for g in self.unreadable if g.lost]


def scan_gpus(adapter: NvmlAdapter) -> GpuScan:
    """Every GPU NVML counts; raises NvmlUnavailable when NVML as a whole fails."""
    # Handles cached by index are stale after a re-enumeration: start afresh, as the
    # adapter's own inventory does.
    adapter.invalidate()
    count = adapter.device_count()
    found: list[GpuInfo] = []
    unreadable: list[UnreadableGpu] = []
    for index in range(count):
        try:
            found.append(adapter.gpu_info(index))
        except (GpuLostError, NvmlCallError) as exc:
            if not isinstance(exc, GpuLostError):
                log.warning("GPU %d does not answer the health scan: %s", index, exc)
            unreadable.append(adapter.unreadable(index, exc))
    return GpuScan(count, found, unreadable)
