"""The Kubernetes manifests of deploy/: schema-valid, and the properties we promise.

What is validated, and how:

* Every overlay (production, mock, and production with every optional component and
  the Prometheus Operator objects switched on) is built with the real kustomize
  (``kubectl kustomize``); every object of the output is validated with
  kubernetes-validate, strictly (unknown fields are errors), for the oldest and the
  newest Kubernetes version we support. Without kubectl the raw base files are
  validated instead and the builds are skipped with the reason.
* PodMonitor and PrometheusRule (Prometheus Operator CRDs) have no schema there: they
  get structural checks; the rules themselves go through promtool elsewhere.
* The semantics: least privilege container by container, RBAC exactly as documented,
  one NATS user per container, probes on each container's own port, the settings file
  loading into gpulet's settings, and the Device CRD accepting what the reporter writes.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gpulet import services
from gpulet.cli import build_parser
from gpulet_common import config
from support.deploy import (
    DEPLOY,
    KUSTOMIZE,
    MIN_KUBERNETES,
    NATS_DIR,
    NATS_USERS,
    PROMETHEUS_DIR,
    inbox_prefix,
    kustomize,
    password_variable,
)

# The oldest Kubernetes gpulet supports and the newest kubernetes-validate knows.
K8S_VERSIONS = (MIN_KUBERNETES, kubernetes_validate.latest_version())
NO_SCHEMA_KINDS = {"PodMonitor", "PrometheusRule"}
GPULET_CONTAINERS = ("collector", "health", "reporter", "allocator", "device-plugin")
ROOT_CONTAINERS = {"allocator", "device-plugin"}
NVML_CONTAINERS = {"collector", "health", "device-plugin"}


@pytest.fixture(scope="module")
def everything_overlay(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """production with every optional part on: leaf node, alerts, Prometheus Operator."""
    root = tmp_path_factory.mktemp("overlay")
    # kustomize loads files relative to the kustomization: copy the whole deploy tree.
    shutil.copytree(DEPLOY, root / "deploy")
    production = root / "deploy" / "kustomize" / "overlays" / "production"
    text = (production / "kustomization.yaml").read_text()
    text = text.replace("  # - ../../../prometheus", "  - ../../../prometheus")
    text = text.replace("components: []\n  # - ", "components:\n  - ")
    text = text.replace("  # - ../../components/alerts", "  - ../../components/alerts")
    (production / "kustomization.yaml").write_text(text)
    return production


BUILDS = {
    "production": KUSTOMIZE / "overlays" / "production",
    "mock": KUSTOMIZE / "overlays" / "mock",
}


@pytest.fixture(scope="module", params=[*BUILDS, "everything"])
def build(
    request: pytest.FixtureRequest, everything_overlay: Path
) -> tuple[str, list[dict[str, Any]]]:
    name: str = request.param
    return name, kustomize(everything_overlay if name == "everything" else BUILDS[name])


def _one(docs: list[dict[str, Any]], kind: str, name_prefix: str = "") -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"{kind} {name_prefix!r}: {len(found)} found"
    return found[0]


def _containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    ds = _one(docs, "DaemonSet", "gpulet")
    return {c["name"]: c for c in ds["spec"]["template"]["spec"]["containers"]}


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


# --- schema validation ---------------------------------------------------------------


def _validate(doc: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(
            f"{doc['kind']} {doc['metadata'].get('name')} (Kubernetes {version}): {exc.message} "
            f"at {'.'.join(str(p) for p in exc.path)}"
        ) from None


def test_every_built_object_validates_against_kubernetes_schemas(
    build: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = build
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "CustomResourceDefinition", "DaemonSet", "ClusterRole"} <= kinds
    for doc in docs:
        if doc["kind"] in NO_SCHEMA_KINDS:
            continue
        for version in K8S_VERSIONS:
            _validate(doc, version)


def _raw_manifests() -> Iterator[tuple[Path, dict[str, Any]]]:
    files = [
        *sorted((KUSTOMIZE / "base").glob("*.yaml")),
        DEPLOY / "crds" / "scheduling.koordinator.sh_devices.yaml",
    ]
    for path in files:
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def test_raw_base_files_validate_without_kustomize() -> None:
    """The base's files as they are (what docker-compose's k3s applies directly)."""
    seen = 0
    for _path, doc in _raw_manifests():
        for version in K8S_VERSIONS:
            _validate(doc, version)
        seen += 1
    assert seen >= 6


def test_prometheus_operator_objects_are_well_formed(
    build: tuple[str, list[dict[str, Any]]],
) -> None:
    name, docs = build
    if name != "everything":
        assert not [d for d in docs if d["kind"] in NO_SCHEMA_KINDS]
        return
    monitor = _one(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    ds = _one(docs, "DaemonSet", "gpulet")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        ds["spec"]["template"]["metadata"]["labels"].items()
    )
    port_names = {p["name"] for c in _containers(docs).values() for p in c.get("ports", [])}
    endpoints = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert endpoints <= port_names
    assert {"m-collector", "m-health", "m-reporter", "m-allocator", "m-plugin"} <= endpoints
    rule = _one(docs, "PrometheusRule")
    assert (
        rule["spec"]["groups"]
        == yaml.safe_load((PROMETHEUS_DIR / "gpulet-rules.yaml").read_text())["groups"]
    )


# --- the DaemonSet ------------------------------------------------------------------


def test_services_run_as_sidecars_of_one_pod(build: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = build
    containers = _containers(docs)
    expected = {"nats", *GPULET_CONTAINERS} | ({"alerts"} if name == "everything" else set())
    assert set(containers) == expected
    images = {containers[c]["image"] for c in containers if c != "nats"}
    assert len(images) == 1, images
    assert containers["nats"]["image"].startswith("nats:")
    parser = build_parser()
    for service in GPULET_CONTAINERS:
        assert service in services.REGISTRY
        # What the image's entrypoint makes of the args: this service, run alone.
        args = parser.parse_args(containers[service]["args"])
        assert (args.command, args.service) == ("serve", service)
    if "alerts" in containers:
        assert parser.parse_args(containers["alerts"]["args"]).command == "alerts"
    for c in containers.values():
        if c["name"] == "nats":
            assert c["command"] == ["nats-server"]
        else:
            assert "command" not in c  # the image's entrypoint is gpulet


def test_containers_have_least_privilege(build: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = build
    pod = _one(docs, "DaemonSet", "gpulet")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert "hostNetwork" not in pod
    assert "hostPID" not in pod
    assert "hostIPC" not in pod
    for name, c in _containers(docs).items():
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, name
        assert sc["readOnlyRootFilesystem"] is True, name
        assert sc["capabilities"] == {"drop": ["ALL"]}, name
        assert not sc.get("privileged", False), name
        if name in ROOT_CONTAINERS:
            assert (sc["runAsUser"], sc["runAsNonRoot"]) == (0, False), name
        else:
            assert not {"runAsUser", "runAsNonRoot"} & set(sc), name
        # Requests and limits on every container.
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), (name, kind)


def test_host_access_is_limited_to_the_kubelet_directories_and_gpulets_state(
    build: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = build
    pod = _one(docs, "DaemonSet", "gpulet")["spec"]["template"]["spec"]
    host_paths = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    assert {name: h["path"] for name, h in host_paths.items()} == {
        "device-plugins": "/var/lib/kubelet/device-plugins",
        "pod-resources": "/var/lib/kubelet/pod-resources",
        "state": "/var/lib/gpulet",
        "kmsg": "/dev/kmsg",
    }
    assert host_paths["state"]["type"] == "DirectoryOrCreate"
    assert host_paths["kmsg"]["type"] == "CharDevice"
    assert not [v["name"] for v in pod["volumes"] if "emptyDir" in v]
    mounts = {
        name: {(m["name"], m.get("subPath", "")): m for m in c.get("volumeMounts", [])}
        for name, c in _containers(docs).items()
    }
    users = {
        vol: sorted(n for n, m in mounts.items() if any(v == vol for v, _ in m))
        for vol in ("device-plugins", "pod-resources", "kmsg")
    }
    assert users == {
        "device-plugins": ["device-plugin"],
        "pod-resources": ["allocator"],
        "kmsg": ["health"],
    }
    assert mounts["health"]["kmsg", ""]["readOnly"] is True
    assert mounts["allocator"]["pod-resources", ""]["readOnly"] is True
    assert (
        mounts["device-plugin"]["device-plugins", ""]["mountPath"]
        == "/var/lib/kubelet/device-plugins"
    )
    # The state survives a pod replacement, each part where its owner expects it:
    # JetStream is the NATS container's alone, the checkpoint the allocator's, and the
    # services share their state dir.
    state_mounts = {
        (name, sub): m["mountPath"]
        for name, ms in mounts.items()
        for (v, sub), m in ms.items()
        if v == "state"
    }
    expected = {(n, "state"): "/var/lib/gpulet" for n in GPULET_CONTAINERS}
    expected["nats", "nats"] = "/data"
    expected["allocator", "allocator"] = "/var/lib/gpulet/allocator"
    assert state_mounts == expected
    nats = _containers(docs)["nats"]
    assert "--store_dir=/data/jetstream" in nats["args"]
    # The init container makes the directories and gives them to the non-root user,
    # with CHOWN as its one capability, and mounts nothing else.
    [init] = pod["initContainers"]
    assert init["volumeMounts"] == [{"name": "state", "mountPath": "/host"}]
    sc = init["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    script = " ".join(init["args"])
    for part in ("state", "allocator", "nats"):
        assert f"/host/{part}" in script
    assert "chown 65532:65532 /host/state /host/nats" in script
    assert pod["securityContext"]["runAsUser"] == 65532


def test_only_the_reporter_and_allocator_get_api_credentials(
    build: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = build
    pod = _one(docs, "DaemonSet", "gpulet")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert _one(docs, "ServiceAccount", "gpulet")["automountServiceAccountToken"] is False
    for service in ("reporter", "allocator"):
        volume = f"{service}-token"
        token_volume = next(v for v in pod["volumes"] if v["name"] == volume)
        sources = token_volume["projected"]["sources"]
        assert any("serviceAccountToken" in s for s in sources)
        for name, c in _containers(docs).items():
            mounted = {m["name"] for m in c.get("volumeMounts", [])}
            assert (volume in mounted) == (name == service), name
        container = _containers(docs)[service]
        mount = next(m for m in container["volumeMounts"] if m["name"] == volume)
        assert mount["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"


def test_each_container_has_its_own_nats_user_and_password(
    build: tuple[str, list[dict[str, Any]]],
) -> None:
    name, docs = build
    containers = _containers(docs)
    secret_names: set[str] = set()
    for service in [c for c in containers if c != "nats"]:
        env = _env(containers[service])
        user = env["GPULET_NATS__USER"]["value"]
        assert user == service
        assert user in NATS_USERS
        ref = env["GPULET_NATS__PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref["key"] == user
        # Its own reply inbox, the only one auth.conf lets it read.
        assert env["GPULET_NATS__INBOX_PREFIX"]["value"] == inbox_prefix(user)
        secret_names.add(ref["name"])
        # No other user's password, and no NATS URL: the sidecar default (127.0.0.1).
        assert not [k for k in env if re.fullmatch(r"GPULET_NATS_[A-Z_]+_PASSWORD", k)]
        assert "GPULET_NATS__URL" not in env
    assert len(secret_names) == 1
    nats_env = _env(containers["nats"])
    referenced = set(
        re.findall(r"\$(GPULET_NATS_\w+_PASSWORD)", (NATS_DIR / "auth.conf").read_text())
    )
    assert referenced == {password_variable(u) for u in NATS_USERS}
    assert {k for k in nats_env if k.endswith("_PASSWORD")} == referenced
    for var in referenced:
        assert nats_env[var]["valueFrom"]["secretKeyRef"]["name"] in secret_names
    args = containers["nats"]["args"]
    assert "--addr=127.0.0.1" in args
    leaf = name == "everything"
    assert ("--config=/etc/nats/leaf.conf" in args) == leaf
    assert ("GPULET_NATS_LEAF_URL" in nats_env) == leaf
    if name == "mock":
        secret = _one(docs, "Secret", "gpulet-nats-users")
        assert secret["metadata"]["name"] == next(iter(secret_names))
        assert set(secret["data"]) == set(NATS_USERS)


def test_nats_configmap_holds_the_shipped_files(build: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = build
    data = _one(docs, "ConfigMap", "gpulet-nats")["data"]
    assert data["node.conf"] == (NATS_DIR / "node.conf").read_text()
    assert data["leaf.conf"] == (NATS_DIR / "leaf.conf").read_text()
    auth = NATS_DIR / "mock" / "auth.conf" if name == "mock" else NATS_DIR / "auth.conf"
    assert data["auth.conf"] == auth.read_text()


def test_probes_and_metrics_ports(build: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = build
    ds = _one(docs, "DaemonSet", "gpulet")
    ports: dict[int, str] = {}
    for name, c in _containers(docs).items():
        if name == "nats":
            assert "exec" in c["livenessProbe"]
            assert "exec" in c["readinessProbe"]
            continue
        (port,) = c["ports"]
        assert port["name"].startswith("m-")
        assert len(port["name"]) <= 15
        assert f"--metrics-port={port['containerPort']}" in c["args"]
        assert port["containerPort"] not in ports, "metrics ports must differ"
        ports[port["containerPort"]] = name
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["containerPort"]}
        if name != "alerts":
            assert c["readinessProbe"]["httpGet"] == {
                "path": "/readyz",
                "port": port["containerPort"],
            }
            assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert _env(c)["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert ("NVIDIA_VISIBLE_DEVICES" in _env(c)) == (name in NVML_CONTAINERS)
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert ports[int(annotations["prometheus.io/port"])] == "collector"


def test_placement_on_gpu_nodes(build: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = build
    pod = _one(docs, "DaemonSet", "gpulet")["spec"]["template"]["spec"]
    if name == "mock":
        assert pod["nodeSelector"] == {"gpulet.io/mock-gpus": "true"}
        assert "affinity" not in pod
        assert "runtimeClassName" not in pod
        for service in ("collector", "health"):
            env = _env(_containers(docs)[service])
            assert env["GPULET_NVML__BACKEND"]["value"] == "mock"
    else:
        # Found without GFD: any one of the three labels places the pod (ORed terms).
        assert "nodeSelector" not in pod
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        assert [t["matchExpressions"] for t in terms] == [
            [{"key": key, "operator": "In", "values": ["true"]}]
            for key in (
                "nvidia.com/gpu.present",
                "feature.node.kubernetes.io/pci-10de.present",
                "gpulet.io/gpu",
            )
        ]
        assert pod["runtimeClassName"] == "nvidia"
        for c in _containers(docs).values():
            assert "GPULET_NVML__BACKEND" not in _env(c)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    # The agent must return to a node its own taint keeps other pods off.
    assert {"key": "gpulet.io/gpu-unhealthy", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["priorityClassName"] == "system-node-critical"


def test_settings_file_is_valid_gpulet_configuration(
    build: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    _, docs = build
    toml = _one(docs, "ConfigMap", "gpulet-config")["data"]["gpulet.toml"]
    path = tmp_path / "gpulet.toml"
    path.write_text(toml)
    for name, c in _containers(docs).items():
        if name == "nats":
            continue
        env = {k: v["value"] for k, v in _env(c).items() if "value" in v}
        env["NODE_NAME"] = "node-1"
        settings = config.load(path, env=env)  # raises on an unknown or invalid setting
        assert settings.reporter.mode == "cluster"
        assert settings.allocator.plugin.resources.gpu == "nvidia.com/gpu"
        assert settings.allocator.handshake.enabled


# --- RBAC and the CRD ----------------------------------------------------------------


def test_rbac_is_exactly_what_the_reporter_and_allocator_need(
    build: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = build
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("ClusterRole", "Role")}
    assert sorted(roles) == ["gpulet-allocator", "gpulet-reporter"]

    def rules(name: str) -> dict[tuple[tuple[str, ...], tuple[str, ...]], list[str]]:
        return {
            (tuple(r["apiGroups"]), tuple(r["resources"])): sorted(r["verbs"])
            for r in roles[name]["rules"]
        }

    assert rules("gpulet-reporter") == {
        (("scheduling.koordinator.sh",), ("devices",)): ["create", "get", "patch", "update"],
        (("",), ("nodes",)): ["get", "patch"],
        # The GpuletGPUHealthy condition (the taint is a patch of nodes).
        (("",), ("nodes/status",)): ["patch"],
    }
    # The koord-scheduler handshake: this node's pods and Events on them; its Node's labels.
    assert rules("gpulet-allocator") == {
        (("",), ("pods",)): ["get", "list", "watch"],
        (("",), ("events",)): ["create"],
    }
    bindings = [d for d in docs if d["kind"] in ("ClusterRoleBinding", "RoleBinding")]
    assert sorted(b["roleRef"]["name"] for b in bindings) == sorted(roles)
    for binding in bindings:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "gpulet", "namespace": "gpulet-system"}
        ]
    ds = _one(docs, "DaemonSet", "gpulet")
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == "gpulet"
    namespace = _one(docs, "Namespace")
    assert namespace["metadata"]["name"] == "gpulet-system"
    # hostPath volumes need the privileged Pod Security level; nothing else does.
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_device_crd_accepts_what_the_reporter_writes(
    build: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = build
    crd = _one(docs, "CustomResourceDefinition")
    assert crd["spec"]["group"] == "scheduling.koordinator.sh"
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    device: dict[str, Any] = {
        "apiVersion": "scheduling.koordinator.sh/v1alpha1",
        "kind": "Device",
        "metadata": {"name": "gpu-node-1"},
        "spec": {
            "devices": [
                {
                    "type": "gpu",
                    "id": "GPU-0b1c",
                    "minor": 0,
                    "health": True,
                    "resources": {
                        "koordinator.sh/gpu-core": "100",
                        "koordinator.sh/gpu-memory": "80Gi",
                        "koordinator.sh/gpu-memory-ratio": "100",
                    },
                    "topology": {
                        "socketID": 0,
                        "nodeID": 0,
                        "pcieID": "pci0000:00",
                        "busID": "0000:18:00.0",
                    },
                }
            ]
        },
    }
    jsonschema.validate(device, schema)
    device["spec"]["devices"][0]["topology"] = {"socketID": 0}  # nodeID, pcieID missing
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(device, schema)


def test_scrape_job_keeps_every_metrics_port() -> None:
    """scrape-config.yaml (plain Prometheus); Debian's promtool lacks kubernetes_sd."""
    job = yaml.safe_load((PROMETHEUS_DIR / "scrape-config.yaml").read_text())["scrape_configs"][0]
    assert job["job_name"] == "gpulet"
    keep = next(
        r
        for r in job["relabel_configs"]
        if r["source_labels"] == ["__meta_kubernetes_pod_container_port_name"]
    )
    assert keep["action"] == "keep"
    ds = next(
        d for d in yaml.safe_load_all((KUSTOMIZE / "base" / "daemonset.yaml").read_text()) if d
    )
    names = [
        p["name"] for c in ds["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
    ]
    assert len(names) == 5
    assert all(re.fullmatch(keep["regex"], n) for n in names)


def test_the_overlay_names_the_image_of_every_gpulet_container(
    build: tuple[str, list[dict[str, Any]]],
) -> None:
    """No public image exists: the mock overlay names what `make image` builds, the
    production overlay a placeholder that fails plainly (InvalidImageName) until set;
    either way one name reaches every gpulet container, the components' too."""
    name, docs = build
    pod = _one(docs, "DaemonSet", "gpulet")["spec"]["template"]["spec"]
    containers = [*pod.get("initContainers", []), *pod["containers"]]
    images = {c["image"] for c in containers if c["name"] != "nats"}
    assert images == {"localhost/gpulet:dev" if name == "mock" else "REGISTRY/gpulet:0.1.0"}
