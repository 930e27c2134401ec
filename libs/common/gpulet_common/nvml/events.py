"""The NVML adapter's events piece: event types, registration per GPU, and the wait.

The event types the health service listens to are taken from ``pynvml`` where it
defines them (the fallbacks are the NVML C header's values) and read by name
(:attr:`NvmlEvent.kinds`), never by bit. Registration asks only for the types a GPU
supports, and falls back type by type when NVML refuses a mask (the ECC types with ECC
off). ``nvmlEventSetWait_v2`` blocks a thread: callers keep its timeout short so that
shutdown stays prompt. NVML's event data carries a device handle and no time: the
handle is resolved to the GPU's index and UUID, the time is when the wait returned.
"""

from __future__ import annotations

import time
from typing import Any, Final, Literal

import msgspec

from gpulet_common.nvml.calls import (
    FIELD_UNSUPPORTED,
    Backend,
    GpuHandle,
    NvmlCalls,
    handle_key,
    log,
    missing_function,
    text,
)
from gpulet_common.nvml.errors import NVML_ERROR_TIMEOUT

try:
    import pynvml as _pynvml
except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
    _pynvml = None


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


# nvmlEventData_t's gpuInstanceId / computeInstanceId when the event is the whole GPU's.
_NO_INSTANCE: Final = 0xFFFFFFFF


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
    # The MIG device the event belongs to (the event data's GPU-instance and
    # compute-instance ids); None: the whole GPU (NVML's 0xFFFFFFFF) or not said.
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    @property
    def xid(self) -> int | None:
        """The XID number when this is an XID event and nothing else, None otherwise."""
        return self.event_data if self.event_type == EVENT_XID else None

    @property
    def kinds(self) -> frozenset[EventKind]:
        """The event's types by name (an unknown bit has none)."""
        return frozenset(name for bit, name in EVENT_KINDS.items() if self.event_type & bit)


def _instance_id(data: Any, field: str) -> int | None:
    """A MIG instance id of event data; None for NVML's "none" (0xFFFFFFFF) or absent."""
    value = getattr(data, field, None)
    if not isinstance(value, int) or value == _NO_INSTANCE:
        return None
    return value


class EventReader(NvmlCalls):
    """NVML events: registration per GPU, and the blocking wait."""

    def __init__(self, nvml_module: Any, backend: Backend = "nvml") -> None:
        super().__init__(nvml_module, backend)
        self._event_devices: dict[Any, tuple[int, str]] = {}
        bind = self._bind
        self._f_event_set_create = bind("nvmlEventSetCreate")
        self._f_register_events = bind("nvmlDeviceRegisterEvents")
        self._f_event_wait = bind("nvmlEventSetWait_v2") or bind("nvmlEventSetWait")
        self._f_event_set_free = bind("nvmlEventSetFree")

    def create_event_set(self) -> Any:
        return self._call(self._f_event_set_create, "nvmlEventSetCreate")

    def free_event_set(self, event_set: Any) -> None:
        if self._f_event_set_free is None:
            return
        try:
            self._f_event_set_free(event_set)
        except self._error_type as exc:
            log.debug("nvmlEventSetFree failed: %s", exc)

    def _register(self, gpu: GpuHandle, mask: int, event_set: Any) -> bool:
        fn = self._f_register_events
        if fn is None:
            return False
        try:
            fn(gpu.handle, mask, event_set)
        except self._error_type as exc:
            if self._code(exc) in FIELD_UNSUPPORTED:
                return False
            raise self._translate(exc, "nvmlDeviceRegisterEvents", gpu.index, gpu.uuid) from exc
        return True

    def register_events(self, event_set: Any, index: int, wanted_mask: int) -> int:
        """Register the wanted event types the GPU supports; returns the registered mask.

        A GPU without event support gives 0, which is not an error. When registration
        of the whole mask says NOT_SUPPORTED (typically the ECC types with ECC off),
        the rest is registered without the ECC types, then type by type.

        The handle is fetched afresh: a cached one may be of a previous enumeration (a
        GPU that went and came back), and registering with it would silently watch
        nothing.
        """
        gpu = self._load(index)
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
                self._event_devices[handle_key(gpu.handle)] = (gpu.index, gpu.uuid)
        return registered

    def wait_event(self, event_set: Any, timeout_ms: int) -> NvmlEvent | None:
        """Wait for one event; None on timeout. Keep ``timeout_ms`` short for shutdown."""
        fn = self._f_event_wait
        if fn is None:
            raise missing_function("nvmlEventSetWait_v2")
        try:
            data = fn(event_set, timeout_ms)
        except self._error_type as exc:
            if self._code(exc) == NVML_ERROR_TIMEOUT:
                return None
            raise self._translate(exc, "nvmlEventSetWait_v2") from exc
        index: int | None
        uuid: str | None
        who = self._event_devices.get(handle_key(data.device))
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
            gpu_instance_id=_instance_id(data, "gpuInstanceId"),
            compute_instance_id=_instance_id(data, "computeInstanceId"),
        )

    def _identify(self, handle: Any) -> tuple[int | None, str | None]:
        if self._f_uuid is None:
            return None, None
        try:
            uuid = text(self._f_uuid(handle))
        except self._error_type:
            return None, None
        for gpu in list(self._gpus.values()):
            if gpu.uuid == uuid:
                return gpu.index, uuid
        return None, uuid
