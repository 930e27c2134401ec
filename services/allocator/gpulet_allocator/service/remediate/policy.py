"""Which faults remediate, and which pods hold the failed device: pure, no I/O.

Faults
------
A GPU's health arrives as the health service's :class:`~gpulet_common.messages.GpuHealth`
(the ``gpu_health`` KV bucket, through the allocator's ``NodeView``). One of its active
conditions remediates (:func:`faults_of`) when it is **fatal for the GPU and the GPU's
own**:

* a lost, removed or missing GPU (``gpu_lost``, ``gpu_removed``, ``gpu_missing``): the
  device under the pod is gone;
* otherwise a condition of severity ``remediation.min_severity`` or worse (critical by
  default) whose action is one of ``remediation.actions`` (reset the GPU, reboot,
  inspect the hardware: what the catalogue's buckets RESET_GPU, RESTART_BM,
  WORKFLOW_XID_48 and CHECK_MECHANICALS become), where severity and action are the
  health service's, operator overrides (``health.xid_overrides``) included;
* never NVML gone (``nvml_unavailable``: every GPU at once, the node's problem, not a
  GPU's), never an XID an application can cause (the catalogue's application flag
  ``yes`` or ``check``, :mod:`gpulet_common.xid_table`): the application already died
  of it, and its pod restarting on the same healthy GPU is the cure.

A condition on a MIG device (``mig_device``) is scoped to that device; any other to the
GPU and all its MIG devices.

Holders
-------
:func:`holders_of` joins three records of who holds a device, since each can miss a pod:
the allocator's ledger (device plugin allocations, with the pod learnt from
PodResources), kubelet's PodResources answer (the device IDs each live container
holds), and DRA claims (the ledger's claim entries, ``reserve-claim``, matched to the
pods that name the claim). The pod list of the node gives each pod its UID (the
eviction's precondition) and says which pods are already terminating.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gpulet_allocator.protocol import AllocationView, parse_device_id
from gpulet_allocator.state.records import ClaimRecord
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.messages import SEVERITY_RANK, ActiveCondition, GpuHealth
from gpulet_common.remediation import Fault
from gpulet_common.settings.remediation import RemediationSettings
from gpulet_common.xid_table import ROWS

LOSS_KINDS: Final = frozenset({"gpu_lost", "gpu_removed", "gpu_missing"})
NODE_KINDS: Final = frozenset({"nvml_unavailable"})
RECOVERY_ACTION_XID: Final = 154
_CATALOGUE: Final = {row.code: row for row in ROWS}


def xid_of(condition: ActiveCondition) -> int | None:
    """The XID of an ``xid:<code>`` / ``xid_repeated:<code>`` / ``recovery_action``
    condition; None for any other."""
    if condition.condition == "recovery_action":
        return RECOVERY_ACTION_XID
    head, _, code = condition.condition.partition(":")
    if head in ("xid", "xid_repeated") and code.isdigit():
        return int(code)
    return None


def why_not(condition: ActiveCondition, settings: RemediationSettings) -> str | None:
    """None when the condition remediates; else why not."""
    if condition.kind in NODE_KINDS:
        return "node-wide (NVML), not one GPU's"
    if condition.kind in LOSS_KINDS:
        return None
    if SEVERITY_RANK.get(condition.severity, 0) < SEVERITY_RANK[settings.min_severity]:
        return f"severity {condition.severity} below {settings.min_severity}"
    if condition.action not in settings.actions:
        return f"action {condition.action} is not the GPU's ({', '.join(settings.actions)})"
    xid = xid_of(condition)
    row = _CATALOGUE.get(xid) if xid is not None else None
    if row is not None and row.app in ("yes", "check"):
        return f"XID {xid} {row.mnemonic} can be caused by an application"
    return None


def faults_of(gpu: GpuHealth, settings: RemediationSettings) -> list[Fault]:
    """The GPU's conditions that remediate, worst first, one per device."""
    found: dict[str, Fault] = {}
    ranked = sorted(
        gpu.conditions, key=lambda c: (-SEVERITY_RANK.get(c.severity, 0), c.since, c.condition)
    )
    for cond in ranked:
        if why_not(cond, settings) is not None:
            continue
        device = cond.mig_device or gpu.gpu_uuid
        if device in found:
            continue
        xid = xid_of(cond)
        row = _CATALOGUE.get(xid) if xid is not None else None
        found[device] = Fault(
            gpu_uuid=gpu.gpu_uuid,
            gpu_index=gpu.gpu_index,
            device=device,
            condition=cond.condition,
            kind=cond.kind,
            severity=cond.severity,
            action=cond.action,
            reason=cond.reason,
            xid=xid,
            mnemonic=row.mnemonic if row else "",
            bucket=row.immediate if row else "",
            since=cond.since,
        )
    return list(found.values())


