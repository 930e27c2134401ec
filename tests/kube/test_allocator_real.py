"""The allocator's Koordinator handshake against the real kube-apiserver: the pod watch
(list + watch of this node's pods by field selector, resumed across the server's watch
timeouts) and the Warning Events it posts, with the agent's own in-cluster credentials
(deploy/'s ServiceAccount, a token bound to a Pod on the node, ``Node,RBAC``).

Pods are created by the test as the scheduler would leave them (``spec.nodeName`` set,
Koordinator's decision annotation); nothing runs them. They are deleted with a grace
period of 0, as nothing (no kubelet) would confirm a graceful deletion.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpulet_allocator.decide.koordinator import (
    ANNOTATION_DEVICE_ALLOCATED,
    Decision,
    PodBook,
    PodKey,
)
from gpulet_allocator.service.pod_watch import (
    EVENT_REASON,
    EventWriter,
    PodWatch,
    kube_configuration,
)
from gpulet_common.kubeapi import KubeClient
from gpulet_common.settings.allocator import HandshakeSettings
from support.control_plane import ControlPlane
from support.gpulet_on_kube import AGENT_USER, AgentIdentity, agent_identity
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

SETTINGS = HandshakeSettings(enabled=True, api_timeout_s=5.0, watch_timeout_s=1.0)
DECISION = json.dumps({"gpu": [{"minor": 0}]})


@pytest.fixture
def agent(gpulet_access: ControlPlane, kube_node_name: str, tmp_path: Path) -> AgentIdentity:
    return agent_identity(gpulet_access, kube_node_name, tmp_path / "agent")


@pytest.fixture
async def api(agent: AgentIdentity) -> AsyncIterator[KubeClient]:
    configuration = await kube_configuration(SETTINGS, env=agent.env, sa_dir=agent.sa_dir)
    async with KubeClient(configuration) as api_client:
        yield api_client


def make_pod(
    plane: ControlPlane, namespace: str, name: str, node: str, *, decision: str | None = None
) -> dict[str, Any]:
    annotations = {ANNOTATION_DEVICE_ALLOCATED: decision} if decision else {}
    pod: dict[str, Any] = plane.must(
        "POST",
        f"/api/v1/namespaces/{namespace}/pods",
        {
            "metadata": {"name": name, "annotations": annotations},
            "spec": {
                "nodeName": node,
                "containers": [{"name": "main", "image": "cuda"}],
            },
        },
    )
    return pod


def delete_pod(plane: ControlPlane, namespace: str, name: str) -> None:
    plane.must(
        "DELETE",
        f"/api/v1/namespaces/{namespace}/pods/{name}",
        {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
    )


def names(book: PodBook) -> set[str]:
    """The book's pods, less gpulet's own (agent_identity's Pod is on the node too)."""
    return {p.key.name for p in book.pods.values() if not p.key.name.startswith("gpulet-")}


async def test_pod_watch_follows_this_nodes_pods_and_resumes_across_watch_timeouts(
    gpulet_access: ControlPlane,
    agent: AgentIdentity,
    api: KubeClient,
    kube_namespace: str,
    kube_node_name: str,
) -> None:
    plane, node, ns = gpulet_access, agent.node, kube_namespace
    make_pod(plane, ns, "before", node, decision=DECISION)
    make_pod(plane, ns, "elsewhere", f"{node}-other")
    book = PodBook(node)
    watch = PodWatch(api, book, SETTINGS)
    async with anyio.create_task_group() as tg:
        await tg.start(watch.run)
        assert book.synced
        assert names(book) == {"before"}
        before = next(p for p in book.pods.values() if p.key.name == "before")
        assert isinstance(before.decision, Decision)
        make_pod(plane, ns, "after", node)
        make_pod(plane, ns, "other", f"{node}-other")
        await wait_until(lambda: names(book) == {"before", "after"}, timeout_s=10)
        delete_pod(plane, ns, "before")
        await wait_until(lambda: names(book) == {"after"}, timeout_s=10)
        # The server ends each watch after watch_timeout_s; it reopens from the last
        # version, without a new list and without missing what came meanwhile.
        opened = watch.watches
        await wait_until(lambda: watch.watches >= opened + 2, timeout_s=10)
        make_pod(plane, ns, "late", node)
        await wait_until(lambda: "late" in names(book), timeout_s=10)
        assert watch.lists == 1
        assert watch.bad_lines == 0
        tg.cancel_scope.cancel()
    # What the agent asked, as the server saw it: lists and watches of pods, no write.
    asked = {
        (e["verb"], e["objectRef"]["resource"])
        for e in plane.audit(user=AGENT_USER)
        if e["user"].get("extra", {}).get("authentication.kubernetes.io/node-name") == [node]
    }
    assert asked == {("list", "pods"), ("watch", "pods")}


async def test_events_on_a_refused_pod_are_accepted_by_the_real_server(
    gpulet_access: ControlPlane,
    agent: AgentIdentity,
    api: KubeClient,
    kube_namespace: str,
) -> None:
    plane, node, ns = gpulet_access, agent.node, kube_namespace
    created = make_pod(plane, ns, "doomed", node, decision=DECISION)
    pod = PodKey(ns, "doomed", created["metadata"]["uid"])
    writer = EventWriter(api, node, SETTINGS)

    def events() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = plane.must("GET", f"/api/v1/namespaces/{ns}/events")["items"]
        return [e for e in items if e["reason"] == EVENT_REASON]

    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        writer.post(pod, "GPU minor 2 is unhealthy")
        writer.post(pod, "GPU minor 2 is unhealthy")  # the same: once
        writer.post(pod, "kubelet allocated minor 3")
        await wait_until(lambda: writer.sent + writer.failed == 2, timeout_s=10)
        tg.cancel_scope.cancel()
    assert writer.failed == 0
    got = events()
    assert sorted(e["message"] for e in got) == [
        "GPU minor 2 is unhealthy",
        "kubelet allocated minor 3",
    ]
    event = got[0]
    assert event["type"] == "Warning"
    assert event["involvedObject"]["uid"] == pod.uid
    assert event["source"] == {"component": "gpulet-allocator", "host": node}
