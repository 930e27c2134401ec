"""Least privilege, proven against the real authorizer and admission chain.

The agent's credentials are the DaemonSet's: deploy/'s ServiceAccount, a token from
TokenRequest bound to a Pod on node A (so it carries A's name, as the projected token
kubelet mounts does). Authorization is the real ``Node,RBAC`` with deploy/'s RBAC, and
admission includes deploy/'s node restriction policy (base/node-restriction.yaml).

- Everything the agent does succeeds: its Device, its node's labels, annotation, taint
  and condition, the pod list and watch, Events.
- What it must not do is refused, each with the status the server gives: another
  node's Device, labels, taints or status; labels, taints or conditions of its node that
  are not its own; Secrets; deleting or creating pods; anything else.
- The finding that made the policy necessary: a SubjectAccessReview shows that RBAC
  alone (the Node authorizer does not apply to ServiceAccounts) allows the agent of A to
  patch node B's Device and labels. The policy is what refuses them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulet_reporter import node_health as nh
from support.control_plane import ControlPlane, Response
from support.control_plane_fixtures import unique_name
from support.gpulet_on_kube import (
    AGENT_USER,
    NAMESPACE,
    SERVICE_ACCOUNT,
    AgentIdentity,
    agent_identity,
)

DEVICES = "/apis/scheduling.koordinator.sh/v1alpha1/devices"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


def device_body(node: str) -> dict[str, Any]:
    return {
        "apiVersion": "scheduling.koordinator.sh/v1alpha1",
        "kind": "Device",
        "metadata": {"name": node},
        "spec": {"devices": []},
    }


@pytest.fixture
def nodes(gpulet_access: ControlPlane) -> Iterator[tuple[str, str]]:
    """Node A (the agent's) and node B (another node, with its Device)."""
    a, b = unique_name("node-a"), unique_name("node-b")
    gpulet_access.add_node(a, labels={"team": "ml"})
    gpulet_access.add_node(b)
    gpulet_access.must("POST", DEVICES, device_body(b))
    yield a, b
    for name in (a, b):
        gpulet_access.request("DELETE", f"/api/v1/nodes/{name}")
        gpulet_access.request("DELETE", f"{DEVICES}/{name}")


@pytest.fixture
def agent(gpulet_access: ControlPlane, nodes: tuple[str, str], tmp_path: Path) -> AgentIdentity:
    return agent_identity(gpulet_access, nodes[0], tmp_path)


def as_agent(
    plane: ControlPlane,
    agent: AgentIdentity,
    method: str,
    path: str,
    body: Any = None,
    content_type: str = "application/json",
) -> Response:
    return plane.request(method, path, body, token=agent.token, content_type=content_type)


def patch_node(
    plane: ControlPlane, agent: AgentIdentity, node: str, body: Any, *, status: bool = False
) -> Response:
    """As the agent: a merge patch of the Node, or a strategic one of its status."""
    if status:
        return as_agent(plane, agent, "PATCH", f"/api/v1/nodes/{node}/status", body, STRATEGIC)
    return as_agent(plane, agent, "PATCH", f"/api/v1/nodes/{node}", body, MERGE)


def condition(status: str) -> dict[str, Any]:
    return {
        "type": nh.CONDITION_TYPE,
        "status": status,
        "reason": "AllGPUsHealthy",
        "message": "all 8 GPUs healthy",
        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }


def test_the_policy_type_checks_clean(
    kube_cluster: ControlPlane, gpulet_access: ControlPlane
) -> None:
    """A CEL expression that fails at run time would deny every agent write (failure
    policy Fail): the type check of the policy (the controller manager's
    validatingadmissionpolicy-status controller) must find nothing."""
    path = (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/gpulet-node-restriction"
    )

    def checked() -> dict[str, Any] | None:
        policy = gpulet_access.must("GET", path)
        status = policy.get("status") or {}
        if status.get("observedGeneration") != policy["metadata"]["generation"]:
            return None
        checking: dict[str, Any] = status.get("typeChecking") or {}
        return checking

    deadline = time.monotonic() + 30
    while (checking := checked()) is None:
        assert time.monotonic() < deadline, "the server never type-checked the policy"
        time.sleep(0.1)
    assert checking.get("expressionWarnings") in (None, [])


def test_everything_the_agent_does_succeeds(
    gpulet_access: ControlPlane, agent: AgentIdentity, kube_namespace: str
) -> None:
    plane, a = gpulet_access, agent.node
    own = f"{DEVICES}/{a}"
    allowed: list[tuple[str, Response]] = [
        ("create its Device", as_agent(plane, agent, "POST", DEVICES, device_body(a))),
        ("get its Device", as_agent(plane, agent, "GET", own)),
        (
            "merge-patch its Device",
            as_agent(plane, agent, "PATCH", own, {"metadata": {"labels": {"x": "y"}}}, MERGE),
        ),
        (
            "replace its Device",
            as_agent(plane, agent, "PUT", own, as_agent(plane, agent, "GET", own).body),
        ),
        ("get its Node", as_agent(plane, agent, "GET", f"/api/v1/nodes/{a}")),
        (
            "label its Node",
            as_agent(
                plane,
                agent,
                "PATCH",
                f"/api/v1/nodes/{a}",
                {
                    "metadata": {
                        "labels": {
                            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                            "node.koordinator.sh/gpu-model": "H100-80GB-HBM3",
                        },
                        "annotations": {"gpulet.io/managed-labels": "nvidia.com/gpu.product"},
                    }
                },
                MERGE,
            ),
        ),
        (
            "taint its Node",
            as_agent(
                plane,
                agent,
                "PATCH",
                f"/api/v1/nodes/{a}",
                {"spec": {"taints": [{"key": nh.TAINT_KEY, "effect": "NoSchedule"}]}},
                MERGE,
            ),
        ),
        (
            "untaint its Node",
            patch_node(plane, agent, a, {"spec": {"taints": None}}),
        ),
        (
            "set its condition",
            as_agent(
                plane,
                agent,
                "PATCH",
                f"/api/v1/nodes/{a}/status",
                {"status": {"conditions": [condition("True")]}},
                STRATEGIC,
            ),
        ),
        (
            "list its node's pods",
            as_agent(plane, agent, "GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{a}"),
        ),
        (
            "watch its node's pods",
            as_agent(
                plane,
                agent,
                "GET",
                f"/api/v1/pods?watch=1&timeoutSeconds=1&fieldSelector=spec.nodeName%3D{a}",
            ),
        ),
        (
            "post an Event",
            as_agent(
                plane,
                agent,
                "POST",
                f"/api/v1/namespaces/{kube_namespace}/events",
                {
                    "metadata": {"name": unique_name("ev")},
                    "involvedObject": {"kind": "Pod", "name": "p", "namespace": kube_namespace},
                    "reason": "GpuletRefusedSchedulerDecision",
                    "message": "m",
                    "type": "Warning",
                },
            ),
        ),
    ]
    failed = {what: (r.status, r.raw[:1500].decode()) for what, r in allowed if not r.ok}
    assert failed == {}
    node = plane.must("GET", f"/api/v1/nodes/{a}")
    assert node["metadata"]["labels"]["team"] == "ml"
    assert sorted(c["type"] for c in node["status"]["conditions"]) == [nh.CONDITION_TYPE, "Ready"]


def test_what_the_agent_must_not_do_is_refused(
    gpulet_access: ControlPlane,
    agent: AgentIdentity,
    nodes: tuple[str, str],
    kube_namespace: str,
) -> None:
    plane, (a, b) = gpulet_access, nodes
    plane.must("POST", DEVICES, device_body(a))
    plane.must(
        "PATCH",
        f"/api/v1/nodes/{a}",
        {"spec": {"taints": [{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]}},
        content_type=MERGE,
    )
    secret = {"metadata": {"name": "s"}, "stringData": {"k": "v"}}
    plane.must("POST", f"/api/v1/namespaces/{kube_namespace}/secrets", secret)
    plane.must(
        "POST",
        f"/api/v1/namespaces/{kube_namespace}/pods",
        {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
    )
    ns = kube_namespace
    label = {"metadata": {"labels": {"nvidia.com/gpu.product": "forged"}}}
    # (what, request, the status the server must answer: 403 from RBAC or the policy)
    refused: list[tuple[str, Response]] = [
        # Other nodes' objects: RBAC allows these (see the SubjectAccessReview test);
        # the node restriction policy refuses them.
        (
            "patch node B's Device",
            as_agent(plane, agent, "PATCH", f"{DEVICES}/{b}", {"spec": {"devices": []}}, MERGE),
        ),
        ("create a Device for node X", as_agent(plane, agent, "POST", DEVICES, device_body("x"))),
        ("label node B", as_agent(plane, agent, "PATCH", f"/api/v1/nodes/{b}", label, MERGE)),
        (
            "taint node B",
            as_agent(
                plane,
                agent,
                "PATCH",
                f"/api/v1/nodes/{b}",
                {"spec": {"taints": [{"key": nh.TAINT_KEY, "effect": "NoSchedule"}]}},
                MERGE,
            ),
        ),
        (
            "set node B's condition",
            as_agent(
                plane,
                agent,
                "PATCH",
                f"/api/v1/nodes/{b}/status",
                {"status": {"conditions": [condition("False")]}},
                STRATEGIC,
            ),
        ),
        # Its own node, beyond what is its own.
        (
            "change a foreign label of its node",
            patch_node(plane, agent, a, {"metadata": {"labels": {"team": "x"}}}),
        ),
        (
            "change a foreign label of its node through nodes/status",
            patch_node(plane, agent, a, {"metadata": {"labels": {"team": "x"}}}, status=True),
        ),
        (
            "annotate its node outside gpulet.io/ through nodes/status",
            patch_node(
                plane, agent, a, {"metadata": {"annotations": {"example.com/x": "y"}}}, status=True
            ),
        ),
        (
            "remove a foreign label of its node",
            patch_node(plane, agent, a, {"metadata": {"labels": {"team": None}}}),
        ),
        (
            "annotate its node outside gpulet.io/",
            as_agent(
                plane,
                agent,
                "PATCH",
                f"/api/v1/nodes/{a}",
                {"metadata": {"annotations": {"example.com/x": "y"}}},
                MERGE,
            ),
        ),
        (
            "remove a foreign taint of its node",
            patch_node(plane, agent, a, {"spec": {"taints": None}}),
        ),
        (
            "cordon its node",
            patch_node(plane, agent, a, {"spec": {"unschedulable": True}}),
        ),
        (
            "set kubelet's Ready condition",
            as_agent(
                plane,
                agent,
                "PATCH",
                f"/api/v1/nodes/{a}/status",
                {"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
                STRATEGIC,
            ),
        ),
        # RBAC: nothing outside its own resources and verbs.
        ("read a Secret", as_agent(plane, agent, "GET", f"/api/v1/namespaces/{ns}/secrets/s")),
        ("list Secrets", as_agent(plane, agent, "GET", "/api/v1/secrets")),
        (
            "read its own namespace's Secrets",
            as_agent(plane, agent, "GET", f"/api/v1/namespaces/{NAMESPACE}/secrets"),
        ),
        ("delete a pod", as_agent(plane, agent, "DELETE", f"/api/v1/namespaces/{ns}/pods/p")),
        (
            "evict a pod",
            as_agent(
                plane,
                agent,
                "POST",
                f"/api/v1/namespaces/{ns}/pods/p/eviction",
                {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "p"}},
            ),
        ),
        (
            "create a pod",
            as_agent(
                plane,
                agent,
                "POST",
                f"/api/v1/namespaces/{ns}/pods",
                {"metadata": {"name": "q"}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
            ),
        ),
        (
            "patch a pod",
            as_agent(
                plane,
                agent,
                "PATCH",
                f"/api/v1/namespaces/{ns}/pods/p",
                {"metadata": {"labels": {"x": "y"}}},
                MERGE,
            ),
        ),
        ("delete its Device", as_agent(plane, agent, "DELETE", f"{DEVICES}/{a}")),
        ("list Devices", as_agent(plane, agent, "GET", DEVICES)),
        ("delete its Node", as_agent(plane, agent, "DELETE", f"/api/v1/nodes/{a}")),
        ("list Nodes", as_agent(plane, agent, "GET", "/api/v1/nodes")),
        (
            "create a ConfigMap",
            as_agent(
                plane,
                agent,
                "POST",
                f"/api/v1/namespaces/{NAMESPACE}/configmaps",
                {"metadata": {"name": "x"}},
            ),
        ),
        (
            "change its own RBAC",
            as_agent(
                plane,
                agent,
                "PATCH",
                "/apis/rbac.authorization.k8s.io/v1/clusterroles/gpulet-reporter",
                {"rules": []},
                MERGE,
            ),
        ),
        (
            "mint itself a token",
            as_agent(
                plane,
                agent,
                "POST",
                f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{SERVICE_ACCOUNT}/token",
                {"spec": {"audiences": ["x"]}},
            ),
        ),
    ]
    statuses = {what: r.status for what, r in refused}
    assert statuses == dict.fromkeys(statuses, 403), {
        what: r.raw[:300] for what, r in refused if r.status != 403
    }
    # Nothing changed.
    node = plane.must("GET", f"/api/v1/nodes/{a}")
    assert node["metadata"]["labels"]["team"] == "ml"
    assert node["spec"]["taints"] == [{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]
    assert "nvidia.com/gpu.product" not in (
        plane.must("GET", f"/api/v1/nodes/{b}")["metadata"].get("labels") or {}
    )


def test_a_token_without_a_node_writes_nothing(
    gpulet_access: ControlPlane, nodes: tuple[str, str]
) -> None:
    """A token of the ServiceAccount not bound to a pod (so naming no node) is refused
    every write, its own-looking Device included."""
    a, _ = nodes
    token = gpulet_access.token_for(NAMESPACE, SERVICE_ACCOUNT)
    resp = gpulet_access.request("POST", DEVICES, device_body(a), token=token)
    assert resp.status == 403
    assert "bound to a pod on a node" in resp.body["message"]
    # Reads are RBAC's business alone.
    assert gpulet_access.request("GET", f"/api/v1/nodes/{a}", token=token).status == 200


def _rbac_allows(plane: ControlPlane, node: str, verb: str, resource: str, name: str) -> bool:
    group, _, plural = resource.rpartition("/")
    plural, _, sub = plural.partition(".")
    review = plane.must(
        "POST",
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": AGENT_USER,
                "groups": [
                    "system:serviceaccounts",
                    f"system:serviceaccounts:{NAMESPACE}",
                    "system:authenticated",
                ],
                "extra": {NODE_NAME_EXTRA: [node]},
                "resourceAttributes": {
                    "group": group,
                    "resource": plural,
                    "subresource": sub,
                    "verb": verb,
                    "name": name,
                },
            },
        },
    )
    allowed: bool = review["status"].get("allowed", False)
    return allowed


def test_rbac_alone_lets_an_agent_write_other_nodes_the_policy_is_what_refuses(
    gpulet_access: ControlPlane, nodes: tuple[str, str]
) -> None:
    """The finding: authorization (Node,RBAC with deploy/'s rules) answers yes for
    another node's Device, labels and status, so without the admission policy one
    node's compromised agent could mark every GPU in the cluster unhealthy or relabel
    every node. Recorded here so that a change in either layer shows."""
    a, b = nodes
    for verb, resource in (
        ("patch", "scheduling.koordinator.sh/devices"),
        ("update", "scheduling.koordinator.sh/devices"),
        ("patch", "/nodes"),
        ("patch", "/nodes.status"),
    ):
        assert _rbac_allows(gpulet_access, a, verb, resource, b), (verb, resource)
    # ... and what RBAC itself refuses stays refused there.
    for verb, resource in (
        ("delete", "scheduling.koordinator.sh/devices"),
        ("get", "/secrets"),
        ("delete", "/pods"),
        ("update", "/nodes.status"),
    ):
        assert not _rbac_allows(gpulet_access, a, verb, resource, b), (verb, resource)
