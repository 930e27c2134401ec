"""The fleet hub's manifests (deploy/fleet) and the node's nats-fleet component.

Validated like deploy/kustomize (test_deploy_kubernetes.py): built with the real
kustomize, every object checked with kubernetes-validate (strict) for the oldest and
newest Kubernetes supported; then the properties docs/fleet.md promises. The shipped
nats configs are checked by a real nats-server (``-t``) with a generated accounts.conf.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpulet_common.embedded_nats import nats_server_binary
from gpulet_common.fleet.identity import IdentityStore
from support.deploy import (
    DEPLOY,
    KUSTOMIZE,
    MIN_KUBERNETES,
    NATS_DIR,
    kustomize,
    set_passwords,
)

K8S_VERSIONS = (MIN_KUBERNETES, kubernetes_validate.latest_version())
FLEET_DIR = DEPLOY / "fleet"


def validate(doc: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(
                f"{doc['kind']} {doc['metadata'].get('name')} (Kubernetes {version}): "
                f"{exc.message} at {'.'.join(str(p) for p in exc.path)}"
            ) from None


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{kind}: {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def hub_docs() -> list[dict[str, Any]]:
    return kustomize(FLEET_DIR)


def test_every_hub_object_validates(hub_docs: list[dict[str, Any]]) -> None:
    assert {d["kind"] for d in hub_docs} == {
        "Namespace",
        "ConfigMap",
        "Service",
        "PodDisruptionBudget",
        "StatefulSet",
        "Job",
        "Deployment",
    }
    for doc in hub_docs:
        validate(doc)


def _secure(pod: dict[str, Any]) -> None:
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in pod["containers"]:
        ctx = container["securityContext"]
        assert ctx["readOnlyRootFilesystem"] is True
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"]["drop"] == ["ALL"]
        assert "limits" in container["resources"]


def test_the_hub_is_a_3_server_cluster_matching_hub_conf(hub_docs: list[dict[str, Any]]) -> None:
    sts = one(hub_docs, "StatefulSet")
    service = one(hub_docs, "Service")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["serviceName"] == service["metadata"]["name"] == "gpulet-hub"
    assert service["spec"]["clusterIP"] == "None"
    conf = (NATS_DIR / "fleet" / "hub.conf").read_text()
    routes = re.findall(r"nats://([\w-]+)\.([\w-]+):(\d+)", conf)
    assert routes == [(f"gpulet-hub-{i}", "gpulet-hub", "6222") for i in range(3)]
    pod = sts["spec"]["template"]["spec"]
    _secure(pod)
    (nats,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in nats["ports"]}
    assert ports == {"client": 4222, "cluster": 6222, "leafnodes": 7422, "monitor": 8222}
    assert {p["name"] for p in service["spec"]["ports"]} == set(ports)
    # The config: hub.conf from the shipped file, accounts.conf from the operator.
    sources = pod["volumes"][0]["projected"]["sources"]
    assert [s["configMap"]["name"] for s in sources] == ["gpulet-hub-config", "gpulet-hub-accounts"]
    config = one(hub_docs, "ConfigMap")
    assert config["data"]["hub.conf"] == conf
    mounts = {m["name"]: m["mountPath"] for m in nats["volumeMounts"]}
    assert mounts == {"config": "/etc/nats", "data": "/data"}
    assert "store_dir: /data/jetstream" in conf
    assert one(hub_docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


def test_alerts_replicas_share_the_hub_consumer(hub_docs: list[dict[str, Any]]) -> None:
    deployment = one(hub_docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    _secure(pod)
    (alerts,) = pod["containers"]
    assert alerts["args"][:2] == ["alerts", "--hub"]
    env = {e["name"]: e["value"] for e in alerts["env"]}
    assert env["GPULET_NATS__INBOX_PREFIX"] == "_INBOX.alerts"
    mount = alerts["volumeMounts"][0]["mountPath"]
    assert env["GPULET_NATS__CREDS_FILE"] == f"{mount}/alerts.creds"
    assert pod["volumes"][0]["secret"]["secretName"] == "gpulet-hub-alerts"
    job = one(hub_docs, "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["fleet", "setup"]


def test_hub_conf_with_generated_accounts_is_valid_for_nats_server(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path / "store")
    store.init()
    shutil.copy(NATS_DIR / "fleet" / "hub.conf", tmp_path / "hub.conf")
    (tmp_path / "accounts.conf").write_text(
        store.hub_accounts_conf(resolver_dir=str(tmp_path / "jwt"))
    )
    conf = (
        (tmp_path / "hub.conf")
        .read_text()
        .replace("store_dir: /data/jetstream", f'store_dir: "{tmp_path / "js"}"')
    )
    (tmp_path / "hub.conf").write_text(conf)
    result = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(tmp_path / "hub.conf")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={"POD_NAME": "gpulet-hub-0", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr + result.stdout


def test_fleet_leaf_conf_is_valid_for_nats_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_passwords(monkeypatch)
    monkeypatch.setenv("GPULET_HUB_LEAF_URL", "nats-leaf://gpulet-hub.gpulet-hub.svc:7422")
    monkeypatch.setenv("GPULET_HUB_CREDS", str(tmp_path / "node.creds"))
    for name in ("node.conf", "auth.conf", "fleet-leaf.conf"):
        shutil.copy(NATS_DIR / name, tmp_path / name)
    result = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(tmp_path / "fleet-leaf.conf")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr + result.stdout


def test_the_node_creds_job_template_pins_one_node_and_its_secret() -> None:
    text = (FLEET_DIR / "node-creds-job.yaml").read_text()
    rendered = text.replace("NODE_ID", "gpu-node-1").replace(
        "nodeName: NODE", "nodeName: gpu-node-1"
    )
    job = yaml.safe_load(rendered)
    validate(job)
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeName"] == "gpu-node-1"
    assert pod["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["creds"]["secret"]["secretName"] == "gpulet-leaf-gpu-node-1"
    assert volumes["host"]["hostPath"]["path"] == "/var/lib/gpulet/fleet"
    # The script fills in what the template leaves open, and nothing else.
    script = (FLEET_DIR / "provision-node-creds.sh").read_text()
    assert "node-creds-job.yaml" in script
    assert set(re.findall(r"\bNODE(?:_ID)?\b", text)) <= {"NODE", "NODE_ID"}


def test_the_nats_fleet_component_mounts_the_node_credential(tmp_path: Path) -> None:
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    production = tmp_path / "deploy" / "kustomize" / "overlays" / "production"
    text = (production / "kustomization.yaml").read_text()
    assert "components: []" in text
    text = text.replace("components: []", "components:\n  - ../../components/nats-fleet")
    (production / "kustomization.yaml").write_text(text)
    docs = kustomize(production)
    for doc in docs:
        if doc["kind"] not in ("PodMonitor", "PrometheusRule"):
            validate(doc)
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    nats = containers["nats"]
    assert "--config=/etc/nats/fleet-leaf.conf" in nats["args"]
    env = {e["name"]: e.get("value") for e in nats["env"]}
    mount = next(m for m in nats["volumeMounts"] if m["name"] == "fleet-creds")
    assert mount["readOnly"] is True
    assert env["GPULET_HUB_CREDS"].startswith(mount["mountPath"] + "/")
    # Only the nats container sees the credential.
    assert [
        n
        for n, c in containers.items()
        if any(m["name"] == "fleet-creds" for m in c.get("volumeMounts", []))
    ] == ["nats"]
    health_env = {e["name"]: e.get("value") for e in containers["health"]["env"]}
    assert health_env["GPULET_FLEET__RELAY_ENABLED"] == "true"
    assert health_env["GPULET_FLEET__STATUS_ENABLED"] == "true"
    configmap = next(
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("gpulet-nats")
    )
    assert "fleet-leaf.conf" in configmap["data"]
    assert KUSTOMIZE.exists()
