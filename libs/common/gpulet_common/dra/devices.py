"""One GPU of the inventory as a DRA device: name, attributes, capacity.

Names follow NVIDIA's DRA driver (``kubernetes-sigs/dra-driver-nvidia-gpu``), so a
user's CEL selectors carry over with only the domain changed (``gpu.nvidia.com`` →
ours): the device is ``gpu-<minor>`` (the index when NVML gives no minor), and its
attributes are

* strings ``type`` (``gpu``), ``uuid``, ``productName``, ``brand``, ``architecture``;
* versions (semver 2.0) ``cudaComputeCapability`` (``9.0.0``), ``driverVersion``,
  ``cudaDriverVersion``: NVML's ``535.104.05`` becomes ``535.104.5`` (semver forbids
  leading zeros), ``12.4`` becomes ``12.4.0``; a version that cannot be made semver is
  left out rather than published wrong;
* the standard ``resource.kubernetes.io/pciBusID`` (``0000:3b:00.0``) and
  ``resource.kubernetes.io/pcieRoot`` (``pci0000:3a``, from a resolver the caller
  passes: sysfs on a node; omitted when unknown);
* gpulet's own ``index``, ``minor``, ``numaNode`` and ``nvlinkIsland``: GPUs joined by
  active NVLinks (directly or through NVSwitch) form one island, named by the smallest
  GPU index in it, so ``matchAttribute: gpu.gpulet.io/nvlinkIsland`` keeps a multi-GPU
  claim on one island and ``numaNode`` on one socket's memory. An island joins GPUs
  that share any single link; ``nvlinkFullIsland`` joins them over full-bandwidth links
  only (as many NVLinks as the best-linked pair of the node, :func:`nvlink_facts`), so
  ``matchAttribute: gpu.gpulet.io/nvlinkFullIsland`` asks for "fully NVLinked";
  ``nvlinkFullLinks`` is the links to each peer of that island (0: none) and
  ``nvlinkLinks`` all of the GPU's active NVLinks, for CEL (``>= 4``).

The inventory carries no brand, so ``brand`` is ``Nvidia`` (NVML's name of the brand
of data-centre parts since Hopper); ``architecture`` comes from the compute
capability.

Capacity ``memory`` is the GPU's memory in bytes. With sharing on, the device also
allows multiple allocations and offers ``cores`` (100, in percent) beside ``memory``,
each with a request policy: a claim that names no amount takes all of it (default),
one that does gets a share within ``validRange`` in ``step`` units; the scheduler
decides both halves of a share together.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from gpulet_common.dra import limits
from gpulet_common.messages import GpuInfo, Inventory
from gpulet_common.pci import sysfs_bus_id
from gpulet_common.quantity import binary

JsonObj = dict[str, Any]

STANDARD_DOMAIN: Final = "resource.kubernetes.io"
PCI_BUS_ID: Final = f"{STANDARD_DOMAIN}/pciBusID"
PCIE_ROOT: Final = f"{STANDARD_DOMAIN}/pcieRoot"
CORES: Final = "cores"
MEMORY: Final = "memory"
CORES_TOTAL: Final = 100
DEFAULT_BRAND: Final = "Nvidia"

# Compute capability (major, minor) → NVML's architecture name; a major alone where
# every minor of it is one architecture.
_ARCH_EXACT: Final = {(7, 0): "Volta", (7, 2): "Volta", (7, 5): "Turing", (8, 9): "Ada Lovelace"}
_ARCH_MAJOR: Final = {
    3: "Kepler",
    5: "Maxwell",
    6: "Pascal",
    7: "Volta",
    8: "Ampere",
    9: "Hopper",
    10: "Blackwell",
    12: "Blackwell",
}


def device_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.minor if gpu.minor is not None else gpu.index}"


def architecture(cc: tuple[int, int] | None) -> str:
    if cc is None:
        return ""
    return _ARCH_EXACT.get(cc) or _ARCH_MAJOR.get(cc[0], "")


_NUMERIC = re.compile(r"^\d+(\.\d+){0,2}$")


def semver(version: str | None) -> str | None:
    """``535.104.05`` → ``535.104.5``, ``12.4`` → ``12.4.0``; None if it is no version."""
    if not version:
        return None
    text = version.strip()
    if not _NUMERIC.fullmatch(text):
        return None
    parts = [str(int(p)) for p in text.split(".")]
    parts += ["0"] * (3 - len(parts))
    result = ".".join(parts)
    return result if limits.is_semver(result) else None


def pci_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` as the standard attribute wants it: ``0000:3b:00.0``
    (:mod:`gpulet_common.pci`); "" for what is not a bus id (the attribute is left out)."""
    return sysfs_bus_id(bus_id) or ""


