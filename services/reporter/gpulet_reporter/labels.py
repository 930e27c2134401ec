"""The node's labels: Koordinator's three keys and the GFD-compatible ones, pure, no I/O.

:func:`node_labels` is what the reporter wants on the Node for an inventory;
:func:`device_labels` the Koordinator keys that also go on the Device.
:func:`node_label_patch` turns the wanted labels into a JSON merge patch that touches
only our own keys: the ones we want, and the ones the ``gpulet.io/managed-labels``
annotation says we set before and no longer want. A label of any other owner is never
written.

Choices, documented once here:

* The model label is the NVML name without ``NVIDIA ``, spaces turned into ``-``,
  reduced to what a label value allows; left out on a node that mixes models, as
  koordlet does.
* The GFD-compatible ``nvidia.com/gpu.product`` keeps the ``NVIDIA-`` prefix as current
  GFD does; it, ``gpu.memory``, ``gpu.family`` and the compute capability are left out
  on a node whose GPUs disagree on them rather than describing only some of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from gpulet_common.messages import Inventory
from gpulet_common.migrules import parent_block
from gpulet_reporter.miglabels import mig_labels
from gpulet_reporter.sharelabels import (
    GFD_SHARING_STRATEGY,
    SHARED_SUFFIX,
    TIME_SLICING,
    sharing_labels,
)

JsonObj = dict[str, Any]

LABEL_GPU_MODEL: Final = "node.koordinator.sh/gpu-model"
LABEL_GPU_DRIVER: Final = "node.koordinator.sh/gpu-driver-version"
LABEL_GPU_VENDOR: Final = "node.koordinator.sh/gpu-vendor"
KOORD_LABELS: Final = (LABEL_GPU_MODEL, LABEL_GPU_DRIVER, LABEL_GPU_VENDOR)

GFD_PRODUCT: Final = "nvidia.com/gpu.product"
GFD_COUNT: Final = "nvidia.com/gpu.count"
GFD_MEMORY: Final = "nvidia.com/gpu.memory"
GFD_DRIVER_PREFIX: Final = "nvidia.com/cuda.driver-version."
GFD_RUNTIME_PREFIX: Final = "nvidia.com/cuda.runtime-version."
# Set by the GPU Operator (and NFD rules) on GPU nodes; what GPU DaemonSets select on.
GFD_PRESENT: Final = "nvidia.com/gpu.present"
GFD_FAMILY: Final = "nvidia.com/gpu.family"
GFD_COMPUTE_MAJOR: Final = "nvidia.com/gpu.compute.major"
GFD_COMPUTE_MINOR: Final = "nvidia.com/gpu.compute.minor"
GFD_MACHINE: Final = "nvidia.com/gpu.machine"
GFD_MPS_CAPABLE: Final = "nvidia.com/mps.capable"
# GFD's value when the machine type file cannot be read.
MACHINE_UNKNOWN: Final = "unknown"
# The resource GFD's sharing labels describe.
WHOLE_GPU_RESOURCE: Final = "nvidia.com/gpu"
# How many GPUs MIG keeps from being handed out whole or shared (MIG enabled, or a mode
# change pending: gpulet_common.migrules); absent when none.
LABEL_MIG_WITHHELD: Final = "gpulet.io/mig.withheld-gpus"

_LABEL_VALUE_MAX = 63
_LABEL_BAD = re.compile(r"[^A-Za-z0-9_.-]+")
_MIB: Final = 2**20


class NodeFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the labels say beyond the inventory: the machine and how gpulet serves it.

    ``machine``: the DMI product name (``/sys/class/dmi/id/product_name``), as GFD
    reads it. ``serves_whole_gpus``: gpulet's device plugin serves ``nvidia.com/gpu``
    (then the GFD sharing labels describe it: one replica, no sharing).
    ``mps_shares``: gpulet serves fractional shares limited through CUDA MPS.
    """

    machine: str = MACHINE_UNKNOWN
    # The device plugin's MIG strategy (allocator.mig_strategy): GFD's MIG labels.
    mig_strategy: str = "none"
    serves_whole_gpus: bool = False
    mps_shares: bool = False
    # Time-slicing replicas of each GPU, the allocator's (GFD's sharing labels).
    replicas: dict[str, int] = {}


