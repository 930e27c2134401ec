"""What the node's Device should look like: pure functions, no I/O.

The node's labels are :mod:`gpulet_reporter.labels`.

Two steps
---------
1. :func:`build_desired` turns the inventory and the per-GPU health view into a
   :class:`DesiredState`: the *intent*, free of timestamps and of anything the API
   server owns. Two intents compare equal exactly when nothing needs writing, which
   is what lets the service drop the 1 Hz stream of unchanged inputs before they ever
   reach the debouncer.
2. :func:`render_device` turns an intent into a Device object, given the object the
   API server holds now (``observed``). Only here do timestamps appear, and they are
   taken from the observed object whenever the condition's status did not change:
   koordlet stamps ``lastTransitionTime`` afresh on every 3 s rebuild and so rewrites
   an unhealthy node's Device forever; we keep it, so an unchanged state renders to a
   byte-identical object and :func:`device_differs` says there is nothing to do.

Ownership
---------
The Device is shared: koordlet reports RDMA NICs (``type: rdma`` with ``vfGroups``) and
other device types into the same object. The reporter owns only the ``type: gpu``
entries of ``spec.devices``, and in them only the fields it writes (``type``, ``id``,
``minor``, ``moduleID``, ``health``, ``topology``, its three ``resources`` keys and the
``Healthy`` condition). Other entries and other fields are carried over as observed;
the writer makes this safe against concurrent writers with a resourceVersion-checked
PUT (see :mod:`gpulet_reporter.writer`).

Health we do not know yet (no health service answered, or it restarted) is carried
over from the observed object rather than assumed healthy, so a reporter restart on a
node with a failed GPU neither flaps the GPU to healthy nor writes at all.

Choices the Koordinator types leave open, documented once here:

* ``gpu-memory`` is the card's total memory as the largest exact binary unit:
  ``80Gi`` when it divides, else ``81559Mi``, else ``Ki``, else plain bytes.
* ``topology.nodeID`` is the NUMA node, ``None``/-1 mapped to 0 (koordlet does the same);
  ``socketID`` is -1 (koordlet leaves it unknown too).
* ``topology.pcieID`` is the PCI root complex the GPU hangs off (``pci0000:3a``), the
  first component of the resolved sysfs path, as koordlet does; the lookup is done by
  the caller (:mod:`gpulet_reporter.pcie`) and passed in. Without sysfs it falls back to
  the GPU's own bus (``pci0000:3b``): distinct per GPU, so a scheduler never believes two
  GPUs share a root complex when we could not check.
* ``minor`` falls back to the NVML index when NVML has no minor number (mock GPUs).
* A GPU with MIG enabled, or a pending MIG mode change (:mod:`gpulet_common.migrules`),
  is written ``health: false`` with the ``Healthy`` condition's reason ``MIGEnabled``
  / ``MIGPending`` (a health fault, when there is one, keeps its own reason): Koordinator
  has no MIG model, and koord-scheduler places neither whole-GPU nor shared requests on
  an unhealthy device. The entry's ``labels`` describe it: ``gpulet.io/mig-mode``,
  ``gpulet.io/mig-devices`` (``<profile>@<gi>/<ci>``, comma-separated, by gi/ci) and
  ``gpulet.io/mig-unhealthy`` (those a fault that named their gi/ci marks).
* ``moduleID`` is NVML's module id (``nvmlDeviceGetModuleId``; a real H100 SXM says 4),
  left out where NVML does not support it or gives a value outside int32.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

import msgspec

from gpulet_common.messages import GpuInfo, Inventory
from gpulet_common.migrules import MIG_PENDING, parent_block
from gpulet_common.pci import sysfs_bus_id
from gpulet_common.quantity import binary
from gpulet_reporter.labels import KOORD_LABELS, NodeFacts, device_labels, node_labels

JsonObj = dict[str, Any]

GROUP: Final = "scheduling.koordinator.sh"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "Device"
PLURAL: Final = "devices"

DEVICE_TYPE_GPU: Final = "gpu"

RES_CORE: Final = "koordinator.sh/gpu-core"
RES_MEMORY: Final = "koordinator.sh/gpu-memory"
RES_MEMORY_RATIO: Final = "koordinator.sh/gpu-memory-ratio"

CONDITION_HEALTHY: Final = "Healthy"
ENTRY_LABEL_MIG_MODE: Final = "gpulet.io/mig-mode"
ENTRY_LABEL_MIG_DEVICES: Final = "gpulet.io/mig-devices"
ENTRY_LABEL_MIG_UNHEALTHY: Final = "gpulet.io/mig-unhealthy"
# The GPU's last reset by remediation that passed its verify: "<time> <cause>".
ENTRY_LABEL_LAST_RESET: Final = "gpulet.io/last-reset"
_ENTRY_LABELS: Final = (
    ENTRY_LABEL_MIG_MODE,
    ENTRY_LABEL_MIG_DEVICES,
    ENTRY_LABEL_MIG_UNHEALTHY,
    ENTRY_LABEL_LAST_RESET,
)
LAST_RESET_MAX: Final = 256
REASON_HEALTHY: Final = "Healthy"
REASON_UNHEALTHY: Final = "Unhealthy"

# The CRD's metav1.Condition rules (reason pattern and lengths).
_REASON_OK = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")
_REASON_MAX = 1024
_MESSAGE_MAX = 32768


class GpuCondition(msgspec.Struct, frozen=True, kw_only=True):
    """What we know about one GPU's health.

    ``since`` is when the status last changed as far as the source knows (epoch s).
    ``from_event``: reason/message come from a health event and are written as they
    are; a state snapshot's text (``False``) does not override the observed object's
    text when the status agrees, so a restart does not reword a condition.
    """

    healthy: bool
    reason: str
    message: str = ""
    since: float = 0.0
    from_event: bool = True
    # MIG devices (UUIDs) unhealthy on their own (a fault that named their gi/ci).
    unhealthy_mig: tuple[str, ...] = ()


class DesiredGpu(msgspec.Struct, frozen=True, kw_only=True):
    uuid: str
    minor: int
    memory: str
    numa_node: int
    pcie_id: str
    bus_id: str
    # NVML's module id (nvmlDeviceGetModuleId); None where the GPU or driver lacks it.
    module_id: int | None = None
    # None: no health source has spoken about this GPU yet.
    condition: GpuCondition | None = None
    # The entry's labels we own (MIG: mode and devices); empty: none.
    labels: dict[str, str] = {}


class DesiredState(msgspec.Struct, frozen=True, kw_only=True):
    """The intent for one node; equal intents need no write."""

    node: str
    gpus: tuple[DesiredGpu, ...] = ()
    # Labels on the Device (the three Koordinator keys).
    device_labels: dict[str, str] = {}
    # Labels on the Node; only these keys are ever written by us.
    node_labels: dict[str, str] = {}


# --- small conversions ---------------------------------------------------------------


def memory_quantity(total_bytes: int) -> str:
    """Bytes as an exact Kubernetes binary quantity: 80Gi, 81559Mi, 1536Ki or 1000."""
    return binary(max(total_bytes, 0))


def condition_reason(text: str, *, healthy: bool, xid: int | None = None) -> str:
    """A reason the CRD accepts (``^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$``).

    A valid reason is kept as it is. Otherwise words are joined in CamelCase
    ("gpu fell off" → "GpuFellOff"); with nothing usable left, ``Xid<n>`` or a generic
    Healthy/Unhealthy stands in.
    """
    text = text.strip()
    if _REASON_OK.fullmatch(text) and len(text) <= _REASON_MAX:
        return text
    words = re.findall(r"[A-Za-z0-9]+", text)
    camel = "".join(w[:1].upper() + w[1:] for w in words)
    camel = camel.lstrip("0123456789")[:_REASON_MAX]
    if camel and _REASON_OK.fullmatch(camel):
        return camel
    if xid is not None:
        return f"Xid{xid}"
    return REASON_HEALTHY if healthy else REASON_UNHEALTHY


def condition_message(text: str) -> str:
    return text[:_MESSAGE_MAX]


# The last second metav1.Time (RFC 3339, four-digit year) can write.
_MAX_EPOCH_S = 253402300799.0


def rfc3339(epoch_s: float) -> str:
    """Seconds precision, as metav1.Time serialises; total: a time out of range
    (``1e18``, NaN, infinity) is clamped to 1970-01-01 / 9999-12-31 instead of raising,
    so one odd timestamp cannot freeze the reporter's output."""
    seconds = min(max(epoch_s, 0.0), _MAX_EPOCH_S) if epoch_s == epoch_s else 0.0
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def bus_id_short(bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` as sysfs and koordlet write it: ``0000:3b:00.0``
    (:mod:`gpulet_common.pci`; what is not a bus id is kept, in lower case)."""
    return sysfs_bus_id(bus_id) or bus_id.strip().lower()


def fallback_pcie_root(bus_id: str) -> str:
    """``pci<domain>:<bus>`` of the GPU itself: used when sysfs cannot be read."""
    short = bus_id_short(bus_id)
    parts = short.split(":")
    if len(parts) == 3:
        return f"pci{parts[0]}:{parts[1]}"
    return ""


def build_desired(
    inventory: Inventory,
    health: Mapping[str, GpuCondition],
    *,
    gfd_labels: bool = True,
    pcie_root: Callable[[str], str] = fallback_pcie_root,
    absent: Sequence[GpuInfo] = (),
    facts: NodeFacts | None = None,
    last_resets: Mapping[str, str] | None = None,
) -> DesiredState:
    """The intent for the inventory's node given what we know about each GPU's health.

    ``absent``: GPUs the node is expected to have that are not in the inventory (lost,
    missing since the agent started; the health service remembers them). They stay
    in the Device, unhealthy: a scheduler must see that a GPU is broken, not that the
    node has one GPU fewer.
    """
    listed = {g.uuid for g in inventory.gpus}
    gone = [g for g in absent if g.uuid not in listed]
    gpus: list[DesiredGpu] = []
    for gpu in [*inventory.gpus, *gone]:
        bus = bus_id_short(gpu.pci_bus_id) if gpu.pci_bus_id else ""
        numa = gpu.numa_node if gpu.numa_node is not None and gpu.numa_node >= 0 else 0
        gpus.append(
            DesiredGpu(
                uuid=gpu.uuid,
                minor=gpu.minor if gpu.minor is not None else gpu.index,
                memory=memory_quantity(gpu.memory_total_bytes),
                numa_node=numa,
                pcie_id=(pcie_root(gpu.pci_bus_id) or fallback_pcie_root(gpu.pci_bus_id))
                if gpu.pci_bus_id
                else "",
                bus_id=bus,
                module_id=gpu.module_id
                if gpu.module_id is not None and 0 <= gpu.module_id < 2**31
                else None,
                condition=_mig_condition(
                    gpu, health.get(gpu.uuid) if gpu.uuid in listed else _absent(health, gpu)
                ),
                labels=_mig_labels(gpu, health.get(gpu.uuid))
                | _last_reset((last_resets or {}).get(gpu.uuid, "")),
            )
        )
    gpus.sort(key=lambda g: (g.minor, g.uuid))
    return DesiredState(
        node=inventory.node,
        gpus=tuple(gpus),
        device_labels=device_labels(inventory),
        node_labels=node_labels(inventory, gfd=gfd_labels, facts=facts, absent=len(gone)),
    )


def _mig_condition(gpu: GpuInfo, known: GpuCondition | None) -> GpuCondition | None:
    """A MIG-enabled (or pending) GPU is unschedulable for koord-scheduler; a health
    fault keeps its own reason."""
    block = parent_block(gpu)
    if block is None or (known is not None and not known.healthy):
        return known
    reason = "MIGPending" if block[0] == MIG_PENDING else "MIGEnabled"
    return GpuCondition(healthy=False, reason=reason, message=block[1])


def _last_reset(text: str) -> dict[str, str]:
    return {ENTRY_LABEL_LAST_RESET: text[:LAST_RESET_MAX]} if text else {}


def _mig_labels(gpu: GpuInfo, known: GpuCondition | None) -> dict[str, str]:
    if gpu.mig_mode is None:
        return {}
    labels: dict[str, str] = {ENTRY_LABEL_MIG_MODE: gpu.mig_mode}
    if gpu.mig_mode_pending is not None and gpu.mig_mode_pending != gpu.mig_mode:
        labels[ENTRY_LABEL_MIG_MODE] += f"-pending-{gpu.mig_mode_pending}"
    devices = sorted(gpu.mig_devices, key=lambda d: (d.gpu_instance_id, d.compute_instance_id))
    if devices:
        labels[ENTRY_LABEL_MIG_DEVICES] = ",".join(
            f"{d.profile}@{d.gpu_instance_id}/{d.compute_instance_id}" for d in devices
        )
    bad = set(known.unhealthy_mig) if known is not None else set()
    if sick := [d for d in devices if d.uuid in bad]:
        labels[ENTRY_LABEL_MIG_UNHEALTHY] = ",".join(
            f"{d.profile}@{d.gpu_instance_id}/{d.compute_instance_id}" for d in sick
        )
    return labels


def _absent(health: Mapping[str, GpuCondition], gpu: GpuInfo) -> GpuCondition:
    known = health.get(gpu.uuid)
    if known is not None and not known.healthy:
        return known
    return GpuCondition(
        healthy=False,
        reason="GpuNotPresent",
        message=f"GPU {gpu.index} is not in the node's GPU inventory (lost or missing)",
    )


# --- rendering against the observed object -------------------------------------------


def _observed_list(observed: JsonObj | None) -> list[Any]:
    if not observed:
        return []
    spec = observed.get("spec")
    devices = spec.get("devices") if isinstance(spec, dict) else None
    return devices if isinstance(devices, list) else []


def is_ours(entry: Any) -> bool:
    """Whether a ``spec.devices`` entry is one the reporter owns: ``type: gpu``."""
    return isinstance(entry, dict) and entry.get("type") == DEVICE_TYPE_GPU


def _observed_devices(observed: JsonObj | None) -> dict[str, JsonObj]:
    """The observed GPU entries by id; entries of other types are not ours to read."""
    found: dict[str, JsonObj] = {}
    for entry in _observed_list(observed):
        if is_ours(entry) and isinstance(entry.get("id"), str):
            found.setdefault(entry["id"], entry)
    return found


def _healthy_condition(entry: JsonObj | None) -> JsonObj | None:
    if entry is None:
        return None
    for cond in entry.get("conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == CONDITION_HEALTHY:
            return cond
    return None


def _status(healthy: bool) -> str:
    return "True" if healthy else "False"


def _render_condition(gpu: DesiredGpu, seen: JsonObj | None, now: float) -> tuple[bool, JsonObj]:
    """The device's health flag and its Healthy condition."""
    seen_cond = _healthy_condition(seen)
    cond = gpu.condition
    if cond is None:
        if seen is not None and isinstance(seen.get("health"), bool):
            healthy = bool(seen["health"])
            if seen_cond is not None and seen_cond.get("status") == _status(healthy):
                return healthy, _clean_condition(seen_cond, healthy, now)
            return healthy, _condition(healthy, _default_reason(healthy), "", now)
        return True, _condition(True, REASON_HEALTHY, "", now)
    status = _status(cond.healthy)
    if seen_cond is not None and seen_cond.get("status") == status:
        if cond.from_event:
            out = _condition(cond.healthy, cond.reason, cond.message, cond.since)
            out["lastTransitionTime"] = _valid_time(seen_cond.get("lastTransitionTime"), now)
            return cond.healthy, out
        return cond.healthy, _clean_condition(seen_cond, cond.healthy, now)
    return cond.healthy, _condition(cond.healthy, cond.reason, cond.message, cond.since or now)


def _default_reason(healthy: bool) -> str:
    return REASON_HEALTHY if healthy else REASON_UNHEALTHY


def _condition(healthy: bool, reason: str, message: str, since: float) -> JsonObj:
    return {
        "type": CONDITION_HEALTHY,
        "status": _status(healthy),
        "reason": condition_reason(reason, healthy=healthy),
        "message": condition_message(message),
        "lastTransitionTime": rfc3339(since),
    }


def _valid_time(value: Any, now: float) -> str:
    if isinstance(value, str) and value:
        return value
    return rfc3339(now)


def _clean_condition(seen: JsonObj, healthy: bool, now: float) -> JsonObj:
    """The observed condition, repaired where another writer left it invalid."""
    reason = seen.get("reason")
    message = seen.get("message")
    return {
        "type": CONDITION_HEALTHY,
        "status": _status(healthy),
        "reason": condition_reason(reason if isinstance(reason, str) else "", healthy=healthy),
        "message": condition_message(message if isinstance(message, str) else ""),
        "lastTransitionTime": _valid_time(seen.get("lastTransitionTime"), now),
    }


def _render_gpu(gpu: DesiredGpu, seen: JsonObj | None, now: float) -> JsonObj:
    """One GPU entry: the observed entry with the fields we own replaced.

    Owned: ``type``, ``id``, ``minor``, ``moduleID``, ``health``, ``topology``, our three
    keys of ``resources`` and the ``Healthy`` condition. Everything else an entry
    carries (``labels``, other resource keys, other condition types, fields a newer
    Koordinator adds) is kept as it was. ``moduleID`` and ``topology`` are facts about
    the GPU we read ourselves: when we cannot read them they are removed, not kept stale.
    """
    healthy, condition = _render_condition(gpu, seen, now)
    entry: JsonObj = _deep_copy_json(seen) if seen is not None else {}
    entry["type"] = DEVICE_TYPE_GPU
    entry["id"] = gpu.uuid
    entry["minor"] = gpu.minor
    if gpu.module_id is not None:
        entry["moduleID"] = gpu.module_id
    else:
        entry.pop("moduleID", None)
    entry["health"] = healthy
    resources = entry.get("resources")
    resources = dict(resources) if isinstance(resources, dict) else {}
    resources.update({RES_CORE: "100", RES_MEMORY: gpu.memory, RES_MEMORY_RATIO: "100"})
    entry["resources"] = resources
    seen_conditions = entry.get("conditions")
    others = [
        c
        for c in (seen_conditions if isinstance(seen_conditions, list) else [])
        if not (isinstance(c, dict) and c.get("type") == CONDITION_HEALTHY)
    ]
    entry["conditions"] = [condition, *others]
    seen_labels = entry.get("labels")
    labels = {
        k: v
        for k, v in (seen_labels if isinstance(seen_labels, dict) else {}).items()
        if k not in _ENTRY_LABELS
    }
    labels.update(gpu.labels)
    if labels:
        entry["labels"] = labels
    else:
        entry.pop("labels", None)
    if gpu.pcie_id or gpu.bus_id:
        entry["topology"] = {
            "socketID": -1,
            "nodeID": gpu.numa_node,
            "pcieID": gpu.pcie_id,
            "busID": gpu.bus_id,
        }
    else:
        entry.pop("topology", None)
    return entry


def render_devices(desired: DesiredState, observed: JsonObj | None, now: float) -> list[JsonObj]:
    """``spec.devices`` for the intent, merged into what ``observed`` holds.

    We own the ``type: gpu`` entries and nothing else. Entries of any other type
    (koordlet's ``rdma`` with ``vfGroups``, ``fpga``, or an entry without a type) are
    copied unchanged and keep their order. Our GPU entries, in minor order, take the
    place of the first GPU entry observed (the front of the list when there was none),
    so the order is stable from one write to the next. A GPU entry whose id is not in
    the intent is dropped: the intent is the whole truth about this node's GPUs.
    Timestamps are kept from ``observed`` where the status did not change.
    """
    seen_by_id = _observed_devices(observed)
    ours: list[JsonObj] = [_render_gpu(gpu, seen_by_id.get(gpu.uuid), now) for gpu in desired.gpus]
    devices: list[JsonObj] = []
    placed = False
    for entry in _observed_list(observed):
        if is_ours(entry):
            if not placed:
                devices.extend(ours)
                placed = True
            continue
        devices.append(_deep_copy_json(entry))
    if not placed:
        devices[0:0] = ours
    return devices


def owner_reference(node: str, node_uid: str) -> JsonObj:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "name": node,
        "uid": node_uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def render_device(
    desired: DesiredState,
    observed: JsonObj | None,
    *,
    node_uid: str | None,
    now: float,
) -> JsonObj:
    """The Device to store: ``observed`` with our parts replaced, or a new object.

    Everything we do not own survives: other labels and annotations, other owner
    references, ``status`` (allocations), spec fields other than ``devices``, entries of
    ``spec.devices`` whose type is not ``gpu`` and the fields of GPU entries we do not
    write (see :func:`render_devices`). The body keeps the observed
    ``resourceVersion``, so the writer's PUT is a compare-and-swap.
    """
    devices = render_devices(desired, observed, now)
    if observed:
        body: JsonObj = _deep_copy_json(observed)
    else:
        body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": desired.node}}
    body["apiVersion"] = API_VERSION
    body["kind"] = KIND
    meta = body.setdefault("metadata", {})
    meta["name"] = desired.node
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k not in KOORD_LABELS}
    labels.update(desired.device_labels)
    if labels:
        meta["labels"] = labels
    else:
        meta.pop("labels", None)
    if node_uid:
        meta["ownerReferences"] = _with_owner(meta.get("ownerReferences"), desired.node, node_uid)
    spec = body.get("spec")
    if not isinstance(spec, dict):
        spec = {}
    spec["devices"] = devices
    body["spec"] = spec
    return body


def _with_owner(refs: Any, node: str, node_uid: str) -> list[JsonObj]:
    others = [
        r
        for r in (refs if isinstance(refs, list) else [])
        if isinstance(r, dict) and not (r.get("kind") == "Node" and r.get("apiVersion") == "v1")
    ]
    ours = owner_reference(node, node_uid)
    if any(r.get("controller") for r in others):
        # Two controllers are invalid; a foreign controller wins, we stay an owner.
        ours["controller"] = False
    return [ours, *others]


def _deep_copy_json(value: Any) -> Any:
    result: Any = msgspec.json.decode(msgspec.json.encode(value))
    return result


# --- comparison ----------------------------------------------------------------------


def _normalize(value: Any) -> Any:
    """JSON value with None-valued keys dropped and quantities compared as text."""
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    return value


def _normalize_resources(devices: Any) -> Any:
    if not isinstance(devices, list):
        return devices
    out = []
    for entry in devices:
        if isinstance(entry, dict) and isinstance(entry.get("resources"), dict):
            entry = {**entry, "resources": {k: str(v) for k, v in entry["resources"].items()}}
        out.append(entry)
    return out


def device_differs(rendered: JsonObj, observed: JsonObj | None) -> bool:
    """Whether writing ``rendered`` would change anything we own in ``observed``.

    Compared: ``spec.devices``, our three Device labels and our owner reference.
    Server fields (resourceVersion, uid, managedFields...) and other owners' parts
    are ignored.
    """
    if observed is None:
        return True
    new_spec = rendered.get("spec") or {}
    old_spec = observed.get("spec") if isinstance(observed.get("spec"), dict) else {}
    if _normalize(_normalize_resources(new_spec.get("devices"))) != _normalize(
        _normalize_resources(old_spec.get("devices") if old_spec else None)
    ):
        return True
    new_meta = rendered.get("metadata") or {}
    old_meta = observed.get("metadata") or {}
    new_labels = {k: v for k, v in (new_meta.get("labels") or {}).items() if k in KOORD_LABELS}
    old_labels = {k: v for k, v in (old_meta.get("labels") or {}).items() if k in KOORD_LABELS}
    if new_labels != old_labels:
        return True
    return bool(_node_owner(new_meta) != _node_owner(old_meta))


def _node_owner(meta: JsonObj) -> Any:
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, dict) and ref.get("kind") == "Node" and ref.get("apiVersion") == "v1":
            return _normalize(ref)
    return None