def nvlink_islands(gpus: Iterable[GpuInfo]) -> dict[str, int]:
    """GPU uuid → island id (the smallest index among the GPUs its active NVLinks reach).

    A link counts when either end reports it active (a peer's report may lag), and only
    between GPUs of this inventory.
    """
    listed = list(gpus)
    by_uuid = {g.uuid: g for g in listed}
    parent = {g.uuid: g.uuid for g in listed}

    def find(uuid: str) -> str:
        while parent[uuid] != uuid:
            parent[uuid] = parent[parent[uuid]]
            uuid = parent[uuid]
        return uuid

    for gpu in listed:
        for link in gpu.topology:
            if link.nvlinks > 0 and link.peer_uuid in by_uuid:
                a, b = find(gpu.uuid), find(link.peer_uuid)
                if a != b:
                    parent[a] = b
    members: dict[str, list[int]] = {}
    for gpu in listed:
        members.setdefault(find(gpu.uuid), []).append(gpu.index)
    return {g.uuid: min(members[find(g.uuid)]) for g in listed}


@dataclass(frozen=True)
class NvLink:
    """A GPU's NVLink facts beside its island: the island over full-bandwidth links
    only, the links to each peer in it, and all of its active links."""

    full_island: int
    full_links: int
    links: int


def _pair_links(listed: list[GpuInfo]) -> dict[tuple[str, str], int]:
    """Active links between two GPUs of the inventory, either end's report (the larger:
    a peer's report may lag)."""
    known = {g.uuid for g in listed}
    pairs: dict[tuple[str, str], int] = {}
    for gpu in listed:
        for link in gpu.topology:
            if link.nvlinks > 0 and link.peer_uuid in known and link.peer_uuid != gpu.uuid:
                key = (min(gpu.uuid, link.peer_uuid), max(gpu.uuid, link.peer_uuid))
                pairs[key] = max(pairs.get(key, 0), link.nvlinks)
    return pairs


def nvlink_facts(gpus: Iterable[GpuInfo]) -> dict[str, NvLink]:
    """GPU uuid → :class:`NvLink`. A link between two GPUs is full-bandwidth when it has
    as many NVLinks as the best-linked pair of the node (NVSwitch systems: every pair;
    the pairs of ``nvlink-pairs-8gpu``: 4 links, not the quads' single one); the full
    island joins GPUs over such links only, named by its smallest GPU index, and a GPU
    with none is an island of its own (``full_links`` 0)."""
    listed = list(gpus)
    pairs = _pair_links(listed)
    best = max(pairs.values(), default=0)
    parent = {g.uuid: g.uuid for g in listed}

    def find(uuid: str) -> str:
        while parent[uuid] != uuid:
            parent[uuid] = parent[parent[uuid]]
            uuid = parent[uuid]
        return uuid

    full_links: dict[str, int] = {}
    total: dict[str, int] = {}
    for (a, b), n in pairs.items():
        total[a] = total.get(a, 0) + n
        total[b] = total.get(b, 0) + n
        if best and n == best:
            full_links[a] = full_links[b] = best
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[ra] = rb
    members: dict[str, list[int]] = {}
    for gpu in listed:
        members.setdefault(find(gpu.uuid), []).append(gpu.index)
    return {
        g.uuid: NvLink(min(members[find(g.uuid)]), full_links.get(g.uuid, 0), total.get(g.uuid, 0))
        for g in listed
    }


