"""MIG in the inventory (issue 27, the inventory part).

* The real NVML code path (``pynvml``'s own wrappers, then the adapter) against a fake
  ``libnvidia-ml`` that answers as real NVML does: a GPU without MIG, MIG disabled,
  MIG enabled and empty, MIG enabled with a device, and a driver without the MIG calls.
* The mock NVML's MIG model, through the adapter, on the shipped scenarios: an A100
  node laid out for the mixed strategy (one GPU MIG-enabled without instances, one
  with MIG disabled) and an H100 node laid out for the single strategy.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml
import pytest

from gpulet_common.messages import GpuInfo, MigDevice
from gpulet_common.mock_nvml import MockNvml, Scenario, load_scenario, scenario_from_toml
from gpulet_common.mock_nvml.faultspec import FaultSpec
from gpulet_common.mock_nvml.migspec import parse_profile
from gpulet_common.nvml import HEALTH_EVENT_MASK, NvmlAdapter
from gpulet_common.nvml.mig import profile_gb, profile_name

GPU = 0x1000
MIG = 0x2000
GPU_INSTANCE = 0x3000
GPU_UUID = b"GPU-20a40a50-21e7-4c3f-9d1e-6a1b2c3d4e5f"
MIG_UUID = b"MIG-5c1e8b6d-2f4a-5b7c-8d9e-0a1b2c3d4e5f"
H100_BYTES = 85_520_809_984  # nvmlDeviceGetMemoryInfo's total on a real H100 80GB HBM3
SUCCESS, NOT_SUPPORTED, NOT_FOUND = 0, 3, 6


def _address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


def _point(ref: Any, address: int) -> None:
    """Write a handle (a pointer) through pynvml's ``byref(handle)``."""
    ctypes.cast(ctypes.pointer(ref._obj), ctypes.POINTER(ctypes.c_void_p))[0] = address


class FakeLibNvml:
    """The C functions of libnvidia-ml.so that a MIG inventory calls, answering as real
    NVML does for one GPU (``layout``): "none" (no MIG: a T4), "disabled", "empty"
    (enabled, no instances), "one" (enabled, one 1g.10gb+me device). Any other C
    function is missing (FUNCTION_NOT_FOUND through pynvml); with ``mig_calls=False``
    so are the MIG ones (an old driver)."""

    def __init__(self, layout: str, *, mig_calls: bool = True) -> None:
        self.layout = layout
        self.mig_calls = mig_calls
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("nvml") and (self.mig_calls or "Mig" not in name):
            fn = getattr(self, "c_" + name, None)
            if fn is not None:

                def call(*args: Any) -> int:
                    self.calls.append(name)
                    return int(fn(*args))

                return call
        raise AttributeError(name)

    def c_nvmlDeviceGetHandleByIndex_v2(self, index: Any, device: Any) -> int:
        _point(device, GPU)
        return SUCCESS

    def c_nvmlDeviceGetUUID(self, handle: Any, buffer: Any, size: Any) -> int:
        buffer.value = MIG_UUID if _address(handle) == MIG else GPU_UUID
        return SUCCESS

    def c_nvmlDeviceGetMemoryInfo(self, handle: Any, memory: Any) -> int:
        total = 9984 * 1024 * 1024 if _address(handle) == MIG else H100_BYTES
        memory._obj.total, memory._obj.free, memory._obj.used = total, total, 0
        return SUCCESS

    def c_nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, count: Any) -> int:
        count._obj.value = 0 if self.layout == "none" else 7
        return SUCCESS

    def c_nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        if self.layout == "none":
            return NOT_SUPPORTED
        mode = 0 if self.layout == "disabled" else 1
        current._obj.value, pending._obj.value = mode, mode
        return SUCCESS

    def c_nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: Any, mig: Any) -> int:
        if self.layout == "none":
            return NOT_SUPPORTED
        if self.layout != "one" or index.value != 0:
            return NOT_FOUND
        _point(mig, MIG)
        return SUCCESS

    def c_nvmlDeviceGetGpuInstanceId(self, handle: Any, value: Any) -> int:
        value._obj.value = 7
        return SUCCESS

    def c_nvmlDeviceGetComputeInstanceId(self, handle: Any, value: Any) -> int:
        value._obj.value = 0
        return SUCCESS

    def c_nvmlDeviceGetAttributes_v2(self, handle: Any, attributes: Any) -> int:
        a = attributes._obj
        a.multiprocessorCount, a.gpuInstanceSliceCount, a.computeInstanceSliceCount = 16, 1, 1
        a.sharedCopyEngineCount, a.sharedDecoderCount, a.sharedJpegCount = 1, 1, 1
        a.sharedOfaCount, a.sharedEncoderCount, a.memorySizeMB = 1, 0, 9984
        return SUCCESS

    def c_nvmlDeviceGetGpuInstanceById(self, handle: Any, gi: int, instance: Any) -> int:
        _point(instance, GPU_INSTANCE)
        return SUCCESS

    def c_nvmlGpuInstanceGetInfo(self, instance: Any, info: Any) -> int:
        info._obj.id = 7
        info._obj.profileId = pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1
        return SUCCESS


