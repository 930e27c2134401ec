"""gpulet_common.kube: the API-server lookup shared by the reporter and the allocator."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import anyio
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
    # Files named relative to the kubeconfig that names them.
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "tok").write_text("from-a-file")
    paths = os.pathsep.join([str(first), str(second)])
    config = await from_kubeconfig(paths)
    settings = config.configuration
    assert config.host == "https://10.0.0.1:6443"
    assert settings.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert config.token == "from-a-file"
    assert await anyio.Path(str(settings.cert_file)).read_bytes() == b"cert"
    assert await anyio.Path(str(settings.key_file)).read_bytes() == b"key"
    assert settings.tls_server_name == "api.local"
    assert settings.verify_ssl
    other = await from_kubeconfig(paths, "d")
    assert (other.host, other.configuration.verify_ssl) == ("https://10.0.0.2:6443", False)
    assert (
        other.configuration.api_key["BearerToken"] == "Basic " + base64.b64encode(b"me:pw").decode()
    )


@pytest.mark.parametrize(
    ("user", "reason"),
    [
        (
            "{exec: {command: /nonexistent/plugin, apiVersion: client.authentication.k8s.io/v1}}",
            "unusable",
        ),
        ("{client-key-data: '!!not base64', client-certificate-data: Y2VydA==}", "unusable"),
        ("{tokenFile: /nonexistent/token}", "unusable"),
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
    assert config.configuration.api_key["BearerToken"] == "Bearer tok"  # no line break


async def test_an_exec_user_runs_its_plugin_and_again_when_the_credential_expires(
    tmp_path: Path,
) -> None:
    # The plugin prints a token that has already expired, then counts its runs.
    plugin = tmp_path / "plugin"
    runs = tmp_path / "runs"
    plugin.write_text(
        "#!/bin/sh\n"
        f"echo x >> {runs}\n"
        "n=$(wc -l < " + str(runs) + ")\n"
        'printf \'{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential",'
        '"status":{"token":"t%s","expirationTimestamp":"2000-01-01T00:00:00Z"}}\' "$n"\n'
    )
    plugin.chmod(0o755)
    path = tmp_path / "config"
    user = f"{{exec: {{command: {plugin}, apiVersion: client.authentication.k8s.io/v1}}}}"
    path.write_text(KUBECONFIG.replace("user: {token: t}", f"user: {user}"))
    config = await from_kubeconfig(str(path))
    assert config.token == "t1"
    # Each request asks the configuration for its key: an expired credential runs the
    # plugin again.
    assert await config.configuration.get_api_key_with_prefix("BearerToken") == "Bearer t2"


@pytest.mark.parametrize(
    "content",
    [
        "a: &a [x, x]\nb: &b [*a, *a]\nclusters: [*b, *b]\n",  # an alias bomb's seed
        "clusters: " + "[" * 10_000 + "]" * 10_000 + "\n",
        "x" * (5 << 20),
    ],
)
async def test_a_hostile_kubeconfig_is_refused_without_expanding_it(
    tmp_path: Path, content: str
) -> None:
    path = tmp_path / "config"
    path.write_text(content)
    with pytest.raises(KubeConfigError, match="unusable"):
        await from_kubeconfig(str(path))
