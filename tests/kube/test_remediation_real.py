"""Remediation against the real control plane: kube-apiserver's Eviction API with
PodDisruptionBudgets kept by the real disruption controller, the agent's own in-cluster
credentials (deploy/'s ServiceAccount and RBAC plus components/remediation, a token
bound to a Pod on the node, ``Node,RBAC``, the node restriction policy).

The holders come from a real :class:`~gpulet_allocator.decide.core.AllocatorCore`
(device plugin allocations, and a DRA claim reserved through ``claims.reserve``) and a
PodResources answer as kubelet gives it; the health is the health service's
``GpuHealth`` as the KV bucket holds it. Pods are created as the scheduler leaves them
(``spec.nodeName``) and marked Running and Ready as kubelet would, since the Eviction API
consults a PodDisruptionBudget only for running pods. The agent's requests are read back
from the server's audit log: what was asked to be evicted is exactly what is asserted.
Mode ``report`` runs with the base's rights alone (it needs no component) and is shown
to ask for no eviction at all while its Events say what it would do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.protocol import ClaimDeviceRequest
from gpulet_allocator.service.pod_watch import kube_configuration
from gpulet_allocator.service.podresources import live_grants
from gpulet_allocator.service.remediate.kube import KubeClient
from gpulet_allocator.service.remediate.runner import Remediator, Sources
from gpulet_allocator.service.remediate.runner import log as runner_log
from gpulet_common import kubeapi
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.messages import GpuHealth
from gpulet_common.settings.allocator import HandshakeSettings, ResourceNames
from gpulet_common.settings.remediation import RemediationSettings
from support import reference, remediation_kube
from support.control_plane import ControlPlane
from support.gpulet_on_kube import AgentIdentity, agent_identity
from support.health_kv import gpu_health
from support.remediation_kube import (
    cleanup,
    events,
    evicted_by_agent,
    node_events,
    running_pod,
    terminating,
)
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

GPU = "nvidia.com/gpu"
HANDSHAKE = HandshakeSettings(api_timeout_s=5.0)
WOULD_EVICT = "GpuletWouldEvictForGpuFault"
SETTINGS = RemediationSettings(
    mode="evict", max_fraction=0.5, window_s=600, retry_initial_s=0.2, retry_max_s=1.0
)


@pytest.fixture
def remediation_rbac(kube_cluster: ControlPlane, gpulet_access: ControlPlane) -> Iterator[None]:
    """components/remediation applied for this test only (other tests check that the
    base refuses evictions); removed afterwards."""
    with remediation_kube.remediation_rbac(gpulet_access):
        yield


@pytest.fixture
def agent(remediation_rbac: None, gpulet_access: ControlPlane, kube_node_name: str,
          tmp_path: Path) -> AgentIdentity:  # fmt: skip
    return agent_identity(gpulet_access, kube_node_name, tmp_path / "agent")


@pytest.fixture
async def api(
    agent: AgentIdentity, gpulet_access: ControlPlane
) -> AsyncIterator[kubeapi.KubeClient]:
    async with remediation_kube.agent_api(agent, gpulet_access) as api_client:
        yield api_client


def pdb(plane: ControlPlane, ns: str, name: str, app: str, min_available: int) -> None:
    body = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"minAvailable": min_available, "selector": {"matchLabels": {"app": app}}},
    }
    assert plane.apply(body).ok


def pdb_status(plane: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    doc = plane.must("GET", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{name}")
    status: dict[str, Any] = doc.get("status") or {}
    if status.get("observedGeneration") != doc["metadata"]["generation"]:
        return {}
    return status


class Node:
    """``count`` GPUs in a real AllocatorCore, their health, kubelet's PodResources."""

    def __init__(self, name: str, count: int) -> None:
        self.core = AllocatorCore(node=name, names=ResourceNames())
        inventory = reference.inventory_from_matrix(name, [[0] * count for _ in range(count)])
        self.core.update_inventory(inventory)
        self.uuids = [g.uuid for g in inventory.gpus]
        self.healths: dict[str, GpuHealth] = {
            u: GpuHealth(gpu_uuid=u, gpu_index=i) for i, u in enumerate(self.uuids)
        }
        self.podresources = pr.ListPodResourcesResponse()

    def plugin_pod(self, ns: str, name: str, gpu: int) -> None:
        """A device plugin allocation of GPU ``gpu``, as kubelet's Allocate and later its
        PodResources tell it (the ledger learns the pod from PodResources)."""
        self.core.allocate(GPU, [[self.uuids[gpu]]])
        pod = self.podresources.pod_resources.add(namespace=ns, name=name)
        pod.containers.add(name="main").devices.add(resource_name=GPU, device_ids=[self.uuids[gpu]])
        self.core.reconcile(live_grants(self.podresources, self.core.kind_of))

    def claim(self, ns: str, name: str, gpu: int) -> None:
        """A DRA claim on GPU ``gpu``, reserved as the kubelet plugin does."""
        minor = self.core.books.gpus[self.uuids[gpu]].minor
        device = ClaimDeviceRequest(device=f"gpu-{minor}")
        self.core.claims.reserve(f"uid-{name}", [device], namespace=ns, name=name)

    def fail(self, *gpus: int) -> None:
        for n in gpus:
            u = self.uuids[n]
            self.healths[u] = gpu_health(
                u, healthy=False, severity="fatal", action="reboot", index=n
            )

    def remediator(
        self, api: kubeapi.KubeClient, node: str, settings: RemediationSettings = SETTINGS
    ) -> Remediator:
        async def podresources() -> pr.ListPodResourcesResponse:
            return self.podresources

        sources = Sources(
            healths=lambda: self.healths,
            node_gpus=lambda: len(self.uuids),
            mig_devices=lambda _: [],
            ledger=lambda: (self.core.allocation_views(), list(self.core.books.claims.values())),
            pod_resources=podresources,
        )
        kube = KubeClient(api, node, "default", HANDSHAKE.api_timeout_s)
        return Remediator(settings, node, sources, kube)


