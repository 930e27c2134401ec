"""MIG devices as DRA devices (issue 27): names, attributes, capacity, lookup.

A MIG-enabled GPU, or one with a pending MIG mode change
(:func:`gpulet_common.migrules.parent_block`), is never a device of the pool: only its
MIG devices are, each given whole (no ``allowMultipleAllocations``, no shares).

Names and attributes follow NVIDIA's DRA driver (``kubernetes-sigs/dra-driver-nvidia-gpu``,
``mig.go``) where gpulet knows the same facts, so CEL selectors carry over with only the
domain changed:

* the name is ``gpu-<parent minor>-mig-<profile>-<gi>-<ci>``: the profile lower-cased
  with its dots removed and anything else that a DNS label forbids written ``-``
  (``1g.10gb+me`` → ``1g10gb-me``), as NVIDIA writes it. NVIDIA ends the name with the
  GPU-instance profile id and placement start, which gpulet does not read; it ends it
  with the GPU-instance and compute-instance ids instead, which are unique on the GPU
  while the MIG device lives (two compute instances of one GPU instance are two
  devices). :func:`parse_name` reads the ids back;
* string attributes ``type`` = ``mig``, ``uuid`` (the MIG UUID), ``parentUUID``,
  ``profile``, and the parent's ``productName``, ``brand``, ``architecture``, versions
  ``cudaComputeCapability``, ``driverVersion``, ``cudaDriverVersion``, the standard
  ``resource.kubernetes.io/pciBusID`` and ``pcieRoot``; gpulet's own ``parentIndex``,
  ``parentMinor``, ``gpuInstanceId``, ``computeInstanceId``, ``numaNode`` and
  ``nvlinkIsland`` (the parent's);
* capacities ``multiprocessors``, ``copyEngines``, ``decoders``, ``encoders``,
  ``jpegEngines``, ``ofaEngines`` and ``memory`` (bytes: the MIG device's memory as
  NVML reports it). NVIDIA also publishes ``memorySlice<N>`` for the placement, which
  gpulet does not read: left out.

:func:`targets` maps every device name of the pool, whole GPUs and MIG devices alike,
to what it is on the node; the decision core (a claim's devices), the kubelet plugin
(health, CDI) and the pool all read names through it, so they never disagree.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

from gpulet_common.dra import devices as dev
from gpulet_common.messages import GpuInfo, Inventory, MigDevice
from gpulet_common.migrules import parent_block
from gpulet_common.quantity import binary

JsonObj = dict[str, Any]

MIG_TYPE: Final = "mig"
# The longest profile part of a name: keeps every name a DNS label (63).
_PROFILE_CHARS: Final = 24
_NAME = re.compile(r"^gpu-(\d{1,6})-mig-(?:[a-z0-9-]+-)?(\d{1,6})-(\d{1,6})$")
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")


@dataclass(frozen=True)
class Target:
    """One device of the pool: a whole GPU (``mig`` None) or a MIG device of ``gpu``."""

    name: str
    gpu: GpuInfo
    mig: MigDevice | None = None

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig is not None else self.gpu.uuid

    @property
    def minor(self) -> int:
        """The device node's minor: the GPU's (the parent's for a MIG device)."""
        return self.gpu.minor if self.gpu.minor is not None else self.gpu.index


def _profile_part(profile: str) -> str:
    text = _NOT_LABEL.sub("-", profile.lower().replace(".", ""))
    return text[:_PROFILE_CHARS].strip("-")


def device_name(gpu: GpuInfo, mig: MigDevice) -> str:
    """``gpu-0-mig-1g10gb-me-3-0`` (see the module docstring)."""
    minor = gpu.minor if gpu.minor is not None else gpu.index
    part = _profile_part(mig.profile)
    middle = f"{part}-" if part else ""
    return f"gpu-{minor}-mig-{middle}{mig.gpu_instance_id}-{mig.compute_instance_id}"


def parse_name(name: str) -> tuple[int, int, int] | None:
    """(parent minor, GPU-instance id, compute-instance id) of a MIG device name; None
    for any other name."""
    found = _NAME.fullmatch(name)
    if found is None:
        return None
    return int(found[1]), int(found[2]), int(found[3])


def offered_migs(gpu: GpuInfo) -> list[MigDevice]:
    """The MIG devices of ``gpu`` the pool offers: those of a GPU whose MIG mode is
    enabled (as the ledger and the device plugin count them), in (gi, ci) order, the
    first of two that share a name."""
    if gpu.mig_mode != "enabled":
        return []
    out: list[MigDevice] = []
    names: set[str] = set()
    for mig in sorted(gpu.mig_devices, key=lambda d: (d.gpu_instance_id, d.compute_instance_id)):
        name = device_name(gpu, mig)
        if name not in names and mig.uuid and mig.uuid != gpu.uuid:
            names.add(name)
            out.append(mig)
    return out


def targets(gpus: Iterable[GpuInfo]) -> dict[str, Target]:
    """Every device name of the pool → what it is: GPUs that may go whole (no MIG
    block) by ``gpu-<minor>``, and the MIG devices of MIG-enabled GPUs."""
    out: dict[str, Target] = {}
    for gpu in sorted(gpus, key=lambda g: (g.index, g.uuid)):
        if parent_block(gpu) is None:
            out.setdefault(dev.device_name(gpu), Target(dev.device_name(gpu), gpu))
        for mig in offered_migs(gpu):
            name = device_name(gpu, mig)
            out.setdefault(name, Target(name, gpu, mig))
    return out


def attributes(
    gpu: GpuInfo,
    mig: MigDevice,
    inventory: Inventory,
    *,
    island: int,
    pcie_root: Callable[[str], str] | None = None,
    nvlink: dev.NvLink | None = None,
) -> JsonObj:
    """The parent's attributes where NVIDIA repeats them, then the MIG device's own."""
    parent = dev.attributes(gpu, inventory, island=island, pcie_root=pcie_root, nvlink=nvlink)
    for own in ("index", "minor"):
        parent.pop(own, None)
    found: dict[str, JsonObj | None] = {
        **parent,
        "type": {"string": MIG_TYPE},
        "uuid": dev.string_attribute(mig.uuid),
        "parentUUID": dev.string_attribute(gpu.uuid),
        "profile": dev.string_attribute(mig.profile),
        "parentIndex": {"int": gpu.index},
        "parentMinor": {"int": gpu.minor} if gpu.minor is not None else None,
        "gpuInstanceId": {"int": mig.gpu_instance_id},
        "computeInstanceId": {"int": mig.compute_instance_id},
    }
    return {k: v for k, v in found.items() if v is not None}


def capacity(mig: MigDevice) -> JsonObj:
    """NVIDIA's capacity names for a MIG device (counts, and memory in bytes)."""
    counts = {
        "multiprocessors": mig.multiprocessors,
        "copyEngines": mig.copy_engines,
        "decoders": mig.decoders,
        "encoders": mig.encoders,
        "jpegEngines": mig.jpegs,
        "ofaEngines": mig.ofas,
    }
    out: JsonObj = {k: {"value": str(v)} for k, v in counts.items()}
    out[dev.MEMORY] = {"value": binary(mig.memory_total_bytes)}
    return out
