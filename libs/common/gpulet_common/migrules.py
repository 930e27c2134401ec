"""MIG rules every service reads: one copy of each (issue 27).

* :func:`parent_block`: a GPU with MIG enabled, or with a pending MIG mode change
  (current != pending, applied at the next GPU reset), is never handed out whole nor
  shared: the allocator refuses it (code ``mig_enabled`` / ``mig_pending``), the
  device plugin does not list it, the reporter marks its Device entry unschedulable.
* :func:`single_layout_problem`: NVIDIA's rules for the ``single`` strategy.
* :func:`mig_resource_name`: ``nvidia.com/mig-<profile>``, ``+`` written ``.``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from gpulet_common.messages import GpuInfo

MIG_ENABLED: Final = "mig_enabled"
MIG_PENDING: Final = "mig_pending"


def parent_block(info: GpuInfo) -> tuple[str, str] | None:
    """Why ``info`` may not go whole or take shares because of MIG: (code, reason)."""
    current, pending = info.mig_mode, info.mig_mode_pending
    if current is not None and pending is not None and current != pending:
        return (
            MIG_PENDING,
            f"{info.uuid} has a pending MIG mode change ({current} -> {pending}, applied at "
            "the next GPU reset): not offered whole nor shared until then",
        )
    if current == "enabled":
        return (
            MIG_ENABLED,
            f"{info.uuid} has MIG enabled ({len(info.mig_devices)} MIG device(s)): only its "
            "MIG devices can run containers, never the GPU whole nor shared",
        )
    return None


def mig_resource_name(gpu_resource: str, profile: str) -> str:
    """``nvidia.com/mig-1g.10gb.me`` for ``1g.10gb+me`` (the domain of the GPU resource)."""
    domain = gpu_resource.partition("/")[0] if "/" in gpu_resource else "nvidia.com"
    return f"{domain}/mig-{profile.replace('+', '.')}"


def mig_resource_prefix(gpu_resource: str) -> str:
    return mig_resource_name(gpu_resource, "")


def single_layout_problem(gpus: Iterable[GpuInfo]) -> str:
    """Why NVIDIA's single strategy cannot serve this layout ("" when it can)."""
    gpus = list(gpus)
    enabled = [g for g in gpus if g.mig_mode == "enabled"]
    if not enabled:
        return ""
    empty = [g.uuid for g in enabled if not g.mig_devices]
    if empty:
        return f"MIG-enabled GPU(s) without MIG devices: {', '.join(empty)}"
    disabled = [g.uuid for g in gpus if g.mig_mode != "enabled"]
    if disabled:
        return f"MIG-enabled GPUs beside MIG-disabled ones ({', '.join(disabled)})"
    profiles = sorted({d.profile for g in enabled for d in g.mig_devices})
    if len(profiles) > 1:
        return f"more than one MIG profile ({', '.join(profiles)})"
    return ""