@pytest.mark.timeout(180)
async def test_only_the_pods_on_the_failed_gpu_are_evicted_and_a_pdb_is_respected(
    kube_cluster: ControlPlane,
    agent: AgentIdentity,
    api: kubeapi.KubeClient,
    kube_namespace: str,
) -> None:
    plane, node, ns = kube_cluster, agent.node, kube_namespace
    gpus = Node(node, 6)
    gpus.plugin_pod(ns, "hit", 0)
    gpus.claim(ns, "claim-0", 4)
    gpus.plugin_pod(ns, "guarded", 1)
    gpus.plugin_pod(ns, "spared", 2)
    gpus.plugin_pod(ns, "guarded-peer", 3)
    names = ["hit", "hit-dra", "guarded", "spared", "guarded-peer", "elsewhere"]
    running_pod(plane, ns, "hit", node)
    running_pod(plane, ns, "hit-dra", node, claim="claim-0")
    running_pod(plane, ns, "guarded", node, labels={"app": "guarded"})
    running_pod(plane, ns, "spared", node)
    running_pod(plane, ns, "guarded-peer", node, labels={"app": "guarded"})
    running_pod(plane, ns, "elsewhere", f"{node}-other", claim="claim-0")
    pdb(plane, ns, "guard", "guarded", 2)
    await wait_until(
        lambda: pdb_status(plane, ns, "guard").get("currentHealthy") == 2, timeout_s=30
    )
    assert pdb_status(plane, ns, "guard")["disruptionsAllowed"] == 0
    mark = plane.audit_mark()
    gpus.fail(0, 1, 4)  # three of six GPUs: within the breaker's share
    remediator = gpus.remediator(api, node)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(remediator.run)
            await wait_until(
                lambda: terminating(plane, ns, "hit") and terminating(plane, ns, "hit-dra"),
                timeout_s=20,
            )
            # The PDB refuses the guarded pod (429), again and again.
            await wait_until(
                lambda: evicted_by_agent(plane, node, mark).count(("guarded", 429)) >= 2,
                timeout_s=20,
            )
            assert not terminating(plane, ns, "guarded")
            # The budget allows one disruption now: the next retry goes through.
            pdb(plane, ns, "guard", "guarded", 1)
            await wait_until(lambda: terminating(plane, ns, "guarded"), timeout_s=30)
            # Its Events follow the accepted eviction (pod first, then the Node).
            await wait_until(lambda: len(node_events(plane, node)) >= 3, timeout_s=20)
            tg.cancel_scope.cancel()
        asked = evicted_by_agent(plane, node, mark)
        assert {pod for pod, _ in asked} == {"hit", "hit-dra", "guarded"}
        assert sorted(p for p, code in asked if code == 201) == ["guarded", "hit", "hit-dra"]
        assert {p for p, code in asked if code == 429} == {"guarded"}
        for name in ("spared", "guarded-peer", "elsewhere"):
            assert not terminating(plane, ns, name), name
        # Events: on each evicted pod and on the Node, naming the catalogue entry.
        evicted = events(plane, ns, "GpuletEvictedForGpuFault")
        assert sorted(e["involvedObject"]["name"] for e in evicted) == [
            "guarded",
            "hit",
            "hit-dra",
        ]
        assert all(
            "XID 79 GPU_HAS_FALLEN_OFF_THE_BUS [RESTART_BM]" in e["message"] for e in evicted
        )
        blocked = events(plane, ns, "GpuletEvictionBlockedByPDB")
        assert [e["involvedObject"]["name"] for e in blocked] == ["guarded"]
        assert len(node_events(plane, node)) == 3
        plan = await remediator.plan()
        states = {(p.name, p.state) for g in plan.gpus for p in g.pods}
        assert states == {("hit", "evicted"), ("hit-dra", "evicted"), ("guarded", "evicted")}
    finally:
        cleanup(plane, ns, names)


