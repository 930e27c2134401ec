"""The reporter against the real kube-apiserver (v1.37, tools/k8s), not the emulator.

The reporter runs as the DaemonSet runs it: in-cluster, with a token of deploy/'s
ServiceAccount bound to a Pod on its node, through ``Node,RBAC`` authorization and the
admission policy of deploy/. The Device CRD is deploy/crds' own, installed for real, so
the server prunes, defaults and validates every Device the reporter writes.

Writes are counted by the server itself, from its audit log: every request the
agent's user made, no-op writes included (a no-op keeps the resourceVersion, so a
resourceVersion comparison alone could not tell a needless write from none).

Inputs are published on the bus by the test, standing in for the collector
(inventories) and the health service (the ``gpu_health`` KV bucket, and an answer to
the node condition's state request), as tests/reporter does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from gpulet_common import codec, subjects
from gpulet_common.bootid import read_boot_id
from gpulet_common.bus import Bus, Delivery
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import HealthState, HealthStateRequest
from gpulet_reporter import labels as lb
from gpulet_reporter import node_health as nh
from support.control_plane import ControlPlane
from support.gpulet_on_kube import AGENT_USER, AgentIdentity, agent_identity
from support.health_kv import gpu_health, put_health
from support.reporter_harness import (
    RunningReporter,
    fast_settings,
    gpu_uuid,
    make_inventory,
    running_reporter,
)
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

DEVICE_PATH = "/apis/scheduling.koordinator.sh/v1alpha1/devices/{}"
WRITES = ("create", "update", "patch", "delete")
FOREIGN_TAINT = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}


@pytest.fixture
def node(gpulet_access: ControlPlane, kube_node_name: str) -> Iterator[str]:
    gpulet_access.add_node(kube_node_name, labels={"team": "ml"})
    yield kube_node_name
    gpulet_access.request("DELETE", f"/api/v1/nodes/{kube_node_name}")
    gpulet_access.request("DELETE", DEVICE_PATH.format(kube_node_name))


@pytest.fixture
def agent(gpulet_access: ControlPlane, node: str, tmp_path: Path) -> AgentIdentity:
    return agent_identity(gpulet_access, node, tmp_path / "agent")


def device(plane: ControlPlane, node: str) -> dict[str, Any] | None:
    resp = plane.request("GET", DEVICE_PATH.format(node))
    return resp.body if resp.status == 200 else None


def health_of(plane: ControlPlane, node: str) -> dict[str, bool]:
    obj = device(plane, node)
    return {} if obj is None else {e["id"]: e["health"] for e in obj["spec"]["devices"]}


def node_object(plane: ControlPlane, node: str) -> dict[str, Any]:
    obj: dict[str, Any] = plane.must("GET", f"/api/v1/nodes/{node}")
    return obj


def agent_writes(plane: ControlPlane, node: str, since: int = 0) -> list[str]:
    """``verb resource`` of every write the agent asked of ``node``'s objects."""
    return [
        f"{e['verb']} {e['objectRef']['resource']}"
        + (f"/{e['objectRef']['subresource']}" if e["objectRef"].get("subresource") else "")
        for e in plane.audit(user=AGENT_USER, name=node, verbs=WRITES, since=since)
    ]


async def converged(r: RunningReporter) -> None:
    def done() -> bool:
        loop = r.service.loop
        return (
            loop is not None
            and r.service.desired is not None
            and loop.applied == r.service.desired
            and not r.service.debouncer.pending
        )

    await wait_until(done, timeout_s=15, what="the reporter converged")


async def test_device_labels_and_health_both_ways_then_zero_writes_at_rest(
    nats_server: EmbeddedNats, gpulet_access: ControlPlane, agent: AgentIdentity, tmp_path: Path
) -> None:
    plane, node = gpulet_access, agent.node
    settings = fast_settings(reconcile_interval_s=0.5)
    async with running_reporter(
        nats_server.url, tmp_path, node, settings, env=agent.env, sa_dir=agent.sa_dir
    ) as r:
        assert r.service.target is not None
        assert r.service.target.source == "in-cluster"
        inventory = make_inventory(node)
        await r.bus.publish(subjects.inventory(node), inventory, codec.INVENTORY)
        await wait_until(lambda: len(health_of(plane, node)) == 8, timeout_s=15, what="the Device")
        obj = device(plane, node)
        assert obj is not None
        owner = obj["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"]) == (
            "Node",
            node,
            node_object(plane, node)["metadata"]["uid"],
        )
        assert obj["metadata"]["labels"][lb.LABEL_GPU_MODEL] == "H100-80GB-HBM3"
        assert all(health_of(plane, node).values())
        await converged(r)
        labels = node_object(plane, node)["metadata"]["labels"]
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert labels[lb.LABEL_GPU_MODEL] == "H100-80GB-HBM3"
        assert labels["team"] == "ml"  # not ours: kept

        # A GPU fails, then recovers.
        bad = gpu_uuid(node, 3)
        await put_health(r.bus, node, gpu_health(bad, healthy=False))
        await wait_until(lambda: health_of(plane, node).get(bad) is False, timeout_s=15)
        entry = next(e for e in device(plane, node)["spec"]["devices"] if e["id"] == bad)  # type: ignore[index]
        assert (entry["conditions"][0]["status"], entry["conditions"][0]["reason"]) == (
            "False",
            "Xid79",
        )
        await put_health(r.bus, node, gpu_health(bad, healthy=True))
        await wait_until(lambda: health_of(plane, node).get(bad) is True, timeout_s=15)
        await converged(r)

        # At rest: the same inputs again and again, the periodic reconcile running
        # (every 0.5 s): the server sees reads and not one write.
        rv = (device(plane, node) or {})["metadata"]["resourceVersion"]
        node_rv = node_object(plane, node)["metadata"]["resourceVersion"]
        mark = plane.audit_mark()
        for _ in range(30):
            await r.bus.publish(subjects.inventory(node), inventory, codec.INVENTORY)
            await put_health(r.bus, node, gpu_health(bad, healthy=True))
            await anyio.sleep(0.05)

        def reads() -> int:
            return len(plane.audit(user=AGENT_USER, name=node, verbs=("get",), since=mark))

        await wait_until(lambda: reads() >= 4, timeout_s=15, what="two reconciles")
        await converged(r)
        assert agent_writes(plane, node, since=mark) == []
        assert (device(plane, node) or {})["metadata"]["resourceVersion"] == rv
        assert node_object(plane, node)["metadata"]["resourceVersion"] == node_rv
        assert r.probe.value("gpulet.reporter.write_failures") == 0
        # Every write it made was accepted: nothing the server refused.
        refused = [
            e
            for e in plane.audit(user=AGENT_USER, name=node)
            if e.get("responseStatus", {}).get("code", 200) >= 400
            and e["verb"] != "get"  # the first read of a Device not yet created: 404
        ]
        assert refused == []


