"""pytest fixtures over :mod:`support.control_plane`, registered for the whole suite by
tests/conftest.py (``pytest_plugins``); a session that asks for none starts nothing.

- ``kube_api``: etcd and kube-apiserver, one per test session (started on first use, a
  few seconds), with the token-file users of :data:`SESSION_USERS`;
- ``kube_cluster``: the same server plus kube-scheduler and kube-controller-manager
  (the controllers in :data:`CONTROLLERS`), started on first use;
- ``gpulet_access``: ``kube_api`` with gpulet's namespace, Device CRD, ServiceAccount,
  RBAC and admission policy from deploy/ applied (support.gpulet_on_kube);
- ``kube_namespace``: a fresh namespace (with its default ServiceAccount) per test;
- ``kube_node_name``: a Node name unique to the test (Nodes are cluster-scoped, so
  tests that share the server never share a Node).

Missing binaries FAIL the test with how to build them (``scripts/k8s-bins.sh``): the
real-server tests are part of ``make test``, which builds them first, and none may be
skipped on CI.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.control_plane import ControlPlane, Credentials, MissingBinaries
from support.gpulet_on_kube import install_access

# The controllers the tests need: claims from ResourceClaimTemplates (DRA), the
# PodDisruptionBudget status the Eviction API reads, ServiceAccounts and their tokens,
# the kube-root-ca.crt ConfigMap that projected tokens mount, namespace deletion, and
# owner-reference garbage collection (a Device goes with its Node), and the type check
# of ValidatingAdmissionPolicies (their status).
CONTROLLERS = (
    "resourceclaim-controller",
    "disruption-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "namespace-controller",
    "garbage-collector-controller",
    "validatingadmissionpolicy-status-controller",
)

# Token-file users every session's server knows (a test that needs a user of its own
# takes a real ServiceAccount token from TokenRequest instead: ControlPlane.token_for).
SESSION_USERS: tuple[Credentials, ...] = ()


@pytest.fixture(scope="session")
def kube_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd and kube-apiserver for the whole session, with an admin kubeconfig written
    to ``<workdir>/admin.kubeconfig``."""
    workdir: Path = tmp_path_factory.mktemp("control-plane")
    try:
        plane = ControlPlane(workdir, users=SESSION_USERS)
    except MissingBinaries as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        plane.start()
        plane.write_kubeconfig(workdir / "admin.kubeconfig")
        print(f"\ncontrol plane ready in {plane.started_in_s:.1f} s at {plane.url}")
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kube_cluster(kube_api: ControlPlane) -> ControlPlane:
    """``kube_api`` plus kube-scheduler and kube-controller-manager."""
    if not any(p.name == "kube-scheduler" for p in kube_api.others):
        t0 = time.monotonic()
        try:
            kube_api.start_scheduler()
            kube_api.start_controller_manager(CONTROLLERS)
        except MissingBinaries as exc:
            pytest.fail(str(exc), pytrace=False)
        print(f"\nscheduler and controller manager ready in {time.monotonic() - t0:.1f} s")
    return kube_api


@pytest.fixture(scope="session")
def gpulet_access(kube_api: ControlPlane) -> ControlPlane:
    """``kube_api`` with deploy/'s namespace, CRD, ServiceAccount, RBAC and policy."""
    install_access(kube_api)
    return kube_api


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def kube_namespace(kube_api: ControlPlane) -> Iterator[str]:
    name = unique_name("t")
    kube_api.create_namespace(name)
    yield name
    kube_api.request("DELETE", f"/api/v1/namespaces/{name}")


@pytest.fixture
def kube_node_name() -> str:
    return unique_name("gpu-node")
