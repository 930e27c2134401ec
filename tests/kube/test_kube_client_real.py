"""gpulet's Kubernetes client (kubernetes-asyncio under gpulet_common.kubeapi) against
the real kube-apiserver: the credentials an operator's cluster really uses.

Who the server thinks we are is read back with a ``SelfSubjectReview`` (any
authenticated user may ask it), so each case proves which credential a request carried:

* a kubeconfig whose user is an ``exec`` plugin (what every managed cluster's kubeconfig
  uses): the plugin's token is sent, and the plugin runs again when the credential it
  gave expires;
* in-cluster, the bound service-account token that the kubelet rotates on disk: the
  next request after the file changes carries the new token.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from kubernetes_asyncio.config import incluster_config

from gpulet_common.kube import from_kubeconfig, in_cluster
from gpulet_common.kubeapi import KubeApiError, KubeClient, api_path
from support.control_plane import ControlPlane
from support.control_plane_fixtures import unique_name

pytestmark = pytest.mark.anyio

REVIEW = api_path("authentication.k8s.io", "v1", "selfsubjectreviews")


async def whoami(api: KubeClient) -> str:
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    review = await api.create(REVIEW, body, timeout_s=10)
    username: str = review["status"]["userInfo"]["username"]
    return username


def two_accounts(plane: ControlPlane, namespace: str) -> dict[str, str]:
    """Two ServiceAccounts of ``namespace`` and a fresh token of each."""
    tokens = {}
    for name in (unique_name("one"), unique_name("two")):
        plane.must(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts",
            {"metadata": {"name": name}},
        )
        tokens[f"system:serviceaccount:{namespace}:{name}"] = plane.token_for(namespace, name)
    return tokens


async def test_an_exec_user_works_and_runs_again_when_its_credential_expires(
    kube_api: ControlPlane, kube_namespace: str, tmp_path: Path
) -> None:
    (first, first_token), (second, second_token) = two_accounts(kube_api, kube_namespace).items()
    # The plugin gives the first token, already expired, then the second one for an hour.
    runs = tmp_path / "runs"
    later = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )

    def credential(token: str, expiry: str) -> str:
        return json.dumps(
            {
                "apiVersion": "client.authentication.k8s.io/v1",
                "kind": "ExecCredential",
                "status": {"token": token, "expirationTimestamp": expiry},
            }
        )

    plugin = tmp_path / "plugin"
    plugin.write_text(
        "#!/bin/sh\n"
        f"echo run >> {runs}\n"
        f'if [ "$(wc -l < {runs})" -eq 1 ]; then\n'
        f"  echo '{credential(first_token, '2000-01-01T00:00:00Z')}'\n"
        "else\n"
        f"  echo '{credential(second_token, later)}'\n"
        "fi\n"
    )
    plugin.chmod(0o755)
    config = kube_api.kubeconfig()
    config["users"][0]["user"] = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": str(plugin),
            "interactiveMode": "Never",
        }
    }
    path = tmp_path / "exec.kubeconfig"
    path.write_text(json.dumps(config))  # JSON is YAML

    async with KubeClient(await from_kubeconfig(str(path))) as api:
        # The first credential had expired when it was given: the first request already
        # asks the plugin again and carries the second token, as do the ones after it.
        assert await whoami(api) == second
        assert await whoami(api) == second
    assert runs.read_text().count("run") == 2
    assert first != second


async def test_a_rotated_service_account_token_is_picked_up(
    kube_api: ControlPlane,
    kube_namespace: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (first, first_token), (second, second_token) = two_accounts(kube_api, kube_namespace).items()
    # kubernetes-asyncio reads the file again once a minute; no minute to wait here.
    monkeypatch.setattr(incluster_config, "TOKEN_REFRESH_PERIOD", datetime.timedelta(0))
    sa_dir = tmp_path / "serviceaccount"
    sa_dir.mkdir()
    (sa_dir / "token").write_text(first_token)
    (sa_dir / "ca.crt").write_bytes((kube_api.pki / "ca.crt").read_bytes())
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(kube_api.port)}
    async with KubeClient(in_cluster(env, sa_dir)) as api:
        assert await whoami(api) == first
        # The kubelet swaps the file (a new file renamed over the old one).
        fresh = sa_dir / "token.new"
        fresh.write_text(second_token)
        fresh.replace(sa_dir / "token")
        assert await whoami(api) == second
        # A token the server does not know is its 401, one KubeApiError.
        (sa_dir / "token").write_text("not-a-token")
        with pytest.raises(KubeApiError) as refused:
            await whoami(api)
        assert refused.value.status == 401
