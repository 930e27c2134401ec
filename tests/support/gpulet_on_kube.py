"""gpulet's deploy/ on the real control plane, and the agent's own credentials there.

- :func:`apply_manifests` applies rendered objects with server-side apply, in the order a
  cluster needs them (Namespaces and CRDs first, then the CRDs Established, then the
  rest), and returns each object's answer;
- :func:`install_access` applies what gpulet needs to talk to the API at all: the
  namespace, the Device CRD, the ServiceAccount, the RBAC and the admission policy from
  deploy/kustomize/base, as rendered by ``kubectl kustomize``;
- :func:`agent_identity` gives one node's agent its credentials the way a DaemonSet pod
  gets them: a Pod of the DaemonSet's ServiceAccount bound to the node, a token from
  TokenRequest bound to that Pod (so it carries the node's name, as kubelet's projected
  token does), and the in-cluster environment (``KUBERNETES_SERVICE_HOST``/``PORT``
  and the service-account directory with ``token``, ``ca.crt`` and ``namespace``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.control_plane import ControlPlane, Response, object_path
from support.deploy import KUSTOMIZE, kustomize

NAMESPACE = "gpulet-system"
SERVICE_ACCOUNT = "gpulet"
AGENT_USER = f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}"
# What install_access takes from the base.
ACCESS_KINDS = frozenset(
    {
        "Namespace",
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
)
_FIRST = ("Namespace", "CustomResourceDefinition")


def _order(obj: Mapping[str, Any]) -> int:
    kind = obj.get("kind")
    return _FIRST.index(kind) if kind in _FIRST else len(_FIRST)


def wait_established(plane: ControlPlane, crd: str, timeout_s: float = 30.0) -> None:
    path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        conditions = (plane.must("GET", path).get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
            return
        time.sleep(0.05)
    raise AssertionError(f"CRD {crd} not Established within {timeout_s}s")


def apply_manifests(
    plane: ControlPlane,
    docs: Iterable[Mapping[str, Any]],
    *,
    manager: str = "gpulet-tests",
    token: str | None = None,
    dry_run: bool = False,
) -> list[tuple[Mapping[str, Any], Response]]:
    """Server-side apply of every object, Namespaces and CRDs first.

    ``dry_run``: the server validates and admits every object but stores only the
    Namespaces and CRDs (the others' home and schema). A test that only asks "does the
    server accept this?" uses it, so that what it applies -- RBAC above all -- never
    reaches the tests after it on the shared control plane."""
    ordered = sorted(docs, key=_order)
    results = []
    established = False
    for obj in ordered:
        if _order(obj) == len(_FIRST) and not established:
            for crd in ordered:
                if crd["kind"] == "CustomResourceDefinition":
                    wait_established(plane, crd["metadata"]["name"])
            established = True
        dry = dry_run and obj.get("kind") not in _FIRST
        results.append((obj, plane.apply(obj, manager=manager, token=token, dry_run=dry)))
    return results


def must_apply(plane: ControlPlane, docs: Iterable[Mapping[str, Any]], **kw: Any) -> None:
    for obj, resp in apply_manifests(plane, docs, **kw):
        if not resp.ok:
            raise AssertionError(
                f"apply {obj['kind']} {object_path(obj)} -> {resp.status}: {resp.raw[:1500]!r}"
            )


def install_access(plane: ControlPlane) -> list[dict[str, Any]]:
    """The base's namespace, CRD, ServiceAccount, RBAC and admission policy, applied,
    and the policy in force (the server loads a new policy asynchronously)."""
    docs = [d for d in kustomize(KUSTOMIZE / "base") if d["kind"] in ACCESS_KINDS]
    must_apply(plane, docs, manager="gpulet-install")
    if any(d["kind"] == "ValidatingAdmissionPolicyBinding" for d in docs):
        wait_policy_enforced(plane)
    return docs


def wait_policy_enforced(plane: ControlPlane, timeout_s: float = 30.0) -> None:
    """Until a write of gpulet's ServiceAccount without a node (a token not bound to a
    pod) is refused by the node restriction policy (a dry run: nothing is stored)."""
    token = plane.token_for(NAMESPACE, SERVICE_ACCOUNT)
    probe = {
        "apiVersion": "scheduling.koordinator.sh/v1alpha1",
        "kind": "Device",
        "metadata": {"name": "policy-probe"},
        "spec": {"devices": []},
    }
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        resp = plane.request(
            "POST",
            "/apis/scheduling.koordinator.sh/v1alpha1/devices",
            probe,
            token=token,
            query={"dryRun": "All"},
        )
        if resp.status == 403:
            return
        time.sleep(0.1)
    raise AssertionError(f"the node restriction policy is not in force after {timeout_s}s")


@dataclass
class AgentIdentity:
    """One node's agent credentials (see the module docstring)."""

    node: str
    pod: dict[str, Any]
    token: str
    sa_dir: Path
    env: dict[str, str]
    kubeconfig: Path


def agent_pod(plane: ControlPlane, node: str) -> dict[str, Any]:
    """A Pod of gpulet's ServiceAccount, bound to ``node`` (nothing runs it)."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"gpulet-{node}", "namespace": NAMESPACE},
        "spec": {
            "nodeName": node,
            "serviceAccountName": SERVICE_ACCOUNT,
            "automountServiceAccountToken": False,
            "containers": [{"name": "reporter", "image": "gpulet"}],
        },
    }
    pod: dict[str, Any] = plane.must("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", body)
    return pod


def agent_identity(plane: ControlPlane, node: str, directory: Path) -> AgentIdentity:
    pod = agent_pod(plane, node)
    token = plane.token_for(NAMESPACE, SERVICE_ACCOUNT, pod=pod)
    sa_dir = directory / "serviceaccount"
    sa_dir.mkdir(parents=True, exist_ok=True)
    (sa_dir / "token").write_text(token)
    (sa_dir / "ca.crt").write_bytes((plane.pki / "ca.crt").read_bytes())
    (sa_dir / "namespace").write_text(NAMESPACE)
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(plane.port)}
    kubeconfig = plane.write_token_kubeconfig(directory / "agent.kubeconfig", token, AGENT_USER)
    return AgentIdentity(node, pod, token, sa_dir, env, kubeconfig)
