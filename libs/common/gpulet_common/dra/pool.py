"""The node's pool of GPUs as ResourceSlice bodies: pure, from the node read model.

Input: the inventory and every GPU's health (what
:class:`~gpulet_common.nodeview.NodeView` holds), the GPUs the device plugin holds
(mode ``both``), the settings, and the ``timeAdded`` of taints already published.
Output: a :class:`Pool`: its devices, and the slices that carry them.

* One pool per node, named after the node, under ``nodeName``; devices sorted by GPU
  index (a GPU's MIG devices after it, :mod:`.mig`; a MIG-enabled GPU, or one with a
  pending MIG mode change, is not a device itself: only its MIG devices are) and
  split into slices of at most 128 (64 when any device carries taints or counters);
  every slice says ``resourceSliceCount``. No GPU: no slice.
* Slice names are fixed (``<node>-<driver>-<n>``, shortened with a hash when the node
  name is long), so the writer compares and replaces by name, and a slice someone
  deleted comes back under its own name.
* ``pool.generation`` is the caller's: :func:`next_generation` raises it only when the
  devices changed, so a re-render of the same facts is the same body (zero writes at
  rest), and every change is a higher generation (the scheduler then ignores any
  older slice of the pool it may still see).
* A Node owner reference, when the Node's uid is known, lets the garbage collector
  remove the slices with the Node.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gpulet_common.dra import devices as dev
from gpulet_common.dra import limits, mig, taints
from gpulet_common.messages import GpuHealth, GpuInfo, Inventory
from gpulet_common.migrules import parent_block
from gpulet_common.settings.dra import DraSettings

JsonObj = dict[str, Any]

API_VERSION: Final = "resource.k8s.io/v1"
KIND: Final = "ResourceSlice"
# The label on each slice that names the node (for humans and label selectors; the
# writer lists by field selector spec.nodeName and spec.driver).
NODE_LABEL: Final = "gpu.gpulet.io/node"


class PoolError(ValueError):
    """A rendered device breaks an API rule (the message names every problem)."""


@dataclass(frozen=True)
class Pool:
    node: str
    driver: str
    devices: list[JsonObj]
    generation: int
    slices: list[JsonObj] = field(default_factory=list)


def slice_name(node: str, driver: str, n: int) -> str:
    base = f"{node}-{driver.replace('.', '-')}"
    suffix = f"-{n}"
    room = limits.MAX_DNS_SUBDOMAIN - len(suffix)
    if len(base) > room:
        digest = hashlib.sha256(base.encode()).hexdigest()[:10]
        base = f"{base[: room - 11].rstrip('-.')}-{digest}"
    return base + suffix


def render_devices(
    inventory: Inventory,
    healths: Mapping[str, GpuHealth],
    settings: DraSettings,
    *,
    held: Collection[str] = (),
    sliced: Mapping[str, int] | None = None,
    known: Mapping[str, Mapping[taints.TaintKey, str]] | None = None,
    now: float = 0.0,
    pcie_root: Callable[[str], str] | None = None,
) -> list[JsonObj]:
    """Every GPU that may go whole, and every MIG device, as a device, in index order;
    raises PoolError when one would break an API rule (a bug or a hostile inventory:
    never published).

    A GPU the health service names as not present (lost, removed, missing at start:
    ``GpuHealth.present`` false, with the identity it remembers) that the inventory no
    longer lists stays in the pool, tainted ``unhealthy=gpu-lost``: as in the Device
    and the device plugin's list, a scheduler must see a broken GPU, not one fewer."""
    islands = dev.nvlink_islands(inventory.gpus)
    nvlinks = dev.nvlink_facts(inventory.gpus)
    known = known or {}
    out: list[JsonObj] = []
    seen: set[str] = set()

    def wanted_taints(gpu: GpuInfo, name: str, uuid: str, mig: str = "") -> list[JsonObj]:
        wanted = taints.health_taints(
            healths.get(gpu.uuid),
            driver=settings.driver,
            unhealthy_effect=settings.unhealthy_effect,
            held_by_device_plugin=settings.mode == "both" and uuid in held,
            time_sliced=(sliced or {}).get(uuid, 0),
            mig_device=mig,
        )
        return taints.render(wanted, known.get(name, {}), now)

    def add(name: str, body: JsonObj) -> None:
        problems = limits.device_problems(body)
        if name in seen:
            problems.append(f"device name {name} is not unique in the pool")
        if problems:
            raise PoolError(f"{name}: " + "; ".join(problems))
        seen.add(name)
        out.append(body)

    listed = {g.uuid for g in inventory.gpus}
    taken = {dev.device_name(g) for g in inventory.gpus}
    # (Not one whose name, its index, another GPU of the inventory holds now.)
    gone = [
        h.info
        for h in healths.values()
        if not h.present
        and h.info is not None
        and h.info.uuid not in listed
        and dev.device_name(h.info) not in taken
    ]
    for gpu in sorted([*inventory.gpus, *gone], key=lambda g: (g.index, g.uuid)):
        island = islands.get(gpu.uuid, gpu.index)
        if gpu.uuid not in listed:
            name = dev.device_name(gpu)
            body = dev.device_body(
                name,
                dev.attributes(gpu, inventory, island=island, pcie_root=pcie_root),
                dev.capacity(gpu, sharing=settings.sharing, memory_step=settings.memory_step_bytes),
                wanted_taints(gpu, name, gpu.uuid),
                shared=settings.sharing,
            )
            add(name, body)
            continue
        if parent_block(gpu) is None:
            name = dev.device_name(gpu)
            body = dev.device_body(
                name,
                dev.attributes(
                    gpu, inventory, island=island, pcie_root=pcie_root, nvlink=nvlinks[gpu.uuid]
                ),
                dev.capacity(gpu, sharing=settings.sharing, memory_step=settings.memory_step_bytes),
                wanted_taints(gpu, name, gpu.uuid),
                shared=settings.sharing,
            )
            add(name, body)
        for m in mig.offered_migs(gpu):
            name = mig.device_name(gpu, m)
            body = dev.device_body(
                name,
                mig.attributes(
                    gpu, m, inventory, island=island, pcie_root=pcie_root, nvlink=nvlinks[gpu.uuid]
                ),
                mig.capacity(m),  # a MIG device is given whole
                wanted_taints(gpu, name, m.uuid, m.uuid),
            )
            add(name, body)
    return out


