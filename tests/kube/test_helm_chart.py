"""The Helm chart deploy/helm/gpulet: ``helm lint``, ``helm template``, the render against
the kustomize base (they must describe the same objects), and the render applied to the
real kube-apiserver with server-side apply.

helm is built from helm.sh/helm/v3 by scripts/k8s-bins.sh, like the control plane.

What may differ between a render of the chart and the kustomize base, and why (all
else must be equal, field by field):

- Helm's own labels (``app.kubernetes.io/managed-by``, ``app.kubernetes.io/instance``,
  ``helm.sh/chart``) on every object;
- ConfigMap names: kustomize appends a content hash (``gpulet-config-<hash>``) so that a
  change rolls the pods; the chart keeps the plain name and rolls the pods with a
  ``checksum/config`` annotation on the pod template instead;
- a namespace on a cluster-scoped object: kustomize 5.5 does not know that a
  ValidatingAdmissionPolicy is cluster-scoped and gives it one (the server ignores it);
- the order of entries in the lists Kubernetes keys by name (containers, env, volumes,
  volume mounts): kustomize's strategic merge puts a component's entries first, and
  Kubernetes gives them no order, so they are compared by their key;
- the Namespace: Helm keeps its release record in the namespace, so it exists before
  ``helm install``; the chart renders it only with ``namespace.create=true``, and then
  it is the base's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from support.control_plane import CLUSTER_KINDS, ControlPlane, require_binaries
from support.deploy import DEPLOY, KUSTOMIZE, kustomize
from support.gpulet_on_kube import NAMESPACE, apply_manifests

CHART = DEPLOY / "helm" / "gpulet"
HELM_LABELS = ("app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "helm.sh/chart")


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    binary = require_binaries("helm")["helm"]
    return subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=120, check=False
    )


# The image the kustomize base names (`gpulet`, which the overlays rewrite): the chart
# has no default, since no public image is published.
BASE_IMAGE = ("image.repository=gpulet", "image.tag=")


def render(*values: str, include_crds: bool = True) -> list[dict[str, Any]]:
    args = ["template", "gpulet", str(CHART), "--namespace", NAMESPACE]
    if include_crds:
        args.append("--include-crds")
    for value in (*BASE_IMAGE, *values):
        args += ["--set", value]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _key(obj: dict[str, Any]) -> str:
    if obj["kind"] in CLUSTER_KINDS:
        # kustomize 5.5 puts its namespace on a ValidatingAdmissionPolicy too (the API
        # server drops it from a cluster-scoped object).
        obj["metadata"].pop("namespace", None)
    return f"{obj['kind']}/{obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}"


# The lists Kubernetes merges by a key, and that key.
KEYED_LISTS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


def keyed(value: Any) -> Any:
    """``value`` with the lists of KEYED_LISTS turned into mappings by their key."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            key = KEYED_LISTS.get(k)
            if key and isinstance(v, list) and all(isinstance(i, dict) and key in i for i in v):
                out[k] = {str(i[key]): keyed(i) for i in v}
            else:
                out[k] = keyed(v)
        return out
    if isinstance(value, list):
        return [keyed(v) for v in value]
    return value


