"""The NVML adapter: the only code of gpulet that calls NVML.

Why an adapter
--------------
NVML speaks in return codes, ctypes structures and opaque handles, and differs by
driver generation (a function may be missing, a counter may be unsupported). The
services want typed answers -- :class:`~gpulet_common.messages.GpuInfo`,
:class:`~gpulet_common.messages.Inventory`, :class:`~gpulet_common.messages.GpuSample`
-- and four kinds of failure (see :mod:`gpulet_common.nvml.errors`). This module is
the translation layer between the two, and nothing else in gpulet imports ``pynvml``.

The NVML module is a constructor parameter
------------------------------------------
:class:`NvmlAdapter` never imports ``pynvml`` itself: it receives a module-like
object. In production that is ``pynvml``; in tests and on machines without a GPU it
is :class:`gpulet_common.mock_nvml.MockNvml`, which has the same function names, the
same return shapes and raises the real ``pynvml.NVMLError`` subclasses. So the mock
exercises exactly the code that runs against the driver.

Layers inside the adapter
-------------------------
1. *Binding*: every NVML function is looked up once, at construction. A function the
   bindings lack (old ``nvidia-ml-py``) is bound to ``None`` and its field reads as
   unsupported, like ``NVML_ERROR_FUNCTION_NOT_FOUND``.
2. *Error translation* (:meth:`NvmlAdapter._translate`): ``NOT_SUPPORTED`` (and
   ``FUNCTION_NOT_FOUND`` / ``NO_PERMISSION`` on a single field) give ``None``;
   ``GPU_IS_LOST`` gives :class:`GpuLostError`; the codes that mean "NVML is gone"
   give :class:`NvmlUnavailable`; the rest give :class:`NvmlCallError`.
3. *Per-GPU state* (:class:`_GpuHandle`): the cached handle and UUID, and a bit mask of the
   fields NVML said it does not support, so that the sampling hot path never calls
   them again. The mask is kept by UUID, so it survives a handle re-fetch.
4. *Public operations*: inventory (with pairwise topology), samples, events.

Threading
---------
All methods block; callers run them in worker threads, several at a time (one GPU
per thread, so that a hung GPU delays only itself). No lock is ever held while NVML
is called: the lock only guards the short updates of the caches. Lookups in the
caches are plain ``dict.get`` calls, which are atomic. Two threads sampling the
*same* GPU at once are safe but may both call an unsupported function once more.

Inventory when a GPU misbehaves
-------------------------------
A GPU whose identity (handle, UUID) cannot be read, or that is lost, is left out of
``gpus`` and logged: without a UUID it cannot be addressed like the others. It is not
dropped: real NVML still counts a lost GPU, so the inventory carries NVML's count
(``nvml_count``) and lists such a GPU in ``unreadable`` by index, with whatever
identity could still be read (:meth:`NvmlAdapter.unreadable`), for the health service
to raise. A GPU whose secondary fields fail (serial, thresholds, ...) is included with
those fields ``None``. A topology query that fails gives ``level=None`` for that pair.
The skipped GPUs and why are also returned by :meth:`NvmlAdapter.inventory_report`.

The hot path
------------
:meth:`NvmlAdapter.sample` is called for every GPU every period. It does one dict
lookup for the cached state, one bit test per field before calling NVML, builds one
``GpuSample`` and never logs for unsupported fields.

The slow path
-------------
``sample(index, slow=True)`` also reads the fields that cost milliseconds on every
call of a real GPU (``nvmlDeviceGetFieldValues``: energy, PCIe replays, NVLink
counters, memory temperature; and GPM activity on Hopper and later), and the
aggregate (lifetime) ECC counts, which nothing needs within seconds. The collector
asks for them every ``collector.slow_period_s``; in between, samples repeat the last
values, and ``slow_fields_at`` tells their age. A field id the GPU answers
NOT_SUPPORTED for is dropped from later batches.

NVLink state
------------
The inventory counts, per pair of GPUs, the NVLinks that are *active*
(``nvmlDeviceGetNvLinkState`` per link, then the far end's PCI bus id and device type).
The adapter remembers, by UUID, every link it has seen active and where it led. A
remembered link that reads inactive later is *down*: it leaves the pair's ``nvlinks``
(so the allocator stops counting it) and is counted in the pair's ``nvlinks_down``
and listed in the GPU's ``nvlinks_down``. A link never seen active (no bridge or
cable, or down since before this process started) is neither: NVML cannot tell it
from a link that does not exist. The slow path re-reads the state of the remembered
links only (one call per link; none on a GPU without NVLink), at the first slow read,
when the GPU's NVLink error counters of that slow read moved (a failing link goes
through replays and recovery first) or when ``nvlink_state_every_s`` has passed since
the last read, and keeps the set of active ones, :meth:`NvmlAdapter.nvlinks_up`; the
collector compares it with the inventory it published and rebuilds the inventory when
they differ. A GPU whose link scan failed has unknown links (``nvlinks_up`` None), not
"none up".
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final, Literal

import msgspec

from gpulet_common.messages import (
    CELSIUS_RANGE,
    PERCENT_RANGE,
    GpuInfo,
    GpuSample,
    Inventory,
    PeerLink,
    UnreadableGpu,
)
from gpulet_common.nvml.errors import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNKNOWN,
    UNAVAILABLE_REASONS,
    GpuLostError,
    GpuResetRequired,
    NvmlCallError,
    NvmlError,
    NvmlUnavailable,
)

try:
    import pynvml as _pynvml
except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
    _pynvml = None

log = logging.getLogger("gpulet.nvml")

Backend = Literal["nvml", "mock"]


def _pynvml_const(name: str, default: int) -> int:
    value = getattr(_pynvml, name, None)
    return value if isinstance(value, int) else default


# The NVML event types the health service listens to. Taken from pynvml where it
# defines them; the fallbacks are the values of the NVML C header.
EVENT_SINGLE_BIT_ECC: Final = _pynvml_const("nvmlEventTypeSingleBitEccError", 0x1)
EVENT_DOUBLE_BIT_ECC: Final = _pynvml_const("nvmlEventTypeDoubleBitEccError", 0x2)
EVENT_PSTATE: Final = _pynvml_const("nvmlEventTypePState", 0x4)
EVENT_XID: Final = _pynvml_const("nvmlEventTypeXidCriticalError", 0x8)
EVENT_CLOCK: Final = _pynvml_const("nvmlEventTypeClock", 0x10)
EVENT_GPU_UNAVAILABLE: Final = _pynvml_const("nvmlEventTypeGpuUnavailableError", 0x4000)
EVENT_ECC_MASK: Final = EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC
HEALTH_EVENT_MASK: Final = EVENT_ECC_MASK | EVENT_XID | EVENT_GPU_UNAVAILABLE
# The event types by name: the health rules read an event's names (NvmlEvent.kinds),
# never its bits.
EventKind = Literal["single_bit_ecc", "double_bit_ecc", "pstate", "xid", "clock", "gpu_unavailable"]
EVENT_KINDS: Final[dict[int, EventKind]] = {
    EVENT_SINGLE_BIT_ECC: "single_bit_ecc",
    EVENT_DOUBLE_BIT_ECC: "double_bit_ecc",
    EVENT_PSTATE: "pstate",
    EVENT_XID: "xid",
    EVENT_CLOCK: "clock",
    EVENT_GPU_UNAVAILABLE: "gpu_unavailable",
}

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


# Codes that, on a single field read, mean "this GPU/driver cannot give this field".
# They do not change while the process runs, so the field is never asked again.
_FIELD_UNSUPPORTED: Final = frozenset(
    {NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_NO_PERMISSION}
)
# During nvmlInit, NO_PERMISSION and FUNCTION_NOT_FOUND mean NVML is unusable; on a
# later call they concern one function only.
_UNAVAILABLE_AFTER_INIT: Final = frozenset(UNAVAILABLE_REASONS) - {
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_FUNCTION_NOT_FOUND,
}

# Room for 4096 CPUs in the affinity bit mask (64-bit words): NVML fills what exists.
_CPU_SET_WORDS: Final = 64

# Bits of _GpuHandle.unsupported, one per sampled NVML call.
_U_UTIL: Final = 1 << 0
_U_MEM: Final = 1 << 1
_U_TEMP: Final = 1 << 2
_U_POWER: Final = 1 << 3
_U_SM_CLOCK: Final = 1 << 4
_U_MEM_CLOCK: Final = 1 << 5
_U_ECC_VOL_CORR: Final = 1 << 6
_U_ECC_VOL_UNCORR: Final = 1 << 7
_U_ECC_AGG_CORR: Final = 1 << 8
_U_ECC_AGG_UNCORR: Final = 1 << 9
_U_REMAP: Final = 1 << 10
_U_RETIRED: Final = 1 << 11
_U_EVENT_REASONS: Final = 1 << 12
_U_THROTTLE_REASONS: Final = 1 << 13
_U_FIELD_VALUES: Final = 1 << 14
_U_GPM: Final = 1 << 15
_U_NVLINK_STATE: Final = 1 << 16

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
# The slow fields that count NVLink errors: when one moves, link state is re-read.
NVLINK_ERROR_FIELDS: Final = (
    "nvlink_crc_flit_errors",
    "nvlink_crc_data_errors",
    "nvlink_replay_errors",
    "nvlink_recovery_errors",
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


class SystemInfo(msgspec.Struct, frozen=True, kw_only=True):
    driver_version: str | None = None
    # "12.4" for NVML's integer 12040.
    cuda_driver_version: str | None = None
    nvml_version: str | None = None


class NvmlEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One NVML event, with the GPU resolved to its index and UUID.

    ``gpu_index`` is the index the GPU had when its events were registered; the UUID is
    authoritative. ``timestamp`` is the wall-clock time the wait returned: NVML's event
    data carries no time.
    """

    gpu_index: int | None
    gpu_uuid: str | None
    event_type: int
    # The XID number for XID events, 0 otherwise.
    event_data: int
    timestamp: float

    @property
    def xid(self) -> int | None:
        """The XID number when this is an XID event and nothing else, None otherwise."""
        return self.event_data if self.event_type == EVENT_XID else None

    @property
    def kinds(self) -> frozenset[EventKind]:
        """The event's types by name (an unknown bit has none)."""
        return frozenset(name for bit, name in EVENT_KINDS.items() if self.event_type & bit)