def gpu_info(monkeypatch: pytest.MonkeyPatch, lib: FakeLibNvml) -> GpuInfo:
    monkeypatch.setattr(pynvml, "nvmlLib", lib)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    return NvmlAdapter(pynvml).gpu_info(0)


def test_real_path_a_gpu_without_mig(monkeypatch: pytest.MonkeyPatch) -> None:
    info = gpu_info(monkeypatch, FakeLibNvml("none"))
    assert info.uuid == GPU_UUID.decode()
    assert (info.mig_max_devices, info.mig_mode, info.mig_mode_pending) == (0, None, None)
    assert not info.mig_capable
    assert info.mig_devices == []


def test_real_path_mig_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = FakeLibNvml("disabled")
    info = gpu_info(monkeypatch, lib)
    assert (info.mig_max_devices, info.mig_mode, info.mig_mode_pending) == (
        7,
        "disabled",
        "disabled",
    )
    assert info.mig_capable
    assert info.mig_devices == []
    assert "nvmlDeviceGetMigDeviceHandleByIndex" not in lib.calls


def test_real_path_mig_enabled_and_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = FakeLibNvml("empty")
    info = gpu_info(monkeypatch, lib)
    assert (info.mig_mode, info.mig_mode_pending, info.mig_devices) == ("enabled", "enabled", [])
    # Every slot was asked; NOT_FOUND is an empty slot, not an error.
    assert lib.calls.count("nvmlDeviceGetMigDeviceHandleByIndex") == 7
    assert info.mig_max_devices == 7


def test_real_path_a_mig_device(monkeypatch: pytest.MonkeyPatch) -> None:
    info = gpu_info(monkeypatch, FakeLibNvml("one"))
    assert info.mig_devices == [
        MigDevice(
            uuid=MIG_UUID.decode(),
            index=0,
            gpu_instance_id=7,
            compute_instance_id=0,
            profile="1g.10gb+me",
            memory_total_bytes=9984 * 1024 * 1024,
            multiprocessors=16,
            slices_gi=1,
            slices_ci=1,
            copy_engines=1,
            decoders=1,
            jpegs=1,
            ofas=1,
        )
    ]


def test_real_path_a_driver_without_the_mig_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    info = gpu_info(monkeypatch, FakeLibNvml("one", mig_calls=False))
    assert (info.mig_max_devices, info.mig_mode, info.mig_devices) == (None, None, [])
    assert info.uuid == GPU_UUID.decode()


@pytest.mark.parametrize(
    ("mib", "total", "name"),
    [
        (9856, H100_BYTES, "10"),
        (19968, H100_BYTES, "20"),
        (40192, H100_BYTES, "40"),
        (4864, 40 * 1024**3, "5"),
        (19968, 40 * 1024**3, "20"),
    ],
)
def test_profile_gb_follows_nvidias_rule(mib: int, total: int, name: str) -> None:
    assert str(profile_gb(mib, total)) == name


def test_profile_names() -> None:
    assert profile_name(1, 1, 10, False) == "1g.10gb"
    assert profile_name(1, 2, 20, False) == "1c.2g.20gb"
    assert profile_name(1, 1, 10, True) == "1g.10gb+me"
    assert parse_profile("1c.2g.20gb+me").c == 1


# --- the mock's MIG model, through the adapter ------------------------------------------


def inventory(scenario: str | Scenario) -> list[GpuInfo]:
    adapter = NvmlAdapter(MockNvml(scenario), backend="mock")
    adapter.init()
    return adapter.inventory("node", 1).gpus


def test_the_a100_mixed_scenario() -> None:
    gpus = inventory("a100-mig-mixed")
    assert [g.name for g in gpus] == ["NVIDIA A100-SXM4-40GB"] * 4
    assert [(g.mig_mode, g.mig_mode_pending, g.mig_max_devices) for g in gpus] == [
        ("enabled", "enabled", 7),
        ("enabled", "enabled", 7),
        ("enabled", "enabled", 7),  # enabled, no instances
        ("disabled", "disabled", 7),
    ]
    layout = [
        [(d.gpu_instance_id, d.compute_instance_id, d.profile) for d in g.mig_devices] for g in gpus
    ]
    assert layout == [
        [(1, 0, "3g.20gb"), (2, 0, "2g.10gb"), (3, 0, "1g.5gb"), (4, 0, "1g.5gb")],
        [(1, 0, "1c.3g.20gb"), (1, 1, "2c.3g.20gb"), (2, 0, "3g.20gb")],
        [],
        [],
    ]
    devices = [d for g in gpus for d in g.mig_devices]
    assert all(d.uuid.startswith("MIG-") for d in devices)
    assert len({d.uuid for d in devices}) == len(devices)
    big = gpus[0].mig_devices[0]
    assert (big.slices_gi, big.slices_ci, big.multiprocessors) == (3, 3, 48)
    assert 19 * 1024**3 < big.memory_total_bytes < 20 * 1024**3