def normalize(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Objects by kind/namespace/name, without what may differ (module docstring)."""
    hashed = {
        d["metadata"]["name"]: re.sub(r"-[a-z0-9]{10}$", "", d["metadata"]["name"])
        for d in docs
        if d["kind"] == "ConfigMap"
    }
    text = json.dumps(docs)
    for name, plain in hashed.items():
        text = text.replace(f'"{name}"', f'"{plain}"')
    out = {}
    for obj in json.loads(text):
        labels = obj["metadata"].get("labels") or {}
        for label in HELM_LABELS:
            labels.pop(label, None)
        template = (obj.get("spec") or {}).get("template") or {}
        (template.get("metadata") or {}).get("annotations", {}).pop("checksum/config", None)
        key = _key(obj)
        out[key] = keyed(obj)
    return out


def base_with(
    *components: str, tmp_path: Path, patches: tuple[dict[str, Any], ...] = ()
) -> list[dict[str, Any]]:
    if not components:
        return kustomize(KUSTOMIZE / "base")
    overlay: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZE / "base", tmp_path)],
        "components": [os.path.relpath(KUSTOMIZE / "components" / c, tmp_path) for c in components],
        # A component's containers get the image names the base sets (nats), as the
        # overlays do (the base's own rewrite ran before the component).
        "images": yaml.safe_load((KUSTOMIZE / "base" / "kustomization.yaml").read_text())["images"],
    }
    if patches:
        overlay["patches"] = [{"patch": yaml.safe_dump(p)} for p in patches]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    return kustomize(tmp_path)


def env_patch(containers: tuple[str, ...], env: dict[str, str]) -> dict[str, Any]:
    """What an overlay adds to set gpulet settings on some of the DaemonSet's containers."""
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "gpulet", "namespace": NAMESPACE},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"name": c, "env": [{"name": k, "value": v} for k, v in env.items()]}
                        for c in containers
                    ]
                }
            }
        },
    }


# The dra component leaves the mode to the overlay (gpulet.toml or the environment);
# the chart's dra.mode sets it on the containers that read it.
DRA_MODE = env_patch(("reporter", "allocator", "device-plugin"), {"GPULET_DRA__MODE": "both"})


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON values differ, as paths (for a readable failure)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += diff(a.get(key, "<absent>"), b.get(key, "<absent>"), f"{path}.{key}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff(x, y, f"{path}[{i}]")
        ]
    return (
        []
        if a == b
        else [f"{path}: chart {json.dumps(a)[:200]} != kustomize {json.dumps(b)[:200]}"]
    )


def assert_same(chart: list[dict[str, Any]], base: list[dict[str, Any]]) -> None:
    c, k = normalize(chart), normalize(base)
    assert sorted(c) == sorted(k)
    differences = [d for key in c for d in diff(c[key], k[key], key)]
    assert differences == [], "\n".join(differences)


def test_helm_lint_is_clean() -> None:
    result = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, "--set", BASE_IMAGE[0])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_without_an_image_the_render_fails_saying_how_to_get_one() -> None:
    """No public image exists: the chart names none, and says what to do."""
    result = helm("template", "gpulet", str(CHART), "--namespace", NAMESPACE)
    assert result.returncode != 0
    assert "image.repository is not set: no public gpulet image is published" in result.stderr
    assert "make image IMAGE=" in result.stderr


def test_the_default_render_is_the_kustomize_base(tmp_path: Path) -> None:
    base = [d for d in base_with(tmp_path=tmp_path) if d["kind"] != "Namespace"]
    assert_same(render(), base)


def test_namespace_create_renders_the_base_namespace(tmp_path: Path) -> None:
    assert_same(render("namespace.create=true"), base_with(tmp_path=tmp_path))


@pytest.mark.parametrize(
    ("values", "components", "patches"),
    [
        (["nats.mode=existing"], ["nats-leaf"], ()),
        (["nats.mode=fleet"], ["nats-fleet"], ()),
        (["alerting.enabled=true"], ["alerts"], ()),
        (["remediation.enabled=true"], ["remediation"], ()),
        (["sharing.timeSlicing.watchNode=true"], ["time-slicing"], ()),
        (["dra.mode=both"], ["dra"], (DRA_MODE,)),
        (["sharing.mps.daemons=true"], ["mps"], ()),
        (["dra.mode=both", "sharing.mps.daemons=true"], ["dra", "mps"], (DRA_MODE,)),
    ],
    ids=[
        "nats-existing",
        "nats-fleet",
        "alerting",
        "remediation",
        "time-slicing",
        "dra",
        "mps",
        "dra-and-mps",
    ],
)
def test_values_render_what_the_kustomize_components_do(
    values: list[str],
    components: list[str],
    patches: tuple[dict[str, Any], ...],
    tmp_path: Path,
) -> None:
    base = [
        d
        for d in base_with(*components, tmp_path=tmp_path, patches=patches)
        if d["kind"] != "Namespace"
    ]
    assert_same(render(*values), base)


