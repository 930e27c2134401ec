"""What the remediation tests against the real control plane share: the remediation
component's RBAC for the agent (applied for one test, removed after), the agent's own
API client, pods as the scheduler and kubelet would leave them, and reading back what
the agent asked for (the audit log) and said (Events)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from gpulet_allocator.service.pod_watch import kube_configuration
from gpulet_common import kubeapi
from gpulet_common.settings.allocator import HandshakeSettings
from support.control_plane import ControlPlane
from support.deploy import KUSTOMIZE, kustomize
from support.gpulet_on_kube import AGENT_USER, AgentIdentity, must_apply
from support.waiting import wait_until

HANDSHAKE = HandshakeSettings(api_timeout_s=5.0)


@contextmanager
def remediation_rbac(gpulet_access: ControlPlane) -> Iterator[None]:
    """components/remediation applied for one test (other tests check that the base
    refuses evictions); removed afterwards."""
    docs = kustomize(KUSTOMIZE / "components" / "remediation")
    must_apply(gpulet_access, docs, manager="remediation-test")
    yield
    for doc in docs:
        plural = "clusterroles" if doc["kind"] == "ClusterRole" else "clusterrolebindings"
        gpulet_access.request(
            "DELETE", f"/apis/rbac.authorization.k8s.io/v1/{plural}/{doc['metadata']['name']}"
        )
    # The tests after this one see the base's rights again (RBAC follows in a moment).
    deadline = time.monotonic() + 30
    while may_evict(gpulet_access):
        assert time.monotonic() < deadline, "the remediation binding is still in force"
        time.sleep(0.1)


def may_evict(plane: ControlPlane) -> bool:
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": AGENT_USER,
            "groups": ["system:serviceaccounts", "system:authenticated"],
            "resourceAttributes": {
                "verb": "create",
                "resource": "pods",
                "subresource": "eviction",
                "namespace": "default",
            },
        },
    }
    answer = plane.must("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
    return bool(answer["status"].get("allowed"))


@asynccontextmanager
async def agent_api(
    agent: AgentIdentity, gpulet_access: ControlPlane
) -> AsyncIterator[kubeapi.KubeClient]:
    """The agent's own API client, once RBAC lets it evict."""

    # RBAC takes the new binding in a moment: an eviction of no pod answers 404, not 403.
    def allowed() -> bool:
        resp = gpulet_access.request(
            "POST",
            "/api/v1/namespaces/default/pods/no-such-pod/eviction",
            {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "no-such-pod"}},
            token=agent.token,
        )
        return resp.status == 404

    await wait_until(allowed, timeout_s=30, interval_s=0.1)
    configuration = await kube_configuration(HANDSHAKE, env=agent.env, sa_dir=agent.sa_dir)
    async with kubeapi.KubeClient(configuration) as api_client:
        yield api_client


def running_pod(
    plane: ControlPlane, ns: str, name: str, node: str, *, labels: dict[str, str] | None = None,
    claim: str = "",
) -> dict[str, Any]:  # fmt: skip
    spec: dict[str, Any] = {"nodeName": node, "containers": [{"name": "main", "image": "cuda"}]}
    if claim:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    pod: dict[str, Any] = plane.must(
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        {"metadata": {"name": name, "labels": labels or {}}, "spec": spec},
    )
    plane.must(
        "PATCH",
        f"/api/v1/namespaces/{ns}/pods/{name}/status",
        {
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        },
        content_type="application/merge-patch+json",
    )
    return pod


def terminating(plane: ControlPlane, ns: str, name: str) -> bool:
    pod = plane.must("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
    return bool(pod["metadata"].get("deletionTimestamp"))


def evicted_by_agent(plane: ControlPlane, node: str, since: int) -> list[tuple[str, int]]:
    """(pod, status) of each eviction the agent of ``node`` asked for."""
    return [
        (e["objectRef"]["name"], e["responseStatus"]["code"])
        for e in plane.audit(user=AGENT_USER, resource="pods/eviction", since=since)
        if e["user"].get("extra", {}).get("authentication.kubernetes.io/node-name") == [node]
        and e["objectRef"]["name"] != "no-such-pod"
    ]


def events(plane: ControlPlane, ns: str, reason: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = plane.must("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    return [e for e in items if e["reason"] == reason]


def node_events(
    plane: ControlPlane, node: str, reason: str = "GpuletEvictedForGpuFault"
) -> list[dict[str, Any]]:
    """The eviction Events on the Node (kept in the default namespace, as kubelet's)."""
    ref = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}
    found = events(plane, "default", reason)
    return [e for e in found if e["involvedObject"] == ref]


def cleanup(plane: ControlPlane, ns: str, names: list[str]) -> None:
    # Nothing runs these pods, so a graceful deletion would never finish.
    for name in names:
        plane.request(
            "DELETE",
            f"/api/v1/namespaces/{ns}/pods/{name}",
            {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
        )
