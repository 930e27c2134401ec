"""GFD's sharing labels of ``nvidia.com/gpu`` (NVIDIA gpu-feature-discovery, ``internal/lm``).

GFD writes, for the whole-GPU resource:

* ``nvidia.com/gpu.replicas``: the time-slicing replicas of each GPU (``1``: none);
* ``nvidia.com/gpu.sharing-strategy``: ``time-slicing`` when replicas > 1, else ``none``;
* ``nvidia.com/gpu.product`` with ``-SHARED`` appended when the GPUs are replicated
  under their own resource name (NVIDIA's ``rename`` unset, which is always so here).

The replicas come from the allocator (its ``held`` reply: the plan of the node's
``sharing.time_slicing`` config, :mod:`gpulet_allocator.timeslicing`), never from the
settings alone, so the labels say what the device plugin offers. gpulet may give GPUs
of one node different counts (per-GPU overrides), which GFD's one label cannot say:
then ``.replicas`` is left out (as the product is on a node that mixes models) while
``.sharing-strategy`` and ``-SHARED`` still say that the node time-slices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from gpulet_common.messages import GpuInfo
from gpulet_common.migrules import parent_block

GFD_SHARING_STRATEGY: Final = "nvidia.com/gpu.sharing-strategy"
GFD_REPLICAS: Final = "nvidia.com/gpu.replicas"
TIME_SLICING: Final = "time-slicing"
# Appended to ``nvidia.com/gpu.product`` while the node time-slices.
SHARED_SUFFIX: Final = "-SHARED"


def sharing_labels(gpus: Sequence[GpuInfo], replicas: Mapping[str, int]) -> dict[str, str]:
    """``.replicas`` and ``.sharing-strategy`` of the whole-GPU resource (the product's
    suffix is the caller's, who has the product)."""
    offered = [g for g in gpus if parent_block(g) is None]
    counts = {max(replicas.get(g.uuid, 1), 1) for g in offered}
    if not counts or counts == {1}:
        return {GFD_SHARING_STRATEGY: "none", GFD_REPLICAS: "1"}
    labels = {GFD_SHARING_STRATEGY: TIME_SLICING}
    if len(counts) == 1:
        labels[GFD_REPLICAS] = str(counts.pop())
    return labels
