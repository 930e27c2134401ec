"""Asking kubelet's PodResources API which container holds which device IDs.

Why
---
Kubelet never tells a device plugin that a pod went away. Its PodResources API
(``v1.PodResourcesLister/List`` on ``/var/lib/kubelet/pod-resources/kubelet.sock``)
lists, for every live pod and container, the device IDs it holds per resource: hashed
the way :func:`gpulet_allocator.decide.books.grant_key` hashes Allocate's IDs, those are the
live grants. The call itself (:func:`gpulet_common.podresources.list_pod_resources`,
bounded by a deadline; a missing socket means "no kubelet here") is shared with the
collector, which labels GPU metrics with the pods holding them.

The same answer, as :func:`held_devices`, is what rebuilds a lost allocation record
(:meth:`gpulet_allocator.decide.core.AllocatorCore.adopt`).
"""

from __future__ import annotations

from collections.abc import Callable

from gpulet_allocator.decide.books import grant_key
from gpulet_allocator.decide.record import HeldDevices, PodRef
from gpulet_allocator.state.records import GrantKind
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.podresources import PodResourcesUnavailable, list_pod_resources

__all__ = ["PodResourcesUnavailable", "held_devices", "list_pod_resources", "live_grants"]


def live_grants(
    response: pr.ListPodResourcesResponse, kind_of: Callable[[str], GrantKind | None]
) -> dict[str, PodRef]:
    """Grant key -> pod and container, for the resources ``kind_of`` knows."""
    live: dict[str, PodRef] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                kind = kind_of(devices.resource_name)
                if kind is None or not devices.device_ids:
                    continue
                key = grant_key(kind, devices.resource_name, devices.device_ids)
                live[key] = PodRef(pod=f"{pod.namespace}/{pod.name}", container=container.name)
    return live


def held_devices(
    response: pr.ListPodResourcesResponse, kind_of: Callable[[str], GrantKind | None]
) -> list[HeldDevices]:
    """Every container's device IDs of the resources ``kind_of`` knows."""
    held: list[HeldDevices] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            ref = PodRef(pod=f"{pod.namespace}/{pod.name}", container=container.name)
            for devices in container.devices:
                if kind_of(devices.resource_name) is None or not devices.device_ids:
                    continue
                held.append(HeldDevices(ref, devices.resource_name, tuple(devices.device_ids)))
    return held
