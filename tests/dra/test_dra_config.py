"""The DRA configuration API (gpu.gpulet.io/v1alpha1): strict decoding, errors that
name the field, and which request gets which configuration."""

from __future__ import annotations

from typing import Any

import pytest

from gpulet_common.dra import config

V = config.API_VERSION


def gpu(**sharing: Any) -> dict[str, Any]:
    return {"apiVersion": V, "kind": "GpuConfig", "sharing": sharing}


def test_nvidias_field_names_decode() -> None:
    decoded = config.decode(
        gpu(
            strategy="MPS",
            mpsConfig={
                "defaultActiveThreadPercentage": 40,
                "defaultPinnedDeviceMemoryLimit": "10Gi",
                "defaultPerDevicePinnedMemoryLimit": {"0": "5Gi"},
            },
        )
    )
    assert config.mps_limits(decoded) == (40, 10 << 30)
    sliced = config.decode(gpu(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"}))
    assert config.strategy(sliced) == "TimeSlicing"
    mig = config.decode({"apiVersion": V, "kind": "MigDeviceConfig"})
    assert isinstance(mig, config.MigDeviceConfig)
    assert config.strategy(mig) == "Exclusive"


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ({"apiVersion": V, "kind": "Bogus"}, "kind: 'Bogus'"),
        ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}, "apiVersion:"),
        (gpu(strategy="Bogus"), "sharing.strategy:"),
        (gpu(strategi="MPS"), "sharing: Object contains unknown field `strategi`"),
        (
            gpu(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 101}),
            "sharing.mpsConfig.defaultActiveThreadPercentage:",
        ),
        (
            gpu(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": "lots"}),
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit:",
        ),
        (
            gpu(strategy="MPS", mpsConfig={"defaultPerDevicePinnedMemoryLimit": {"x": "1Gi"}}),
            "defaultPerDevicePinnedMemoryLimit['x']",
        ),
        (gpu(strategy="Exclusive", mpsConfig={}), "sharing.mpsConfig: only with strategy MPS"),
        (gpu(strategy="MPS", timeSlicingConfig={}), "sharing.timeSlicingConfig:"),
        (
            gpu(strategy="TimeSlicing", timeSlicingConfig={"interval": "Forever"}),
            "sharing.timeSlicingConfig.interval:",
        ),
        ("not an object", "parameters:"),
    ],
)
def test_an_invalid_config_names_its_field(parameters: Any, field: str) -> None:
    with pytest.raises(config.ConfigError) as info:
        config.decode(parameters)
    assert field in str(info.value)


def opaque(parameters: Any, *requests: str, driver: str = "gpu.gpulet.io") -> dict[str, Any]:
    return {
        "source": "FromClaim",
        "requests": list(requests),
        "opaque": {"driver": driver, "parameters": parameters},
    }


def test_the_last_config_naming_a_request_wins_and_other_drivers_are_theirs() -> None:
    mps = gpu(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 10})
    chosen, errors = config.resolve(
        [
            opaque(gpu(strategy="TimeSlicing")),  # every request (a class's, say)
            opaque(mps, "r2"),
            opaque({"kind": "Bogus"}, "r1", driver="gpu.nvidia.com"),  # not ours
        ],
        "gpu.gpulet.io",
        ["r1", "r2"],
    )
    assert errors == []
    assert config.strategy(chosen["r1"]) == "TimeSlicing"
    assert config.mps_limits(chosen["r2"]) == (10, None)
    _, errors = config.resolve(
        [opaque({"apiVersion": V, "kind": "Bogus"})], "gpu.gpulet.io", ["r1"]
    )
    assert errors == [
        "config[0] (gpu.gpulet.io): kind: 'Bogus' is not one of GpuConfig, MigDeviceConfig"
    ]
    assert config.resolve("junk", "gpu.gpulet.io", ["r1"])[1] == ["config: malformed"]


def test_a_config_of_the_wrong_kind_for_the_device_is_refused() -> None:
    from gpulet_allocator.kubelet.dra.claims import ClaimError, configs_of
    from gpulet_allocator.kubelet.dra.contract import ClaimDevice

    claim = {
        "status": {
            "allocation": {"devices": {"config": [opaque({"apiVersion": V, "kind": "GpuConfig"})]}}
        }
    }
    whole = ClaimDevice("node", "gpu-0", ("gpu",))
    assert set(configs_of(claim, [whole], driver="gpu.gpulet.io", where="ns/c")) == {"gpu-0"}
    mig = ClaimDevice("node", "gpu-0-mig-1g10gb-19-0", ("gpu",))
    with pytest.raises(ClaimError, match="takes a MigDeviceConfig, not a GpuConfig"):
        configs_of(claim, [mig], driver="gpu.gpulet.io", where="ns/c")
