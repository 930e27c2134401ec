"""The mock NVML's readings: samples, field values (the slow fields) and GPM.

Readings come from the GPU's spec (its baseline), varied a little by the scenario's
seeded jitter, and from what faults did to it: a temperature program, ECC counts,
remapped rows, PCIe and NVLink error counters, clock-event reasons. A hot GPU shows
thermal slowdown in its clock and its clock-event reasons. GPM answers on compute
capability 9.0 and later only, as on real GPUs.
"""

from __future__ import annotations

import time
from typing import Any, Final

import pynvml

from gpulet_common.mock_nvml.device import DISABLED, ENABLED, MockCore, Slot, err
from gpulet_common.mock_nvml.recovery import FIELD_ID as RECOVERY_FIELD
from gpulet_common.mock_nvml.shapes import (
    MockFieldValue,
    MockGpmMetricsGet,
    MockGpmSample,
    MockGpmSupport,
    MockMemory,
    MockUtilization,
)

_THROTTLE_THERMAL: Final = (
    pynvml.nvmlClocksEventReasonSwThermalSlowdown | pynvml.nvmlClocksEventReasonHwThermalSlowdown
)
# Energy counter at mock start (mJ): the GPU has been up a while.
_ENERGY_AT_START_MJ: Final = 3_600_000_000


class MockReadings(MockCore):
    """``nvmlDeviceGetUtilizationRates`` ... ``nvmlGpmMetricsGet``."""

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> MockUtilization:
        slot, _ = self._enter(handle)
        spec = slot.spec
        gpu, memory = spec.gpu_util_pct, spec.mem_util_pct
        if self._jitter and gpu:
            gpu = min(100, max(0, gpu + round(3 * self._jitter_unit(slot))))
        if self._jitter and memory:
            memory = min(100, max(0, memory + round(3 * self._jitter_unit(slot))))
        return MockUtilization(gpu, memory)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> MockMemory:
        spec = self._enter(handle)[0].spec
        total = spec.memory_total_bytes
        used = spec.memory_used_mib * 1024 * 1024
        return MockMemory(total=total, free=total - used, used=used)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        slot, now = self._enter(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._temperature_c(slot, now)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        slot, _ = self._enter(handle)
        return round(slot.spec.power_w * 1000 * (1 + 0.02 * self._jitter_unit(slot)))

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        slot, now = self._enter(handle)
        if type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            clock = slot.spec.sm_clock_mhz
            # Thermal slowdown is what makes a hot GPU slow: show it in the clock.
            return round(clock * 0.7) if self._thermal_slowdown(slot, now) else clock
        if type == pynvml.NVML_CLOCK_MEM:
            return slot.spec.mem_clock_mhz
        raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        if not self._scenario.system.clocks_event_reasons:
            self._system()
            raise err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self.nvmlDeviceGetCurrentClocksThrottleReasons(handle)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        slot, now = self._enter(handle)
        reasons = slot.spec.throttle_reasons
        if self._thermal_slowdown(slot, now):
            reasons |= _THROTTLE_THERMAL
        if now < slot.clock_events_until:
            reasons |= slot.clock_events
        return reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        slot, _ = self._enter(handle)
        if not slot.spec.ecc_enabled:
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if errorType not in (0, 1) or counterType not in (0, 1):
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        counters = (
            slot.ecc_volatile if counterType == pynvml.NVML_VOLATILE_ECC else slot.ecc_aggregate
        )
        return counters[errorType]

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        slot, _ = self._enter(device)
        if not slot.spec.remapped_rows:
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return (
            slot.remap_correctable,
            slot.remap_uncorrectable,
            int(slot.remap_pending),
            int(slot.remap_failure),
        )

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        slot, _ = self._enter(device)
        if not slot.spec.retired_pages:
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return ENABLED if slot.retired_pending else DISABLED

    # --- slow fields: field values, energy, PCIe replays, GPM -----------------

    def _energy_mj(self, slot: Slot, now: float) -> int:
        return _ENERGY_AT_START_MJ + round(slot.spec.power_w * 1000 * now)

    def _field(self, slot: Slot, now: float, field_id: int) -> int | None:
        """One field's value, or None when this GPU does not support it."""
        spec = slot.spec
        nvlink = bool(slot.links)
        if field_id == pynvml.NVML_FI_DEV_MEMORY_TEMP:
            return spec.memory_temperature_c
        if field_id == pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
            return self._energy_mj(slot, now)
        if field_id == pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER:
            return slot.pcie_replays
        if field_id == RECOVERY_FIELD:
            return self.recovery.field(slot.slot)
        nvlink_errors = {
            pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: 0,
            pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: 1,
            pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: 2,
            pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: 3,
        }
        if field_id in nvlink_errors:
            return slot.nvlink_errors[nvlink_errors[field_id]] if nvlink else None
        if field_id == pynvml.NVML_FI_DEV_NVLINK_BANDWIDTH_C0_TOTAL:
            # A made-up but monotonic traffic: 1 MiB/s per link per utilisation percent.
            return round(len(slot.links) * spec.gpu_util_pct * 1024 * now) if nvlink else None
        return None

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> list[MockFieldValue]:
        slot, now = self._enter(handle)
        stamp = int(time.time() * 1e6)
        values = []
        for entry in fieldIds:
            field_id = entry[0] if isinstance(entry, tuple) else int(entry)
            value = self._field(slot, now, field_id)
            code = pynvml.NVML_SUCCESS if value is not None else pynvml.NVML_ERROR_NOT_SUPPORTED
            values.append(MockFieldValue(field_id, code, value or 0, stamp))
        return values

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        slot, now = self._enter(handle)
        return self._energy_mj(slot, now)

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return self._enter(handle)[0].pcie_replays

    c_nvmlGpmMetricsGet_t = MockGpmMetricsGet

    def _gpm_supported(self, slot: Slot) -> bool:
        return slot.spec.compute_capability >= (9, 0)

    def nvmlGpmQueryDeviceSupport(self, device: Any) -> MockGpmSupport:
        slot, _ = self._enter(device)
        return MockGpmSupport(self._gpm_supported(slot))

    def nvmlGpmSampleAlloc(self) -> MockGpmSample:
        self._system()
        return MockGpmSample()

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        if not isinstance(gpmSample, MockGpmSample):
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> MockGpmSample:
        slot, now = self._enter(device)
        if not isinstance(gpmSample, MockGpmSample):
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not self._gpm_supported(slot):
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        gpmSample.gpu_slot, gpmSample.at = slot.slot, now
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        self._system()
        first, second = metricsGet.sample1, metricsGet.sample2
        if (
            not isinstance(first, MockGpmSample)
            or not isinstance(second, MockGpmSample)
            or first.gpu_slot is None
            or first.gpu_slot != second.gpu_slot
            or not 0 < metricsGet.numMetrics <= len(metricsGet.metrics)
        ):
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        spec = self._slots[first.gpu_slot].spec
        # Activity is constant in the mock, so any interval gives the baseline.
        percent = {
            pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: spec.gpu_util_pct,
            pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: spec.tensor_util_pct,
            pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: spec.mem_util_pct,
        }
        for metric in metricsGet.metrics[: metricsGet.numMetrics]:
            value = percent.get(metric.metricId)
            metric.nvmlReturn = (
                pynvml.NVML_SUCCESS if value is not None else pynvml.NVML_ERROR_NOT_SUPPORTED
            )
            metric.value = float(value or 0)
        return metricsGet
