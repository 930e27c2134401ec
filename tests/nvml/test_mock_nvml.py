"""The mock NVML itself: pynvml's shapes and exceptions, the timeline, live injection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from gpulet_common.messages import MockInjectRequest
from gpulet_common.mock_nvml import (
    FAULT_KINDS,
    ManualClock,
    MockNvml,
    load_scenario,
    scenario_from_toml,
)
from gpulet_common.mock_nvml.faultspec import FaultSpec, check_fault
from gpulet_common.nvml import (
    EVENT_GPU_UNAVAILABLE,
    EVENT_XID,
    HEALTH_EVENT_MASK,
    NvmlAdapter,
    NvmlUnavailable,
)

MockFactory = Callable[..., tuple[NvmlAdapter, MockNvml]]
MIB = 1024 * 1024


def started(scenario: str = "dgx-h100", **kw: Any) -> MockNvml:
    mock = MockNvml(scenario, jitter=False, clock=ManualClock(), **kw)
    mock.nvmlInit()
    return mock


# --- shapes and exceptions of pynvml ---------------------------------------------------


def test_mock_raises_the_real_pynvml_error_classes() -> None:
    mock = MockNvml("t4", clock=ManualClock())
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        mock.nvmlDeviceGetCount()
    mock.nvmlInit()
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported) as unsupported:
        mock.nvmlDeviceGetRemappedRows(handle)
    assert type(unsupported.value) is pynvml.NVMLError_NotSupported
    assert unsupported.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert str(unsupported.value) == "Not Supported"
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        mock.nvmlDeviceGetCurrentClocksEventReasons(handle)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        mock.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NotFound):
        mock.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    event_set = mock.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_Timeout):
        mock.nvmlEventSetWait_v2(event_set, 0)
    mock.inject(MockInjectRequest(fault="lost", gpu=0))
    with pytest.raises(pynvml.NVMLError_GpuIsLost) as lost:
        mock.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    assert lost.value.value == 15
    mock.inject(MockInjectRequest(fault="nvml_vanish", value=9))
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        mock.nvmlInit()


def test_mock_return_shapes_match_pynvml() -> None:
    mock = started("dgx-h100")
    spec = mock.scenario.gpus[4]
    handle = mock.nvmlDeviceGetHandleByIndex(4)
    assert mock.nvmlDeviceGetHandleByUUID(spec.uuid) is handle
    assert mock.nvmlDeviceGetHandleByUUID(spec.uuid.encode()) is handle
    assert mock.nvmlDeviceGetHandleByPciBusId("0000:9a:00.0") is handle
    assert mock.nvmlDeviceGetIndex(handle) == 4
    assert mock.nvmlDeviceGetUUID(handle) == spec.uuid
    assert isinstance(mock.nvmlDeviceGetName(handle), str)
    assert isinstance(mock.nvmlSystemGetDriverVersion(), str)
    assert mock.nvmlSystemGetCudaDriverVersion() == 12040
    memory = mock.nvmlDeviceGetMemoryInfo(handle)
    assert (memory.total, memory.used, memory.free) == (
        81559 * MIB,
        4096 * MIB,
        (81559 - 4096) * MIB,
    )
    pci = mock.nvmlDeviceGetPciInfo(handle)
    assert (pci.busId, pci.busIdLegacy, pci.domain, pci.bus, pci.device) == (
        "00000000:9A:00.0",
        "0000:9A:00.0",
        0,
        0x9A,
        0,
    )
    assert pci.pciDeviceId == 0x233010DE
    util = mock.nvmlDeviceGetUtilizationRates(handle)
    assert (util.gpu, util.memory) == (20, 8)
    assert mock.nvmlDeviceGetEccMode(handle) == [1, 1]
    assert mock.nvmlDeviceGetCudaComputeCapability(handle) == (9, 0)
    assert mock.nvmlDeviceGetModuleId(handle) == 5  # GPU 4 of dgx-h100 sits in slot 5
    words = mock.nvmlDeviceGetCpuAffinityWithinScope(handle, 4, pynvml.NVML_AFFINITY_SCOPE_NODE)
    # CPUs 56-111 and 168-223 as 64-bit words.
    assert words == [0xFF << 56, (1 << 48) - 1, ((1 << 24) - 1) << 40, (1 << 32) - 1]
    assert mock.nvmlDeviceGetTotalEccErrors(handle, 0, 0) == 0
    assert mock.nvmlDeviceGetRemappedRows(handle) == (0, 0, 0, 0)
    assert mock.nvmlDeviceGetNvLinkState(handle, 0) == 1
    assert mock.nvmlDeviceGetNvLinkRemoteDeviceType(handle, 17) == 2  # NVSwitch
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        mock.nvmlDeviceGetNvLinkState(handle, 18)
    other = mock.nvmlDeviceGetHandleByIndex(5)
    assert mock.nvmlDeviceGetTopologyCommonAncestor(handle, other) == pynvml.NVML_TOPOLOGY_NODE
    assert mock.nvmlDeviceGetTopologyCommonAncestor(handle, handle) == 0

    event_set = mock.nvmlEventSetCreate()
    mock.nvmlDeviceRegisterEvents(handle, EVENT_XID, event_set)
    mock.inject(MockInjectRequest(fault="xid", gpu=4, value=31))
    data = mock.nvmlEventSetWait_v2(event_set, 0)
    assert (data.device, data.eventType, data.eventData) == (handle, EVENT_XID, 31)
    assert data.gpuInstanceId == data.computeInstanceId == 0xFFFFFFFF
    mock.nvmlEventSetFree(event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        mock.nvmlEventSetWait_v2(event_set, 0)
    mock.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        mock.nvmlDeviceGetCount()


def test_constants_and_error_classes_are_pynvml_s() -> None:
    mock = MockNvml("t4")
    assert mock.NVMLError is pynvml.NVMLError
    assert mock.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost
    assert mock.NVML_TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU
    assert mock.NVML_NVLINK_MAX_LINKS == pynvml.NVML_NVLINK_MAX_LINKS
    assert mock.nvmlEventTypeXidCriticalError == 0x8
    with pytest.raises(AttributeError):
        _ = mock.nvmlDeviceGetFanSpeed  # a function the mock does not have


def test_register_rejects_unsupported_types() -> None:
    mock = started("t4")
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    event_set = mock.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        mock.nvmlDeviceRegisterEvents(handle, EVENT_GPU_UNAVAILABLE, event_set)
    assert mock.nvmlDeviceGetSupportedEventTypes(handle) == 0x1F


# --- jitter -------------------------------------------------------------------------------


def readings(mock: MockNvml, count: int) -> list[tuple[int, int, int]]:
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    out = []
    for _ in range(count):
        util = mock.nvmlDeviceGetUtilizationRates(handle).gpu
        power = mock.nvmlDeviceGetPowerUsage(handle)
        temp = mock.nvmlDeviceGetTemperature(handle, 0)
        out.append((util, power, temp))
    return out


def test_jitter_is_small_deterministic_and_alive() -> None:
    first = MockNvml("dgx-h100", clock=ManualClock())
    second = MockNvml("dgx-h100", clock=ManualClock())
    first.nvmlInit()
    second.nvmlInit()
    values = readings(first, 50)
    assert values == readings(second, 50)
    assert len(set(values)) > 5
    for util, power, temp in values:
        assert 17 <= util <= 23
        assert 118_000 * 0.98 <= power <= 118_000 * 1.02
        assert 33 <= temp <= 35


# --- the faults-demo timeline, played on a manual clock ---------------------------------------


def test_faults_demo_covers_every_fault_kind() -> None:
    kinds = {f.fault for f in load_scenario("faults-demo").timeline}
    assert kinds == set(FAULT_KINDS)


def test_faults_demo_timeline(open_mock: MockFactory, clock: ManualClock) -> None:
    adapter, mock = open_mock("faults-demo")
    uuids = [adapter.uuid_of(i) for i in range(8)]
    assert uuids == [g.uuid for g in load_scenario("dgx-h100").gpus]
    event_set = adapter.create_event_set()
    for index in range(8):
        assert adapter.register_events(event_set, index, HEALTH_EVENT_MASK) == HEALTH_EVENT_MASK

    def at(t: float) -> None:
        clock.advance(t - mock.elapsed())
        mock.tick()

    def events() -> list[tuple[int | None, int, int]]:
        out = []
        for _ in range(20):
            event = adapter.wait_event(event_set, 0)
            if event is None:
                break
            out.append((event.gpu_index, event.event_type, event.event_data))
        return out

    at(4.9)
    assert events() == []
    at(5)
    assert events() == [(1, EVENT_XID, 13)]
    at(8)
    assert events() == [(2, 0x1, 0)]
    assert adapter.sample(2).ecc_volatile_corrected == 3
    at(10)
    assert events() == [(3, 0x2, 0), (3, EVENT_XID, 48)]
    assert adapter.sample(3).ecc_volatile_uncorrected == 1

    at(20)  # halfway up the ramp 34 -> 96 over 10 s
    assert adapter.sample(4).temperature_c == 65
    sample = adapter.sample(5)
    assert sample.remapped_rows_pending is True
    assert sample.remapped_rows_uncorrectable == 1
    at(25)
    hot = adapter.sample(4)
    assert hot.temperature_c == 96
    assert hot.throttle_reasons is not None
    assert hot.throttle_reasons & 0x40
    assert hot.sm_clock_mhz == round(1980 * 0.7)
    assert adapter.sample(6).remapped_rows_failed is True

    at(27)
    assert adapter.sample(1, slow=True).pcie_replay_count == 50
    assert adapter.sample(2, slow=True).nvlink_replay_errors == 5

    at(31)
    assert mock.slot_state(6)["hung"] is True
    at(33.5)
    assert mock.slot_state(6)["hung"] is False
    assert adapter.sample(6).error is None

    at(36)
    assert events() == [(0, EVENT_GPU_UNAVAILABLE, 0)]
    with pytest.raises(Exception, match="lost"):
        adapter.sample(0)
    at(40)
    reset = adapter.sample(3, slow=True)
    assert (reset.ecc_volatile_uncorrected, reset.ecc_aggregate_uncorrected) == (0, 1)

    at(45)  # the hot-added GPU, and GPU 0 is back
    assert adapter.sample(0).uuid == uuids[0]
    assert adapter.device_count() == 9
    inventory = adapter.inventory("n", 2)
    new = inventory.gpus[8]
    assert new.pci_bus_id == "00000000:E0:00.0"
    assert new.uuid not in uuids
    assert new.name == "NVIDIA H100 80GB HBM3"
    assert [p.nvlinks for p in new.topology] == [18] * 8
    assert adapter.sample(4).temperature_c == 96

    at(50)  # halfway down the ramp
    assert adapter.sample(4).temperature_c == 65
    at(56)
    assert adapter.sample(4).temperature_c == 34

    # Registered while it is at index 8: registration reads the handle at the index now.
    adapter.register_events(event_set, 8, HEALTH_EVENT_MASK)
    at(60)
    assert events() == [(7, EVENT_XID, 79), (7, EVENT_GPU_UNAVAILABLE, 0)]
    assert adapter.device_count() == 8
    with pytest.raises(Exception, match="lost"):
        adapter.sample(7)
    inventory = adapter.inventory("n", 3)
    assert uuids[7] not in [g.uuid for g in inventory.gpus]
    # NVLink 3 of GPU 2 went down at 46 s: seen up at 45 s, so it is down, not absent.
    gpu2 = next(g for g in inventory.gpus if g.uuid == uuids[2])
    assert gpu2.nvlinks_down == [3]
    assert 3 not in gpu2.nvlinks_up
    assert {(p.nvlinks, p.nvlinks_down) for p in gpu2.topology} == {(17, 1)}
    assert adapter.sample(2, slow=True).error is None
    assert adapter.nvlinks_up(uuids[2]) == frozenset(range(18)) - {3}
    at(70)
    assert adapter.device_count() == 9
    assert uuids[7] in [g.uuid for g in adapter.inventory("n", 4).gpus]
    at(75)
    assert adapter.device_count() == 8
    at(80)
    assert adapter.device_count() == 9

    at(85)
    with pytest.raises(NvmlUnavailable) as gone:
        adapter.device_count()
    assert gone.value.code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    at(90)
    with pytest.raises(NvmlUnavailable, match="not initialised"):
        adapter.device_count()
    adapter.init()
    assert adapter.device_count() == 9
    at(95)
    adapter.sample(2, slow=True)
    assert adapter.nvlinks_up(uuids[2]) == frozenset(range(18))
    gpu2 = next(g for g in adapter.inventory("n", 5).gpus if g.uuid == uuids[2])
    assert (gpu2.nvlinks_up, gpu2.nvlinks_down) == (list(range(18)), [])
    assert {(p.nvlinks, p.nvlinks_down) for p in gpu2.topology} == {(18, 0)}


# --- live injection of every fault kind ------------------------------------------------------


def inject(mock: MockNvml, fault: str, gpu: int | None = None, **kw: Any) -> tuple[bool, str]:
    reply = mock.inject(MockInjectRequest(fault=fault, gpu=gpu, **kw))
    return reply.applied, reply.detail


@pytest.mark.parametrize("fault", FAULT_KINDS)
def test_live_injection_of_every_fault_kind(open_mock: MockFactory, fault: str) -> None:
    # The recovery action needs an R570 driver: faults-demo's (its timeline stays unplayed).
    scenario = "faults-demo" if fault == "recovery_action" else "dgx-h100"
    adapter, mock = open_mock(scenario, real_clock=fault == "hang")
    event_set = adapter.create_event_set()
    adapter.register_events(event_set, 2, HEALTH_EVENT_MASK)
    uuid2 = adapter.uuid_of(2)
    per_fault: dict[str, dict[str, Any]] = {
        "xid": {"value": 74},
        "ecc_sbe": {"value": 4},
        "ecc_dbe": {},
        "temperature": {"value": 97, "duration_s": 60},
        "hang": {"duration_s": 0.3},
        "clock_event": {"value": 0x80},
        "pcie_replay": {"value": 9},
        "nvlink_error": {"value": 3},
        "nvlink_down": {"value": 5},
        "nvlink_up": {"value": 5},
        "nvml_vanish": {"value": 12},
        "recovery_action": {"value": 1},
        "process": {"value": 4242},
        "reset_degrade": {"value": 8},
        "reset_hang": {"duration_s": 0.05},
    }
    args = per_fault.get(fault, {})
    gpu = None if fault in ("hot_add", "nvml_vanish", "nvml_return") else 2
    applied, detail = inject(mock, fault, gpu, **args)
    assert applied, detail

    if fault == "xid":
        event = adapter.wait_event(event_set, 0)
        assert event is not None
        assert (event.gpu_index, event.event_data) == (2, 74)
    elif fault == "ecc_sbe":
        assert adapter.sample(2, slow=True).ecc_aggregate_corrected == 4
    elif fault == "ecc_dbe":
        assert adapter.sample(2).ecc_volatile_uncorrected == 1
    elif fault == "temperature":
        sample = adapter.sample(2)
        assert sample.temperature_c == 97
        assert sample.throttle_reasons == 0x20 | 0x40
        applied, _ = inject(mock, "temperature", 2)
        assert applied
        assert adapter.sample(2).temperature_c == 34
    elif fault in ("lost", "fall_off_bus", "remove"):
        with pytest.raises(Exception, match="lost"):
            adapter.sample(2)
        assert adapter.device_count() == (8 if fault == "lost" else 7)
        back = "hot_add" if fault == "remove" else "reset"
        assert inject(mock, back, 2)[0]
        assert adapter.device_count() == 8
        assert adapter.sample(2).uuid == uuid2
    elif fault == "hot_add":
        assert adapter.device_count() == 9
        assert "hot-added GPU 8" in detail
    elif fault == "remap_pending":
        assert adapter.sample(2).remapped_rows_pending is True
        assert inject(mock, "reset", 2)[0]
        assert adapter.sample(2).remapped_rows_pending is False
    elif fault == "remap_failure":
        assert adapter.sample(2).remapped_rows_failed is True
    elif fault == "hang":
        assert mock.slot_state(2)["hung"] is True
    elif fault == "clock_event":
        assert (adapter.sample(2).throttle_reasons or 0) & 0x80
        assert not (adapter.sample(1).throttle_reasons or 0) & 0x80
        assert inject(mock, "clock_event", 2, value=0)[0]
        assert not (adapter.sample(2).throttle_reasons or 0) & 0x80
    elif fault in ("pcie_replay", "nvlink_error"):
        sample = adapter.sample(2, slow=True)
        links = (
            sample.nvlink_crc_flit_errors,
            sample.nvlink_crc_data_errors,
            sample.nvlink_replay_errors,
            sample.nvlink_recovery_errors,
        )
        pcie, nvlink = (9, 0) if fault == "pcie_replay" else (0, 3)
        assert (sample.pcie_replay_count, links) == (pcie, (nvlink,) * 4)
        assert adapter.sample(1, slow=True).pcie_replay_count == 0
        # A reset starts the counters again from 0.
        assert inject(mock, "reset", 2)[0]
        sample = adapter.sample(2, slow=True)
        assert (sample.pcie_replay_count, sample.nvlink_replay_errors) == (0, 0)
    elif fault in ("nvlink_down", "nvlink_up"):
        gpu2 = adapter.inventory("n", 1).gpus[2]
        down = fault == "nvlink_down"
        assert (5 in gpu2.nvlinks_up) is not down
        assert mock.slot_state(2)["nvlinks_down"] == ([5] if down else [])
        assert {p.nvlinks for p in gpu2.topology} == {17 if down else 18}
        assert inject(mock, "nvlink_up", 2)[0]
        assert mock.slot_state(2)["nvlinks_down"] == []
    elif fault == "nvml_vanish":
        with pytest.raises(NvmlUnavailable):
            adapter.sample(2)
    elif fault == "nvml_return":
        adapter.init()
        assert adapter.device_count() == 8
    elif fault == "reset":
        assert "reset" in detail
    elif fault == "recovery_action":
        assert mock.recovery.field(2) == 1
        assert inject(mock, "reset", 2)[0]
        assert mock.recovery.field(2) == 0
    elif fault == "process":
        assert [p.pid for p in mock.nvmlDeviceGetComputeRunningProcesses(h2(mock))] == [4242]
        with pytest.raises(pynvml.NVMLError_InUse):
            mock.gpu_reset(mock.scenario.gpus[2].bus_id)
    elif fault in ("reset_fail", "reset_hang"):
        error = pynvml.NVMLError_Unknown if fault == "reset_fail" else pynvml.NVMLError_Timeout
        with pytest.raises(error):
            mock.gpu_reset(mock.scenario.gpus[2].bus_id)
        assert mock.resets_of(2) == 0
        mock.gpu_reset(mock.scenario.gpus[2].bus_id)
        assert mock.resets_of(2) == 1
    elif fault == "reset_degrade":
        assert mock.nvmlDeviceGetCurrPcieLinkWidth(h2(mock)) == 16
        mock.gpu_reset(mock.scenario.gpus[2].bus_id)
        assert mock.nvmlDeviceGetCurrPcieLinkWidth(h2(mock)) == 8
    else:  # pragma: no cover - every kind has a branch
        pytest.fail(f"no check for {fault}")


def h2(mock: MockNvml) -> Any:
    return mock.nvmlDeviceGetHandleByIndex(2)


@pytest.mark.parametrize(
    ("scenario", "request_args", "expected"),
    [
        ("dgx-h100", {"fault": "explode", "gpu": 0}, "unknown fault 'explode'"),
        ("dgx-h100", {"fault": "xid", "gpu": 8, "value": 79}, "GPU 8 does not exist (GPUs: 0-7)"),
        ("dgx-h100", {"fault": "xid", "gpu": 0}, "needs value = the XID"),
        ("dgx-h100", {"fault": "xid", "gpu": 0, "value": 7.5}, "whole number"),
        ("dgx-h100", {"fault": "lost"}, "needs a gpu"),
        ("dgx-h100", {"fault": "hang", "gpu": 1}, "needs duration_s > 0"),
        ("dgx-h100", {"fault": "ecc_sbe", "gpu": 1, "value": 0}, "a count"),
        ("dgx-h100", {"fault": "temperature", "gpu": 1, "value": 900}, "not a plausible"),
        ("dgx-h100", {"fault": "nvml_vanish", "value": 3}, "not one of the NVML codes"),
        ("dgx-h100", {"fault": "hot_add", "gpu": 3}, "GPU 3 is present already"),
        ("t4", {"fault": "remap_pending", "gpu": 0}, "does not support row remapping"),
        ("t4", {"fault": "nvlink_error", "gpu": 0}, "has no NVLink"),
        ("dgx-h100", {"fault": "pcie_replay", "gpu": 0, "value": -2}, "a count"),
    ],
)
def test_bad_injections_are_rejected_with_a_precise_detail(
    scenario: str, request_args: dict[str, Any], expected: str
) -> None:
    mock = started(scenario)
    reply = mock.inject(MockInjectRequest(**request_args))
    assert not reply.applied
    assert expected in reply.detail


def test_injections_that_do_not_apply_in_the_current_state() -> None:
    scenario = "a100-pcie"
    mock = started(scenario)
    assert inject(mock, "remove", 0)[0]
    assert inject(mock, "remove", 0) == (False, f"GPU 0 ({mock.slot_uuid(0)}) is not present")
    applied, detail = inject(mock, "reset", 0)
    assert not applied
    assert "hot_add brings it back" in detail
    assert inject(mock, "hot_add", 0)[0]

    # ECC off: ECC faults cannot happen.
    mock = MockNvml(
        scenario_from_toml('base = "a100-pcie"\n[[gpus]]\necc_enabled = false\n'),
        clock=ManualClock(),
    )
    mock.nvmlInit()
    applied, detail = inject(mock, "ecc_sbe", 0)
    assert not applied
    assert "ECC is not enabled" in detail

    # Without row remapping (T4), an uncorrectable error leaves a retired page pending.
    mock = started("t4")
    assert inject(mock, "ecc_dbe", 0)[0]
    assert mock.slot_state(0)["retired_pages_pending"] is True
    assert inject(mock, "reset", 0)[0]
    assert mock.slot_state(0)["retired_pages_pending"] is False
    assert mock.faults == FAULT_KINDS


# --- NVLink down and up ------------------------------------------------------------------------


def _pairs(inventory: Any, index: int) -> dict[int, tuple[int, int]]:
    gpu = inventory.gpus[index]
    return {p.peer_index: (p.nvlinks, p.nvlinks_down) for p in gpu.topology}


def test_nvlink_down_takes_both_ends_of_a_direct_link(open_mock: MockFactory) -> None:
    adapter, mock = open_mock("nvlink-pairs-8gpu")
    before = adapter.inventory("n", 1)
    assert _pairs(before, 0)[1] == (4, 0)
    assert before.gpus[0].nvlinks_up == list(range(6))
    assert before.gpus[0].nvlinks_down == []

    # Link 0 of GPU 0 is one of its 4 links to GPU 1.
    assert inject(mock, "nvlink_down", 0, value=0)[0]
    after = adapter.inventory("n", 2)
    assert _pairs(after, 0)[1] == (3, 1)
    assert _pairs(after, 1)[0] == (3, 1)
    assert after.gpus[0].nvlinks_down == [0]
    assert len(after.gpus[1].nvlinks_down) == 1  # the far end went down with it
    assert _pairs(after, 0)[2] == (1, 0)  # other pairs untouched

    # Every link of GPU 0, then all back up.
    assert inject(mock, "nvlink_down", 0)[0]
    after = adapter.inventory("n", 3)
    assert {b: _pairs(after, 0)[b] for b in (1, 2, 3)} == {1: (0, 4), 2: (0, 1), 3: (0, 1)}
    assert after.gpus[0].nvlinks_up == []
    assert inject(mock, "nvlink_up", 0)[0]
    back = adapter.inventory("n", 4)
    assert _pairs(back, 0) == _pairs(before, 0)
    assert back.gpus[0].nvlinks_down == []


def test_slow_sample_rereads_the_links_seen_up(open_mock: MockFactory) -> None:
    adapter, mock = open_mock("nvlink-pairs-8gpu")
    uuid = adapter.uuid_of(0)
    assert adapter.nvlinks_up(uuid) is None  # nothing read yet
    adapter.inventory("n", 1)
    assert adapter.nvlinks_up(uuid) == frozenset(range(6))
    assert inject(mock, "nvlink_down", 0, value=2, duration_s=3600)[0]
    adapter.sample(0)  # a fast sample does not read link state
    assert adapter.nvlinks_up(uuid) == frozenset(range(6))
    assert adapter.sample(0, slow=True).error is None
    assert adapter.nvlinks_up(uuid) == frozenset(range(6)) - {2}
    assert inject(mock, "nvlink_up", 0, value=2)[0]
    adapter.sample(0, slow=True)
    assert adapter.nvlinks_up(uuid) == frozenset(range(6))


def _counting_state_calls(scenario: str) -> tuple[NvmlAdapter, MockNvml, list[int]]:
    mock = started(scenario)
    calls: list[int] = []
    state = mock.nvmlDeviceGetNvLinkState

    def counted(handle: Any, link: int) -> int:
        calls.append(link)
        return int(state(handle, link))

    mock.nvmlDeviceGetNvLinkState = counted  # type: ignore[method-assign,assignment]
    return NvmlAdapter(mock, backend="mock"), mock, calls


@pytest.mark.parametrize(("scenario", "links"), [("t4", 0), ("nvlink-pairs-8gpu", 6)])
def test_the_slow_path_reads_only_the_links_seen_up(scenario: str, links: int) -> None:
    adapter, mock, calls = _counting_state_calls(scenario)
    adapter.inventory("n", 1)
    calls.clear()
    adapter.sample(0, slow=True)
    assert len(calls) == links  # not NVML_NVLINK_MAX_LINKS per GPU
    if not links:
        applied, detail = inject(mock, "nvlink_down", 0)
        assert not applied
        assert "no NVLinks" in detail


def test_link_state_is_reread_when_the_error_counters_move() -> None:
    adapter, mock, calls = _counting_state_calls("nvlink-pairs-8gpu")
    uuid = adapter.uuid_of(0)
    adapter.inventory("n", 1)
    hour = 3600.0
    adapter.sample(0, slow=True, nvlink_state_every_s=hour)  # the first slow read reads
    calls.clear()
    for _ in range(3):  # nothing moved, the period has not passed: no state read
        adapter.sample(0, slow=True, nvlink_state_every_s=hour)
    assert calls == []
    # The link fails after recovery attempts: the recovery counter moves, the same slow
    # read re-reads the state of GPU 0's six links.
    assert inject(mock, "nvlink_down", 0, value=1)[0]
    sample = adapter.sample(0, slow=True, nvlink_state_every_s=hour)
    assert (sample.nvlink_recovery_errors or 0) >= 1
    assert len(calls) == 6
    assert adapter.nvlinks_up(uuid) == frozenset(range(6)) - {1}
    # Coming back moves no counter: seen when the period has passed.
    assert inject(mock, "nvlink_up", 0, value=1)[0]
    adapter.sample(0, slow=True, nvlink_state_every_s=hour)
    assert adapter.nvlinks_up(uuid) == frozenset(range(6)) - {1}
    adapter.sample(0, slow=True, nvlink_state_every_s=0.0)
    assert adapter.nvlinks_up(uuid) == frozenset(range(6))


def test_a_failed_link_scan_is_unknown_not_all_down() -> None:
    mock = started("nvlink-pairs-8gpu")
    state = mock.nvmlDeviceGetNvLinkState
    failing = {"on": False}

    def flaky(handle: Any, link: int) -> int:
        if failing["on"] and handle.slot == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return int(state(handle, link))

    mock.nvmlDeviceGetNvLinkState = flaky  # type: ignore[method-assign,assignment]
    adapter = NvmlAdapter(mock, backend="mock")
    uuid = adapter.uuid_of(0)
    adapter.inventory("n", 1)
    assert adapter.nvlinks_up(uuid) == frozenset(range(6))
    failing["on"] = True
    gpu0 = adapter.inventory("n", 2).gpus[0]
    assert (gpu0.nvlinks_up, gpu0.nvlinks_down) == ([], [])
    # Unknown: the collector has nothing to compare, so it does not rebuild for it.
    assert adapter.nvlinks_up(uuid) is None


def test_nvlink_fault_checks() -> None:
    assert check_fault(FaultSpec(fault="nvlink_down", gpu=0, value=1.5), 8, live=True)
    assert check_fault(FaultSpec(fault="nvlink_down", gpu=0, value=99), 8, live=True)
    assert check_fault(FaultSpec(fault="nvlink_up"), 8, live=True)  # needs a GPU
    assert check_fault(FaultSpec(fault="nvlink_down", gpu=0, value=17), 8, live=True) is None
