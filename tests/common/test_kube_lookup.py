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


async def test_kubeconfig_fields_merge_and_relative_paths(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_text(
        """\
clusters:
- name: a
  cluster:
    server: https://10.0.0.1:6443
    certificate-authority: ca.crt
    tls-server-name: api.local
users:
- name: u
  user: {tokenFile: tok, client-certificate-data: Y2VydA==, client-key-data: a2V5}
contexts:
- name: c
  context: {cluster: a, user: u}
current-context: c
"""
    )
    # The second file's "a" is not used (the first file that names one wins), nor its
    # current-context; its own context "d" is there to pick.
    second.write_text(
        """\
clusters:
- name: a
  cluster: {server: "https://wrong:1"}
- name: b
  cluster: {server: "https://10.0.0.2:6443", insecure-skip-tls-verify: true}
users:
- name: v
  user: {username: me, password: pw}
contexts:
- name: d
  context: {cluster: b, user: v}
current-context: d
"""
    )
    paths = os.pathsep.join([str(first), str(second)])
    config = await from_kubeconfig(paths)
    assert config.host == "https://10.0.0.1:6443"
    assert config.ca_file == str(tmp_path / "ca.crt")
    assert config.token_file == str(tmp_path / "tok")
    assert (config.cert_data, config.key_data) == (b"cert", b"key")
    assert config.tls_server_name == "api.local"
    assert not config.insecure
    other = await from_kubeconfig(paths, "d")
    assert (other.host, other.insecure, other.username, other.password) == (
        "https://10.0.0.2:6443",
        True,
        "me",
        "pw",
    )


@pytest.mark.parametrize(
    ("user", "reason"),
    [
        ("{exec: {command: aws}}", "exec plugin"),
        ("{auth-provider: {name: gcp}}", "auth-provider plugin"),
        ("{client-key-data: '!!not base64'}", "unusable"),
    ],
)
async def test_what_gpulet_cannot_use_is_refused_with_the_reason(
    tmp_path: Path, user: str, reason: str
) -> None:
    path = tmp_path / "config"
    path.write_text(KUBECONFIG.replace("user: {token: t}", f"user: {user}"))
    with pytest.raises(KubeConfigError, match=reason):
        await from_kubeconfig(str(path))


def test_in_cluster_ipv6_and_an_empty_token(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "token").write_text("\n")
    with pytest.raises(KubeConfigError, match="empty"):
        in_cluster(env, tmp_path)
    (tmp_path / "token").write_text("tok\n")
    config = in_cluster(env, tmp_path)
    assert (config.host, config.token) == ("https://[fd00::1]:443", "tok")