def test_the_h100_single_scenario() -> None:
    gpus = inventory("h100-mig-single")
    assert len(gpus) == 8
    for gpu in gpus:
        assert gpu.mig_mode == "enabled"
        assert [d.profile for d in gpu.mig_devices] == ["1g.10gb"] * 7
        assert [d.gpu_instance_id for d in gpu.mig_devices] == list(range(7, 14))


def test_a_gpu_without_mig_in_the_mock_answers_as_real_nvml() -> None:
    mock = MockNvml("t4")
    mock.nvmlInit()
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    assert mock.nvmlDeviceGetMaxMigDeviceCount(handle) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        mock.nvmlDeviceGetMigMode(handle)
    [gpu] = inventory("t4")
    assert (gpu.mig_max_devices, gpu.mig_mode, gpu.mig_devices) == (0, None, [])


def test_a_pending_mode_and_a_wrong_layout() -> None:
    base = 'base = "a100-pcie"\n[gpu_defaults.mig]\nmode = "disabled"\npending = "enabled"\n'
    [gpu] = inventory(scenario_from_toml(base))
    assert (gpu.mig_mode, gpu.mig_mode_pending) == ("disabled", "enabled")
    bad = (
        'base = "a100-pcie"\n[gpu_defaults.mig]\nmode = "enabled"\n'
        'devices = [{gi = 1, profile = "9g.5gb"}]\n'
    )
    with pytest.raises(ValueError, match="MIG profile"):
        scenario_from_toml(bad)
    assert load_scenario("a100-mig-mixed").gpus[2].mig is not None


def test_the_mig_fault_changes_a_layout_and_refuses_a_wrong_one() -> None:
    mock = MockNvml("a100-mig-mixed")
    adapter = NvmlAdapter(mock, backend="mock")
    adapter.init()
    before = adapter.gpu_info(2)
    assert not adapter.mig_changed(before)
    layout = {"mode": "enabled", "devices": [{"gi": 1, "profile": "7g.40gb"}]}
    assert mock.apply(FaultSpec(fault="mig", gpu=2, spec=layout))[0]
    assert adapter.mig_changed(before)
    assert [d.profile for d in adapter.gpu_info(2).mig_devices] == ["7g.40gb"]
    too_big = {
        "mode": "enabled",
        "devices": [{"gi": 1, "profile": "7g.40gb"}, {"gi": 2, "profile": "1g.5gb"}],
    }
    applied, detail = mock.apply(FaultSpec(fault="mig", gpu=2, spec=too_big))
    assert not applied
    assert "slices" in detail
    assert "needs spec" in mock.apply(FaultSpec(fault="mig", gpu=2))[1]
    t4 = MockNvml("t4")
    applied, detail = t4.apply(FaultSpec(fault="mig", gpu=0, spec=layout))
    assert (applied, "has no MIG" in detail) == (False, True)


def test_an_xid_on_one_mig_device_carries_its_instance_ids() -> None:
    mock = MockNvml("a100-mig-mixed")
    adapter = NvmlAdapter(mock, backend="mock")
    adapter.init()
    event_set = adapter.create_event_set()
    assert adapter.register_events(event_set, 0, HEALTH_EVENT_MASK)
    assert mock.apply(FaultSpec(fault="xid", gpu=0, value=43, gi=1, ci=0))[0]
    assert mock.apply(FaultSpec(fault="xid", gpu=0, value=79))[0]
    on_device = adapter.wait_event(event_set, 0)
    whole_gpu = adapter.wait_event(event_set, 0)
    assert on_device is not None
    assert whole_gpu is not None
    assert (on_device.xid, on_device.gpu_instance_id, on_device.compute_instance_id) == (43, 1, 0)
    assert (whole_gpu.xid, whole_gpu.gpu_instance_id, whole_gpu.compute_instance_id) == (
        79,
        None,
        None,
    )
    for wrong in (
        FaultSpec(fault="xid", gpu=0, value=43, gi=1),
        FaultSpec(fault="ecc_sbe", gpu=0, gi=1, ci=0),
        FaultSpec(fault="xid", gpu=0, value=43, gi=-1, ci=0),
    ):
        applied, detail = mock.apply(wrong)
        assert not applied
        assert "gi and ci" in detail