@pytest.mark.timeout(180)
async def test_the_circuit_breaker_stops_a_storm(
    kube_cluster: ControlPlane,
    agent: AgentIdentity,
    api: kubeapi.KubeClient,
    kube_namespace: str,
) -> None:
    plane, node, ns = kube_cluster, agent.node, kube_namespace
    gpus = Node(node, 4)
    names = [f"job-{n}" for n in range(4)]
    for n, name in enumerate(names):
        gpus.plugin_pod(ns, name, n)
        running_pod(plane, ns, name, node)
    mark = plane.audit_mark()
    gpus.fail(0, 1, 2, 3)  # every GPU at once: a storm
    remediator = gpus.remediator(api, node)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(remediator.run)
            await wait_until(lambda: len(evicted_by_agent(plane, node, mark)) >= 2, timeout_s=20)
            await wait_until(
                lambda: bool(events(plane, "default", "GpuletRemediationBreakerOpen")), timeout_s=20
            )
            # Later passes (a health change, the periodic look) still evict nothing more.
            passes = remediator.passes
            remediator.poke()
            await wait_until(lambda: remediator.passes >= passes + 1, timeout_s=20)
            remediator.poke()
            await wait_until(lambda: remediator.passes >= passes + 2, timeout_s=20)
            tg.cancel_scope.cancel()
        asked = evicted_by_agent(plane, node, mark)
        assert sorted(asked) == [("job-0", 201), ("job-1", 201)]  # half of the 4 GPUs
        assert [n for n in names if terminating(plane, ns, n)] == ["job-0", "job-1"]
        (opened,) = [
            e
            for e in events(plane, "default", "GpuletRemediationBreakerOpen")
            if e["involvedObject"]["name"] == node
        ]
        assert "circuit breaker open" in opened["message"]
        plan = await remediator.plan()
        assert plan.breaker.open
        assert plan.breaker.trips == 1
        assert [g.gpu_index for g in plan.gpus if not g.admitted] == [2, 3]
    finally:
        cleanup(plane, ns, names)


@pytest.mark.timeout(180)
async def test_report_mode_evicts_nothing_and_says_what_it_would_do(
    kube_cluster: ControlPlane,
    gpulet_access: ControlPlane,
    kube_node_name: str,
    kube_namespace: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``remediation.mode = "report"`` with deploy/'s base rights only (no
    components/remediation, as the component's comment says report needs): a fatal
    fault on a GPU a pod holds, and the pod stays; the Events say what would be done."""
    plane, node, ns = kube_cluster, kube_node_name, kube_namespace
    # The base alone: report needs no eviction right.
    assert not remediation_kube.may_evict(gpulet_access)
    agent = agent_identity(gpulet_access, node, tmp_path / "agent")
    gpus = Node(node, 2)
    gpus.plugin_pod(ns, "held", 0)
    gpus.plugin_pod(ns, "other", 1)
    names = ["held", "other"]
    held = running_pod(plane, ns, "held", node)
    running_pod(plane, ns, "other", node)
    mark = plane.audit_mark()
    gpus.fail(0)
    configuration = await kube_configuration(HANDSHAKE, env=agent.env, sa_dir=agent.sa_dir)
    report = msgspec.structs.replace(SETTINGS, mode="report")
    try:
        async with kubeapi.KubeClient(configuration) as api:
            remediator = gpus.remediator(api, node, report)
            async with anyio.create_task_group() as tg:
                tg.start_soon(remediator.run)
                await wait_until(
                    lambda: (
                        len(events(plane, ns, WOULD_EVICT)) >= 1
                        and len(node_events(plane, node, WOULD_EVICT)) >= 1
                    ),
                    timeout_s=30,
                )
                # Later passes (the periodic look, a poke) say it once, evict nothing.
                passes = remediator.passes
                remediator.poke()
                await wait_until(lambda: remediator.passes >= passes + 2, timeout_s=20)
                tg.cancel_scope.cancel()
            plan = await remediator.plan()
        assert evicted_by_agent(plane, node, mark) == []  # not even asked for
        assert remediator.evictions_requested == 0
        assert not terminating(plane, ns, "held")
        assert not terminating(plane, ns, "other")
        (on_pod,) = events(plane, ns, WOULD_EVICT)
        (on_node,) = node_events(plane, node, WOULD_EVICT)
        assert on_pod["involvedObject"]["name"] == "held"
        assert on_pod["involvedObject"]["uid"] == held["metadata"]["uid"]
        assert on_pod["type"] == on_node["type"] == "Warning"
        for event in (on_pod, on_node):
            assert event["message"].startswith(f"would evict pod {ns}/held: GPU 0 ")
            assert "XID 79 GPU_HAS_FALLEN_OFF_THE_BUS [RESTART_BM]" in event["message"]
        assert events(plane, ns, "GpuletEvictedForGpuFault") == []
        said = [r.getMessage() for r in caplog.records if r.name == runner_log.name]
        assert sum(m.startswith("remediation (report only): would evict pod") for m in said) == 1
        assert plan.mode == "report"
        (gpu,) = plan.gpus
        assert gpu.gpu_index == 0
        assert [(p.name, p.state, p.attempts) for p in gpu.pods] == [("held", "planned", 0)]
    finally:
        cleanup(plane, ns, names)
