"""Time-slicing for the allocator: how many replicas each GPU is offered as.

Neutral ground like :mod:`gpulet_allocator.mig`: a pure function of the settings
(``sharing.time_slicing``), the config name the node label picks and the collector's
inventory. The allocator resolves it (it reads the label: :mod:`.service.node_label`),
puts it in its ledger (the one owner model,
:meth:`~gpulet_allocator.decide.engine.Ledger.refusal`) and hands the result to the
device plugin (``withheld`` reply) and the reporter (``held`` reply), so that all three
say the same.

Rules
-----
* **Which config.** The node label ``sharing.time_slicing.node_label`` names a config
  of ``sharing.time_slicing.configs``; without the label, ``default_config``; ``""``
  or ``none``: no time-slicing. A label naming no config is not guessed at: the config
  in force stays (at start: the default's), and the problem is said. The configs are
  ``configs`` and those of ``configs_file``, re-read when the file changes; a config
  in force that leaves the file stays in force until the label names another.
* **How many replicas per GPU.** The first of: an override naming the GPU's UUID, its
  index, its product (NVML's name or GFD's ``nvidia.com/gpu.product`` form); then the
  config's ``resources`` entry of the whole-GPU resource; else 1. A GPU with one
  replica is not time-sliced (offered whole, ID = its UUID). An entry of another
  resource (``nvidia.com/mig-1g.10gb``...) is ignored and said: MIG devices are not
  replicated by gpulet (NVIDIA's plugin can; not built here).
* **Never a MIG-enabled GPU** (or one with a mode change pending): it is not offered
  at all (:func:`~gpulet_common.migrules.parent_block`), so not as replicas either.
* **A change applies at once and takes nothing back.** Replica ``n`` of a GPU keeps
  its ID ``<uuid>::<n>`` across changes, so an allocation made stays valid. When the
  count shrinks, the replicas held above the new count stay recorded until released
  but are not offered again (a new allocation of one is refused); when a GPU stops
  being time-sliced, it goes whole (or shared) again only once its last replica is
  released. A GPU held whole or in shares when a config makes it time-sliced offers
  its replicas only once it is free (the ledger refuses them meanwhile, and the device
  plugin lists them ``Unhealthy``).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from gpulet_common.messages import GpuInfo
from gpulet_common.migrules import parent_block
from gpulet_common.settings.sharing import TimeSlicingConfig, TimeSlicingSettings

NO_CONFIG = "none"


class TimeSlicePlan(msgspec.Struct, frozen=True, kw_only=True):
    """The config in force and the replicas of each time-sliced GPU (count > 1)."""

    config: str = ""
    replicas: dict[str, int] = {}
    fail_requests_greater_than_one: bool = False
    # What the config asked that is not done (an unknown name, another resource).
    problems: tuple[str, ...] = ()


def chosen_config(settings: TimeSlicingSettings, label: str | None) -> tuple[str, str]:
    """The config name a label value picks (None: no label) and the problem, if any.

    ``("", problem)``: the label names no config, so the caller keeps what it has.
    """
    name = (label if label is not None else settings.default_config).strip()
    if name in ("", NO_CONFIG) or name in settings.configs:
        return (name if name != NO_CONFIG else "", "")
    known = ", ".join(sorted(settings.configs)) or "none"
    return ("", f"node label {settings.node_label}={name[:63]!r} names no config (known: {known})")


def _product_forms(name: str) -> set[str]:
    stripped = name.strip()
    return {stripped, stripped.replace(" ", "-")}


def gpu_replicas(config: TimeSlicingConfig, gpu: GpuInfo, gpu_resource: str) -> int:
    """How many replicas ``config`` gives ``gpu`` (1: not time-sliced)."""
    by_uuid = [o.replicas for o in config.gpus if o.gpu.strip() == gpu.uuid]
    by_index = [o.replicas for o in config.gpus if o.gpu.strip() == str(gpu.index)]
    products = _product_forms(gpu.name)
    by_product = [o.replicas for o in config.gpus if o.gpu.strip() in products]
    for found in (by_uuid, by_index, by_product):
        if found:
            return found[0]
    for resource in config.resources:
        if resource.name == gpu_resource:
            return resource.replicas
    return 1


def plan(
    config: str, chosen: TimeSlicingConfig | None, gpus: Iterable[GpuInfo], gpu_resource: str
) -> TimeSlicePlan:
    """The replicas each GPU gets under ``chosen``, the config named ``config`` (None:
    no time-slicing)."""
    if chosen is None:
        return TimeSlicePlan()
    problems = [
        f"config {config!r}: resource {r.name!r} is not replicated (only {gpu_resource})"
        for r in chosen.resources
        if r.name != gpu_resource
    ]
    replicas: dict[str, int] = {}
    for gpu in gpus:
        count = gpu_replicas(chosen, gpu, gpu_resource)
        if count <= 1:
            continue
        if parent_block(gpu) is not None:
            problems.append(f"GPU {gpu.index} ({gpu.uuid}) is MIG-enabled: never replicated")
            continue
        replicas[gpu.uuid] = count
    return TimeSlicePlan(
        config=config,
        replicas=replicas,
        fail_requests_greater_than_one=chosen.fail_requests_greater_than_one,
        problems=tuple(problems),
    )