class _GpuHandle:
    """What the adapter remembers about one GPU between calls."""

    __slots__ = ("error", "handle", "index", "slow", "unsupported", "uuid")

    def __init__(
        self, index: int, handle: Any, uuid: str, unsupported: int, slow: dict[str, Any]
    ) -> None:
        self.index = index
        self.handle = handle
        self.uuid = uuid
        self.unsupported = unsupported
        # First unexpected (non-fatal) field error of the current sample.
        self.error: str | None = None
        # The last slow fields read (GpuSample field -> value), "slow_fields_at" included;
        # shared with the adapter's per-UUID memory so a handle re-fetch keeps them.
        self.slow = slow


class _LinkScan:
    """One GPU's NVLinks as one inventory scan read them."""

    __slots__ = ("direct", "down", "down_direct", "down_switch", "switch", "up")

    def __init__(self) -> None:
        # Active links per peer bus id, and active links into NVSwitches.
        self.direct: dict[str, int] = {}
        self.switch = 0
        # Links seen active before that are inactive now, counted the same way.
        self.down_direct: dict[str, int] = {}
        self.down_switch = 0
        self.up: list[int] = []
        self.down: list[int] = []


class _GpmState:
    """Two GPM sample buffers of one GPU, alternated: metrics need two samples."""

    __slots__ = ("previous", "spare")

    def __init__(self) -> None:
        self.previous: Any = None
        self.spare: Any = None


def _within(value: Any, bounds: tuple[int, int]) -> int | None:
    """An NVML reading inside the wire range of its field, else None (as unsupported):
    consumers refuse a whole message over one value out of range."""
    if value is None:
        return None
    number = int(value)
    return number if bounds[0] <= number <= bounds[1] else None


