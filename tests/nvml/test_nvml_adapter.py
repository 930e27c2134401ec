"""The NVML adapter against the mock NVML: every field, every error path, events."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from gpulet_common.messages import MockInjectRequest
from gpulet_common.mock_nvml import MockNvml, load_scenario, scenario_from_toml
from gpulet_common.nvml import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_GPU_UNAVAILABLE,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID,
    HEALTH_EVENT_MASK,
    GpuLostError,
    GpuResetRequired,
    NvmlAdapter,
    NvmlCallError,
    NvmlUnavailable,
    cuda_version_string,
    normalize_bus_id,
)
from gpulet_common.nvml.adapter import handle_key

MockFactory = Callable[..., tuple[NvmlAdapter, MockNvml]]
MIB = 1024 * 1024
DGX_BUSES = [
    "00000000:18:00.0",
    "00000000:2A:00.0",
    "00000000:3A:00.0",
    "00000000:5D:00.0",
    "00000000:9A:00.0",
    "00000000:AB:00.0",
    "00000000:BA:00.0",
    "00000000:DB:00.0",
]
SOCKET0_CPUS = [*range(56), *range(112, 168)]
SOCKET1_CPUS = [*range(56, 112), *range(168, 224)]
NODE, SYSTEM, SINGLE, HOSTBRIDGE = 40, 50, 10, 30


def inject(mock: MockNvml, fault: str, gpu: int | None = None, **kw: Any) -> str:
    reply = mock.inject(MockInjectRequest(fault=fault, gpu=gpu, **kw))
    assert reply.applied, reply.detail
    return reply.detail


class Wrapped:
    """An NVML module that forwards to a mock, with some functions replaced or removed."""

    def __init__(self, inner: MockNvml, drop: tuple[str, ...] = (), **replace: Any) -> None:
        self._inner = inner
        self._drop = drop
        self._replace = replace
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        if name in self._drop:
            raise AttributeError(name)
        target = self._replace.get(name) or getattr(self._inner, name)
        if not callable(target) or isinstance(target, type):
            return target

        def counted(*args: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return target(*args)

        counted.__name__ = name
        return counted


def raising(code: int) -> Any:
    def fn(*args: Any) -> Any:
        raise pynvml.NVMLError(code)

    return fn


# --- system and inventory ------------------------------------------------------------


def test_system_info_of_dgx_h100(open_mock: MockFactory) -> None:
    adapter, _ = open_mock("dgx-h100")
    info = adapter.system_info()
    assert info.driver_version == "550.54.15"
    assert info.cuda_driver_version == "12.4"
    assert info.nvml_version == "12.550.54.15"
    assert adapter.device_count() == 8


def test_every_gpu_info_field_of_dgx_h100(open_mock: MockFactory) -> None:
    adapter, mock = open_mock("dgx-h100")
    for index in range(8):
        spec = mock.scenario.gpus[index]
        info = adapter.gpu_info(index)
        assert info.uuid == spec.uuid
        assert info.uuid.startswith("GPU-")
        assert info.index == index
        assert info.minor == index
        assert info.name == "NVIDIA H100 80GB HBM3"
        assert info.memory_total_bytes == 81559 * MIB
        assert info.pci_bus_id == DGX_BUSES[index]
        assert info.numa_node == (0 if index < 4 else 1)
        assert info.cpu_affinity == (SOCKET0_CPUS if index < 4 else SOCKET1_CPUS)
        assert info.serial == spec.serial
        assert len(info.serial) == 13
        assert info.board_id == int(DGX_BUSES[index][9:11], 16) << 8
        assert info.compute_capability == (9, 0)
        assert info.module_id == index + 1  # the scenario's (mock) SXM slots
        assert info.ecc_enabled is True
        assert (info.temp_shutdown_c, info.temp_slowdown_c) == (97, 94)
        assert (info.temp_gpu_max_c, info.temp_mem_max_c) == (92, 95)
        assert info.supported_events == 0x1 | 0x2 | 0x4 | 0x8 | 0x10 | 0x4000
        assert info.topology == []


def test_dgx_h100_inventory_topology(open_mock: MockFactory) -> None:
    adapter, _ = open_mock("dgx-h100")
    inventory, skipped = adapter.inventory_report("node-a", 7)
    assert skipped == {}
    assert (inventory.node, inventory.generation, inventory.nvml_backend) == ("node-a", 7, "mock")
    assert inventory.driver_version == "550.54.15"
    assert inventory.cuda_driver_version == "12.4"
    assert [g.index for g in inventory.gpus] == list(range(8))
    uuids = [g.uuid for g in inventory.gpus]
    for gpu in inventory.gpus:
        assert [p.peer_index for p in gpu.topology] == [i for i in range(8) if i != gpu.index]
        for peer in gpu.topology:
            assert peer.peer_uuid == uuids[peer.peer_index]
            same_socket = (gpu.index < 4) == (peer.peer_index < 4)
            assert peer.level == (NODE if same_socket else SYSTEM)
            assert peer.nvlinks == 18


def test_pcie_7gpu_topology(open_mock: MockFactory) -> None:
    adapter, _ = open_mock("pcie-7gpu")
    inventory = adapter.inventory("n", 1)
    assert len(inventory.gpus) == 7
    group = [0, 0, 0, 1, 1, 1, 1]
    for gpu in inventory.gpus:
        assert gpu.name == "Tesla V100-PCIE-16GB"
        for peer in gpu.topology:
            expected = SINGLE if group[gpu.index] == group[peer.peer_index] else HOSTBRIDGE
            assert peer.level == expected, (gpu.index, peer.peer_index)
            assert peer.nvlinks == 0


def test_nvlink_pairs_and_numa_topologies(open_mock: MockFactory) -> None:
    adapter, _ = open_mock("nvlink-pairs-8gpu")
    links = {
        (g.index, p.peer_index): (p.level, p.nvlinks)
        for g in adapter.inventory("n", 1).gpus
        for p in g.topology
    }
    assert links[(0, 1)] == links[(1, 0)] == (SINGLE, 4)
    assert links[(6, 7)] == (SINGLE, 4)
    assert links[(0, 2)] == (NODE, 1)
    assert links[(5, 7)] == (NODE, 1)
    assert links[(3, 4)] == (SYSTEM, 0)

    adapter, _ = open_mock("numa-2x4")
    inventory = adapter.inventory("n", 1)
    levels = {(g.index, p.peer_index): p.level for g in inventory.gpus for p in g.topology}
    assert levels[(0, 1)] == levels[(6, 7)] == HOSTBRIDGE
    assert levels[(0, 3)] == levels[(5, 6)] == NODE
    assert levels[(3, 4)] == levels[(0, 7)] == SYSTEM
    assert [g.numa_node for g in inventory.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_every_sample_field_of_dgx_h100(open_mock: MockFactory) -> None:
    adapter, _ = open_mock("dgx-h100")
    before = time.time()
    sample = adapter.sample(3, slow=True)
    assert sample.uuid == adapter.uuid_of(3)
    assert sample.index == 3
    assert before <= sample.timestamp <= time.time()
    assert (sample.gpu_util_pct, sample.mem_util_pct) == (20, 8)
    assert sample.memory_used_bytes == 4096 * MIB
    assert sample.memory_free_bytes == (81559 - 4096) * MIB
    assert sample.temperature_c == 34
    assert sample.power_mw == 118_000
    assert (sample.sm_clock_mhz, sample.mem_clock_mhz) == (1980, 2619)
    assert sample.ecc_volatile_corrected == sample.ecc_volatile_uncorrected == 0
    assert sample.ecc_aggregate_corrected == sample.ecc_aggregate_uncorrected == 0
    assert (sample.remapped_rows_correctable, sample.remapped_rows_uncorrectable) == (0, 0)
    assert sample.remapped_rows_pending is False
    assert sample.remapped_rows_failed is False
    assert sample.retired_pages_pending is None  # H100 remaps rows, no page retirement
    assert sample.throttle_reasons == 0
    assert sample.error is None
    # The slow fields: one nvmlDeviceGetFieldValues batch (GPM needs a second read).
    assert sample.slow_fields_at is not None
    assert before <= sample.slow_fields_at <= time.time()
    assert sample.memory_temperature_c == 38
    assert sample.energy_mj is not None
    assert sample.energy_mj >= 3_600_000_000
    assert sample.pcie_replay_count == 0
    assert sample.nvlink_crc_flit_errors == sample.nvlink_crc_data_errors == 0
    assert sample.nvlink_replay_errors == sample.nvlink_recovery_errors == 0
    assert sample.nvlink_bandwidth_total is not None
    assert sample.tensor_active is None
    again = adapter.sample(3, slow=True)
    assert (again.gr_engine_active, again.tensor_active, again.dram_active) == (0.2, 0.12, 0.08)


def test_fast_samples_repeat_the_last_slow_fields(open_mock: MockFactory) -> None:
    adapter, _ = open_mock("dgx-h100")
    assert adapter.sample(0).slow_fields_at is None  # never read yet
    slow = adapter.sample(0, slow=True)
    fast = adapter.sample(0)
    assert fast.slow_fields_at == slow.slow_fields_at
    assert (fast.energy_mj, fast.ecc_aggregate_corrected) == (slow.energy_mj, 0)
    assert fast.timestamp > slow.timestamp
    later = adapter.sample(0, slow=True)
    assert later.slow_fields_at is not None
    assert slow.slow_fields_at is not None
    assert later.slow_fields_at > slow.slow_fields_at


def test_t4_unsupported_fields_are_none(open_mock: MockFactory) -> None:
    adapter, _ = open_mock("t4")
    inventory = adapter.inventory("n", 1)
    assert inventory.driver_version == "470.223.02"
    assert inventory.cuda_driver_version == "11.4"
    (info,) = inventory.gpus
    assert info.name == "Tesla T4"
    assert info.memory_total_bytes == 15360 * MIB
    assert info.pci_bus_id == "00000000:00:1E.0"
    assert info.numa_node is None  # NOT_SUPPORTED
    assert info.module_id is None  # NOT_SUPPORTED on a PCIe card
    assert info.cpu_affinity == list(range(8))
    assert info.compute_capability == (7, 5)
    assert (info.temp_shutdown_c, info.temp_slowdown_c, info.temp_gpu_max_c) == (96, 93, 85)
    assert info.temp_mem_max_c is None
    assert info.supported_events == 0x1F  # no GpuUnavailable
    assert info.topology == []

    sample = adapter.sample(0)
    assert sample.remapped_rows_correctable is None
    assert sample.remapped_rows_uncorrectable is None
    assert sample.remapped_rows_pending is None
    assert sample.remapped_rows_failed is None
    assert sample.retired_pages_pending is False
    # Driver 470 lacks ...ClocksEventReasons: the older ...ThrottleReasons answers.
    assert sample.throttle_reasons == 1
    assert (sample.temperature_c, sample.power_mw, sample.sm_clock_mhz) == (29, 9500, 300)
    assert sample.error is None


def test_slow_fields_a_gpu_lacks_are_not_asked_again(open_mock: MockFactory) -> None:
    _, mock = open_mock("t4")
    asked: list[list[int]] = []

    def field_values(handle: Any, field_ids: list[int]) -> Any:
        asked.append(list(field_ids))
        return mock.nvmlDeviceGetFieldValues(handle, field_ids)

    wrapped = Wrapped(mock, nvmlDeviceGetFieldValues=field_values)
    adapter = NvmlAdapter(wrapped, backend="mock")
    adapter.init()
    first = adapter.sample(0, slow=True)
    adapter.sample(0, slow=True)
    # A T4 has no NVLink and no memory temperature sensor; Turing has no GPM.
    assert (first.energy_mj is not None, first.pcie_replay_count) == (True, 0)
    assert first.nvlink_crc_flit_errors is None
    assert first.memory_temperature_c is None
    assert len(asked[0]) == 8
    assert sorted(asked[1]) == sorted(
        [pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER]
    )
    assert wrapped.calls["nvmlGpmQueryDeviceSupport"] == 1
    assert "nvmlGpmSampleGet" not in wrapped.calls


def test_unsupported_fields_are_not_asked_again(open_mock: MockFactory) -> None:
    _, mock = open_mock("t4")
    wrapped = Wrapped(mock)
    adapter = NvmlAdapter(wrapped, backend="mock")
    adapter.init()
    for _ in range(5):
        adapter.sample(0)
    assert wrapped.calls["nvmlDeviceGetRemappedRows"] == 1
    assert wrapped.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1
    assert wrapped.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 5
    assert wrapped.calls["nvmlDeviceGetRetiredPagesPendingStatus"] == 5
    assert wrapped.calls["nvmlDeviceGetHandleByIndex"] == 1  # the handle is cached
    # A re-fetched handle (same UUID) keeps what is known to be unsupported.
    adapter.invalidate()
    adapter.sample(0)
    assert wrapped.calls["nvmlDeviceGetHandleByIndex"] == 2
    assert wrapped.calls["nvmlDeviceGetRemappedRows"] == 1


def test_missing_functions_read_as_unsupported(open_mock: MockFactory) -> None:
    _, mock = open_mock("dgx-h100")
    adapter = NvmlAdapter(
        Wrapped(mock, drop=("nvmlDeviceGetNumaNodeId", "nvmlDeviceGetCpuAffinityWithinScope")),
        backend="mock",
    )
    adapter.init()
    info = adapter.gpu_info(4)
    assert info.numa_node is None
    assert info.cpu_affinity == SOCKET1_CPUS  # from nvmlDeviceGetCpuAffinity
    assert info.name == "NVIDIA H100 80GB HBM3"


# --- NVML unavailable -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "library not found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "no permission"),
        (pynvml.NVML_ERROR_UNINITIALIZED, "not initialised"),
    ],
)
def test_init_failures_raise_nvml_unavailable_with_reason(
    open_mock: MockFactory, code: int, words: str
) -> None:
    _, mock = open_mock("dgx-h100")
    inject(mock, "nvml_vanish", value=code)
    adapter = NvmlAdapter(mock, backend="mock")
    with pytest.raises(NvmlUnavailable) as caught:
        adapter.init()
    assert caught.value.code == code
    assert words in caught.value.reason
    assert "nvmlInit" in caught.value.reason
    assert not adapter.initialized


def test_init_failure_for_missing_function(open_mock: MockFactory) -> None:
    _, mock = open_mock("dgx-h100")
    with pytest.raises(NvmlUnavailable, match="function is missing"):
        NvmlAdapter(Wrapped(mock, drop=("nvmlInit",)), backend="mock").init()
    replaced = Wrapped(mock, nvmlInit=raising(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND))
    with pytest.raises(NvmlUnavailable) as caught:
        NvmlAdapter(replaced, backend="mock").init()
    assert caught.value.code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND


def test_calls_before_init_are_unavailable() -> None:
    adapter = NvmlAdapter(MockNvml("t4", jitter=False), backend="mock")
    with pytest.raises(NvmlUnavailable, match="not initialised"):
        adapter.device_count()


def test_nvml_vanishing_and_returning(open_mock: MockFactory) -> None:
    adapter, mock = open_mock("dgx-h100")
    assert adapter.sample(0).error is None
    inject(mock, "nvml_vanish")
    with pytest.raises(NvmlUnavailable) as caught:
        adapter.sample(0)
    assert caught.value.code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(NvmlUnavailable):
        adapter.inventory("n", 2)
    with pytest.raises(NvmlUnavailable):
        adapter.init()
    inject(mock, "nvml_return")
    with pytest.raises(NvmlUnavailable, match="not initialised"):
        adapter.device_count()
    adapter.init()
    assert adapter.sample(0).error is None
    assert len(adapter.inventory("n", 3).gpus) == 8


# --- one GPU in trouble ------------------------------------------------------------------


def test_lost_gpu_raises_gpu_lost_and_is_left_out_of_inventory(open_mock: MockFactory) -> None:
    adapter, mock = open_mock("dgx-h100")
    uuid5 = adapter.uuid_of(5)
    inject(mock, "lost", gpu=5)
    with pytest.raises(GpuLostError) as caught:
        adapter.sample(5)
    assert (caught.value.index, caught.value.uuid) == (5, uuid5)
    with pytest.raises(GpuLostError):
        adapter.gpu_info(5)
    assert adapter.sample(4).error is None  # the others are fine

    inventory, skipped = adapter.inventory_report("n", 2)
    assert [g.index for g in inventory.gpus] == [0, 1, 2, 3, 4, 6, 7]
    assert set(skipped) == {5}
    assert "lost" in skipped[5]
    for gpu in inventory.gpus:
        assert 5 not in [p.peer_index for p in gpu.topology]
        assert all(p.nvlinks == 18 for p in gpu.topology)

    inject(mock, "reset", gpu=5)
    assert adapter.sample(5).uuid == uuid5


def test_a_gpu_lost_after_a_scan_is_reported_by_the_identity_that_scan_read(
    open_mock: MockFactory,
) -> None:
    """NVML no longer answers for it (its handle fails): the unreadable entry names the
    GPU the first scan read at that index, not a placeholder without a bus ID."""
    adapter, mock = open_mock("dgx-h100")
    first, _ = adapter.inventory_report("n", 1)
    gpu3 = first.gpus[3]
    inject(mock, "lost", gpu=3)
    inventory, skipped = adapter.inventory_report("n", 2)
    assert set(skipped) == {3}
    [entry] = inventory.unreadable
    assert (entry.index, entry.uuid, entry.pci_bus_id, entry.name, entry.lost) == (
        3,
        gpu3.uuid,
        gpu3.pci_bus_id,
        gpu3.name,
        True,
    )


def test_reset_required_raises(open_mock: MockFactory) -> None:
    _, mock = open_mock("dgx-h100")
    wrapped = Wrapped(mock, nvmlDeviceGetPowerUsage=raising(pynvml.NVML_ERROR_RESET_REQUIRED))
    adapter = NvmlAdapter(wrapped, backend="mock")
    adapter.init()
    with pytest.raises(GpuResetRequired) as caught:
        adapter.sample(2)
    assert isinstance(caught.value, NvmlCallError)
    assert caught.value.code == pynvml.NVML_ERROR_RESET_REQUIRED
    assert caught.value.function == "nvmlDeviceGetPowerUsage"
    assert caught.value.index == 2


def test_unexpected_field_error_leaves_field_none_and_refetches_handle(
    open_mock: MockFactory,
) -> None:
    _, mock = open_mock("dgx-h100")
    wrapped = Wrapped(mock, nvmlDeviceGetPowerUsage=raising(pynvml.NVML_ERROR_UNKNOWN))
    adapter = NvmlAdapter(wrapped, backend="mock")
    adapter.init()
    first = adapter.sample(1)
    assert first.power_mw is None
    assert first.temperature_c == 34
    assert first.error is not None
    assert first.error.startswith("error: nvmlDeviceGetPowerUsage")
    assert "999" in first.error
    adapter.sample(1)
    # Not cached as unsupported (asked again), and the handle was fetched again.
    assert wrapped.calls["nvmlDeviceGetPowerUsage"] == 2
    assert wrapped.calls["nvmlDeviceGetHandleByIndex"] == 2


def test_other_call_errors_raise_nvml_call_error(open_mock: MockFactory) -> None:
    _, mock = open_mock("dgx-h100")
    wrapped = Wrapped(mock, nvmlDeviceGetCount=raising(pynvml.NVML_ERROR_UNKNOWN))
    adapter = NvmlAdapter(wrapped, backend="mock")
    adapter.init()
    with pytest.raises(NvmlCallError) as caught:
        adapter.device_count()
    assert (caught.value.function, caught.value.code) == ("nvmlDeviceGetCount", 999)
    with pytest.raises(NvmlCallError) as lookup:
        adapter.sample(8)  # no such index: INVALID_ARGUMENT
    assert lookup.value.code == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_inventory_survives_one_failing_secondary_field(open_mock: MockFactory) -> None:
    _, mock = open_mock("dgx-h100")
    wrapped = Wrapped(mock, nvmlDeviceGetSerial=raising(pynvml.NVML_ERROR_UNKNOWN))
    adapter = NvmlAdapter(wrapped, backend="mock")
    adapter.init()
    inventory, skipped = adapter.inventory_report("n", 1)
    assert skipped == {}
    assert len(inventory.gpus) == 8
    assert all(g.serial is None and g.name for g in inventory.gpus)


def test_hung_gpu_does_not_delay_the_others(open_mock: MockFactory) -> None:
    adapter, mock = open_mock("dgx-h100", real_clock=True)
    for index in range(8):
        adapter.sample(index)
    inject(mock, "hang", gpu=2, duration_s=0.6)
    done = threading.Event()
    hung_for: list[float] = []

    def sample_hung() -> None:
        start = time.monotonic()
        adapter.sample(2)
        hung_for.append(time.monotonic() - start)
        done.set()

    thread = threading.Thread(target=sample_hung, daemon=True)
    thread.start()
    start = time.monotonic()
    for index in (0, 1, 3, 4, 5, 6, 7):
        adapter.sample(index)
    others = time.monotonic() - start
    assert others < 0.3
    assert not done.is_set()
    assert done.wait(5.0)
    assert hung_for[0] >= 0.5


# --- events ----------------------------------------------------------------------------


def test_wait_event_timeout_is_none(open_mock: MockFactory) -> None:
    adapter, _ = open_mock("dgx-h100")
    event_set = adapter.create_event_set()
    assert adapter.register_events(event_set, 0, HEALTH_EVENT_MASK) == HEALTH_EVENT_MASK
    start = time.monotonic()
    assert adapter.wait_event(event_set, 20) is None
    assert time.monotonic() - start < 1.0
    adapter.free_event_set(event_set)


def test_xid_event_is_delivered_with_gpu_and_xid(open_mock: MockFactory) -> None:
    adapter, mock = open_mock("dgx-h100")
    event_set = adapter.create_event_set()
    for index in range(8):
        adapter.register_events(event_set, index, HEALTH_EVENT_MASK)
    inject(mock, "xid", gpu=3, value=79)
    event = adapter.wait_event(event_set, 100)
    assert event is not None
    assert (event.gpu_index, event.gpu_uuid) == (3, adapter.uuid_of(3))
    assert (event.event_type, event.event_data) == (EVENT_XID, 79)
    assert event.timestamp > 0
    assert adapter.wait_event(event_set, 0) is None


def test_event_from_another_thread_wakes_the_waiter(open_mock: MockFactory) -> None:
    adapter, mock = open_mock("dgx-h100", real_clock=True)
    event_set = adapter.create_event_set()
    adapter.register_events(event_set, 6, EVENT_XID)
    timer = threading.Timer(0.1, lambda: inject(mock, "xid", gpu=6, value=48))
    timer.start()
    start = time.monotonic()
    event = adapter.wait_event(event_set, 5000)
    assert time.monotonic() - start < 2.0
    timer.join()
    assert event is not None
    assert (event.gpu_index, event.event_data) == (6, 48)


def test_timeline_event_wakes_a_waiter_on_time() -> None:
    scenario = scenario_from_toml(
        'base = "t4"\n[[timeline]]\nat = 0.15\nfault = "xid"\ngpu = 0\nvalue = 31\n'
    )
    mock = MockNvml(scenario)
    adapter = NvmlAdapter(mock, backend="mock")
    adapter.init()
    event_set = adapter.create_event_set()
    assert adapter.register_events(event_set, 0, HEALTH_EVENT_MASK) == 0x1 | 0x2 | 0x8
    start = time.monotonic()
    event = adapter.wait_event(event_set, 5000)
    waited = time.monotonic() - start
    assert event is not None
    assert event.event_data == 31
    assert waited < 1.0
    mock.close()


def test_register_events_partial_support(open_mock: MockFactory) -> None:
    base = load_scenario("a100-pcie")
    scenario = scenario_from_toml(
        """
        base = "a100-pcie"
        [[gpus]]
        name = "ECC off"
        ecc_enabled = false
        [[gpus]]
        name = "no events"
        supported_events = []
        """
    )
    assert base.gpus[0].ecc_enabled
    adapter, mock = open_mock(scenario)
    event_set = adapter.create_event_set()
    # ECC off: registering the ECC types says NOT_SUPPORTED, the rest is registered.
    assert adapter.register_events(event_set, 0, HEALTH_EVENT_MASK) == (
        EVENT_XID | EVENT_GPU_UNAVAILABLE
    )
    # No event support at all: 0, and not an error.
    assert adapter.register_events(event_set, 1, HEALTH_EVENT_MASK) == 0
    inject(mock, "xid", gpu=1, value=13)
    inject(mock, "xid", gpu=0, value=94)
    event = adapter.wait_event(event_set, 100)
    assert event is not None
    assert (event.gpu_index, event.event_data) == (0, 94)
    assert adapter.wait_event(event_set, 0) is None


def test_ecc_events(open_mock: MockFactory) -> None:
    adapter, mock = open_mock("dgx-h100")
    event_set = adapter.create_event_set()
    adapter.register_events(event_set, 1, HEALTH_EVENT_MASK)
    inject(mock, "ecc_sbe", gpu=1, value=2)
    inject(mock, "ecc_dbe", gpu=1)
    types = []
    for _ in range(2):
        event = adapter.wait_event(event_set, 100)
        assert event is not None
        assert event.gpu_index == 1
        types.append(event.event_type)
    assert types == [EVENT_SINGLE_BIT_ECC, EVENT_DOUBLE_BIT_ECC]
    sample = adapter.sample(1, slow=True)
    assert (sample.ecc_volatile_corrected, sample.ecc_volatile_uncorrected) == (2, 1)
    assert (sample.ecc_aggregate_corrected, sample.ecc_aggregate_uncorrected) == (2, 1)


def test_lost_gpu_in_event_wait(open_mock: MockFactory) -> None:
    # H100: the loss arrives as a GpuUnavailable event.
    adapter, mock = open_mock("dgx-h100")
    event_set = adapter.create_event_set()
    adapter.register_events(event_set, 2, HEALTH_EVENT_MASK)
    uuid2 = adapter.uuid_of(2)
    inject(mock, "lost", gpu=2)
    event = adapter.wait_event(event_set, 100)
    assert event is not None
    assert (event.event_type, event.gpu_index, event.gpu_uuid) == (EVENT_GPU_UNAVAILABLE, 2, uuid2)

    # T4 (no GpuUnavailable event): the wait itself fails with GPU_IS_LOST.
    adapter, mock = open_mock("t4")
    event_set = adapter.create_event_set()
    adapter.register_events(event_set, 0, HEALTH_EVENT_MASK)
    inject(mock, "lost", gpu=0)
    with pytest.raises(GpuLostError) as caught:
        adapter.wait_event(event_set, 100)
    assert caught.value.index is None
    assert caught.value.uuid is None
    assert adapter.wait_event(event_set, 0) is None


def test_event_of_unregistered_handle_is_identified_by_uuid(open_mock: MockFactory) -> None:
    adapter, mock = open_mock("dgx-h100")
    event_set = adapter.create_event_set()
    adapter.register_events(event_set, 3, EVENT_XID)
    adapter._event_devices.clear()  # as after a restart of the bookkeeping
    inject(mock, "xid", gpu=3, value=63)
    event = adapter.wait_event(event_set, 100)
    assert event is not None
    assert (event.gpu_index, event.gpu_uuid) == (3, adapter.uuid_of(3))


# --- helpers and the hot path -------------------------------------------------------------


def test_small_helpers() -> None:
    assert cuda_version_string(12040) == "12.4"
    assert cuda_version_string(11080) == "11.8"
    assert normalize_bus_id("0000:3b:00.0") == "00000000:3B:00.0"
    assert normalize_bus_id("3b:00.0") == "00000000:3B:00.0"
    assert normalize_bus_id("00000000:3B:00.0") == "00000000:3B:00.0"


def test_real_pynvml_handles_are_keyed_by_address() -> None:
    device = pynvml.struct_c_nvmlDevice_t()
    other = pynvml.struct_c_nvmlDevice_t()
    first = ctypes.cast(ctypes.pointer(device), pynvml.c_nvmlDevice_t)
    second = ctypes.cast(ctypes.pointer(device), pynvml.c_nvmlDevice_t)
    assert first is not second
    assert handle_key(first) == handle_key(second)
    assert handle_key(first) != handle_key(
        ctypes.cast(ctypes.pointer(other), pynvml.c_nvmlDevice_t)
    )


class _InstantNvml:
    """An NVML whose every call returns at once: measures the adapter's own cost."""

    NVMLError = pynvml.NVMLError

    class _Memory:
        total, free, used = 80, 60, 20

    class _Util:
        gpu, memory = 50, 10

    def __init__(self) -> None:
        self.handle = object()
        memory, util = self._Memory(), self._Util()
        self.nvmlDeviceGetHandleByIndex = lambda index: self.handle
        self.nvmlDeviceGetUUID = lambda handle: "GPU-instant"
        self.nvmlDeviceGetUtilizationRates = lambda handle: util
        self.nvmlDeviceGetMemoryInfo = lambda handle: memory
        self.nvmlDeviceGetTemperature = lambda handle, sensor: 40
        self.nvmlDeviceGetPowerUsage = lambda handle: 100_000
        self.nvmlDeviceGetClockInfo = lambda handle, kind: 1000
        self.nvmlDeviceGetTotalEccErrors = lambda handle, kind, counter: 0
        self.nvmlDeviceGetRemappedRows = lambda handle: (0, 0, 0, 0)
        self.nvmlDeviceGetRetiredPagesPendingStatus = raising(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self.nvmlDeviceGetCurrentClocksEventReasons = lambda handle: 0


def test_sample_overhead_is_small() -> None:
    adapter = NvmlAdapter(_InstantNvml(), backend="mock")
    adapter.sample(0)
    rounds = 2000
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(rounds):
            adapter.sample(0)
        best = min(best, (time.perf_counter() - start) / rounds)
    assert best < 100e-6, f"{best * 1e6:.1f} us per sample"


def test_a_failed_gpm_measurement_starts_over_without_failing_the_sample(
    open_mock: MockFactory,
) -> None:
    _, mock = open_mock("dgx-h100")
    failures = [pynvml.NVML_ERROR_UNKNOWN]

    def metrics_get(request: Any) -> Any:
        if failures:
            raise pynvml.NVMLError(failures.pop())
        return mock.nvmlGpmMetricsGet(request)

    wrapped = Wrapped(mock, nvmlGpmMetricsGet=metrics_get)
    adapter = NvmlAdapter(wrapped, backend="mock")
    adapter.init()
    adapter.sample(0, slow=True)  # GPM's first sample
    failed = adapter.sample(0, slow=True)
    assert failed.error is None
    assert failed.tensor_active is None
    assert failed.energy_mj is not None  # the rest of the slow fields are there
    adapter.sample(0, slow=True)  # starts over
    assert adapter.sample(0, slow=True).tensor_active == 0.12
    assert wrapped.calls["nvmlGpmQueryDeviceSupport"] == 2