# --- pods ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodInfo:
    """What remediation needs of a pod on the node (decoded by :func:`pod_info`)."""

    namespace: str
    name: str
    uid: str
    claims: frozenset[str] = frozenset()
    terminating: bool = False
    finished: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_info(obj: Any) -> PodInfo | None:
    """A pod of the API's JSON, or None when it does not read as one. Never raises."""
    if not isinstance(obj, dict):
        return None
    meta, spec, status = (obj.get(k) for k in ("metadata", "spec", "status"))
    meta = meta if isinstance(meta, dict) else {}
    spec = spec if isinstance(spec, dict) else {}
    status = status if isinstance(status, dict) else {}
    ns, name, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
    if not (isinstance(ns, str) and isinstance(name, str) and ns and name):
        return None
    claims: set[str] = set()
    for entries in (spec.get("resourceClaims"), status.get("resourceClaimStatuses")):
        for entry in entries if isinstance(entries, list) else []:
            claim = entry.get("resourceClaimName") if isinstance(entry, dict) else None
            if isinstance(claim, str) and claim:
                claims.add(claim)
    return PodInfo(
        namespace=ns,
        name=name,
        uid=uid if isinstance(uid, str) else "",
        claims=frozenset(claims),
        terminating=bool(meta.get("deletionTimestamp")),
        finished=status.get("phase") in ("Succeeded", "Failed"),
    )


@dataclass(slots=True)
class Holder:
    namespace: str
    name: str
    uid: str = ""
    via: set[str] = field(default_factory=set)
    terminating: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Records:
    """The allocator's records of who holds what, taken at one moment."""

    allocations: Sequence[AllocationView] = ()
    claims: Sequence[ClaimRecord] = ()
    pod_resources: pr.ListPodResourcesResponse | None = None
    # None: the node's pods could not be listed (then no UID and no claim match).
    pods: Sequence[PodInfo] | None = None


def devices_in_scope(fault: Fault, mig_devices: Callable[[str], Iterable[str]]) -> frozenset[str]:
    if fault.device != fault.gpu_uuid:
        return frozenset({fault.device})
    return frozenset({fault.gpu_uuid, *mig_devices(fault.gpu_uuid)})


def holders_of(devices: frozenset[str], records: Records) -> list[Holder]:
    """Every pod that holds one of ``devices``, by any record; sorted by key."""
    found: dict[str, Holder] = {}
    # The UIDs the ledger recorded for its holders (a grant names the pod it was for).
    recorded: dict[str, set[str]] = {}

    def add(namespace: str, name: str, via: str) -> None:
        holder = found.setdefault(f"{namespace}/{name}", Holder(namespace, name))
        holder.via.add(via)

    for alloc in records.allocations:
        if devices.isdisjoint(alloc.gpus):
            continue
        for grant in alloc.grants:
            ns, sep, name = grant.pod.partition("/")
            if sep and ns and name:
                add(ns, name, "ledger")
                recorded.setdefault(grant.pod, set()).add(grant.pod_uid)
    if records.pod_resources is not None:
        for pod in records.pod_resources.pod_resources:
            if any(_holds(c, devices) for c in pod.containers):
                add(pod.namespace, pod.name, "podresources")
    pods: Mapping[str, PodInfo] = {p.key: p for p in records.pods or ()}
    claimed = {
        f"{c.namespace}/{c.name}"
        for c in records.claims
        if c.name and not devices.isdisjoint(d.uuid for d in c.devices)
    }
    if claimed:
        for info in pods.values():
            if any(f"{info.namespace}/{claim}" in claimed for claim in info.claims):
                add(info.namespace, info.name, "dra_claim")
    listed = (
        {f"{p.namespace}/{p.name}" for p in records.pod_resources.pod_resources}
        if records.pod_resources is not None
        else None
    )
    result = []
    for key in sorted(found):
        holder = found[key]
        known = pods.get(key)
        if holder.via == {"ledger"}:
            # Known by name alone: the pod the ledger recorded may be gone and another
            # of the same name (a StatefulSet's web-0) hold other GPUs now.
            uids = recorded.get(key, set()) - {""}
            if len(uids) == 1:
                holder.uid = uids.pop()  # the eviction's precondition: that pod only
                if known is not None and known.uid != holder.uid:
                    continue  # that pod is gone; the one of its name is another
            elif listed is not None and key in listed:
                continue  # kubelet lists the pod of that name, without these devices
        if known is not None:
            if known.finished:
                continue
            if not holder.uid or holder.uid == known.uid:
                holder.uid, holder.terminating = known.uid, known.terminating
        result.append(holder)
    return result


def _holds(container: pr.ContainerResources, devices: frozenset[str]) -> bool:
    for group in container.devices:
        for device_id in group.device_ids:
            try:
                if parse_device_id(device_id).gpu_uuid in devices:
                    return True
            except ValueError:
                continue
    return False