def next_generation(previous: Pool | None, devices: list[JsonObj], floor: int = 0) -> int:
    """The generation for ``devices``: the previous one when nothing changed, else
    one more than both the previous and ``floor`` (the highest seen in the API)."""
    if previous is not None and previous.devices == devices and previous.generation >= floor:
        return previous.generation
    return max(previous.generation if previous else 0, floor) + 1


def slices(
    node: str,
    driver: str,
    devices: list[JsonObj],
    generation: int,
    *,
    node_uid: str | None = None,
) -> list[JsonObj]:
    if not devices:
        return []
    if not limits.is_driver_name(driver):
        raise PoolError(f"driver name {driver!r} is not a DNS subdomain of at most 63")
    if not limits.is_pool_name(node):
        raise PoolError(f"node name {node!r} cannot name a pool")
    size = limits.slice_limit(devices)
    chunks = [devices[i : i + size] for i in range(0, len(devices), size)]
    out: list[JsonObj] = []
    for n, chunk in enumerate(chunks):
        meta: JsonObj = {
            "name": slice_name(node, driver, n),
            "labels": {NODE_LABEL: limits.label_value(node) or "node"},
        }
        if node_uid:
            meta["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}
            ]
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "metadata": meta,
                "spec": {
                    "driver": driver,
                    "nodeName": node,
                    "pool": {
                        "name": node,
                        "generation": generation,
                        "resourceSliceCount": len(chunks),
                    },
                    "devices": chunk,
                },
            }
        )
    return out


def build(
    inventory: Inventory,
    healths: Mapping[str, GpuHealth],
    settings: DraSettings,
    *,
    previous: Pool | None = None,
    generation_floor: int = 0,
    held: Collection[str] = (),
    sliced: Mapping[str, int] | None = None,
    known: Mapping[str, Mapping[taints.TaintKey, str]] | None = None,
    now: float = 0.0,
    node_uid: str | None = None,
    pcie_root: Callable[[str], str] | None = None,
) -> Pool:
    """The whole pool: devices, generation, slices."""
    devices = render_devices(
        inventory,
        healths,
        settings,
        held=held,
        sliced=sliced,
        known=known,
        now=now,
        pcie_root=pcie_root,
    )
    generation = next_generation(previous, devices, generation_floor)
    return Pool(
        node=inventory.node,
        driver=settings.driver,
        devices=devices,
        generation=generation,
        slices=slices(inventory.node, settings.driver, devices, generation, node_uid=node_uid),
    )
