"""The pod-labels component: the collector may read kubelet's PodResources, nothing more."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.deploy import DEPLOY

COMPONENT = "../../components/pod-labels"


def build_with_pod_labels(root: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found: the kustomize builds need `kubectl kustomize`")
    shutil.copytree(DEPLOY, root / "deploy")
    production = root / "deploy" / "kustomize" / "overlays" / "production"
    text = (production / "kustomization.yaml").read_text()
    assert f"  # - {COMPONENT}" in text  # the overlay offers it, commented out
    text = text.replace("components: []\n", "components:\n")
    text = text.replace(f"  # - {COMPONENT}", f"  - {COMPONENT}")
    (production / "kustomization.yaml").write_text(text)
    result = subprocess.run(
        [kubectl, "kustomize", str(production)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def test_collector_gets_the_pod_resources_socket_read_only(tmp_path: Path) -> None:
    docs = build_with_pod_labels(tmp_path)
    [daemonset] = [d for d in docs if d["kind"] == "DaemonSet"]
    containers = {c["name"]: c for c in daemonset["spec"]["template"]["spec"]["containers"]}
    collector = containers["collector"]
    mounts = {m["name"]: m for m in collector["volumeMounts"]}
    assert set(mounts) == {"config", "state", "pod-resources"}
    assert mounts["pod-resources"]["readOnly"] is True
    assert mounts["pod-resources"]["mountPath"] == "/var/lib/kubelet/pod-resources"
    sc = collector["securityContext"]
    assert (sc["runAsUser"], sc["runAsNonRoot"]) == (0, False)
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    # Nobody else gains anything: health still runs as the pod's non-root user.
    assert "pod-resources" not in {m["name"] for m in containers["health"]["volumeMounts"]}
    assert "runAsUser" not in containers["health"]["securityContext"]
