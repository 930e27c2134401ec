"""Asking kubelet's PodResources API which container holds which device IDs.

Why
---
Kubelet never tells a device plugin that a pod went away. Its PodResources API
(``v1.PodResourcesLister/List`` on ``/var/lib/kubelet/pod-resources/kubelet.sock``)
lists, for every live pod and container, the device IDs it holds per resource: hashed
the way :func:`gpulet_allocator.core.grant_key` hashes Allocate's IDs, those are the
live grants. The call is bounded by a deadline; a missing socket means "no kubelet
here" and is reported as such, not as an error.

The same answer, as :func:`held_devices`, is what rebuilds a lost allocation record
(:meth:`gpulet_allocator.core.AllocatorCore.adopt`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import grpc
import grpc.aio

from gpulet_allocator.core import GrantKind, HeldDevices, PodRef, grant_key
from gpulet_allocator.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_allocator.kubelet_api.podresources.v1 import api_pb2_grpc as pr_grpc


class PodResourcesUnavailable(Exception):
    pass


async def list_pod_resources(socket: Path, timeout_s: float) -> pr.ListPodResourcesResponse:
    """One ``List`` call; raises PodResourcesUnavailable (socket missing, RPC failed)."""
    if not await anyio.Path(socket).exists():
        raise PodResourcesUnavailable(f"{socket} does not exist")
    try:
        # The outer deadline also covers connecting and closing the channel.
        with anyio.fail_after(timeout_s + 1.0):
            async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
                stub = pr_grpc.PodResourcesListerStub(channel)
                return await stub.List(pr.ListPodResourcesRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise PodResourcesUnavailable(f"{exc.code().name}: {exc.details()}") from exc
    except (TimeoutError, OSError) as exc:
        raise PodResourcesUnavailable(f"{type(exc).__name__}: {exc}") from exc


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