DRA_CONTAINERS = ("reporter", "allocator", "device-plugin")
DRA_MOUNTS = {"plugins-registry", "dra-plugin", "cdi"}
TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount"


def pod_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    pod: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return pod


def test_dra_values_reach_the_settings_mounts_classes_and_rbac() -> None:
    docs = render(
        "dra.mode=dra",
        "dra.driver=gpu.example.com",
        "dra.kubeletDir=/data/kubelet",
        "dra.cdiDir=/etc/cdi",
        "dra.claimCache=true",
        "dra.deviceClasses.extendedResource=",
        "dra.deviceClasses.whole=whole.example.com",
    )
    pod = pod_of(docs)
    containers = {c["name"]: c for c in pod["containers"]}
    want = {
        "GPULET_DRA__MODE": "dra",
        "GPULET_DRA__DRIVER": "gpu.example.com",
        "GPULET_DRA__PLUGINS_REGISTRY": "/data/kubelet/plugins_registry",
        "GPULET_DRA__PLUGINS_DIR": "/data/kubelet/plugins",
        "GPULET_DRA__CLAIM_CACHE": "true",
    }
    # Every container that reads [dra] gets the same settings (the allocator hosts the
    # plugin by default, so it is one of them).
    for name in DRA_CONTAINERS:
        env = {e["name"]: e.get("value") for e in containers[name]["env"]}
        assert {k: env.get(k) for k in want} == want, name
        assert "GPULET_DRA__PLUGIN_HOST" not in env, name  # the default, allocator
    for name in set(containers) - set(DRA_CONTAINERS):
        env_names = {e["name"] for e in containers[name].get("env", [])}
        assert not any(n.startswith("GPULET_DRA__") for n in env_names), name
    volumes = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    assert volumes["plugins-registry"] == "/data/kubelet/plugins_registry"
    assert volumes["dra-plugin"] == "/data/kubelet/plugins/gpu.example.com"
    assert volumes["cdi"] == "/etc/cdi"
    mounts = {m["name"]: m["mountPath"] for m in containers["allocator"]["volumeMounts"]}
    # kubelet dials the socket path the plugin registers: the host's path, inside too.
    assert mounts["plugins-registry"] == "/data/kubelet/plugins_registry"
    assert mounts["dra-plugin"] == "/data/kubelet/plugins/gpu.example.com"
    assert mounts["cdi"] == "/var/run/cdi"
    classes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "DeviceClass"}
    assert sorted(classes) == ["gpu-share.gpulet.io", "mig.gpulet.io", "whole.example.com"]
    for name, cls in classes.items():
        expression = cls["spec"]["selectors"][0]["cel"]["expression"]
        kind = "mig" if name == "mig.gpulet.io" else "gpu"
        assert "device.driver == 'gpu.example.com'" in expression
        assert f"device.attributes['gpu.example.com'].type == '{kind}'" in expression
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "gpulet-dra"
    ]
    verbs = {r["resources"][0]: r["verbs"] for r in role["rules"]}
    assert verbs["resourceclaims"] == ["get", "list", "watch"]