async def _serve_state(bus: Bus, node: str, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    """The health service's answer to the state request (per-GPU state is in KV)."""

    async def answer(_request: Delivery[HealthStateRequest]) -> HealthState:
        return HealthState(node=node)

    await bus.serve(
        subjects.health_state(node),
        answer,
        codec.HEALTH_STATE_REQUEST,
        codec.HEALTH_STATE,
        task_status=task_status,
    )


def condition(plane: ControlPlane, node: str) -> dict[str, Any] | None:
    return nh.find_condition(node_object(plane, node))


def taints(plane: ControlPlane, node: str) -> list[dict[str, Any]]:
    return list((node_object(plane, node).get("spec") or {}).get("taints") or [])


async def test_node_condition_and_taint_both_ways_keep_the_others(
    nats_server: EmbeddedNats, gpulet_access: ControlPlane, agent: AgentIdentity, tmp_path: Path
) -> None:
    """The GpuletGPUHealthy condition through the real nodes/status subresource (a
    strategic merge patch that keeps kubelet's Ready) and the taint through the Node
    (a merge patch carrying the resourceVersion), both ways, kubelet's condition and a
    foreign taint untouched."""
    plane, node = gpulet_access, agent.node
    plane.must(
        "PATCH",
        f"/api/v1/nodes/{node}",
        {"spec": {"taints": [FOREIGN_TAINT]}},
        content_type="application/merge-patch+json",
    )
    settings = fast_settings(
        node_condition=True,
        node_labels=False,
        taint_policy="any-gpu-unhealthy",
        health_probe_interval_s=0.1,
        health_stale_after_s=10.0,
        condition_heartbeat_s=300.0,
    )
    bad = gpu_uuid(node, 1)
    async with (
        running_reporter(
            nats_server.url, tmp_path, node, settings, env=agent.env, sa_dir=agent.sa_dir
        ) as r,
        anyio.create_task_group() as responder,
    ):
        await responder.start(_serve_state, r.bus, node)
        await r.bus.publish(subjects.inventory(node), make_inventory(node, 2), codec.INVENTORY)
        await wait_until(
            lambda: (condition(plane, node) or {}).get("status") == "True", timeout_s=15
        )
        await put_health(r.bus, node, gpu_health(bad, healthy=False))
        await wait_until(
            lambda: (condition(plane, node) or {}).get("status") == "False", timeout_s=15
        )
        await wait_until(lambda: nh.TAINT_KEY in {t["key"] for t in taints(plane, node)})
        cond = condition(plane, node)
        assert cond is not None
        # The reporter reads this host's boot ID, as the test does (issue 28).
        boot = read_boot_id()
        assert cond["message"] == f"1 of 2 GPUs unhealthy: GPU 1 {bad} (xid); boot ID {boot}"
        conditions = node_object(plane, node)["status"]["conditions"]
        # (A strategic merge patch puts a new condition first on the real server.)
        assert sorted(c["type"] for c in conditions) == [nh.CONDITION_TYPE, "Ready"]
        assert taints(plane, node)[0] == FOREIGN_TAINT

        await put_health(r.bus, node, gpu_health(bad, healthy=True))
        await wait_until(
            lambda: (condition(plane, node) or {}).get("status") == "True", timeout_s=15
        )
        await wait_until(lambda: taints(plane, node) == [FOREIGN_TAINT], timeout_s=15)
        writes = agent_writes(plane, node)
        assert writes.count("patch nodes/status") == 3  # True, False, True
        assert writes.count("patch nodes") == 2  # taint on, taint off
        responder.cancel_scope.cancel()


async def test_device_goes_with_its_node(
    nats_server: EmbeddedNats,
    kube_cluster: ControlPlane,
    gpulet_access: ControlPlane,
    agent: AgentIdentity,
    tmp_path: Path,
) -> None:
    """The owner reference the reporter writes is one the real garbage collector
    honours: deleting the Node deletes its Device."""
    plane, node = gpulet_access, agent.node
    async with running_reporter(
        nats_server.url, tmp_path, node, fast_settings(), env=agent.env, sa_dir=agent.sa_dir
    ) as r:
        await r.bus.publish(subjects.inventory(node), make_inventory(node), codec.INVENTORY)
        await wait_until(lambda: device(plane, node) is not None, timeout_s=15)
        await converged(r)
    plane.must("DELETE", f"/api/v1/nodes/{node}")
    await wait_until(lambda: device(plane, node) is None, timeout_s=30, what="Device collected")
