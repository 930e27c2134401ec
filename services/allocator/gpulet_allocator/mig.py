"""MIG for the allocator: which GPUs may not go whole, and which MIG devices are offered.

The rules themselves (:func:`parent_block`, NVIDIA's single-layout rules, the
resource names) are :mod:`gpulet_common.migrules`, which the reporter reads too.
Neutral ground, like :mod:`gpulet_allocator.protocol`: the decision core (the ledger's
one answer, :meth:`~gpulet_allocator.decide.engine.Ledger.refusal`, and the core's
pool check) and the device plugin (what ``ListAndWatch`` lists) both read these pure
functions of the collector's inventory, so they never disagree.

Rules
-----
* **A MIG-enabled parent never goes whole.** A GPU whose MIG mode is enabled, or whose
  mode change is pending (current != pending; it applies at the next GPU reset), leaves
  the whole-GPU and the share pools under every strategy (:func:`parent_block`: the
  refusal code ``mig_enabled`` or ``mig_pending`` and why). Unlike NVIDIA's ``none``,
  which offers such a GPU whole and lets the pod fail.
* **Strategies** (``allocator.mig_strategy``, NVIDIA's ``--mig-strategy``):

  - ``none``: no MIG device is offered;
  - ``single``: the MIG devices are offered as the whole-GPU resource
    (``nvidia.com/gpu``), if the layout is valid by NVIDIA's rules: no MIG-enabled GPU
    without MIG devices, no MIG-enabled GPU beside a MIG-disabled one, one profile
    only. An invalid layout offers no MIG device (:attr:`MigPlan.invalid` says why);
    the MIG-disabled GPUs beside it are still offered whole;
  - ``mixed``: each MIG device as ``<domain>/mig-<profile>``, ``+`` written ``.``
    (``nvidia.com/mig-1g.10gb.me``), one resource per profile.

  Device IDs are the MIG UUIDs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

from gpulet_common.messages import GpuInfo
from gpulet_common.migrules import MIG_ENABLED as MIG_ENABLED
from gpulet_common.migrules import MIG_PENDING as MIG_PENDING
from gpulet_common.migrules import mig_resource_name, single_layout_problem
from gpulet_common.migrules import mig_resource_prefix as mig_resource_prefix
from gpulet_common.migrules import parent_block as parent_block

MigStrategy = Literal["none", "single", "mixed"]


class MigOffer(msgspec.Struct, frozen=True, kw_only=True):
    """One MIG device offered to kubelet, under ``resource``."""

    uuid: str
    parent_uuid: str
    parent_index: int
    parent_minor: int | None
    gpu_instance_id: int
    compute_instance_id: int
    profile: str
    resource: str


class MigPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What a strategy offers of a node's MIG devices (by MIG UUID)."""

    strategy: MigStrategy
    offers: dict[str, MigOffer] = {}
    # Not empty: the single strategy's layout is invalid (why); nothing MIG is offered.
    invalid: str = ""

    def resources(self, gpu_resource: str) -> list[str]:
        """The resources other than the whole-GPU one that the offers need, sorted."""
        return sorted({o.resource for o in self.offers.values()} - {gpu_resource})


def mig_plan(gpus: Iterable[GpuInfo], strategy: MigStrategy, gpu_resource: str) -> MigPlan:
    """The MIG devices ``strategy`` offers on this node (see the module docstring)."""
    gpus = list(gpus)
    if strategy == "none":
        return MigPlan(strategy=strategy)
    if strategy == "single" and (problem := single_layout_problem(gpus)):
        return MigPlan(strategy=strategy, invalid=problem)
    offers: dict[str, MigOffer] = {}
    for g in sorted(gpus, key=lambda g: (g.index, g.uuid)):
        if g.mig_mode != "enabled":
            continue
        for d in sorted(g.mig_devices, key=lambda d: (d.gpu_instance_id, d.compute_instance_id)):
            if not d.profile or d.uuid in offers:
                continue
            resource = (
                gpu_resource if strategy == "single" else mig_resource_name(gpu_resource, d.profile)
            )
            offers[d.uuid] = MigOffer(
                uuid=d.uuid,
                parent_uuid=g.uuid,
                parent_index=g.index,
                parent_minor=g.minor,
                gpu_instance_id=d.gpu_instance_id,
                compute_instance_id=d.compute_instance_id,
                profile=d.profile,
                resource=resource,
            )
    return MigPlan(strategy=strategy, offers=offers)