def _text(value: Any) -> str:
    # nvidia-ml-py >= 11 decodes char buffers to str; older ones returned bytes.
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def cuda_version_string(version: int) -> str:
    """NVML's CUDA driver version integer (12040) as "12.4"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def normalize_bus_id(bus_id: str) -> str:
    """A PCI bus id in NVML's canonical form ``DDDDDDDD:BB:DD.F``, upper case.

    NVML reports the 8-digit domain form, sysfs and some tools the 4-digit one; link
    peers are matched on this form so both compare equal.
    """
    bus = bus_id.strip().upper()
    colons = bus.count(":")
    if colons == 1:
        return "00000000:" + bus
    if colons == 2:
        domain, _, rest = bus.partition(":")
        try:
            return f"{int(domain, 16):08X}:{rest}"
        except ValueError:
            return bus
    return bus


def _field_value(answer: Any) -> float | None:
    """The number in one ``nvmlFieldValue_t`` (its union read by ``valueType``)."""
    kind = int(getattr(answer, "valueType", -1))
    member = _VALUE_MEMBERS.get(kind) or _VALUE_MEMBERS_MORE.get(kind)
    if member is None:
        return None
    value = getattr(answer.value, member, None)
    return float(value) if isinstance(value, int | float) else None


def _pair_links(a: _LinkScan, b: _LinkScan, bus_a: str, bus_b: str) -> tuple[int, int]:
    """(active, down) NVLinks between two GPUs, from both GPUs' scans.

    Direct links count from both ends (one side's scan may have failed): the larger
    count. Through NVSwitches every pair reaches the other with the smaller of the
    two GPUs' switch links; the switch links down are what that leaves out.
    """
    up = max(a.direct.get(bus_b, 0), b.direct.get(bus_a, 0))
    down = max(a.down_direct.get(bus_b, 0), b.down_direct.get(bus_a, 0))
    switch_up = min(a.switch, b.switch) if a.switch and b.switch else 0
    a_all, b_all = a.switch + a.down_switch, b.switch + b.down_switch
    switch_all = min(a_all, b_all) if a_all and b_all else 0
    return up + switch_up, down + switch_all - switch_up


def _handle_key(handle: Any) -> Any:
    """A hashable identity of a device handle, equal for two handles of one GPU.

    pynvml handles are ctypes pointers: a new Python object per call (event data
    included), so they are compared by address. Mock handles are plain objects
    returned unchanged by every call, so they are their own key.
    """
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _missing(function: str) -> NvmlUnavailable:
    reason = UNAVAILABLE_REASONS[NVML_ERROR_FUNCTION_NOT_FOUND]
    return NvmlUnavailable(f"{reason} [{function}]", NVML_ERROR_FUNCTION_NOT_FOUND)


def _affinity_cpus(words: Any) -> list[int]:
    cpus: list[int] = []
    for word_index, word in enumerate(words):
        word = int(word)
        base = word_index * 64
        while word:
            low = word & -word
            cpus.append(base + low.bit_length() - 1)
            word ^= low
    return cpus


class NvmlAdapter:
    """Typed, thread-safe access to NVML (real ``pynvml`` or the mock)."""

    def __init__(self, nvml_module: Any, backend: Backend = "nvml") -> None:
        self._nvml = nvml_module
        self.backend: Backend = backend
        self._error_type: type[BaseException] = nvml_module.NVMLError
        self._lock = threading.Lock()
        self._gpus: dict[int, _GpuHandle] = {}
        self._unsupported_by_uuid: dict[str, int] = {}
        self._slow_by_uuid: dict[str, dict[str, Any]] = {}
        self._gpm_by_uuid: dict[str, _GpmState] = {}
        # Field ids a GPU answered NOT_SUPPORTED for, per UUID: never asked again.
        self._fields_unsupported: dict[str, frozenset[int]] = {}
        # NVLinks ever seen active, per UUID: link id -> (far end's bus id, is a switch);
        # and the active links at the last read of their state (inventory or slow path).
        self._nvlink_seen: dict[str, dict[int, tuple[str, bool]]] = {}
        self._nvlink_up: dict[str, frozenset[int]] = {}
        self._nvlink_read_at: dict[str, float] = {}  # time.monotonic() of that read
        self._event_devices: dict[Any, tuple[int, str]] = {}
        self._initialized = False

        bind = self._bind
        self._f_init = bind("nvmlInit")
        self._f_shutdown = bind("nvmlShutdown")
        self._f_driver_version = bind("nvmlSystemGetDriverVersion")
        self._f_cuda_version = bind("nvmlSystemGetCudaDriverVersion")
        self._f_nvml_version = bind("nvmlSystemGetNVMLVersion")
        self._f_count = bind("nvmlDeviceGetCount")
        self._f_handle_by_index = bind("nvmlDeviceGetHandleByIndex")
        self._f_uuid = bind("nvmlDeviceGetUUID")
        self._f_name = bind("nvmlDeviceGetName")
        self._f_minor = bind("nvmlDeviceGetMinorNumber")
        self._f_pci = bind("nvmlDeviceGetPciInfo")
        self._f_memory = bind("nvmlDeviceGetMemoryInfo")
        self._f_numa = bind("nvmlDeviceGetNumaNodeId")
        self._f_affinity_scope = bind("nvmlDeviceGetCpuAffinityWithinScope")
        self._f_affinity = bind("nvmlDeviceGetCpuAffinity")
        self._f_serial = bind("nvmlDeviceGetSerial")
        self._f_board_id = bind("nvmlDeviceGetBoardId")
        self._f_compute_cap = bind("nvmlDeviceGetCudaComputeCapability")
        self._f_module_id = bind("nvmlDeviceGetModuleId")
        self._f_ecc_mode = bind("nvmlDeviceGetEccMode")
        self._f_threshold = bind("nvmlDeviceGetTemperatureThreshold")
        self._f_supported_events = bind("nvmlDeviceGetSupportedEventTypes")
        self._f_common_ancestor = bind("nvmlDeviceGetTopologyCommonAncestor")
        self._f_nvlink_state = bind("nvmlDeviceGetNvLinkState")
        self._f_nvlink_remote_pci = bind("nvmlDeviceGetNvLinkRemotePciInfo")
        self._f_nvlink_remote_type = bind("nvmlDeviceGetNvLinkRemoteDeviceType")
        self._f_utilization = bind("nvmlDeviceGetUtilizationRates")
        self._f_temperature = bind("nvmlDeviceGetTemperature")
        self._f_power = bind("nvmlDeviceGetPowerUsage")
        self._f_clock = bind("nvmlDeviceGetClockInfo")
        self._f_total_ecc = bind("nvmlDeviceGetTotalEccErrors")
        self._f_remapped_rows = bind("nvmlDeviceGetRemappedRows")
        self._f_retired_pending = bind("nvmlDeviceGetRetiredPagesPendingStatus")
        self._f_event_reasons = bind("nvmlDeviceGetCurrentClocksEventReasons")
        self._f_throttle_reasons = bind("nvmlDeviceGetCurrentClocksThrottleReasons")
        self._f_event_set_create = bind("nvmlEventSetCreate")
        self._f_register_events = bind("nvmlDeviceRegisterEvents")
        self._f_event_wait = bind("nvmlEventSetWait_v2") or bind("nvmlEventSetWait")
        self._f_event_set_free = bind("nvmlEventSetFree")
        self._f_field_values = bind("nvmlDeviceGetFieldValues")
        self._f_gpm_support = bind("nvmlGpmQueryDeviceSupport")
        self._f_gpm_alloc = bind("nvmlGpmSampleAlloc")
        self._f_gpm_get = bind("nvmlGpmSampleGet")
        self._f_gpm_metrics = bind("nvmlGpmMetricsGet")
        self._f_gpm_free = bind("nvmlGpmSampleFree")
        self._gpm_request_type = getattr(nvml_module, "c_nvmlGpmMetricsGet_t", None)

        const = self._const
        self._c_temperature_gpu = const("NVML_TEMPERATURE_GPU", 0)
        self._c_clock_sm = const("NVML_CLOCK_SM", 1)
        self._c_clock_mem = const("NVML_CLOCK_MEM", 2)
        self._c_corrected = const("NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
        self._c_uncorrected = const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        self._c_volatile = const("NVML_VOLATILE_ECC", 0)
        self._c_aggregate = const("NVML_AGGREGATE_ECC", 1)
        self._c_threshold_shutdown = const("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", 0)
        self._c_threshold_slowdown = const("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1)
        self._c_threshold_mem_max = const("NVML_TEMPERATURE_THRESHOLD_MEM_MAX", 2)
        self._c_threshold_gpu_max = const("NVML_TEMPERATURE_THRESHOLD_GPU_MAX", 3)
        self._c_nvlink_max_links = const("NVML_NVLINK_MAX_LINKS", 18)
        self._c_nvlink_switch = const("NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        self._c_affinity_scope_node = const("NVML_AFFINITY_SCOPE_NODE", 0)
        self._c_feature_enabled = const("NVML_FEATURE_ENABLED", 1)
        self._c_gpm_version = const("NVML_GPM_METRICS_GET_VERSION", 1)
        self._slow_fields = [(field, const(name, value)) for field, name, value in SLOW_FIELD_IDS]
        self._gpm_metrics = [(field, const(name, value)) for field, name, value in GPM_METRIC_IDS]

    # --- binding and error translation -----------------------------------------------

    def _bind(self, name: str) -> Callable[..., Any] | None:
        fn = getattr(self._nvml, name, None)
        return fn if callable(fn) else None

    def _const(self, name: str, default: int) -> int:
        value = getattr(self._nvml, name, None)
        return value if isinstance(value, int) else default

    @staticmethod
    def _code(exc: BaseException) -> int:
        code = getattr(exc, "value", None)
        return code if isinstance(code, int) else NVML_ERROR_UNKNOWN

    def _translate(
        self,
        exc: BaseException,
        function: str,
        index: int | None = None,
        uuid: str | None = None,
        *,
        unavailable_codes: frozenset[int] = _UNAVAILABLE_AFTER_INIT,
    ) -> NvmlError:
        code = self._code(exc)
        if code == NVML_ERROR_GPU_IS_LOST:
            return GpuLostError(index, uuid, function)
        if code in unavailable_codes:
            return NvmlUnavailable(f"{UNAVAILABLE_REASONS[code]} [{function}]", code)
        if code == NVML_ERROR_RESET_REQUIRED:
            return GpuResetRequired(function, code, str(exc), index)
        return NvmlCallError(function, code, str(exc), index)

    def _call(self, fn: Callable[..., Any] | None, name: str, *args: Any) -> Any:
        """Call a function that must exist and succeed; translate any failure."""
        if fn is None:
            raise _missing(name)
        try:
            return fn(*args)
        except self._error_type as exc:
            raise self._translate(exc, name) from exc

    # --- lifecycle -----------------------------------------------------------------

    @property
    def module(self) -> Any:
        """The NVML module this adapter talks to (``pynvml`` or a ``MockNvml``)."""
        return self._nvml

    @property
    def initialized(self) -> bool:
        return self._initialized

    def init(self) -> None:
        """Initialise NVML; raises :class:`NvmlUnavailable` saying why it cannot be used.

        Also the way back after NVML vanished: every cache is dropped, because handles
        from a previous initialisation are not valid any more.
        """
        if self._f_init is None:
            raise _missing("nvmlInit")
        try:
            self._f_init()
        except self._error_type as exc:
            err = self._translate(exc, "nvmlInit", unavailable_codes=frozenset(UNAVAILABLE_REASONS))
            if isinstance(err, NvmlUnavailable):
                raise err from exc
            raise NvmlUnavailable(f"nvmlInit failed: {exc}", self._code(exc)) from exc
        except OSError as exc:  # a broken library file rather than a missing one
            raise NvmlUnavailable(f"loading the NVML library failed: {exc}") from exc
        self.invalidate()
        with self._lock:
            # GPM buffers of a previous initialisation are not valid any more.
            self._gpm_by_uuid.clear()
        self._initialized = True

    def shutdown(self) -> None:
        """Release NVML. Errors are logged, never raised: this runs on the way out."""
        self._initialized = False
        self.invalidate()
        self._free_gpm_samples()
        if self._f_shutdown is None:
            return
        try:
            self._f_shutdown()
        except self._error_type as exc:
            log.debug("nvmlShutdown failed: %s", exc)

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

    def invalidate(self, index: int | None = None) -> None:
        """Forget cached handles (of one GPU, or all), e.g. after the GPU count changed."""
        with self._lock:
            if index is None:
                self._gpus.clear()
            else:
                self._gpus.pop(index, None)

    # --- per-GPU state -------------------------------------------------------------

    def _load(self, index: int) -> _GpuHandle:
        if self._f_handle_by_index is None or self._f_uuid is None:
            raise _missing("nvmlDeviceGetHandleByIndex")
        function = "nvmlDeviceGetHandleByIndex"
        try:
            handle = self._f_handle_by_index(index)
            function = "nvmlDeviceGetUUID"
            uuid = _text(self._f_uuid(handle))
        except self._error_type as exc:
            raise self._translate(exc, function, index) from exc
        with self._lock:
            slow = self._slow_by_uuid.setdefault(uuid, {})
            gpu = _GpuHandle(index, handle, uuid, self._unsupported_by_uuid.get(uuid, 0), slow)
            self._gpus[index] = gpu
        return gpu

    def _forget(self, gpu: _GpuHandle) -> None:
        with self._lock:
            if self._gpus.get(gpu.index) is gpu:
                del self._gpus[gpu.index]

    def _mark_unsupported(self, gpu: _GpuHandle, bit: int) -> None:
        with self._lock:
            gpu.unsupported |= bit
            self._unsupported_by_uuid[gpu.uuid] = gpu.unsupported

    def _field_failed(
        self, gpu: _GpuHandle, bit: int, fn: Callable[..., Any], exc: BaseException
    ) -> None:
        code = self._code(exc)
        if code in _FIELD_UNSUPPORTED:
            self._mark_unsupported(gpu, bit)
            return
        name = getattr(fn, "__name__", "nvml")
        if code == NVML_ERROR_GPU_IS_LOST or code in _UNAVAILABLE_AFTER_INIT:
            self._forget(gpu)
            raise self._translate(exc, name, gpu.index, gpu.uuid) from exc
        if code == NVML_ERROR_RESET_REQUIRED:
            raise self._translate(exc, name, gpu.index, gpu.uuid) from exc
        if gpu.error is None:
            gpu.error = f"error: {name}: {exc} (NVML code {code})"

    def _read(self, gpu: _GpuHandle, bit: int, fn: Callable[..., Any] | None, *args: Any) -> Any:
        """One field: its value, or None when unsupported or failed (see _field_failed)."""
        if fn is None or gpu.unsupported & bit:
            return None
        try:
            return fn(gpu.handle, *args)
        except self._error_type as exc:
            self._field_failed(gpu, bit, fn, exc)
            return None

    def _opt(self, gpu: _GpuHandle, fn: Callable[..., Any] | None, *args: Any) -> Any:
        """An inventory field: like _read but not cached, and other errors are logged."""
        if fn is None:
            return None
        try:
            return fn(gpu.handle, *args)
        except self._error_type as exc:
            code = self._code(exc)
            if code in _FIELD_UNSUPPORTED:
                return None
            name = getattr(fn, "__name__", "nvml")
            if (
                code in (NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED)
                or code in _UNAVAILABLE_AFTER_INIT
            ):
                raise self._translate(exc, name, gpu.index, gpu.uuid) from exc
            log.warning("GPU %d (%s): %s failed: %s", gpu.index, gpu.uuid, name, exc)
            return None

    # --- system --------------------------------------------------------------------

    def system_info(self) -> SystemInfo:
        driver = self._system_field(self._f_driver_version, "nvmlSystemGetDriverVersion")
        cuda = self._system_field(self._f_cuda_version, "nvmlSystemGetCudaDriverVersion")
        nvml = self._system_field(self._f_nvml_version, "nvmlSystemGetNVMLVersion")
        return SystemInfo(
            driver_version=_text(driver) if driver is not None else None,
            cuda_driver_version=cuda_version_string(int(cuda)) if cuda is not None else None,
            nvml_version=_text(nvml) if nvml is not None else None,
        )

    def _system_field(self, fn: Callable[..., Any] | None, name: str) -> Any:
        if fn is None:
            return None
        try:
            return fn()
        except self._error_type as exc:
            if self._code(exc) in _FIELD_UNSUPPORTED:
                return None
            raise self._translate(exc, name) from exc

    def device_count(self) -> int:
        return int(self._call(self._f_count, "nvmlDeviceGetCount"))

    # --- inventory -----------------------------------------------------------------

    def gpu_info(self, index: int) -> GpuInfo:
        """Static facts about one GPU, without topology (see :meth:`inventory`)."""
        gpu = self._gpus.get(index) or self._load(index)
        return self._gpu_info(gpu)

    def _gpu_info(self, gpu: _GpuHandle) -> GpuInfo:
        opt = self._opt
        name = opt(gpu, self._f_name)
        memory = opt(gpu, self._f_memory)
        pci = opt(gpu, self._f_pci)
        minor = opt(gpu, self._f_minor)
        numa = opt(gpu, self._f_numa)
        serial = opt(gpu, self._f_serial)
        board_id = opt(gpu, self._f_board_id)
        capability = opt(gpu, self._f_compute_cap)
        module_id = opt(gpu, self._f_module_id)
        ecc_mode = opt(gpu, self._f_ecc_mode)
        supported_events = opt(gpu, self._f_supported_events)
        threshold = self._f_threshold
        shutdown = opt(gpu, threshold, self._c_threshold_shutdown)
        slowdown = opt(gpu, threshold, self._c_threshold_slowdown)
        gpu_max = opt(gpu, threshold, self._c_threshold_gpu_max)
        mem_max = opt(gpu, threshold, self._c_threshold_mem_max)
        return GpuInfo(
            uuid=gpu.uuid,
            index=gpu.index,
            minor=int(minor) if minor is not None else None,
            name=_text(name) if name is not None else "",
            memory_total_bytes=int(memory.total) if memory is not None else 0,
            pci_bus_id=_text(pci.busId) if pci is not None else "",
            # Some platforms answer -1 rather than NOT_SUPPORTED when there is no NUMA.
            numa_node=int(numa) if numa is not None and int(numa) >= 0 else None,
            cpu_affinity=self._cpu_affinity(gpu),
            serial=_text(serial) if serial is not None else None,
            board_id=int(board_id) if board_id is not None else None,
            compute_capability=(
                (int(capability[0]), int(capability[1])) if capability is not None else None
            ),
            ecc_enabled=(
                int(ecc_mode[0]) == self._c_feature_enabled if ecc_mode is not None else None
            ),
            temp_shutdown_c=_within(shutdown, CELSIUS_RANGE),
            temp_slowdown_c=_within(slowdown, CELSIUS_RANGE),
            temp_gpu_max_c=_within(gpu_max, CELSIUS_RANGE),
            temp_mem_max_c=_within(mem_max, CELSIUS_RANGE),
            supported_events=int(supported_events) if supported_events is not None else None,
            module_id=int(module_id) if module_id is not None else None,
        )

    def _cpu_affinity(self, gpu: _GpuHandle) -> list[int]:
        words = self._opt(gpu, self._f_affinity_scope, _CPU_SET_WORDS, self._c_affinity_scope_node)
        if words is None:
            words = self._opt(gpu, self._f_affinity, _CPU_SET_WORDS)
        return _affinity_cpus(words) if words is not None else []

    def _nvlinks(self, gpu: _GpuHandle) -> _LinkScan:
        """Active and down NVLinks of one GPU, per peer bus id and into NVSwitches.

        On NVSwitch systems (DGX/HGX) a GPU's links end at switches, never at a peer,
        and every GPU reaches every other one through the fabric; the pair count is
        then the smaller of the two GPUs' switch links (what ``nvidia-smi topo`` shows
        as NV18 on a DGX H100). A link is *down* when this adapter saw it active
        before (module docstring); it is counted where it led when it was up.
        """
        state = self._f_nvlink_state
        remote_pci = self._f_nvlink_remote_pci
        remote_type = self._f_nvlink_remote_type
        scan = _LinkScan()
        if state is None or remote_pci is None:
            return scan
        handle = gpu.handle
        with self._lock:
            seen = dict(self._nvlink_seen.get(gpu.uuid, {}))
        for link in range(self._c_nvlink_max_links):
            try:
                if not state(handle, link):
                    known = seen.get(link)
                    if known is not None:
                        scan.down.append(link)
                        if known[1]:
                            scan.down_switch += 1
                        else:
                            scan.down_direct[known[0]] = scan.down_direct.get(known[0], 0) + 1
                    continue
                bus = normalize_bus_id(_text(remote_pci(handle, link).busId))
            except self._error_type as exc:
                code = self._code(exc)
                if code in _FIELD_UNSUPPORTED:
                    if link == 0:  # no NVLink on this GPU at all
                        break
                    continue
                if code == NVML_ERROR_INVALID_ARGUMENT:  # beyond this GPU's last link
                    break
                raise self._translate(exc, "nvmlDeviceGetNvLinkState", gpu.index, gpu.uuid) from exc
            kind = None
            if remote_type is not None:
                try:
                    kind = remote_type(handle, link)
                except self._error_type as exc:
                    if self._code(exc) == NVML_ERROR_GPU_IS_LOST:
                        raise self._translate(
                            exc, "nvmlDeviceGetNvLinkRemoteDeviceType", gpu.index, gpu.uuid
                        ) from exc
            to_switch = kind == self._c_nvlink_switch
            seen[link] = (bus, to_switch)
            scan.up.append(link)
            if to_switch:
                scan.switch += 1
            else:
                scan.direct[bus] = scan.direct.get(bus, 0) + 1
        with self._lock:
            self._nvlink_seen[gpu.uuid] = seen
            self._nvlink_up[gpu.uuid] = frozenset(scan.up)
            self._nvlink_read_at[gpu.uuid] = time.monotonic()
        return scan

    def _nvlink_state_due(self, gpu: _GpuHandle, before: dict[str, Any], every_s: float) -> bool:
        """Whether this slow read re-reads link state: the first slow read (no counters
        to compare with yet), the error counters moved since the previous slow read,
        or ``every_s`` has passed since the last state read."""
        if before.get("slow_fields_at") is None or any(
            gpu.slow.get(field) != before.get(field) for field in NVLINK_ERROR_FIELDS
        ):
            return True
        last = self._nvlink_read_at.get(gpu.uuid)
        return last is None or time.monotonic() - last >= every_s

    def _read_nvlink_state(self, gpu: _GpuHandle) -> None:
        """Re-read the state of the links seen active before (the slow path).

        One ``nvmlDeviceGetNvLinkState`` per remembered link, nothing on a GPU without
        NVLink. A link whose state cannot be read keeps its last known state; a lost
        GPU or NVML gone raise as in :meth:`sample`.
        """
        fn = self._f_nvlink_state
        if fn is None or gpu.unsupported & _U_NVLINK_STATE:
            return
        with self._lock:
            links = sorted(self._nvlink_seen.get(gpu.uuid, {}))
            before = self._nvlink_up.get(gpu.uuid, frozenset())
        if not links:
            return
        up = set(before)
        for link in links:
            try:
                active = bool(fn(gpu.handle, link))
            except self._error_type as exc:
                code = self._code(exc)
                if code == NVML_ERROR_GPU_IS_LOST or code in _UNAVAILABLE_AFTER_INIT:
                    self._field_failed(gpu, _U_NVLINK_STATE, fn, exc)
                log.debug("GPU %d: state of NVLink %d unknown: %s", gpu.index, link, exc)
                continue
            if active:
                up.add(link)
            else:
                up.discard(link)
        with self._lock:
            self._nvlink_up[gpu.uuid] = frozenset(up)
            self._nvlink_read_at[gpu.uuid] = time.monotonic()

    def nvlinks_up(self, uuid: str) -> frozenset[int] | None:
        """The GPU's active NVLinks at the last read (None: never read)."""
        return self._nvlink_up.get(uuid)

    def _common_ancestor(self, a: _GpuHandle, b: _GpuHandle) -> int | None:
        fn = self._f_common_ancestor
        if fn is None:
            return None
        try:
            return int(fn(a.handle, b.handle))
        except self._error_type as exc:
            if self._code(exc) not in _FIELD_UNSUPPORTED:
                log.warning("topology of GPU %d and GPU %d unknown: %s", a.index, b.index, exc)
            return None

    def inventory(self, node: str, generation: int) -> Inventory:
        """The node's GPUs with their pairwise topology; see :meth:`inventory_report`."""
        return self.inventory_report(node, generation)[0]

    def inventory_report(self, node: str, generation: int) -> tuple[Inventory, dict[int, str]]:
        """The inventory, and the GPUs left out of it with the reason (by index).

        Re-fetches every handle: the GPU count or order may have changed since the last
        inventory. Raises :class:`NvmlUnavailable` only when NVML as a whole fails.
        """
        system = self.system_info()
        count = self.device_count()
        self.invalidate()
        skipped: dict[int, str] = {}
        unreadable: list[UnreadableGpu] = []
        found: list[tuple[_GpuHandle, GpuInfo]] = []
        for index in range(count):
            try:
                gpu = self._load(index)
                found.append((gpu, self._gpu_info(gpu)))
            except (GpuLostError, NvmlCallError) as exc:
                log.warning("GPU %d left out of the inventory: %s", index, exc)
                skipped[index] = str(exc)
                unreadable.append(self.unreadable(index, exc))

        links: list[_LinkScan] = []
        for gpu, _ in found:
            try:
                links.append(self._nvlinks(gpu))
            except (GpuLostError, NvmlCallError) as exc:
                log.warning("NVLinks of GPU %d unknown: %s", gpu.index, exc)
                links.append(_LinkScan())
                with self._lock:
                    # Unknown, not "none up": the collector must not rebuild the
                    # inventory again and again to compare with it.
                    self._nvlink_up.pop(gpu.uuid, None)

        buses = [normalize_bus_id(info.pci_bus_id) for _, info in found]
        peers: list[list[PeerLink]] = [[] for _ in found]
        for a in range(len(found)):
            gpu_a = found[a][0]
            for b in range(a + 1, len(found)):
                gpu_b = found[b][0]
                level = self._common_ancestor(gpu_a, gpu_b)
                nvlinks, down = _pair_links(links[a], links[b], buses[a], buses[b])
                peers[a].append(
                    PeerLink(
                        peer_uuid=gpu_b.uuid,
                        peer_index=gpu_b.index,
                        level=level,
                        nvlinks=nvlinks,
                        nvlinks_down=down,
                    )
                )
                peers[b].append(
                    PeerLink(
                        peer_uuid=gpu_a.uuid,
                        peer_index=gpu_a.index,
                        level=level,
                        nvlinks=nvlinks,
                        nvlinks_down=down,
                    )
                )

        gpus = [
            msgspec.structs.replace(
                info,
                topology=sorted(peers[i], key=lambda p: p.peer_index),
                nvlinks_up=links[i].up,
                nvlinks_down=links[i].down,
            )
            for i, (_, info) in enumerate(found)
        ]
        inventory = Inventory(
            node=node,
            generation=generation,
            driver_version=system.driver_version,
            cuda_driver_version=system.cuda_driver_version,
            nvml_version=system.nvml_version,
            gpus=gpus,
            nvml_backend=self.backend,
            published_at=time.time(),
            nvml_count=count,
            unreadable=unreadable,
        )
        return inventory, skipped

    def unreadable(self, index: int, error: NvmlError) -> UnreadableGpu:
        """What can still be read of a GPU that NVML counts but that could not be listed.

        A lost GPU stays in ``nvmlDeviceGetCount``; its handle, or the calls on it,
        fail with GPU_IS_LOST. Each identity field is tried on its own (a driver may
        still answer the PCI info it knew from the probe); what fails stays None.
        """
        uuid = error.uuid if isinstance(error, GpuLostError) else None
        bus = name = None
        handle = self._try(self._f_handle_by_index, index)
        if handle is not None:
            if uuid is None:
                text = self._try(self._f_uuid, handle)
                uuid = _text(text) if text else None
            pci = self._try(self._f_pci, handle)
            bus = _text(pci.busId) if pci is not None else None
            text = self._try(self._f_name, handle)
            name = _text(text) if text else None
        return UnreadableGpu(
            index=index,
            uuid=uuid,
            pci_bus_id=bus,
            name=name,
            lost=isinstance(error, GpuLostError),
            reason=str(error),
        )

    def _try(self, fn: Callable[..., Any] | None, *args: Any) -> Any:
        """A best-effort call: None when missing or failing (any NVML error)."""
        if fn is None:
            return None
        try:
            return fn(*args)
        except self._error_type:
            return None

    # --- samples -------------------------------------------------------------------

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
        """
        gpu = self._gpus.get(index) or self._load(index)
        gpu.error = None
        read = self._read
        utilization = read(gpu, _U_UTIL, self._f_utilization)
        memory = read(gpu, _U_MEM, self._f_memory)
        temperature = read(gpu, _U_TEMP, self._f_temperature, self._c_temperature_gpu)
        power = read(gpu, _U_POWER, self._f_power)
        sm_clock = read(gpu, _U_SM_CLOCK, self._f_clock, self._c_clock_sm)
        mem_clock = read(gpu, _U_MEM_CLOCK, self._f_clock, self._c_clock_mem)
        ecc = self._f_total_ecc
        corrected, uncorrected = self._c_corrected, self._c_uncorrected
        volatile, aggregate = self._c_volatile, self._c_aggregate
        ecc_vol_corr = read(gpu, _U_ECC_VOL_CORR, ecc, corrected, volatile)
        ecc_vol_uncorr = read(gpu, _U_ECC_VOL_UNCORR, ecc, uncorrected, volatile)
        remapped = read(gpu, _U_REMAP, self._f_remapped_rows)
        retired = read(gpu, _U_RETIRED, self._f_retired_pending)
        reasons = read(gpu, _U_EVENT_REASONS, self._f_event_reasons)
        if reasons is None and gpu.unsupported & _U_EVENT_REASONS:
            # Drivers before 535 only have the older name of the same call.
            reasons = read(gpu, _U_THROTTLE_REASONS, self._f_throttle_reasons)
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
                _within(utilization.gpu, PERCENT_RANGE) if utilization is not None else None
            ),
            mem_util_pct=(
                _within(utilization.memory, PERCENT_RANGE) if utilization is not None else None
            ),
            memory_used_bytes=memory.used if memory is not None else None,
            memory_free_bytes=memory.free if memory is not None else None,
            temperature_c=_within(temperature, CELSIUS_RANGE),
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
            **gpu.slow,
        )

    # --- slow fields -----------------------------------------------------------------

    def _read_slow(self, gpu: _GpuHandle, aggregate: int) -> None:
        """Read the slow fields into ``gpu.slow`` (errors as in :meth:`_read`)."""
        values: dict[str, Any] = {}
        # Aggregate ECC counts are the persistent (lifetime) ones: nothing acts on
        # them within seconds, and two calls per GPU per period are not free.
        ecc = self._f_total_ecc
        for field, bit, kind in (
            ("ecc_aggregate_corrected", _U_ECC_AGG_CORR, self._c_corrected),
            ("ecc_aggregate_uncorrected", _U_ECC_AGG_UNCORR, self._c_uncorrected),
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

    def _read_field_values(self, gpu: _GpuHandle) -> dict[str, Any]:
        fn = self._f_field_values
        if fn is None or gpu.unsupported & _U_FIELD_VALUES:
            return {}
        skip = self._fields_unsupported.get(gpu.uuid, frozenset())
        wanted = [(field, fid) for field, fid in self._slow_fields if fid not in skip]
        if not wanted:
            return {}
        try:
            answers = fn(gpu.handle, [fid for _, fid in wanted])
        except self._error_type as exc:
            self._field_failed(gpu, _U_FIELD_VALUES, fn, exc)
            return {}
        out: dict[str, Any] = {}
        unsupported: set[int] = set()
        for (field, fid), answer in zip(wanted, answers, strict=False):
            code = int(getattr(answer, "nvmlReturn", NVML_ERROR_UNKNOWN))
            if code != 0:
                if code in _FIELD_UNSUPPORTED:
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

    def _read_gpm(self, gpu: _GpuHandle) -> dict[str, Any]:
        """GPM activity since the previous slow read (nothing on the first one)."""
        support, alloc, get = self._f_gpm_support, self._f_gpm_alloc, self._f_gpm_get
        metrics_get, request_type = self._f_gpm_metrics, self._gpm_request_type
        if (
            support is None
            or alloc is None
            or get is None
            or metrics_get is None
            or request_type is None
            or gpu.unsupported & _U_GPM
        ):
            return {}
        try:
            state = self._gpm_by_uuid.get(gpu.uuid)
            if state is None:
                if not int(support(gpu.handle).isSupportedDevice):
                    self._mark_unsupported(gpu, _U_GPM)
                    return {}
                state = _GpmState()
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
            if code in _FIELD_UNSUPPORTED or code in (
                NVML_ERROR_GPU_IS_LOST,
                NVML_ERROR_RESET_REQUIRED,
                *_UNAVAILABLE_AFTER_INIT,
            ):
                self._field_failed(gpu, _U_GPM, get, exc)
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

    def uuid_of(self, index: int) -> str:
        """The UUID of the GPU at ``index`` (cached)."""
        return (self._gpus.get(index) or self._load(index)).uuid

    # --- events --------------------------------------------------------------------

    def create_event_set(self) -> Any:
        return self._call(self._f_event_set_create, "nvmlEventSetCreate")

    def free_event_set(self, event_set: Any) -> None:
        if self._f_event_set_free is None:
            return
        try:
            self._f_event_set_free(event_set)
        except self._error_type as exc:
            log.debug("nvmlEventSetFree failed: %s", exc)

    def _register(self, gpu: _GpuHandle, mask: int, event_set: Any) -> bool:
        fn = self._f_register_events
        if fn is None:
            return False
        try:
            fn(gpu.handle, mask, event_set)
        except self._error_type as exc:
            if self._code(exc) in _FIELD_UNSUPPORTED:
                return False
            raise self._translate(exc, "nvmlDeviceRegisterEvents", gpu.index, gpu.uuid) from exc
        return True

    def register_events(self, event_set: Any, index: int, wanted_mask: int) -> int:
        """Register the wanted event types the GPU supports; returns the registered mask.

        A GPU without event support gives 0, which is not an error. When registration
        of the whole mask says NOT_SUPPORTED (typically the ECC types with ECC off),
        the rest is registered without the ECC types, then type by type.
        """
        gpu = self._gpus.get(index) or self._load(index)
        supported = self._opt(gpu, self._f_supported_events)
        mask = wanted_mask & int(supported) if supported is not None else 0
        registered = 0
        if mask and self._register(gpu, mask, event_set):
            registered = mask
        elif mask:
            rest = mask & ~EVENT_ECC_MASK
            if rest and rest != mask and self._register(gpu, rest, event_set):
                registered = rest
            else:
                for bit_index in range(mask.bit_length()):
                    bit = 1 << bit_index
                    if mask & bit and self._register(gpu, bit, event_set):
                        registered |= bit
        if registered:
            with self._lock:
                self._event_devices[_handle_key(gpu.handle)] = (gpu.index, gpu.uuid)
        return registered

    def wait_event(self, event_set: Any, timeout_ms: int) -> NvmlEvent | None:
        """Wait for one event; None on timeout. Keep ``timeout_ms`` short for shutdown."""
        fn = self._f_event_wait
        if fn is None:
            raise _missing("nvmlEventSetWait_v2")
        try:
            data = fn(event_set, timeout_ms)
        except self._error_type as exc:
            if self._code(exc) == NVML_ERROR_TIMEOUT:
                return None
            raise self._translate(exc, "nvmlEventSetWait_v2") from exc
        index: int | None
        uuid: str | None
        who = self._event_devices.get(_handle_key(data.device))
        if who is not None:
            index, uuid = who
        else:
            index, uuid = self._identify(data.device)
        return NvmlEvent(
            gpu_index=index,
            gpu_uuid=uuid,
            event_type=int(data.eventType),
            event_data=int(data.eventData),
            timestamp=time.time(),
        )

    def _identify(self, handle: Any) -> tuple[int | None, str | None]:
        if self._f_uuid is None:
            return None, None
        try:
            uuid = _text(self._f_uuid(handle))
        except self._error_type:
            return None, None
        for gpu in list(self._gpus.values()):
            if gpu.uuid == uuid:
                return gpu.index, uuid
        return None, uuid