def label_value(text: str) -> str:
    """Reduce any text to a valid label value (may be empty)."""
    value = _LABEL_BAD.sub("-", text.strip())
    value = value[:_LABEL_VALUE_MAX]
    return value.strip("-_.")


def model_label(name: str) -> str:
    """NVML name → Koordinator model label: "NVIDIA A100-SXM4-80GB" → "A100-SXM4-80GB"."""
    short = name.strip()
    if short.startswith("NVIDIA "):
        short = short[len("NVIDIA ") :]
    return label_value(short.replace(" ", "-"))


def product_label(name: str) -> str:
    """NVML name → GFD product label: "NVIDIA H100 80GB HBM3" → "NVIDIA-H100-80GB-HBM3"."""
    return label_value(name.strip().replace(" ", "-"))


def _split_version(version: str) -> list[str]:
    return [p for p in re.split(r"[.]", version.strip()) if p]


# --- the intent ----------------------------------------------------------------------


def gpu_family(major: int, minor: int) -> str:
    """GFD's architecture family of a CUDA compute capability (9.0 → ``hopper``)."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    families = {
        1: "tesla",
        2: "fermi",
        3: "kepler",
        5: "maxwell",
        6: "pascal",
        9: "hopper",
        10: "blackwell",
        12: "blackwell",
    }
    return families.get(major, "undefined")


def node_labels(
    inventory: Inventory, *, gfd: bool = True, facts: NodeFacts | None = None, absent: int = 0
) -> dict[str, str]:
    """Koordinator's three labels plus (optionally) GFD-compatible ones.

    GFD's names and values (NVIDIA k8s-device-plugin, ``internal/lm``): product, count,
    memory (MiB), family, compute major/minor, machine, the CUDA versions,
    ``mps.capable``, and the sharing labels of ``nvidia.com/gpu``. ``absent``: GPUs the
    node is expected to have that the inventory does not list (lost, missing at start):
    the device plugin lists them, unhealthy, so kubelet's capacity counts them, and
    ``gpu.count`` does too. What describes one
    model (product, memory, family, compute capability) is left out on a node whose
    GPUs disagree on it, rather than describing only some of them. ``gpu.present`` is
    the GPU Operator's label, which GPU DaemonSets (ours included) select on.
    """
    labels = device_labels(inventory)
    withheld = sum(1 for g in inventory.gpus if parent_block(g) is not None)
    if withheld:
        labels[LABEL_MIG_WITHHELD] = str(withheld)
    if not gfd:
        return labels
    facts = facts or NodeFacts()
    gpus = inventory.gpus
    labels[GFD_COUNT] = str(len(gpus) + absent)
    if gpus:
        labels[GFD_PRESENT] = "true"
    names = {g.name for g in gpus}
    if len(names) == 1:
        product = product_label(gpus[0].name)
        if product:
            labels[GFD_PRODUCT] = product
        memories = {g.memory_total_bytes for g in gpus}
        if len(memories) == 1 and gpus[0].memory_total_bytes > 0:
            labels[GFD_MEMORY] = str(gpus[0].memory_total_bytes // _MIB)
    capabilities = {g.compute_capability for g in gpus}
    if len(capabilities) == 1:
        capability = capabilities.pop()
        if capability is not None and capability[0] > 0:
            major, minor = capability
            labels[GFD_FAMILY] = gpu_family(major, minor)
            labels[GFD_COMPUTE_MAJOR] = str(major)
            labels[GFD_COMPUTE_MINOR] = str(minor)
    # The plain product: MIG's labels name their products after it, never -SHARED.
    plain_product = labels.get(GFD_PRODUCT, "")
    if gpus:
        labels[GFD_MACHINE] = label_value(facts.machine.replace(" ", "-")) or MACHINE_UNKNOWN
        labels[GFD_MPS_CAPABLE] = "true" if facts.mps_shares else "false"
        if facts.serves_whole_gpus:
            labels.update(sharing := sharing_labels(gpus, facts.replicas))
            if sharing[GFD_SHARING_STRATEGY] == TIME_SLICING and GFD_PRODUCT in labels:
                labels[GFD_PRODUCT] = label_value(labels[GFD_PRODUCT] + SHARED_SUFFIX)
    labels.update(mig_labels(gpus, facts.mig_strategy, plain_product, absent=absent))
    if inventory.driver_version:
        full = label_value(inventory.driver_version)
        parts = _split_version(inventory.driver_version)
        labels[GFD_DRIVER_PREFIX + "full"] = full
        for key, part in zip(("major", "minor", "revision"), parts, strict=False):
            labels[GFD_DRIVER_PREFIX + key] = label_value(part)
    if inventory.cuda_driver_version:
        parts = _split_version(inventory.cuda_driver_version)
        labels[GFD_RUNTIME_PREFIX + "full"] = label_value(inventory.cuda_driver_version)
        for key, part in zip(("major", "minor"), parts, strict=False):
            labels[GFD_RUNTIME_PREFIX + key] = label_value(part)
    return {k: v for k, v in labels.items() if v}


def device_labels(inventory: Inventory) -> dict[str, str]:
    """Koordinator's labels; ``gpu-model`` only when every GPU is the same model
    (koordlet leaves it out on a mixed node rather than writing it empty)."""
    labels: dict[str, str] = {}
    if not inventory.gpus:
        return labels
    models = {model_label(g.name) for g in inventory.gpus}
    if len(models) == 1:
        model = models.pop()
        if model:
            labels[LABEL_GPU_MODEL] = model
    labels[LABEL_GPU_VENDOR] = "nvidia"
    if inventory.driver_version:
        driver = label_value(inventory.driver_version)
        if driver:
            labels[LABEL_GPU_DRIVER] = driver
    return labels


MANAGED_LABELS_ANNOTATION: Final = "gpulet.io/managed-labels"


def managed_keys(node: JsonObj) -> set[str]:
    annotations = (node.get("metadata") or {}).get("annotations") or {}
    raw = annotations.get(MANAGED_LABELS_ANNOTATION, "")
    if not isinstance(raw, str):
        return set()
    return {k.strip() for k in raw.split(",") if k.strip()}


def node_label_patch(desired: Mapping[str, str], node: JsonObj) -> JsonObj | None:
    """A JSON merge patch for the Node, or None when nothing needs to change.

    Only our keys are written: the ones we want, and -- set to null, i.e. removed --
    the ones the ``gpulet.io/managed-labels`` annotation says we set before and no
    longer want. A label of any other owner is never in the patch. The patch carries
    the Node's resourceVersion, so a concurrent change makes it fail with 409 instead
    of acting on a stale view.
    """
    meta = node.get("metadata") or {}
    labels: Mapping[str, Any] = meta.get("labels") or {}
    annotations: Mapping[str, Any] = meta.get("annotations") or {}
    patch_labels: dict[str, str | None] = {k: v for k, v in desired.items() if labels.get(k) != v}
    for key in sorted(managed_keys(node) - set(desired)):
        if key in labels:
            patch_labels[key] = None
    managed_value = ",".join(sorted(desired))
    patch_meta: JsonObj = {}
    if patch_labels:
        patch_meta["labels"] = patch_labels
    if annotations.get(MANAGED_LABELS_ANNOTATION, "") != managed_value:
        patch_meta["annotations"] = {MANAGED_LABELS_ANNOTATION: managed_value or None}
        if not managed_value and MANAGED_LABELS_ANNOTATION not in annotations:
            del patch_meta["annotations"]
    if not patch_meta:
        return None
    if meta.get("resourceVersion"):
        patch_meta["resourceVersion"] = meta["resourceVersion"]
    return {"metadata": patch_meta}
