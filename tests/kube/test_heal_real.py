"""Remediation by reset end to end: the real control plane (kube-apiserver's Eviction
API, the agent's own token with deploy/'s RBAC plus components/remediation), the real
collector and health service on the mock NVML over a real nats-server, the allocator's
remediation loop with its state machine on the node's KV, and the mock's GPU reset.

XID 79 (GPU 3 falls off the bus) while a pod holds GPU 3 and another pod GPU 1: the
pod on GPU 3 is evicted (and only it), GPU 3 is quarantined at once in every node view,
reset once, verified and returned; the health service sees it back; a new pod gets
GPU 3; the node is never cordoned. Kubelet's part (deleting the evicted pod, its
PodResources gone) is played by the test, as in test_remediation_real.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.service.podresources import live_grants
from gpulet_allocator.service.remediate.heal import Healer
from gpulet_allocator.service.remediate.heal_events import NodeEvents
from gpulet_allocator.service.remediate.heal_store import KvHealStore
from gpulet_allocator.service.remediate.heal_view import faults_since, known_identity
from gpulet_allocator.service.remediate.kube import KubeClient
from gpulet_allocator.service.remediate.nvml_port import NvmlGpu
from gpulet_allocator.service.remediate.reset_exec import MockExecutor
from gpulet_allocator.service.remediate.runner import Remediator, Sources
from gpulet_common import kubeapi
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.heal import HEAL_KV_BUCKET
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.nodeview import NodeView
from gpulet_common.settings.allocator import ResourceNames
from gpulet_common.settings.remediation import RemediationSettings, ResetSettings
from support.control_plane import ControlPlane
from support.gpulet_on_kube import agent_identity
from support.health_harness import HealthNode, health_node
from support.remediation_kube import (
    HANDSHAKE,
    agent_api,
    cleanup,
    evicted_by_agent,
    node_events,
    remediation_rbac,
    running_pod,
    terminating,
)
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

GPU = "nvidia.com/gpu"
SETTLE_S = 1.0
SETTINGS = RemediationSettings(
    mode="reset",
    retry_initial_s=0.2,
    retry_max_s=1.0,
    reset=ResetSettings(executor="mock", settle_s=SETTLE_S, idle_timeout_s=30, timeout_s=10),
)


class Kubelet:
    """The node's allocations in a real AllocatorCore, and PodResources as kubelet
    answers it."""

    def __init__(self, view: NodeView) -> None:
        assert view.inventory is not None
        # Released as soon as PodResources no longer lists it (kubelet's answer is the
        # test's own here, never late).
        self.core = AllocatorCore(
            node=view.inventory.node, names=ResourceNames(), release_grace_s=0.0
        )
        self.core.update_inventory(view.inventory)
        self.podresources = pr.ListPodResourcesResponse()

    def start(self, ns: str, name: str, uuid: str) -> None:
        """Allocate (kubelet's Allocate names the device), then PodResources lists it."""
        self.core.allocate(GPU, [[uuid]])
        pod = self.podresources.pod_resources.add(namespace=ns, name=name)
        pod.containers.add(name="main").devices.add(resource_name=GPU, device_ids=[uuid])
        self.core.reconcile(live_grants(self.podresources, self.core.kind_of))

    def gone(self, ns: str, name: str) -> None:
        kept = [p for p in self.podresources.pod_resources if (p.namespace, p.name) != (ns, name)]
        self.podresources = pr.ListPodResourcesResponse(pod_resources=kept)
        self.core.reconcile(live_grants(self.podresources, self.core.kind_of))


@asynccontextmanager
async def node_view(h: HealthNode) -> AsyncIterator[NodeView]:
    view = NodeView(h.runtime.bus, h.node, retry_s=0.05, who="test")
    async with anyio.create_task_group() as tg:
        await tg.start(view.run)
        await wait_until(
            lambda: view.inventory is not None and view.health_seen.is_set(),
            timeout_s=20,
            what="inventory and health in the view",
        )
        yield view
        tg.cancel_scope.cancel()


@pytest.mark.timeout(240)
async def test_xid_79_on_gpu_3_reset_verified_returned_without_draining_the_node(
    kube_cluster: ControlPlane,
    gpulet_access: ControlPlane,
    kube_node_name: str,
    kube_namespace: str,
    nats_server: EmbeddedNats,
    tmp_path: Path,
) -> None:
    plane, node, ns = kube_cluster, kube_node_name, kube_namespace
    names = ["hit", "spared", "next"]
    with remediation_rbac(gpulet_access):
        agent = agent_identity(gpulet_access, node, tmp_path / "agent")
        async with (
            agent_api(agent, gpulet_access) as api,
            health_node(nats_server.url, tmp_path) as h,
            node_view(h) as view,
            anyio.create_task_group() as tg,
        ):
            try:
                await run_the_fault(plane, api, node, ns, h, view, tg)
            finally:
                tg.cancel_scope.cancel()
                cleanup(plane, ns, names)


async def run_the_fault(
    plane: ControlPlane,
    api: kubeapi.KubeClient,
    node: str,
    ns: str,
    h: HealthNode,
    view: NodeView,
    tg: anyio.abc.TaskGroup,
) -> None:
    g3, g1 = h.uuid(3), h.uuid(1)
    kubelet = Kubelet(view)
    kubelet.start(ns, "hit", g3)
    kubelet.start(ns, "spared", g1)
    running_pod(plane, ns, "hit", node)
    running_pod(plane, ns, "spared", node)

    async def podresources() -> pr.ListPodResourcesResponse:
        return kubelet.podresources

    sources = Sources(
        healths=view.healths,
        node_gpus=lambda: 5,
        mig_devices=kubelet.core.mig_devices_of,
        ledger=lambda: (kubelet.core.allocation_views(), list(kubelet.core.books.claims.values())),
        pod_resources=podresources,
    )
    kube = KubeClient(api, node, "default", HANDSHAKE.api_timeout_s)
    remediator = Remediator(SETTINGS, node, sources, kube)
    kv = await h.runtime.bus.key_value(HEAL_KV_BUCKET)
    store = KvHealStore(kv, h.runtime.bus.jetstream, h.node)
    executor = MockExecutor(h.mock, 10.0)
    remediator.healer = Healer(
        SETTINGS.reset,
        store,
        NvmlGpu(h.mock),
        executor,
        remediator,
        NodeEvents(node, kube, h.runtime.bus, nats_node=h.node),
        known=known_identity(view),
        faults_since=faults_since(view),
    )
    view.listen(lambda _change: remediator.poke())
    mark = plane.audit_mark()
    tg.start_soon(remediator.run)

    h.inject("fall_off_bus", 3)  # XID 79, and GPU 3 gone from the bus

    async def state() -> str:
        record, _ = await store.get(g3)
        return record.state if record is not None else ""

    # The pod on GPU 3 is evicted; while it terminates GPU 3 is quarantined everywhere.
    await wait_until(lambda: terminating(plane, ns, "hit"), timeout_s=30, what="hit evicted")
    assert await state() == "evicting"

    def quarantined() -> bool:
        health = view.health(g3)
        return health is not None and "remediation:quarantined" in [
            c.condition for c in health.conditions
        ]

    await wait_until(quarantined, timeout_s=10, what="GPU 3 quarantined in the node view")
    assert g3 in view.unhealthy()
    assert g1 not in view.unhealthy()
    # Kubelet's part: the evicted pod goes, its devices with it.
    cleanup(plane, ns, ["hit"])
    kubelet.gone(ns, "hit")

    for _ in range(600):
        if await state() in ("returned", "escalated", "retired"):
            break
        await anyio.sleep(0.05)
    record, _ = await store.get(g3)
    assert record is not None
    assert record.state == "returned", record.steps
    assert [s.split("@")[0] for s in record.steps] == [
        "quarantined",
        "evicting",
        "waiting_idle",
        "resetting",
        "verifying",
        "returned",
    ]
    assert h.mock.resets_of(3) == 1
    assert executor.calls == [h.mock.scenario.gpus[3].bus_id]
    # The health service saw GPU 3 come back; the quarantine is gone: in service.
    await wait_until(lambda: view.healthy(g3), timeout_s=30, what="GPU 3 healthy again")
    await wait_until(
        lambda: len(node_events(plane, node, "GpuletGpuReturnedToService")) == 1,
        timeout_s=20,
        what="the return's Event on the Node",
    )
    message = node_events(plane, node, "GpuletGpuReturnedToService")[0]["message"]
    assert f"GPU {g3} back in service (last reset " in message
    # The cause: the health service's first word of it (the GPU gone from NVML's list,
    # lost, or XID 79).
    assert any(cause in message for cause in ("gpu_removed", "gpu_lost", "xid:79")), message
    # Only the pod on GPU 3 was asked to go; the node was never cordoned.
    assert evicted_by_agent(plane, node, mark) == [("hit", 201)]
    assert not terminating(plane, ns, "spared")
    answer = plane.request("GET", f"/api/v1/nodes/{node}")
    if answer.ok:
        assert not (answer.body.get("spec") or {}).get("unschedulable")
    # A new pod gets GPU 3.
    kubelet.start(ns, "next", g3)
    running_pod(plane, ns, "next", node)
    held = [a for a in kubelet.core.allocation_views() if g3 in a.gpus]
    assert [g.pod for a in held for g in a.grants] == [f"{ns}/next"]
