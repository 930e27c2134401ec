"""GFD's MIG labels (NVIDIA gpu-feature-discovery, ``internal/lm``), for the same layout.

* ``nvidia.com/mig.capable``: ``true`` when a GPU of the node is MIG-capable.
* ``nvidia.com/mig.strategy``: the device plugin's strategy, under ``single`` and
  ``mixed`` (GFD's ``none`` sets none).
* ``single`` (:func:`gpulet_common.migrules.single_layout_problem`): with MIG devices,
  the ``nvidia.com/gpu.*`` labels describe one MIG device (``count`` = how many,
  ``product`` = ``<product>-MIG-<profile>``, ``memory`` in MiB, ``multiprocessors``,
  ``slices.gi``, ``slices.ci``, ``engines.{copy,decoder,encoder,jpeg,ofa}``); an invalid
  layout reads ``count=0``, ``memory=0``, ``product=<product>-MIG-INVALID``.
* ``mixed``: the same per profile under ``nvidia.com/mig-<profile>.*`` (``+`` as
  ``.``), and ``nvidia.com/gpu.count`` counts the GPUs without MIG.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from gpulet_common.messages import GpuInfo, MigDevice
from gpulet_common.migrules import mig_resource_name, single_layout_problem

GFD_MIG_CAPABLE: Final = "nvidia.com/mig.capable"
GFD_MIG_STRATEGY: Final = "nvidia.com/mig.strategy"
_MIB: Final = 2**20


def _describe(prefix: str, product: str, devices: Sequence[MigDevice]) -> dict[str, str]:
    d = devices[0]
    labels = {
        f"{prefix}.count": str(len(devices)),
        f"{prefix}.memory": str(d.memory_total_bytes // _MIB),
        f"{prefix}.multiprocessors": str(d.multiprocessors),
        f"{prefix}.slices.gi": str(d.slices_gi),
        f"{prefix}.slices.ci": str(d.slices_ci),
        f"{prefix}.engines.copy": str(d.copy_engines),
        f"{prefix}.engines.decoder": str(d.decoders),
        f"{prefix}.engines.encoder": str(d.encoders),
        f"{prefix}.engines.jpeg": str(d.jpegs),
        f"{prefix}.engines.ofa": str(d.ofas),
    }
    if product:
        labels[f"{prefix}.product"] = f"{product}-MIG-{d.profile.replace('+', '.')}"
    return labels


def mig_labels(
    gpus: Sequence[GpuInfo],
    strategy: str,
    product: str,
    gpu_resource: str = "nvidia.com/gpu",
    *,
    absent: int = 0,
) -> dict[str, str]:
    """GFD's MIG labels of these GPUs under ``strategy``; ``product`` is the GPUs'
    ``nvidia.com/gpu.product`` ("" when they differ). Keys here replace the plain ones.
    ``absent``: whole GPUs listed (unhealthy) though the inventory lacks them."""
    labels: dict[str, str] = {}
    if any(g.mig_max_devices is not None for g in gpus):
        labels[GFD_MIG_CAPABLE] = "true" if any(g.mig_capable for g in gpus) else "false"
    if strategy not in ("single", "mixed") or not gpus:
        return labels
    labels[GFD_MIG_STRATEGY] = strategy
    enabled = [g for g in gpus if g.mig_mode == "enabled"]
    devices = [d for g in enabled for d in g.mig_devices if d.profile]
    if strategy == "single":
        if not enabled:
            return labels
        if single_layout_problem(gpus):
            labels.update({f"{gpu_resource}.count": "0", f"{gpu_resource}.memory": "0"})
            if product:
                labels[f"{gpu_resource}.product"] = f"{product}-MIG-INVALID"
            return labels
        labels.update(_describe(gpu_resource, product, devices))
        return labels
    labels[f"{gpu_resource}.count"] = str(len(gpus) - len(enabled) + absent)
    by_profile: dict[str, list[MigDevice]] = {}
    for d in devices:
        by_profile.setdefault(d.profile, []).append(d)
    for profile, same in sorted(by_profile.items()):
        labels.update(_describe(mig_resource_name(gpu_resource, profile), product, same))
    return labels
