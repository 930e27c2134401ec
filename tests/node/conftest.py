"""Fixtures of the real-node tests: one real node (support.node: containerd and a
kubelet joined to the session's real control plane) per test module, and gpulet on it.

Only one real kubelet can run on a machine (its device-plugin socket is fixed at
/var/lib/kubelet/device-plugins/kubelet.sock), so :func:`real_node` holds the
machine-wide lock of support.node.exclusive for the module: under ``pytest -n 2 --dist
loadfile`` a second node module waits for the first to finish.

Missing parts FAIL the tests with how to build them (``scripts/k8s-bins.sh``; Debian's
runc, containernetworking-plugins, busybox-static and buildah): none may be skipped.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.control_plane import ControlPlane
from support.control_plane_fixtures import unique_name
from support.node import Pods, RealNode, exclusive
from support.node_parts import MissingParts


@pytest.fixture(scope="module")
def real_node(
    kube_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealNode]:
    with exclusive():
        # A short root: unix socket paths are limited to 107 bytes.
        root = Path(tempfile.mkdtemp(prefix="gn", dir="/tmp"))
        try:
            node = RealNode(kube_cluster, unique_name("real-node"), root)
        except MissingParts as exc:
            shutil.rmtree(root, ignore_errors=True)
            pytest.fail(str(exc), pytrace=False)
        try:
            node.start()
            print(f"\nreal node {node.name} ready in {node.started_in_s:.1f} s")
            yield node
        except BaseException:
            print(node.logs(60))
            raise
        finally:
            node.stop()
            kube_cluster.request("DELETE", f"/api/v1/nodes/{node.name}")
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def node_namespace(real_node: RealNode) -> Iterator[str]:
    name = unique_name("node")
    real_node.plane.create_namespace(name)
    yield name
    real_node.plane.request("DELETE", f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="module")
def pods(real_node: RealNode, node_namespace: str) -> Pods:
    return Pods(real_node.plane, node_namespace)
