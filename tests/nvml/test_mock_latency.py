"""The mock NVML's latency profile: real-H100 call costs, spent as CPU like the driver."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from gpulet_common.mock_nvml import MockNvml
from gpulet_common.mock_nvml.latency import H100, LatencyProfile, spend_cpu
from gpulet_common.nvml.loader import open_nvml
from gpulet_common.settings.nvml import NvmlSettings


def cpu_ms(call: Any, *args: Any) -> float:
    start = time.thread_time()
    call(*args)
    return (time.thread_time() - start) * 1e3


def test_first_read_of_a_field_is_dear_later_ones_cheap() -> None:
    mock = MockNvml("dgx-h100", latency="h100")
    mock.nvmlInit()
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    first = cpu_ms(mock.nvmlDeviceGetTemperature, handle, 0)
    later = min(cpu_ms(mock.nvmlDeviceGetTemperature, handle, 0) for _ in range(5))
    # Another GPU's first read is dear again: "first" is per GPU and field.
    other = cpu_ms(mock.nvmlDeviceGetTemperature, mock.nvmlDeviceGetHandleByIndex(1), 0)
    assert first >= 1.5
    assert other >= 1.5
    assert later < 0.5


def test_field_value_batches_and_energy_stay_dear() -> None:
    mock = MockNvml("dgx-h100", latency="h100")
    mock.nvmlInit()
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    for _ in range(3):
        assert cpu_ms(mock.nvmlDeviceGetFieldValues, handle, [83]) >= 4.6
        assert cpu_ms(mock.nvmlDeviceGetTotalEnergyConsumption, handle) >= 3.5
    assert mock.latency.calls >= 6


def test_without_a_profile_calls_cost_microseconds() -> None:
    mock = MockNvml("dgx-h100")
    mock.nvmlInit()
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    assert not mock.latency.active
    assert cpu_ms(mock.nvmlDeviceGetFieldValues, handle, [83]) < 1.0


def test_the_cost_is_cpu_time_a_process_meter_sees() -> None:
    """Real NVML works on the calling thread: CPU time equals wall time."""
    cpu0 = time.process_time()
    threads = [threading.Thread(target=spend_cpu, args=(0.02,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert time.process_time() - cpu0 >= 0.04


def test_the_setting_selects_the_profile() -> None:
    adapter, _ = open_nvml(NvmlSettings(backend="mock", mock_latency="h100"))
    assert adapter is not None
    assert adapter.module.latency.name == "h100"
    adapter, _ = open_nvml(NvmlSettings(backend="mock"))
    assert adapter is not None
    assert adapter.module.latency.name == "none"  # the scenario's default


def test_the_profile_covers_every_sampled_call() -> None:
    sampled = {
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetFieldValues",
        "nvmlGpmSampleGet",
    }
    assert sampled <= set(H100)
    with pytest.raises(ValueError, match="unknown NVML latency profile"):
        LatencyProfile("a100")