def string_attribute(value: str) -> JsonObj | None:
    """A string attribute; None (left out) when empty or longer than the API allows."""
    return {"string": value} if value and len(value) <= limits.MAX_STRING_VALUE else None


def attributes(
    gpu: GpuInfo,
    inventory: Inventory,
    *,
    island: int,
    pcie_root: Callable[[str], str] | None = None,
    nvlink: NvLink | None = None,
) -> JsonObj:
    cc = gpu.compute_capability
    found: dict[str, JsonObj | None] = {
        "type": {"string": "gpu"},
        "uuid": string_attribute(gpu.uuid),
        "productName": string_attribute(gpu.name),
        "brand": {"string": DEFAULT_BRAND},
        "architecture": string_attribute(architecture(cc)),
        "cudaComputeCapability": (
            {"version": v} if cc and (v := semver(f"{cc[0]}.{cc[1]}")) else None
        ),
        "driverVersion": ({"version": v} if (v := semver(inventory.driver_version)) else None),
        "cudaDriverVersion": (
            {"version": v} if (v := semver(inventory.cuda_driver_version)) else None
        ),
        "index": {"int": gpu.index},
        "minor": {"int": gpu.minor} if gpu.minor is not None else None,
        "numaNode": {"int": gpu.numa_node} if gpu.numa_node is not None else None,
        "nvlinkIsland": {"int": island},
        "nvlinkFullIsland": {"int": nvlink.full_island} if nvlink is not None else None,
        "nvlinkFullLinks": {"int": nvlink.full_links} if nvlink is not None else None,
        "nvlinkLinks": {"int": nvlink.links} if nvlink is not None else None,
    }
    bus = pci_bus_id(gpu.pci_bus_id)
    if bus:
        found[PCI_BUS_ID] = {"string": bus}
        root = pcie_root(gpu.pci_bus_id) if pcie_root is not None else ""
        found[PCIE_ROOT] = string_attribute(root)
    return {k: v for k, v in found.items() if v is not None}


def _policy(total: int, step: int) -> JsonObj:
    """A request of nothing names all of it (``default``); the range starts at 0 so
    that an ``adminAccess`` request may ask for 0 of each: the 1.37 allocator charges
    an admin request like any other against what is left of a device that allows
    multiple allocations (its admin results are then not counted), so only a request
    of 0 fits beside a claim that holds the whole GPU. Prepare refuses 0 to any
    request without admin access."""
    return {
        "default": binary(total),
        "validRange": {"min": "0", "max": binary(total), "step": binary(step)},
    }


def capacity(gpu: GpuInfo, *, sharing: bool, memory_step: int) -> JsonObj:
    memory = gpu.memory_total_bytes
    if not sharing:
        return {MEMORY: {"value": binary(memory)}}
    step = min(memory_step, memory) if memory > 0 else memory_step
    # A range whose maximum is not a whole number of steps is refused: round it down.
    top = memory - memory % step if memory >= step else memory
    return {
        CORES: {"value": binary(CORES_TOTAL), "requestPolicy": _policy(CORES_TOTAL, 1)},
        MEMORY: {"value": binary(memory), "requestPolicy": _policy(top, step)},
    }


def device_body(
    name: str,
    attributes: JsonObj,
    capacity: JsonObj,
    taints: list[JsonObj] | None,
    *,
    shared: bool = False,
) -> JsonObj:
    """A ``Device``'s JSON body (a GPU's or a MIG device's); ``shared``: it may be
    allocated to several claims (consumable capacity)."""
    body: JsonObj = {"name": name, "attributes": attributes, "capacity": capacity}
    if shared:
        body["allowMultipleAllocations"] = True
    if taints:
        body["taints"] = taints
    return body


def by_name(devices: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {str(d.get("name")): d for d in devices}
