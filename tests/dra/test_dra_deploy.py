"""The dra kustomize component: DeviceClasses, RBAC, the kubelet plugin's mounts (on
the allocator container, the default ``dra.plugin_host``).

Built on top of the production overlay in a copy of deploy/ (the base and the overlay
stay as shipped), every object validated against the 1.37 OpenAPI schemas. Applying
them to a real kube-apiserver comes with issue 25's fixture.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpulet_common.settings.dra import DEFAULT_DRIVER, DEFAULT_PLUGINS_DIR, DraSettings
from support.deploy import DEPLOY, kustomize

K8S = kubernetes_validate.latest_version()


def build(root: Path) -> list[dict[str, Any]]:
    shutil.copytree(DEPLOY, root / "deploy")
    overlay = root / "deploy" / "kustomize" / "overlays" / "dra-test"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        "resources: [../production]\n"
        "components: [../../components/dra]\n"
    )
    return kustomize(overlay)


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return build(tmp_path_factory.mktemp("dra-deploy"))


def test_every_object_passes_the_schema(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        kubernetes_validate.validate(doc, K8S, strict=True)


def test_device_classes_select_our_driver(docs: list[dict[str, Any]]) -> None:
    classes = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "DeviceClass"}
    assert set(classes) == {
        "gpu.gpulet.io",
        "gpu-share.gpulet.io",
        "nvidia-gpu.gpulet.io",
        "mig.gpulet.io",
    }
    for spec in classes.values():
        (selector,) = spec["selectors"]
        assert f"device.driver == '{DEFAULT_DRIVER}'" in selector["cel"]["expression"]
    assert (
        "allowMultipleAllocations"
        in classes["gpu-share.gpulet.io"]["selectors"][0]["cel"]["expression"]
    )
    assert classes["nvidia-gpu.gpulet.io"]["extendedResourceName"] == "nvidia.com/gpu"
    mig = classes["mig.gpulet.io"]["selectors"][0]["cel"]["expression"]
    assert "type == 'mig'" in mig


def test_rbac_is_what_the_publisher_and_prepare_use(docs: list[dict[str, Any]]) -> None:
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "gpulet-dra"
    ]
    rules = {tuple(r["resources"]): sorted(r["verbs"]) for r in role["rules"]}
    assert rules == {
        ("resourceslices",): sorted(["list", "watch", "create", "update", "delete"]),
        ("resourceclaims",): ["get"],
        # status.devices after Prepare (the API server also checks node and driver).
        ("resourceclaims/status",): ["update"],
        ("resourceclaims/driver",): ["associated-node:update"],
    }
    [driver_rule] = [r for r in role["rules"] if r["resources"] == ["resourceclaims/driver"]]
    assert driver_rule["resourceNames"] == ["gpu.gpulet.io"]
    (binding,) = [
        d
        for d in docs
        if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == "gpulet-dra"
    ]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpulet", "namespace": "gpulet-system"}
    ]


TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount"
DRA_VOLUMES = {"plugins-registry", "dra-plugin", "cdi"}


def test_the_allocator_container_hosts_the_plugin(docs: list[dict[str, Any]]) -> None:
    """The default dra.plugin_host: kubelet's dirs, the CDI dir and the /dev/nvidia*
    files go to the allocator container, which reads claims with the token it has."""
    assert DraSettings(mode="both").plugin_runs_in("allocator")
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    containers = {c["name"]: c for c in spec["containers"]}
    allocator = containers["allocator"]
    mounts = {m["mountPath"]: m["name"] for m in allocator["volumeMounts"]}
    settings = DraSettings()
    assert mounts[settings.plugins_registry] == "plugins-registry"
    assert mounts[f"{DEFAULT_PLUGINS_DIR}/{DEFAULT_DRIVER}"] == "dra-plugin"
    assert mounts[settings.cdi_dir] == "cdi"
    for name, path in (
        ("plugins-registry", settings.plugins_registry),
        ("dra-plugin", f"{DEFAULT_PLUGINS_DIR}/{DEFAULT_DRIVER}"),
        ("cdi", settings.cdi_dir),
    ):
        assert volumes[name]["hostPath"]["path"] == path
        mount = next(m for m in allocator["volumeMounts"] if m["name"] == name)
        assert not mount.get("readOnly"), name  # sockets, specs, its checkpoint
    # One token per mount path: the allocator's own, of ServiceAccount gpulet, which
    # the ClusterRole gpulet-dra is bound to (test_rbac_... checks the binding).
    paths = [m["mountPath"] for m in allocator["volumeMounts"]]
    assert len(paths) == len(set(paths))
    assert mounts[TOKEN] == "allocator-token"
    assert spec["serviceAccountName"] == "gpulet"
    assert "dra-token" not in volumes
    # The /dev/nvidia* control files for the CDI specs, as the device plugin gets them.
    env = {e["name"]: e.get("value") for e in allocator["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    # The allocator keeps what it had.
    assert mounts["/var/lib/kubelet/pod-resources"] == "pod-resources"
    # Nobody else gains anything, the device-plugin container included.
    for other, container in containers.items():
        if other != "allocator":
            names = {m["name"] for m in container.get("volumeMounts", [])}
            assert not names & DRA_VOLUMES, other
    plugin = {m["mountPath"]: m["name"] for m in containers["device-plugin"]["volumeMounts"]}
    assert plugin["/var/lib/kubelet/device-plugins"] == "device-plugins"
    assert TOKEN not in plugin


def test_the_docs_examples_pass_the_schema() -> None:
    """Every Kubernetes object in docs/dra.md's YAML blocks is one the server knows."""
    text = (DEPLOY.parent / "docs" / "dra.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    objects = [d for block in blocks for d in yaml.safe_load_all(block) if d and "apiVersion" in d]
    assert {d["kind"] for d in objects} >= {"ResourceClaimTemplate", "Pod"}
    for doc in objects:
        kubernetes_validate.validate(doc, K8S, strict=True)
