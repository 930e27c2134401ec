"""The NVML adapter's sampling piece: one reading of one GPU, fast and slow fields.

The hot path
------------
:meth:`Sampler.sample` is called for every GPU every period. It does one dict lookup
for the cached state, one bit test per field before calling NVML, builds one
``GpuSample`` and never logs for unsupported fields.

The slow path
-------------
``sample(index, slow=True)`` also reads the fields that cost milliseconds on every
call of a real GPU (``nvmlDeviceGetFieldValues``: energy, PCIe replays, NVLink
counters, memory temperature; and GPM activity on Hopper and later), and the
aggregate (lifetime) ECC counts, which nothing needs within seconds. The collector
asks for them every ``collector.slow_period_s``; in between, samples repeat the last
values, and ``slow_fields_at`` tells their age. A field id the GPU answers
NOT_SUPPORTED for is dropped from later batches. A slow read may also re-read the
NVLink state (:mod:`.topology`).
"""

from __future__ import annotations

import time
from typing import Any, Final

from gpulet_common.messages import CELSIUS_RANGE, PERCENT_RANGE, GpuSample
from gpulet_common.nvml.calls import (
    FIELD_UNSUPPORTED,
    U_ECC_AGG_CORR,
    U_ECC_AGG_UNCORR,
    U_ECC_VOL_CORR,
    U_ECC_VOL_UNCORR,
    U_EVENT_REASONS,
    U_FIELD_VALUES,
    U_GPM,
    U_MEM,
    U_MEM_CLOCK,
    U_POWER,
    U_REMAP,
    U_RETIRED,
    U_SM_CLOCK,
    U_TEMP,
    U_THROTTLE_REASONS,
    U_UTIL,
    UNAVAILABLE_AFTER_INIT,
    Backend,
    GpuHandle,
    handle_key,
    log,
    within,
)
from gpulet_common.nvml.errors import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_RESET_REQUIRED,
    NVML_ERROR_UNKNOWN,
    GpuLostError,
)
from gpulet_common.nvml.topology import NvLinkReader

# Clock-event ("throttle") reasons of nvmlDeviceGetCurrentClocksEventReasons, named as
# the health messages name them. The SW power cap is no fault: a GPU under full load
# sits at its power limit with that bit set all the time (a real H100 at 700 W did).
CLOCK_EVENT_SW_POWER_CAP: Final = 0x4
CLOCK_EVENT_HW_SLOWDOWN: Final = 0x8
CLOCK_EVENT_SW_THERMAL: Final = 0x20
CLOCK_EVENT_HW_THERMAL: Final = 0x40
CLOCK_EVENT_HW_POWER_BRAKE: Final = 0x80
CLOCK_EVENT_NAMES: Final[dict[int, str]] = {
    CLOCK_EVENT_SW_POWER_CAP: "SW power cap",
    CLOCK_EVENT_HW_SLOWDOWN: "HW slowdown",
    CLOCK_EVENT_SW_THERMAL: "SW thermal slowdown",
    CLOCK_EVENT_HW_THERMAL: "HW thermal slowdown",
    CLOCK_EVENT_HW_POWER_BRAKE: "HW power brake slowdown",
}
# Thermal slowdown (the thermal rules), and the hardware holding clocks down for
# another reason (external power brake, HW slowdown: the clock_slowdown rule).
CLOCK_EVENTS_THERMAL: Final = CLOCK_EVENT_SW_THERMAL | CLOCK_EVENT_HW_THERMAL
CLOCK_EVENTS_HW_SLOWDOWN: Final = CLOCK_EVENT_HW_SLOWDOWN | CLOCK_EVENT_HW_POWER_BRAKE


def clock_event_names(bits: int, mask: int) -> str:
    """The named reasons of ``bits & mask``, joined with "and"."""
    return " and ".join(name for bit, name in CLOCK_EVENT_NAMES.items() if bits & mask & bit)


# The slow fields: one nvmlDeviceGetFieldValues batch per GPU, read every
# ``collector.slow_period_s`` (it costs ~5 ms on a real H100 every time, see
# docs/metrics.md). (GpuSample field, pynvml constant, its value in nvml.h.)
SLOW_FIELD_IDS: Final[tuple[tuple[str, str, int], ...]] = (
    ("memory_temperature_c", "NVML_FI_DEV_MEMORY_TEMP", 82),
    ("energy_mj", "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 83),
    ("pcie_replay_count", "NVML_FI_DEV_PCIE_REPLAY_COUNTER", 94),
    ("nvlink_crc_flit_errors", "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", 38),
    ("nvlink_crc_data_errors", "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", 45),
    ("nvlink_replay_errors", "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", 52),
    ("nvlink_recovery_errors", "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", 59),
    ("nvlink_bandwidth_total", "NVML_FI_DEV_NVLINK_BANDWIDTH_C0_TOTAL", 66),
)
# GPM metrics (Hopper and later), percentages turned into 0..1 ratios:
# (GpuSample field, pynvml constant, its value in nvml_gpm.h).
GPM_METRIC_IDS: Final[tuple[tuple[str, str, int], ...]] = (
    ("gr_engine_active", "NVML_GPM_METRIC_GRAPHICS_UTIL", 1),
    ("tensor_active", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 5),
    ("dram_active", "NVML_GPM_METRIC_DRAM_BW_UTIL", 10),
)
# nvmlValueType_t -> the member of the value union that holds it.
_VALUE_MEMBERS: Final = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}
_VALUE_MEMBERS_MORE: Final = {6: "usVal"}


