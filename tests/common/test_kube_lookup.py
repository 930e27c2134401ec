"""gpulet_common.kube: the API-server lookup shared by the reporter and the allocator."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpulet_common.kube import (
    KubeConfigError,
    from_kubeconfig,
    in_cluster,
    in_cluster_available,
    kubeconfig_path,
)

pytestmark = pytest.mark.anyio

KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters:
- name: a
  cluster: {server: "https://127.0.0.1:6443"}
- name: b
  cluster: {server: "https://127.0.0.1:7443"}
users:
- name: u
  user: {token: t}
contexts:
- name: ca
  context: {cluster: a, user: u}
- name: cb
  context: {cluster: b, user: u}
current-context: ca
"""


def test_path_order(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    assert kubeconfig_path("", {"HOME": str(home)}) is None
    (home / ".kube" / "config").write_text(KUBECONFIG)
    assert kubeconfig_path("", {"HOME": str(home)}) == str(home / ".kube" / "config")
    one, missing = tmp_path / "one", tmp_path / "missing"
    one.write_text(KUBECONFIG)
    listed = os.pathsep.join([str(missing), str(one)])
    # $KUBECONFIG wins over ~/.kube/config and keeps only the files that exist.
    assert kubeconfig_path("", {"HOME": str(home), "KUBECONFIG": listed}) == str(one)
    assert kubeconfig_path("", {"KUBECONFIG": str(missing)}) is None
    # A configured path wins over both, even before it exists.
    assert kubeconfig_path("/x/y", {"KUBECONFIG": str(one)}) == "/x/y"


async def test_kubeconfig_context(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text(KUBECONFIG)
    assert (await from_kubeconfig(str(path))).host == "https://127.0.0.1:6443"
    assert (await from_kubeconfig(str(path), "cb")).host == "https://127.0.0.1:7443"


@pytest.mark.parametrize(
    ("content", "context", "reason"),
    [
        (None, "", "not found"),
        ("{[not yaml", "", "unusable"),
        ("42", "", "unusable"),
        (KUBECONFIG, "nope", "unusable"),
    ],
)
async def test_kubeconfig_failures_are_one_error(
    tmp_path: Path, content: str | None, context: str, reason: str
) -> None:
    path = tmp_path / "config"
    if content is not None:
        path.write_text(content)
    with pytest.raises(KubeConfigError, match=reason):
        await from_kubeconfig(str(path), context)


def test_in_cluster(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
    assert not in_cluster_available(env, tmp_path)
    (tmp_path / "token").write_text("tok")
    assert in_cluster_available(env, tmp_path)
    assert not in_cluster_available({"KUBERNETES_SERVICE_HOST": "127.0.0.1"}, tmp_path)
    # No CA certificate next to the token: refused with the reason, not a loader exception.
    with pytest.raises(KubeConfigError, match="in-cluster config unusable"):
        in_cluster(env, tmp_path)
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    assert in_cluster(env, tmp_path).host == "https://127.0.0.1:6443"
