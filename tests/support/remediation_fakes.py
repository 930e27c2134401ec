"""A node for remediation loop tests against a fake API: four GPUs with one pod each
(replaced as they are evicted), their health, the ledger, a fake Kubernetes client that
records evictions and Event reasons, and a settable clock."""

from __future__ import annotations

from collections.abc import Mapping

from gpulet_allocator.protocol import AllocationView, GrantView
from gpulet_allocator.service.remediate.kube import EventTarget, EvictOutcome
from gpulet_allocator.service.remediate.policy import PodInfo
from gpulet_allocator.service.remediate.runner import Remediator, Sources
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.messages import ActiveCondition, GpuHealth
from gpulet_common.podresources import PodResourcesUnavailable
from gpulet_common.settings.remediation import RemediationSettings

XID79 = ActiveCondition(
    condition="xid:79", kind="xid", severity="fatal", action="reboot", reason="off the bus"
)


class Clock:
    def __init__(self) -> None:
        self.now = 1.8e9

    def __call__(self) -> float:
        return self.now


class FakeKube:
    def __init__(self) -> None:
        self.pods: list[PodInfo] = []
        self.evictions: list[str] = []
        self.reasons: list[str] = []

    async def list_pods(self) -> list[PodInfo]:
        return self.pods

    async def evict(self, namespace: str, name: str, uid: str) -> EvictOutcome:
        self.evictions.append(name)
        return EvictOutcome("evicted", 201)

    async def post_event(
        self, target: EventTarget, reason: str, message: str, *, warning: bool = True
    ) -> bool:
        self.reasons.append(reason)
        return True


def health(n: int, failed: bool) -> GpuHealth:
    return GpuHealth(
        gpu_uuid=f"GPU-{n}", gpu_index=n, healthy=not failed, conditions=[XID79] if failed else []
    )


class Node:
    """Four GPUs, one pod on each; pods replaced as they are evicted."""

    def __init__(self) -> None:
        self.healths: dict[str, GpuHealth] = {f"GPU-{n}": health(n, False) for n in range(4)}
        self.pod_of = {n: f"p{n}-0" for n in range(4)}

    def allocations(self) -> list[AllocationView]:
        return [
            AllocationView(
                id=f"a{n}",
                kind="whole",
                gpus=[f"GPU-{n}"],
                grants=[
                    GrantView(
                        key=f"k-{pod}",
                        resource="nvidia.com/gpu",
                        kind="whole",
                        units=1,
                        created_at=0.0,
                        pod=f"ns/{pod}",
                        container="main",
                    )
                ],
            )
            for n, pod in self.pod_of.items()
        ]

    def remediator(
        self, settings: RemediationSettings, kube: FakeKube, clock: Clock, store: object = None
    ) -> Remediator:
        async def no_podresources() -> pr.ListPodResourcesResponse:
            raise PodResourcesUnavailable("no kubelet here")

        healths: Mapping[str, GpuHealth] = self.healths
        sources = Sources(
            healths=lambda: healths,
            node_gpus=lambda: 4,
            mig_devices=lambda _: [],
            ledger=lambda: (self.allocations(), []),
            pod_resources=no_podresources,
        )
        return Remediator(
            settings,
            "node-a",
            sources,
            kube,
            clock=clock,
            wall=clock,
            breaker_store=store,  # type: ignore[arg-type]
        )


async def no_podresources() -> pr.ListPodResourcesResponse:
    raise PodResourcesUnavailable("no kubelet here")
