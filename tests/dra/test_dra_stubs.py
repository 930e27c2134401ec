"""The DRA kubelet stubs carry kubelet's wire names and load side by side.

The committed stubs being what scripts/gen-protos makes of the vendored protos is
checked for every tree by tests/allocator/test_kubelet_api_stubs.py; this file checks
what the DRA plugin relies on: the proto packages (they are the gRPC method paths
kubelet dials) and that every version loads into one process next to the PodResources
and device plugin stubs (protobuf's descriptor pool is global; ``v1`` and ``v1beta1``
packages are shared with them).
"""

from __future__ import annotations

from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as dp
from gpulet_common.kubelet_api.dra.v1 import api_pb2 as dra
from gpulet_common.kubelet_api.dra_health.v1 import api_pb2 as health_v1
from gpulet_common.kubelet_api.dra_health.v1alpha1 import api_pb2 as health_v1alpha1
from gpulet_common.kubelet_api.dra_health.v1beta1 import api_pb2 as health_v1beta1
from gpulet_common.kubelet_api.pluginregistration.v1 import api_pb2 as reg
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr


def _methods(module: object, service: str) -> list[str]:
    descriptor = module.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
    return [f"/{descriptor.full_name}/{m.name}" for m in descriptor.methods]


def test_dra_plugin_paths_are_kubelets() -> None:
    assert _methods(dra, "DRAPlugin") == [
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
    ]
    assert [f.name for f in dra.Device.DESCRIPTOR.fields] == [
        "request_names",
        "pool_name",
        "device_name",
        "cdi_device_ids",
        "share_id",
    ]
    assert dra.Device.DESCRIPTOR.fields_by_name["share_id"].number == 5


def test_registration_paths_are_kubelets() -> None:
    assert _methods(reg, "Registration") == [
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    ]


def test_health_paths_of_every_version() -> None:
    for module, version in (
        (health_v1alpha1, "v1alpha1"),
        (health_v1beta1, "v1beta1"),
        (health_v1, "v1"),
    ):
        assert _methods(module, "DRAResourceHealth") == [
            f"/{version}.DRAResourceHealth/NodeWatchResources"
        ]
        assert module.HealthStatus.Name(2) == "UNHEALTHY"


def test_all_stubs_share_one_process() -> None:
    # Importing them all above would have raised on a descriptor clash; make sure the
    # shared packages really are shared and nothing was shadowed.
    assert pr.DESCRIPTOR.package == health_v1.DESCRIPTOR.package == "v1"
    assert dp.DESCRIPTOR.package == health_v1beta1.DESCRIPTOR.package == "v1beta1"
    assert pr.ListPodResourcesRequest.DESCRIPTOR.full_name == "v1.ListPodResourcesRequest"
    assert health_v1.DeviceHealth.DESCRIPTOR.full_name == "v1.DeviceHealth"
    # v1alpha1 lacks the message fields v1beta1 and v1 added.
    assert "message" not in health_v1alpha1.DeviceHealth.DESCRIPTOR.fields_by_name
    assert "message" in health_v1.DeviceHealth.DESCRIPTOR.fields_by_name
