"""The DRA configuration API checked at `kubectl apply`: deploy/'s ValidatingAdmissionPolicy
``gpulet-dra-config`` on the real kube-apiserver (v1.37) refuses a ResourceClaim or
ResourceClaimTemplate whose gpu.gpulet.io config is wrong, naming the field, and lets
every config the strict decoder (gpulet_common.dra.config) takes through."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpulet_common.dra import config
from support.control_plane import ControlPlane
from support.control_plane_fixtures import unique_name

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "deploy" / "kustomize" / "components" / "dra" / "config-policy.yaml"
RESOURCE = "/apis/resource.k8s.io/v1"
V = config.API_VERSION


def claim(parameters: Any, *, driver: str = "gpu.gpulet.io") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": unique_name("c")},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpulet.io"}}],
                "config": [
                    {"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}}
                ],
            }
        },
    }


def template(parameters: Any) -> dict[str, Any]:
    body = claim(parameters)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": unique_name("t")},
        "spec": {"spec": body["spec"]},
    }


def gpu(**sharing: Any) -> dict[str, Any]:
    return {"apiVersion": V, "kind": "GpuConfig", "sharing": sharing}


@pytest.fixture(scope="module")
def policy(kube_api: ControlPlane) -> Iterator[ControlPlane]:
    for obj in yaml.safe_load_all(POLICY.read_text()):
        resp = kube_api.apply(obj)
        assert resp.ok, resp.raw[:1000]
    yield kube_api
    for obj in yaml.safe_load_all(POLICY.read_text()):
        kind = obj["kind"].lower()
        plural = kind[:-1] + "ies" if kind.endswith("y") else kind + "s"
        resp = kube_api.request(
            "DELETE", f"/apis/admissionregistration.k8s.io/v1/{plural}/{obj['metadata']['name']}"
        )
        assert resp.ok, resp.raw[:500]


def create(plane: ControlPlane, namespace: str, body: dict[str, Any]) -> tuple[int, str]:
    plural = "resourceclaims" if body["kind"] == "ResourceClaim" else "resourceclaimtemplates"
    resp = plane.request("POST", f"{RESOURCE}/namespaces/{namespace}/{plural}", body)
    return resp.status, resp.raw.decode(errors="replace")


def wait_active(plane: ControlPlane, namespace: str) -> None:
    """The API server loads a new policy a moment after it is created: until a bad
    claim is refused (bounded), then the policy is in force."""
    deadline = time.monotonic() + 60
    while True:
        status, _ = create(plane, namespace, claim({"apiVersion": V, "kind": "Bogus"}))
        if status == 422:
            return
        assert time.monotonic() < deadline, "the policy never refused a bad claim"
        time.sleep(0.2)


BAD = [
    ({"apiVersion": V, "kind": "Bogus"}, "opaque.parameters.kind"),
    ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}, "apiVersion"),
    ({"apiVersion": V, "kind": "GpuConfig", "sharin": {}}, "opaque.parameters: unknown field"),
    (gpu(strategy="MPs"), "opaque.parameters.sharing.strategy"),
    (gpu(strategi="MPS"), "opaque.parameters.sharing: unknown field"),
    (gpu(strategy="Exclusive", mpsConfig={}), "mpsConfig: only with strategy MPS"),
    (gpu(strategy="MPS", timeSlicingConfig={}), "timeSlicingConfig: only with strategy"),
    (gpu(strategy="TimeSlicing", timeSlicingConfig={"interval": "Forever"}), "interval"),
    (
        gpu(strategy="MPS", mpsConfig={"defaultActiveThreadPercentag": 5}),
        "mpsConfig: unknown field",
    ),
    (gpu(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 101}), "1 to 100"),
]
GOOD = [
    {"apiVersion": V, "kind": "GpuConfig"},
    {"apiVersion": V, "kind": "MigDeviceConfig", "sharing": {"strategy": "Exclusive"}},
    gpu(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"}),
    gpu(
        strategy="MPS",
        mpsConfig={
            "defaultActiveThreadPercentage": 50,
            "defaultPinnedDeviceMemoryLimit": "10Gi",
            "defaultPerDevicePinnedMemoryLimit": {"0": "5Gi"},
        },
    ),
]


def test_a_bad_config_is_refused_at_apply_naming_the_field(
    policy: ControlPlane, kube_namespace: str
) -> None:
    wait_active(policy, kube_namespace)
    for parameters, field in BAD:
        # Prepare's decoder refuses every one of them too.
        with pytest.raises(config.ConfigError):
            config.decode(copy.deepcopy(parameters))
        for body in (claim(parameters), template(parameters)):
            status, text = create(policy, kube_namespace, body)
            assert status == 422, (parameters, text[:500])
            assert "gpulet-dra-config" in text
            assert field in text, (field, text[:500])
    for parameters in GOOD:
        config.decode(copy.deepcopy(parameters))
        for body in (claim(parameters), template(parameters)):
            status, text = create(policy, kube_namespace, body)
            assert status == 201, (parameters, text[:500])
    # Another driver's config is that driver's business.
    status, text = create(policy, kube_namespace, claim({"kind": "Bogus"}, driver="gpu.nvidia.com"))
    assert status == 201, text[:500]
