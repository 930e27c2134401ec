"""Every manifest in deploy/ applied to the real kube-apiserver with server-side apply,
as an operator would (``kubectl apply --server-side -k ...``): the CRD, RBAC, the
admission policy, the DaemonSet, the ConfigMaps and Secrets are accepted as written,
by the server's own validation (which a schema check before it only approximates).

Covered: both overlays (mock, production), the production overlay with each optional
component (NATS leaf, NATS fleet, alerts, pod labels), and the fleet hub (deploy/fleet).
Not applied: deploy/prometheus (a PodMonitor and a PrometheusRule), whose CRDs belong to
the Prometheus Operator and are not part of this control plane; promtool checks its
rules (tests/test_deploy_prometheus.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.control_plane import ControlPlane, object_path
from support.deploy import DEPLOY, KUSTOMIZE, kustomize
from support.gpulet_on_kube import apply_manifests

OVERLAYS = sorted(p.name for p in (KUSTOMIZE / "overlays").iterdir() if p.is_dir())
COMPONENTS = sorted(p.name for p in (KUSTOMIZE / "components").iterdir() if p.is_dir())


def kubectl() -> str:
    path = shutil.which("kubectl")
    assert path is not None, "kubectl is needed to render and apply the kustomize overlays"
    return path


def test_the_overlays_are_all_here() -> None:
    """The parametrisations below are read from the tree: a new overlay is applied too."""
    assert OVERLAYS == ["mock", "production"]
    assert {"nats-leaf", "nats-fleet", "alerts", "remediation"} <= set(COMPONENTS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubectl_apply_server_side_of_each_overlay(
    gpulet_access: ControlPlane, overlay: str, tmp_path: Path
) -> None:
    """The documented command, verbatim but for the kubeconfig."""
    kubeconfig = gpulet_access.write_kubeconfig(tmp_path / "admin.kubeconfig")
    result = subprocess.run(
        [
            kubectl(),
            f"--kubeconfig={kubeconfig}",
            "apply",
            "--server-side",
            "--force-conflicts",
            f"--field-manager=overlay-{overlay}",
            "-k",
            str(KUSTOMIZE / "overlays" / overlay),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rendered = kustomize(KUSTOMIZE / "overlays" / overlay)
    assert len(result.stdout.splitlines()) == len(rendered)
    # What the server stored is what was rendered (spot checks of what matters).
    for obj in rendered:
        stored = gpulet_access.must("GET", object_path(obj))
        assert stored["metadata"]["name"] == obj["metadata"]["name"]
        if obj["kind"] == "DaemonSet":
            want = [c["name"] for c in obj["spec"]["template"]["spec"]["containers"]]
            got = [c["name"] for c in stored["spec"]["template"]["spec"]["containers"]]
            # A subset: under server-side apply, containers that another test applied
            # to the same DaemonSet (the alerts component) stay, owned by their manager.
            assert set(want) <= set(got)


def _with_components(tmp_path: Path, components: list[str]) -> list[dict[str, Any]]:
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(KUSTOMIZE / "overlays" / "production", tmp_path)],
                "components": [
                    os.path.relpath(KUSTOMIZE / "components" / c, tmp_path) for c in components
                ],
            }
        )
    )
    return kustomize(tmp_path)


# nats-leaf and nats-fleet are alternatives (a leaf to a cluster NATS, or to the hub).
@pytest.mark.parametrize(
    "components",
    [
        ["nats-leaf", "alerts", "remediation"],
        ["nats-fleet", "alerts", "remediation"],
        ["dra", "mps", "time-slicing"],
    ],
    ids=["leaf", "fleet", "dra-mps"],
)
def test_production_with_components_is_accepted(
    gpulet_access: ControlPlane, components: list[str], tmp_path: Path
) -> None:
    docs = _with_components(tmp_path, components)
    results = apply_manifests(
        gpulet_access, docs, manager="with-" + "-".join(components), dry_run=True
    )
    refused = {
        f"{obj['kind']}/{obj['metadata']['name']}": resp.raw[:500]
        for obj, resp in results
        if not resp.ok
    }
    assert refused == {}


def test_fleet_hub_is_accepted(gpulet_access: ControlPlane) -> None:
    docs = kustomize(DEPLOY / "fleet")
    results = apply_manifests(gpulet_access, docs, manager="fleet", dry_run=True)
    refused = {
        f"{obj['kind']}/{obj['metadata']['name']}": resp.raw[:500]
        for obj, resp in results
        if not resp.ok
    }
    assert refused == {}
    assert {obj["kind"] for obj, _ in results} >= {"Namespace", "Job"}


def test_a_broken_manifest_is_refused(gpulet_access: ControlPlane) -> None:
    """The apply path above really validates: the DaemonSet with a container that
    lost its image is refused with the field named."""
    daemonset = next(
        d for d in kustomize(KUSTOMIZE / "overlays" / "mock") if d["kind"] == "DaemonSet"
    )
    # A new name: under server-side apply, a field that another manager applied to an
    # existing DaemonSet would stay.
    daemonset["metadata"]["name"] = "gpulet-broken"
    del daemonset["spec"]["template"]["spec"]["containers"][0]["image"]
    resp = gpulet_access.apply(daemonset, manager="broken")
    assert resp.status == 422
    assert "image" in resp.body["message"]


def test_the_documented_image_steps_give_a_daemonset_of_that_image(
    gpulet_access: ControlPlane, tmp_path: Path
) -> None:
    """README and docs/deploy.md: no public image, so the reader names the one they
    pushed in the production overlay (newName/newTag), then `kubectl apply -k`. The
    server takes it (a dry run), and every gpulet container runs that image."""
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    production = tmp_path / "deploy" / "kustomize" / "overlays" / "production"
    text = (production / "kustomization.yaml").read_text()
    assert "newName: REGISTRY/gpulet" in text  # the placeholder the docs tell to replace
    text = text.replace("newName: REGISTRY/gpulet", "newName: registry.example.com/gpulet")
    (production / "kustomization.yaml").write_text(text)
    kubeconfig = gpulet_access.write_kubeconfig(tmp_path / "admin.kubeconfig")
    result = subprocess.run(
        [
            kubectl(),
            f"--kubeconfig={kubeconfig}",
            "apply",
            "--dry-run=server",
            "--server-side",
            "--force-conflicts",
            "--field-manager=documented-image",
            "-o",
            "yaml",
            "-k",
            str(production),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    items = yaml.safe_load(result.stdout)["items"]
    ds = next(i for i in items if i["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    images = {c["name"]: c["image"] for c in [*ds.get("initContainers", []), *ds["containers"]]}
    # The overlay's containers: under server-side apply, a container another test
    # applied to the same DaemonSet (a component's) stays, owned by its manager.
    rendered = next(d for d in kustomize(production) if d["kind"] == "DaemonSet")
    pod = rendered["spec"]["template"]["spec"]
    names = {c["name"] for c in [*pod.get("initContainers", []), *pod["containers"]]}
    assert names <= set(images), (names, images)
    assert images["nats"].startswith("nats:")
    ours = {images[n] for n in names - {"nats"}}
    assert ours == {"registry.example.com/gpulet:0.1.0"}, images
