"""Least privilege per component: exactly which rights the base and each opt-in
component give the agent, read back from the real authorizer with the account's own
token.

Each case binds deploy/'s RBAC -- the base's, and the base's plus one component's --
to a ServiceAccount of its own, in a namespace of its own, under ClusterRole and binding
names of its own. The agent's real ServiceAccount (``gpulet-system/gpulet``) is never
touched, so nothing here can leak a right into another test on the shared control
plane, and no other test's RBAC can reach these accounts.

The rights are what ``SelfSubjectRulesReview`` answers for the account's token, minus
what any authenticated user has (discovery, self reviews): a set of
``(group, resource, verb, resourceNames)``. A component that gains a right, or the base
that gains one, fails here with the difference named, and the table below is where the
change is made on purpose.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.control_plane import ControlPlane, object_path
from support.control_plane_fixtures import unique_name
from support.deploy import KUSTOMIZE, kustomize
from support.gpulet_on_kube import NAMESPACE, SERVICE_ACCOUNT, must_apply

Right = tuple[str, str, str, str]  # group, resource, verb, resource names
RBAC_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")

BASE: frozenset[Right] = frozenset(
    {
        # The reporter: its Device, its node's labels, taints and condition.
        ("scheduling.koordinator.sh", "devices", "create", ""),
        ("scheduling.koordinator.sh", "devices", "get", ""),
        ("scheduling.koordinator.sh", "devices", "patch", ""),
        ("scheduling.koordinator.sh", "devices", "update", ""),
        ("", "nodes", "get", ""),
        ("", "nodes", "patch", ""),
        ("", "nodes/status", "patch", ""),
        # The allocator: its node's pods (Koordinator's handshake, PodResources names).
        ("", "pods", "get", ""),
        ("", "pods", "list", ""),
        ("", "pods", "watch", ""),
        # Events (the allocator's refusals, the remediation's evictions).
        ("", "events", "create", ""),
    }
)

# What each component adds to the base; components that only change the DaemonSet or
# the settings add nothing.
ADDS: dict[str, frozenset[Right]] = {
    "remediation": frozenset({("", "pods/eviction", "create", "")}),
    "time-slicing": frozenset({("", "nodes", "list", ""), ("", "nodes", "watch", "")}),
    "dra": frozenset(
        {
            ("resource.k8s.io", "resourceslices", verb, "")
            for verb in ("list", "watch", "create", "update", "delete")
        }
        | {("resource.k8s.io", "resourceclaims", "get", "")}
        # Prepare reports on the claim (status.devices), for its own driver only.
        | {("resource.k8s.io", "resourceclaims/status", "update", "")}
        | {("resource.k8s.io", "resourceclaims/driver", "associated-node:update", "gpu.gpulet.io")}
    ),
    "mps": frozenset(),
    "nats-fleet": frozenset(),
    "nats-leaf": frozenset(),
    "alerts": frozenset(),
}


def _rbac(path: Path) -> list[dict[str, Any]]:
    """The RBAC of the base (rendered) or of a component (its files: a kustomize
    Component renders only inside a kustomization)."""
    if path.parent.name == "components":
        docs = [
            d
            for file in sorted(path.glob("*.yaml"))
            if file.name != "kustomization.yaml"
            for d in yaml.safe_load_all(file.read_text())
            if d and d.get("kind") in RBAC_KINDS
        ]
    else:
        docs = [d for d in kustomize(path) if d["kind"] in RBAC_KINDS]
    # Only cluster-wide RBAC: a namespaced Role would need its namespace's twin here.
    assert all(d["kind"].startswith("Cluster") for d in docs), [d["kind"] for d in docs]
    return docs


def _for_account(
    docs: list[dict[str, Any]], suffix: str, namespace: str, account: str
) -> list[dict[str, Any]]:
    """deploy/'s RBAC, renamed with ``suffix`` and bound to ``namespace/account``
    instead of gpulet's ServiceAccount."""
    out = []
    for doc in copy.deepcopy(docs):
        doc["metadata"]["name"] += suffix
        if doc["kind"].endswith("Binding"):
            doc["roleRef"]["name"] += suffix
            subjects = doc.get("subjects") or []
            assert subjects == [
                {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}
            ], f"{doc['metadata']['name']} binds someone else: {subjects}"
            doc["subjects"] = [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]
        out.append(doc)
    return out