class GpmState:
    """Two GPM sample buffers of one GPU, alternated: metrics need two samples."""

    __slots__ = ("previous", "spare")

    def __init__(self) -> None:
        self.previous: Any = None
        self.spare: Any = None


def _field_value(answer: Any) -> float | None:
    """The number in one ``nvmlFieldValue_t`` (its union read by ``valueType``)."""
    kind = int(getattr(answer, "valueType", -1))
    member = _VALUE_MEMBERS.get(kind) or _VALUE_MEMBERS_MORE.get(kind)
    if member is None:
        return None
    value = getattr(answer.value, member, None)
    return float(value) if isinstance(value, int | float) else None


class Sampler(NvLinkReader):
    """One reading of one GPU: the fast fields every period, the slow ones on request."""

    def __init__(self, nvml_module: Any, backend: Backend = "nvml") -> None:
        super().__init__(nvml_module, backend)
        self._gpm_by_uuid: dict[str, GpmState] = {}
        # Field ids a GPU answered NOT_SUPPORTED for, per UUID: never asked again.
        self._fields_unsupported: dict[str, frozenset[int]] = {}
        bind, const = self._bind, self._const
        self._f_utilization = bind("nvmlDeviceGetUtilizationRates")
        self._f_temperature = bind("nvmlDeviceGetTemperature")
        self._f_power = bind("nvmlDeviceGetPowerUsage")
        self._f_clock = bind("nvmlDeviceGetClockInfo")
        self._f_total_ecc = bind("nvmlDeviceGetTotalEccErrors")
        self._f_remapped_rows = bind("nvmlDeviceGetRemappedRows")
        self._f_retired_pending = bind("nvmlDeviceGetRetiredPagesPendingStatus")
        self._f_event_reasons = bind("nvmlDeviceGetCurrentClocksEventReasons")
        self._f_throttle_reasons = bind("nvmlDeviceGetCurrentClocksThrottleReasons")
        self._f_field_values = bind("nvmlDeviceGetFieldValues")
        self._f_gpm_support = bind("nvmlGpmQueryDeviceSupport")
        self._f_gpm_alloc = bind("nvmlGpmSampleAlloc")
        self._f_gpm_get = bind("nvmlGpmSampleGet")
        self._f_gpm_metrics = bind("nvmlGpmMetricsGet")
        self._f_gpm_free = bind("nvmlGpmSampleFree")
        self._gpm_request_type = getattr(nvml_module, "c_nvmlGpmMetricsGet_t", None)
        self._c_temperature_gpu = const("NVML_TEMPERATURE_GPU", 0)
        self._c_clock_sm = const("NVML_CLOCK_SM", 1)
        self._c_clock_mem = const("NVML_CLOCK_MEM", 2)
        self._c_corrected = const("NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
        self._c_uncorrected = const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        self._c_volatile = const("NVML_VOLATILE_ECC", 0)
        self._c_aggregate = const("NVML_AGGREGATE_ECC", 1)
        self._c_gpm_version = const("NVML_GPM_METRICS_GET_VERSION", 1)
        self._slow_fields = [(field, const(name, value)) for field, name, value in SLOW_FIELD_IDS]
        self._gpm_metrics = [(field, const(name, value)) for field, name, value in GPM_METRIC_IDS]

    def init(self) -> None:
        super().init()
        with self._lock:
            # GPM buffers of a previous initialisation are not valid any more.
            self._gpm_by_uuid.clear()

    def shutdown(self) -> None:
        self._free_gpm_samples()
        super().shutdown()

    def _free_gpm_samples(self) -> None:
        """Give back the GPM sample buffers (NVML allocates them; two per GPU)."""
        with self._lock:
            states = list(self._gpm_by_uuid.values())
            self._gpm_by_uuid.clear()
        free = self._f_gpm_free
        if free is None:
            return
        for state in states:
            for sample in (state.previous, state.spare):
                if sample is None:
                    continue
                try:
                    free(sample)
                except self._error_type as exc:
                    log.debug("nvmlGpmSampleFree failed: %s", exc)

    def sample(
        self, index: int, *, slow: bool = False, nvlink_state_every_s: float = 0.0
    ) -> GpuSample:
        """One reading of one GPU.

        With ``slow`` the expensive fields (:data:`SLOW_FIELD_IDS` in one
        ``nvmlDeviceGetFieldValues`` call, and GPM) are read too; without it the sample
        repeats their last values, with ``slow_fields_at`` saying when those were read.
        A slow read also re-reads the NVLink state (:meth:`nvlinks_up`) when the NVLink
        error counters moved or ``nvlink_state_every_s`` has passed (0: every time).
        Unsupported fields are None (and never asked again). An unexpected error on one
        field leaves it None, sets ``error`` and drops the cached handle. Raises
        :class:`GpuLostError` for a lost GPU, :class:`GpuResetRequired` when it needs a
        reset, and :class:`NvmlUnavailable` when NVML itself went away.

        A cached handle that answers ``INVALID_ARGUMENT`` is of a previous enumeration
        (the GPU went and came back, see :mod:`.calls`): the handle at ``index`` is
        fetched again and read once more, so the sample names whichever GPU is at
        ``index`` now.
        """
        cached = self._gpus.get(index)
        sample = self._sample(cached or self._load(index), index, slow, nvlink_state_every_s)
        if cached is not None and cached.error_code == NVML_ERROR_INVALID_ARGUMENT:
            fresh = self._load(index)
            if handle_key(fresh.handle) != handle_key(cached.handle):
                sample = self._sample(fresh, index, slow, nvlink_state_every_s)
        return sample

    def _sample(
        self, gpu: GpuHandle, index: int, slow: bool, nvlink_state_every_s: float
    ) -> GpuSample:
        gpu.error = None
        gpu.error_code = None
        read = self._read
        utilization = read(gpu, U_UTIL, self._f_utilization)
        memory = read(gpu, U_MEM, self._f_memory)
        temperature = read(gpu, U_TEMP, self._f_temperature, self._c_temperature_gpu)
        power = read(gpu, U_POWER, self._f_power)
        sm_clock = read(gpu, U_SM_CLOCK, self._f_clock, self._c_clock_sm)
        mem_clock = read(gpu, U_MEM_CLOCK, self._f_clock, self._c_clock_mem)
        ecc = self._f_total_ecc
        corrected, uncorrected = self._c_corrected, self._c_uncorrected
        volatile, aggregate = self._c_volatile, self._c_aggregate
        ecc_vol_corr = read(gpu, U_ECC_VOL_CORR, ecc, corrected, volatile)
        ecc_vol_uncorr = read(gpu, U_ECC_VOL_UNCORR, ecc, uncorrected, volatile)
        remapped = read(gpu, U_REMAP, self._f_remapped_rows)
        retired = read(gpu, U_RETIRED, self._f_retired_pending)
        reasons = read(gpu, U_EVENT_REASONS, self._f_event_reasons)
        if reasons is None and gpu.unsupported & U_EVENT_REASONS:
            # Drivers before 535 only have the older name of the same call.
            reasons = read(gpu, U_THROTTLE_REASONS, self._f_throttle_reasons)
        if slow:
            before = dict(gpu.slow)
            self._read_slow(gpu, aggregate)
            if self._nvlink_state_due(gpu, before, nvlink_state_every_s):
                self._read_nvlink_state(gpu)
        error = gpu.error
        if error is not None:
            self._forget(gpu)
        return GpuSample(
            uuid=gpu.uuid,
            index=index,
            timestamp=time.time(),
            gpu_util_pct=(
                within(utilization.gpu, PERCENT_RANGE) if utilization is not None else None
            ),
            mem_util_pct=(
                within(utilization.memory, PERCENT_RANGE) if utilization is not None else None
            ),
            memory_used_bytes=memory.used if memory is not None else None,
            memory_free_bytes=memory.free if memory is not None else None,
            temperature_c=within(temperature, CELSIUS_RANGE),
            power_mw=power,
            sm_clock_mhz=sm_clock,
            mem_clock_mhz=mem_clock,
            ecc_volatile_corrected=ecc_vol_corr,
            ecc_volatile_uncorrected=ecc_vol_uncorr,
            remapped_rows_correctable=remapped[0] if remapped is not None else None,
            remapped_rows_uncorrectable=remapped[1] if remapped is not None else None,
            remapped_rows_pending=bool(remapped[2]) if remapped is not None else None,
            remapped_rows_failed=bool(remapped[3]) if remapped is not None else None,
            retired_pages_pending=bool(retired) if retired is not None else None,
            throttle_reasons=reasons,
            error=error,
            mig=self._mig_samples(gpu),
            **gpu.slow,
        )

    # --- slow fields ----------------------------------------------------------

    def _read_slow(self, gpu: GpuHandle, aggregate: int) -> None:
        """Read the slow fields into ``gpu.slow`` (errors as in :meth:`_read`)."""
        values: dict[str, Any] = {}
        # Aggregate ECC counts are the persistent (lifetime) ones: nothing acts on
        # them within seconds, and two calls per GPU per period are not free.
        ecc = self._f_total_ecc
        for field, bit, kind in (
            ("ecc_aggregate_corrected", U_ECC_AGG_CORR, self._c_corrected),
            ("ecc_aggregate_uncorrected", U_ECC_AGG_UNCORR, self._c_uncorrected),
        ):
            value = self._read(gpu, bit, ecc, kind, aggregate)
            if value is not None:
                values[field] = value
        values.update(self._read_field_values(gpu))
        values.update(self._read_gpm(gpu))
        values["slow_fields_at"] = time.time()
        with self._lock:
            gpu.slow.clear()
            gpu.slow.update(values)

    def _read_field_values(self, gpu: GpuHandle) -> dict[str, Any]:
        fn = self._f_field_values
        if fn is None or gpu.unsupported & U_FIELD_VALUES:
            return {}
        skip = self._fields_unsupported.get(gpu.uuid, frozenset())
        wanted = [(field, fid) for field, fid in self._slow_fields if fid not in skip]
        if not wanted:
            return {}
        try:
            answers = fn(gpu.handle, [fid for _, fid in wanted])
        except self._error_type as exc:
            self._field_failed(gpu, U_FIELD_VALUES, fn, exc)
            return {}
        out: dict[str, Any] = {}
        unsupported: set[int] = set()
        for (field, fid), answer in zip(wanted, answers, strict=False):
            code = int(getattr(answer, "nvmlReturn", NVML_ERROR_UNKNOWN))
            if code != 0:
                if code in FIELD_UNSUPPORTED:
                    unsupported.add(fid)
                elif code == NVML_ERROR_GPU_IS_LOST:
                    self._forget(gpu)
                    raise GpuLostError(gpu.index, gpu.uuid, "nvmlDeviceGetFieldValues")
                continue
            value = _field_value(answer)
            if value is not None:
                out[field] = round(value)
        if unsupported:
            with self._lock:
                self._fields_unsupported[gpu.uuid] = skip | unsupported
        return out

    def _read_gpm(self, gpu: GpuHandle) -> dict[str, Any]:
        """GPM activity since the previous slow read (nothing on the first one)."""
        support, alloc, get = self._f_gpm_support, self._f_gpm_alloc, self._f_gpm_get
        metrics_get, request_type = self._f_gpm_metrics, self._gpm_request_type
        if (
            support is None
            or alloc is None
            or get is None
            or metrics_get is None
            or request_type is None
            or gpu.unsupported & U_GPM
        ):
            return {}
        try:
            state = self._gpm_by_uuid.get(gpu.uuid)
            if state is None:
                if not int(support(gpu.handle).isSupportedDevice):
                    self._mark_unsupported(gpu, U_GPM)
                    return {}
                state = GpmState()
                state.previous, state.spare = alloc(), alloc()
                with self._lock:
                    self._gpm_by_uuid[gpu.uuid] = state
                get(gpu.handle, state.previous)
                return {}
            current = state.spare
            get(gpu.handle, current)
            request = request_type()
            request.version = self._c_gpm_version
            request.numMetrics = len(self._gpm_metrics)
            request.sample1 = state.previous
            request.sample2 = current
            for i, (_, metric_id) in enumerate(self._gpm_metrics):
                request.metrics[i].metricId = metric_id
            metrics_get(request)
            state.previous, state.spare = current, state.previous
        except self._error_type as exc:
            code = self._code(exc)
            if code in FIELD_UNSUPPORTED or code in (
                NVML_ERROR_GPU_IS_LOST,
                NVML_ERROR_RESET_REQUIRED,
                *UNAVAILABLE_AFTER_INIT,
            ):
                self._field_failed(gpu, U_GPM, get, exc)
            else:
                # GPM is an extra: a failed measurement starts over at the next slow
                # read rather than marking the GPU's sample as failed.
                log.debug("GPU %d: GPM measurement failed, starting over: %s", gpu.index, exc)
                with self._lock:
                    self._gpm_by_uuid.pop(gpu.uuid, None)
            return {}
        out: dict[str, Any] = {}
        for i, (field, _) in enumerate(self._gpm_metrics):
            metric = request.metrics[i]
            if int(metric.nvmlReturn) == 0:
                out[field] = min(max(float(metric.value) / 100.0, 0.0), 1.0)
        return out
