"""Which pods hold which GPUs, from kubelet's PodResources ``List``, for metric labels.

Why
---
"Which pod is using this GPU" is the question operators ask first. dcgm-exporter
answers it by asking kubelet's PodResources API which container holds which device
IDs, and labelling each GPU's metrics with ``pod``, ``namespace`` and ``container``.
The collector does the same: every ``collector.pod_resources_poll_s`` it calls
``List`` (:mod:`gpulet_common.podresources`), maps every device ID to its GPU (whole
GPUs and shares alike: a share's ID is ``<uuid>::...``) and hands the holders to the
DCGM exporter. Labels therefore follow allocations within one poll, with no restart.

Hostile input: kubelet's answer is checked against what the collector knows. A device
ID naming a GPU that is not in the inventory is ignored; a pod listed twice is kept
once; an answer that cannot be read keeps the last holders and is logged, never ends
the collector. A failed or missing socket keeps the last known holders only while kubelet says
nothing new -- on a missing socket (no kubelet) they are dropped, since nobody can
hold a GPU through a kubelet that is not there -- and the state change is logged once.

There is nothing to watch: PodResources v1 has only ``List``,
``GetAllocatableResources`` and ``Get`` (see the vendored api.proto), so polling
``List`` is the way, as dcgm-exporter does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path

import anyio
import anyio.abc

from gpulet_collector.dcgm import PodLabels
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.lifecycle import repeat_every
from gpulet_common.podresources import (
    PodResourcesUnavailable,
    gpu_of_device,
    list_pod_resources,
)

log = logging.getLogger("gpulet.collector.pods")

# Per-call deadline of List (kubelet answers from memory in milliseconds).
LIST_TIMEOUT_S = 5.0


def holders_of(
    response: pr.ListPodResourcesResponse, gpus: Collection[str]
) -> dict[str, list[PodLabels]]:
    """GPU UUID -> the containers holding it (whole or a share), for GPUs in ``gpus``."""
    holders: dict[str, list[PodLabels]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            held = PodLabels(pod=pod.name, namespace=pod.namespace, container=container.name)
            for devices in container.devices:
                for device_id in devices.device_ids:
                    uuid = gpu_of_device(device_id)
                    if uuid not in gpus:
                        continue
                    same = holders.setdefault(uuid, [])
                    if held not in same:
                        same.append(held)
    return {
        uuid: sorted(h, key=lambda p: (p.namespace, p.pod, p.container))
        for uuid, h in holders.items()
    }


class PodAttribution:
    """Polls PodResources and publishes the holders through ``update``."""

    def __init__(
        self,
        socket: Path,
        poll_s: float,
        gpus: Callable[[], Collection[str]],
        update: Callable[[dict[str, list[PodLabels]]], None],
    ) -> None:
        self._socket = socket
        self._poll_s = poll_s
        self._gpus = gpus
        self._update = update
        self._problem: str | None = ""  # "" before the first call: log the first state

    async def refresh(self) -> None:
        """One List call and update (never raises for kubelet's failures)."""
        try:
            response = await list_pod_resources(self._socket, LIST_TIMEOUT_S)
            holders = holders_of(response, frozenset(self._gpus()))
        except PodResourcesUnavailable as exc:
            self._report(str(exc))
            if not await anyio.Path(self._socket).exists():
                self._update({})
            return
        except Exception as exc:  # whatever kubelet answered, the collector lives on
            self._report(f"unexpected answer: {type(exc).__name__}: {exc}")
            return
        self._report(None)
        self._update(holders)

    def _report(self, problem: str | None) -> None:
        if problem == self._problem:
            return
        if problem is None:
            log.info("pod labels from kubelet's PodResources at %s", self._socket)
        else:
            log.warning(
                "no pod labels on GPU metrics: PodResources List failed: %s (mount kubelet's "
                "pod-resources directory, deploy/kustomize/components/pod-labels, or set "
                "collector.pod_labels=false)",
                problem,
            )
        self._problem = problem

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        await repeat_every(self._poll_s, self.refresh, task_status=task_status)