def _rights(plane: ControlPlane, token: str, namespace: str) -> set[Right]:
    review = plane.must(
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectRulesReview",
            "spec": {"namespace": namespace},
        },
        token=token,
    )
    status = review["status"]
    assert not status.get("incomplete"), status.get("evaluationError")
    rights: set[Right] = set()
    for rule in status.get("resourceRules") or []:
        names = ",".join(sorted(rule.get("resourceNames") or []))
        for group in rule.get("apiGroups") or []:
            for resource in rule.get("resources") or []:
                for verb in rule.get("verbs") or []:
                    rights.add((group, resource, verb, names))
    return rights


class Accounts:
    """Fresh ServiceAccounts, each with the RBAC it is given; all removed at the end."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.namespace = unique_name("rights")
        plane.create_namespace(self.namespace)
        self.created: list[Mapping[str, Any]] = []

    def with_rbac(self, docs: list[dict[str, Any]]) -> str:
        """A new account bound to ``docs``; its token once RBAC has taken the binding."""
        account = unique_name("sa")
        self.plane.must(
            "POST",
            f"/api/v1/namespaces/{self.namespace}/serviceaccounts",
            {"metadata": {"name": account}},
        )
        bound = _for_account(docs, "-" + account, self.namespace, account)
        must_apply(self.plane, bound, manager="component-rights")
        self.created += bound
        return self.plane.token_for(self.namespace, account)

    def remove(self) -> None:
        for doc in self.created:
            self.plane.request("DELETE", object_path(doc))
        self.plane.request("DELETE", f"/api/v1/namespaces/{self.namespace}")


@pytest.fixture
def accounts(gpulet_access: ControlPlane) -> Iterator[Accounts]:
    made = Accounts(gpulet_access)
    try:
        yield made
    finally:
        made.remove()


def _settled_rights(
    plane: ControlPlane, token: str, namespace: str, want: set[Right]
) -> set[Right]:
    """The account's rights once RBAC has taken its new bindings (a moment after the
    apply): the first answer that equals ``want``, else the last one after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        got = _rights(plane, token, namespace)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


@pytest.mark.parametrize("component", sorted(ADDS))
def test_each_component_adds_exactly_its_rights(accounts: Accounts, component: str) -> None:
    plane = accounts.plane
    nothing = accounts.with_rbac([])
    everyone = _rights(plane, nothing, accounts.namespace)  # what any account may do
    base_docs = _rbac(KUSTOMIZE / "base")
    base = accounts.with_rbac(base_docs)
    base_rights = _settled_rights(plane, base, accounts.namespace, everyone | BASE) - everyone
    assert base_rights == BASE, {
        "granted beyond the table": sorted(base_rights - BASE),
        "missing": sorted(BASE - base_rights),
    }
    added_docs = _rbac(KUSTOMIZE / "components" / component)
    full = accounts.with_rbac(base_docs + added_docs)
    want = everyone | BASE | ADDS[component]
    added = _settled_rights(plane, full, accounts.namespace, want) - everyone - BASE
    assert added == ADDS[component], {
        "granted beyond the table": sorted(added - ADDS[component]),
        "missing": sorted(ADDS[component] - added),
    }


def test_every_component_is_in_the_table() -> None:
    on_disk = {p.name for p in (KUSTOMIZE / "components").iterdir() if p.is_dir()}
    assert on_disk == set(ADDS)


def test_the_tables_are_what_the_rbac_files_say() -> None:
    """The same rights read from the files, so that a rule the server would not show
    (a typo in a group) cannot make both sides agree by accident."""

    def declared(docs: list[dict[str, Any]]) -> set[Right]:
        return {
            (group, resource, verb, ",".join(sorted(rule.get("resourceNames") or [])))
            for doc in docs
            if doc["kind"] == "ClusterRole"
            for rule in doc.get("rules") or []
            for group in rule.get("apiGroups") or []
            for resource in rule.get("resources") or []
            for verb in rule.get("verbs") or []
        }

    assert declared(_rbac(KUSTOMIZE / "base")) == BASE
    for component, adds in ADDS.items():
        assert declared(_rbac(KUSTOMIZE / "components" / component)) == adds, component
