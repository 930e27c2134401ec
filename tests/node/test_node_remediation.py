"""Remediation on a real node (issue 35, test 4): with ``remediation.mode=evict``, a fatal
XID on a GPU that a running pod holds makes gpulet evict that pod through the Eviction
API, and the real kubelet really terminates it (the pod object goes only when kubelet
has stopped its container and confirmed it); a pod on a healthy GPU keeps running; a
PodDisruptionBudget that allows no disruption (status kept by the real disruption
controller) makes the API server refuse the eviction (429), and that pod keeps running.

gpulet finds the pods by kubelet's PodResources (under the node's root) and asks the API
with the admin's kubeconfig (the RBAC of the eviction is tests/kube/test_remediation_real's).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from support.agent_process import Agent
from support.control_plane_fixtures import unique_name
from support.node import Pods, RealNode, pod_manifest
from support.node_gpulet import env_of, gpulet_cli, ledger, start_agent, wait_logged, wait_running
from support.waiting import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

GPU = "nvidia.com/gpu"
SCRIPT = "env; echo ---; ls -l /dev/nvidia*"
XID = 79  # the GPU fell off the bus: fatal


@pytest.fixture(scope="module")
def agent(real_node: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    workdir: Path = tmp_path_factory.mktemp("remediation-agent")
    kubeconfig = real_node.plane.write_kubeconfig(workdir / "kubeconfig")
    sets = {
        "remediation.mode": "evict",
        "remediation.max_fraction": "1.0",
        "remediation.retry_initial_s": "0.2",
        "remediation.retry_max_s": "1.0",
        "allocator.handshake.kubeconfig": str(kubeconfig),
    }
    agent = start_agent(
        real_node, workdir, *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    )
    try:
        anyio.run(lambda: wait_until(lambda: real_node.allocatable(GPU) == "8", timeout_s=60))
        yield agent
    except BaseException:
        print(agent.output()[-5000:])
        raise
    finally:
        agent.stop()


def evictions(node: RealNode, since: int) -> list[tuple[str, int]]:
    """(pod, status) of each eviction asked since audit line ``since``."""
    return [
        (e["objectRef"]["name"], e["responseStatus"]["code"])
        for e in node.plane.audit(resource="pods/eviction", since=since)
    ]


def pdb_status(node: RealNode, ns: str, name: str) -> dict[str, Any]:
    doc = node.plane.must("GET", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{name}")
    status: dict[str, Any] = doc.get("status") or {}
    return status


async def test_the_pod_on_a_failed_gpu_is_evicted_and_terminated_and_a_pdb_holds(
    real_node: RealNode, agent: Agent, pods: Pods
) -> None:
    victim, bystander, guarded = (unique_name(n) for n in ("victim", "bystander", "guarded"))
    for name in (victim, bystander, guarded):
        manifest = pod_manifest(name, real_node.name, script=SCRIPT, limits={GPU: "1"})
        manifest["metadata"]["labels"] = {"app": name}
        pods.create(manifest)
    assert real_node.plane.apply(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": guarded, "namespace": pods.ns},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": guarded}}},
        }
    ).ok
    gpus = {}
    for name in (victim, bystander, guarded):
        await wait_running(pods, name)
        gpus[name] = env_of(await wait_logged(pods, name))["NVIDIA_VISIBLE_DEVICES"]
    await wait_until(
        lambda: pdb_status(real_node, pods.ns, guarded).get("currentHealthy") == 1,
        timeout_s=60,
        interval_s=0.2,
        what="the PodDisruptionBudget's status (the disruption controller)",
    )
    # PodResources has told gpulet which pod holds which GPU.
    await wait_until(
        lambda: (
            sum(
                1 for a in ledger(agent)["allocations"] for g in a.get("grants", []) if g.get("pod")
            )
            == 3
        ),
        timeout_s=30,
        interval_s=0.5,
        what="the three pods named in the ledger",
    )
    index = {g["uuid"]: g["index"] for g in ledger(agent)["gpus"]}
    mark = real_node.plane.audit_mark()
    for name in (victim, guarded):
        gpulet_cli(agent, "mock", "inject", "--gpu", str(index[gpus[name]]), "--xid", str(XID))
    await wait_until(
        lambda: pods.get(victim) is None,
        timeout_s=90,
        interval_s=0.2,
        what="the victim evicted and terminated by kubelet",
    )
    assert (victim, 201) in evictions(real_node, mark)
    await wait_until(
        lambda: evictions(real_node, mark).count((guarded, 429)) >= 2,
        timeout_s=60,
        interval_s=0.2,
        what="the guarded pod's eviction refused by its PodDisruptionBudget, again",
    )
    assert pods.running(bystander)
    assert pods.running(guarded)
    assert bystander not in {name for name, _ in evictions(real_node, mark)}
    for name in (bystander, guarded):
        pods.delete(name)
    for name in (victim, guarded):
        gpulet_cli(agent, "health", "clear", "--gpu", str(index[gpus[name]]), "--by", "test")