@pytest.mark.parametrize("host", ["allocator", "device-plugin"])
def test_the_plugin_host_gets_the_plugins_mounts_and_the_others_none(host: str) -> None:
    """dra.pluginHost puts the kubelet plugin's mounts, the /dev/nvidia* files and API
    credentials on the container that runs it, and tells every container which one it
    is; the allocator reads claims with its own token, the device plugin gets one."""
    docs = render("dra.mode=both", f"dra.pluginHost={host}", include_crds=False)
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    pod = pod_of(docs)
    containers = {c["name"]: c for c in pod["containers"]}
    for name, container in containers.items():
        mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
        paths = [m["mountPath"] for m in container.get("volumeMounts", [])]
        assert len(paths) == len(set(paths)), name
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if name == host:
            assert set(mounts) >= DRA_MOUNTS, name
            assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
            assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
            token = "allocator-token" if host == "allocator" else "dra-token"
            assert {p: n for n, p in mounts.items()}[TOKEN] == token
        else:
            assert not set(mounts) & DRA_MOUNTS, name
            assert "dra-token" not in mounts, name
        if name in DRA_CONTAINERS:
            assert env.get("GPULET_DRA__PLUGIN_HOST") == (None if host == "allocator" else host)
    volumes = {v["name"] for v in pod["volumes"]}
    assert ("dra-token" in volumes) == (host == "device-plugin")
    # The device plugin sees /dev/nvidia* for its Allocate either way.
    env = {e["name"]: e.get("value") for e in containers["device-plugin"]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"


def test_dra_off_renders_nothing_of_it() -> None:
    docs = render("dra.rbac.create=true")
    assert not [d for d in docs if d["kind"] == "DeviceClass" or "dra" in d["metadata"]["name"]]
    text = json.dumps(docs)
    assert "GPULET_DRA__" not in text
    assert "plugins_registry" not in text


def test_placement_and_image_values() -> None:
    docs = render(
        "image.repository=registry.example.com/gpulet",
        "image.tag=9.9.9",
        "nodeSelector.pool=gpu",
        "runtimeClassName=nvidia",
        "tolerations=null",
    )
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["runtimeClassName"] == "nvidia"
    assert "tolerations" not in pod
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert images == {"registry.example.com/gpulet:9.9.9", "nats:2.14-alpine"}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("kubeletApi=dra", "replaced by dra.mode"),
        ("dra.mode=on", "one of device-plugin, both, dra"),
        ("dra.pluginHost=reporter", "one of allocator, device-plugin"),
        ("mig.strategy=mixed", "whole GPUs only"),
        ("sharing.strategy=time-slicing", "Koordinator"),
        ("nats.mode=cloud", "one of embedded, existing, fleet"),
    ],
)
def test_values_this_version_cannot_serve_fail_the_render(value: str, says: str) -> None:
    result = helm("template", "gpulet", str(CHART), "--set", BASE_IMAGE[0], "--set", value)
    assert result.returncode != 0
    assert says in result.stderr


def test_a_renamed_release_namespace_keeps_the_node_restriction_on_its_agent() -> None:
    """The policy's match condition names the release's ServiceAccount (the kustomize
    base has to be patched by hand for that)."""
    result = helm(
        "template", "gpulet", str(CHART), "--namespace", "gpu-agents", "--set", BASE_IMAGE[0]
    )
    assert result.returncode == 0, result.stderr
    policy = next(
        d
        for d in yaml.safe_load_all(result.stdout)
        if d and d["kind"] == "ValidatingAdmissionPolicy"
    )
    condition = policy["spec"]["matchConditions"][0]["expression"]
    assert "system:serviceaccount:gpu-agents:gpulet" in condition


def test_the_render_is_accepted_by_the_real_server(gpulet_access: ControlPlane) -> None:
    docs = render("alerting.enabled=true", "namespace.create=true", "dra.mode=both")
    results = apply_manifests(gpulet_access, docs, manager="helm-render", dry_run=True)
    refused = {
        f"{obj['kind']}/{obj['metadata']['name']}": resp.raw[:500]
        for obj, resp in results
        if not resp.ok
    }
    assert refused == {}
    assert {obj["kind"] for obj, _ in results} >= {
        "CustomResourceDefinition",
        "DaemonSet",
        "ValidatingAdmissionPolicy",
        "DeviceClass",
    }
