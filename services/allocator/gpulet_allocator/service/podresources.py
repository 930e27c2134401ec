"""Asking kubelet's PodResources API which container holds which device IDs.

Why
---
Kubelet never tells a device plugin that a pod went away. Its PodResources API
(``v1.PodResourcesLister/List`` on ``/var/lib/kubelet/pod-resources/kubelet.sock``)
lists, for every live pod and container, the device IDs it holds per resource: hashed
the way :func:`gpulet_allocator.decide.books.grant_key` hashes Allocate's IDs, those are the
live grants. The call itself (:func:`gpulet_common.podresources.list_pod_resources`)
is bounded by a deadline; a missing socket means "no kubelet here".

The same answer, as :func:`held_devices`, is what rebuilds a lost allocation record
(:meth:`gpulet_allocator.decide.core.AllocatorCore.adopt`), and, as
:func:`pod_holders`, what the ``pods`` endpoint tells the collector (its metric labels):
the allocator is the one reader of PodResources on the node.
"""

from __future__ import annotations

from collections.abc import Callable

from gpulet_allocator.decide.books import grant_key
from gpulet_allocator.decide.record import HeldDevices, PodRef
from gpulet_allocator.state.records import GrantKind
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.messages import (
    MAX_DEVICE_IDS_PER_HOLDER,
    MAX_HOLDERS_PER_DEVICE,
    PodHolder,
)
from gpulet_common.podresources import (
    PodResourcesUnavailable,
    gpu_of_device,
    list_pod_resources,
)

__all__ = [
    "PodResourcesUnavailable",
    "held_devices",
    "list_pod_resources",
    "live_grants",
    "pod_holders",
]

# Longer names and IDs than these are not Kubernetes' nor ours: such a holder is left out
# (the bounds of :class:`~gpulet_common.messages.PodHolder`).
_MAX_NAME = 253
_MAX_DEVICE_ID = 512
_MAX_UUID = 128


def _no_uid(_namespace: str, _name: str) -> str:
    return ""


def live_grants(
    response: pr.ListPodResourcesResponse,
    kind_of: Callable[[str], GrantKind | None],
    uid_of: Callable[[str, str], str] = _no_uid,
) -> dict[str, PodRef]:
    """Grant key -> pod, its UID (``uid_of``: the pod watch's, "" unknown) and the
    container, for the resources ``kind_of`` knows."""
    live: dict[str, PodRef] = {}
    for pod in response.pod_resources:
        uid = uid_of(pod.namespace, pod.name)
        for container in pod.containers:
            for devices in container.devices:
                kind = kind_of(devices.resource_name)
                if kind is None or not devices.device_ids:
                    continue
                key = grant_key(kind, devices.resource_name, devices.device_ids)
                live[key] = PodRef(f"{pod.namespace}/{pod.name}", container.name, uid)
    return live


def held_devices(
    response: pr.ListPodResourcesResponse,
    kind_of: Callable[[str], GrantKind | None],
    uid_of: Callable[[str, str], str] = _no_uid,
) -> list[HeldDevices]:
    """Every container's device IDs of the resources ``kind_of`` knows."""
    held: list[HeldDevices] = []
    for pod in response.pod_resources:
        uid = uid_of(pod.namespace, pod.name)
        for container in pod.containers:
            ref = PodRef(f"{pod.namespace}/{pod.name}", container.name, uid)
            for devices in container.devices:
                if kind_of(devices.resource_name) is None or not devices.device_ids:
                    continue
                held.append(HeldDevices(ref, devices.resource_name, tuple(devices.device_ids)))
    return held


def pod_holders(response: pr.ListPodResourcesResponse) -> dict[str, list[PodHolder]]:
    """Device UUID (a GPU's, or a MIG device's) -> the containers holding it or a part
    of it, of every resource (a device ID names its GPU before ``::``), each with the
    device IDs it holds there; bounded as :class:`~gpulet_common.messages.PodsReply`
    allows (the collector checks the UUIDs against its inventory)."""
    holders: dict[str, list[PodHolder]] = {}
    for pod in response.pod_resources:
        if max(len(pod.name), len(pod.namespace)) > _MAX_NAME:
            continue
        for container in pod.containers:
            if len(container.name) > _MAX_NAME:
                continue
            for devices in container.devices:
                by_uuid: dict[str, list[str]] = {}
                for device_id in devices.device_ids:
                    uuid = gpu_of_device(device_id)
                    if uuid and len(uuid) <= _MAX_UUID and len(device_id) <= _MAX_DEVICE_ID:
                        by_uuid.setdefault(uuid, []).append(device_id)
                for uuid, ids in by_uuid.items():
                    same = holders.setdefault(uuid, [])
                    if len(same) >= MAX_HOLDERS_PER_DEVICE:
                        continue
                    same.append(
                        PodHolder(
                            namespace=pod.namespace,
                            pod=pod.name,
                            container=container.name,
                            resource=devices.resource_name[:_MAX_NAME],
                            device_ids=sorted(ids)[:MAX_DEVICE_IDS_PER_HOLDER],
                            device_count=len(ids),
                        )
                    )
    return {
        uuid: sorted(h, key=lambda p: (p.namespace, p.pod, p.container, p.resource))
        for uuid, h in sorted(holders.items())
    }
