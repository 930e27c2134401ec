"""What every piece of the NVML adapter shares: binding, error translation, the GPU cache.

Binding
-------
Every NVML function is looked up once, at construction, by the piece that calls it
(:meth:`NvmlCalls._bind`). A function the bindings lack (old ``nvidia-ml-py``) is bound
to ``None`` and its field reads as unsupported, like ``NVML_ERROR_FUNCTION_NOT_FOUND``.

Error translation
-----------------
:meth:`NvmlCalls._translate`: ``NOT_SUPPORTED`` (and ``FUNCTION_NOT_FOUND`` /
``NO_PERMISSION`` on a single field) give ``None``; ``GPU_IS_LOST`` gives
:class:`GpuLostError`; the codes that mean "NVML is gone" give :class:`NvmlUnavailable`;
the rest give :class:`NvmlCallError`.

Per-GPU state
-------------
:class:`GpuHandle`: the cached handle and UUID, and a bit mask of the fields NVML said
it does not support (the ``U_*`` bits, one list for every piece), so that the sampling
hot path never calls them again. The mask is kept by UUID, so it survives a handle
re-fetch. A field that fails unexpectedly drops the cached handle: the next call
fetches it again (the adapter's only retry; callers decide when to call again).

Handles of a previous enumeration
---------------------------------
A GPU that disappears and comes back (a reset that re-enumerates it, a driver reload, a
hot-plug) is a new device to NVML: the handle cached for its index is void and answers
``INVALID_ARGUMENT``, and the index may now belong to another GPU. The inventory and the
health scan drop every cached handle before they read (:meth:`NvmlCalls.invalidate`);
a sample whose cached handle answers ``INVALID_ARGUMENT`` fetches the handle again and
reads once more (:meth:`~.sampling.Sampler.sample`), and event registration always
fetches a fresh handle (:meth:`~.events.EventReader.register_events`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any, Final, Literal

import msgspec

from gpulet_common.messages import GpuInfo, MigSample
from gpulet_common.nvml.errors import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_ERROR_UNKNOWN,
    UNAVAILABLE_REASONS,
    GpuLostError,
    GpuResetRequired,
    NvmlCallError,
    NvmlError,
    NvmlUnavailable,
)

log = logging.getLogger("gpulet.nvml")

Backend = Literal["nvml", "mock"]

# Codes that, on a single field read, mean "this GPU/driver cannot give this field".
# They do not change while the process runs, so the field is never asked again.
FIELD_UNSUPPORTED: Final = frozenset(
    {NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_NO_PERMISSION}
)
# During nvmlInit, NO_PERMISSION and FUNCTION_NOT_FOUND mean NVML is unusable; on a
# later call they concern one function only.
UNAVAILABLE_AFTER_INIT: Final = frozenset(UNAVAILABLE_REASONS) - {
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_FUNCTION_NOT_FOUND,
}


# Bits of GpuHandle.unsupported, one per NVML call read per GPU; one list for every
# piece of the adapter, so that a new piece takes the next free bit.
U_UTIL: Final = 1 << 0
U_MEM: Final = 1 << 1
U_TEMP: Final = 1 << 2
U_POWER: Final = 1 << 3
U_SM_CLOCK: Final = 1 << 4
U_MEM_CLOCK: Final = 1 << 5
U_ECC_VOL_CORR: Final = 1 << 6
U_ECC_VOL_UNCORR: Final = 1 << 7
U_ECC_AGG_CORR: Final = 1 << 8
U_ECC_AGG_UNCORR: Final = 1 << 9
U_REMAP: Final = 1 << 10
U_RETIRED: Final = 1 << 11
U_EVENT_REASONS: Final = 1 << 12
U_THROTTLE_REASONS: Final = 1 << 13
U_FIELD_VALUES: Final = 1 << 14
U_GPM: Final = 1 << 15
U_NVLINK_STATE: Final = 1 << 16


class SystemInfo(msgspec.Struct, frozen=True, kw_only=True):
    driver_version: str | None = None
    # "12.4" for NVML's integer 12040.
    cuda_driver_version: str | None = None
    nvml_version: str | None = None


class GpuHandle:
    """What the adapter remembers about one GPU between calls."""

    __slots__ = ("error", "error_code", "handle", "index", "slow", "unsupported", "uuid")

    def __init__(
        self, index: int, handle: Any, uuid: str, unsupported: int, slow: dict[str, Any]
    ) -> None:
        self.index = index
        self.handle = handle
        self.uuid = uuid
        self.unsupported = unsupported
        # First unexpected (non-fatal) field error of the current sample.
        self.error: str | None = None
        self.error_code: int | None = None
        # The last slow fields read (GpuSample field -> value), "slow_fields_at" included;
        # shared with the adapter's per-UUID memory so a handle re-fetch keeps them.
        self.slow = slow


def within(value: Any, bounds: tuple[int, int]) -> int | None:
    """An NVML reading inside the wire range of its field, else None (as unsupported):
    consumers refuse a whole message over one value out of range."""
    if value is None:
        return None
    number = int(value)
    return number if bounds[0] <= number <= bounds[1] else None


def text(value: Any) -> str:
    # nvidia-ml-py >= 11 decodes char buffers to str; older ones returned bytes.
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def cuda_version_string(version: int) -> str:
    """NVML's CUDA driver version integer (12040) as "12.4"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def handle_key(handle: Any) -> Any:
    """A hashable identity of a device handle, equal for two handles of one GPU.

    pynvml handles are ctypes pointers: a new Python object per call (event data
    included), so they are compared by address. Mock handles are plain objects
    returned unchanged by every call, so they are their own key.
    """
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def missing_function(function: str) -> NvmlUnavailable:
    reason = UNAVAILABLE_REASONS[NVML_ERROR_FUNCTION_NOT_FOUND]
    return NvmlUnavailable(f"{reason} [{function}]", NVML_ERROR_FUNCTION_NOT_FOUND)


class NvmlCalls:
    """The binding, error translation and per-GPU cache every piece of the adapter uses."""

    def __init__(self, nvml_module: Any, backend: Backend = "nvml") -> None:
        self._nvml = nvml_module
        self.backend: Backend = backend
        self._error_type: type[BaseException] = nvml_module.NVMLError
        self._lock = threading.Lock()
        self._gpus: dict[int, GpuHandle] = {}
        self._unsupported_by_uuid: dict[str, int] = {}
        self._slow_by_uuid: dict[str, dict[str, Any]] = {}
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
        # Read by more than one piece: inventory and samples, inventory and events.
        self._f_memory = bind("nvmlDeviceGetMemoryInfo")
        self._f_supported_events = bind("nvmlDeviceGetSupportedEventTypes")

    # --- binding and error translation ----------------------------------------

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
        unavailable_codes: frozenset[int] = UNAVAILABLE_AFTER_INIT,
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
            raise missing_function(name)
        try:
            return fn(*args)
        except self._error_type as exc:
            raise self._translate(exc, name) from exc

    def _try(self, fn: Callable[..., Any] | None, *args: Any) -> Any:
        """A best-effort call: None when missing or failing (any NVML error)."""
        if fn is None:
            return None
        try:
            return fn(*args)
        except self._error_type:
            return None

    # --- lifecycle ------------------------------------------------------------

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
            raise missing_function("nvmlInit")
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
        self._initialized = True

    def shutdown(self) -> None:
        """Release NVML. Errors are logged, never raised: this runs on the way out."""
        self._initialized = False
        self.invalidate()
        if self._f_shutdown is None:
            return
        try:
            self._f_shutdown()
        except self._error_type as exc:
            log.debug("nvmlShutdown failed: %s", exc)

    def invalidate(self, index: int | None = None) -> None:
        """Forget cached handles (of one GPU, or all), e.g. after the GPU count changed."""
        with self._lock:
            if index is None:
                self._gpus.clear()
            else:
                self._gpus.pop(index, None)

    # --- per-GPU state --------------------------------------------------------

    def _load(self, index: int) -> GpuHandle:
        if self._f_handle_by_index is None or self._f_uuid is None:
            raise missing_function("nvmlDeviceGetHandleByIndex")
        function = "nvmlDeviceGetHandleByIndex"
        try:
            handle = self._f_handle_by_index(index)
            function = "nvmlDeviceGetUUID"
            uuid = text(self._f_uuid(handle))
        except self._error_type as exc:
            raise self._translate(exc, function, index) from exc
        with self._lock:
            slow = self._slow_by_uuid.setdefault(uuid, {})
            gpu = GpuHandle(index, handle, uuid, self._unsupported_by_uuid.get(uuid, 0), slow)
            self._gpus[index] = gpu
        return gpu

    def _forget(self, gpu: GpuHandle) -> None:
        with self._lock:
            if self._gpus.get(gpu.index) is gpu:
                del self._gpus[gpu.index]

    def _mark_unsupported(self, gpu: GpuHandle, bit: int) -> None:
        with self._lock:
            gpu.unsupported |= bit
            self._unsupported_by_uuid[gpu.uuid] = gpu.unsupported

    def _field_failed(
        self, gpu: GpuHandle, bit: int, fn: Callable[..., Any], exc: BaseException
    ) -> None:
        code = self._code(exc)
        if code in FIELD_UNSUPPORTED:
            self._mark_unsupported(gpu, bit)
            return
        name = getattr(fn, "__name__", "nvml")
        if code == NVML_ERROR_GPU_IS_LOST or code in UNAVAILABLE_AFTER_INIT:
            self._forget(gpu)
            raise self._translate(exc, name, gpu.index, gpu.uuid) from exc
        if code == NVML_ERROR_RESET_REQUIRED:
            raise self._translate(exc, name, gpu.index, gpu.uuid) from exc
        if gpu.error is None:
            gpu.error = f"error: {name}: {exc} (NVML code {code})"
            gpu.error_code = code

    def _read(self, gpu: GpuHandle, bit: int, fn: Callable[..., Any] | None, *args: Any) -> Any:
        """One field: its value, or None when unsupported or failed (see _field_failed)."""
        if fn is None or gpu.unsupported & bit:
            return None
        try:
            return fn(gpu.handle, *args)
        except self._error_type as exc:
            self._field_failed(gpu, bit, fn, exc)
            return None

    def _opt(
        self, gpu: GpuHandle, fn: Callable[..., Any] | None, *args: Any, on: Any = None
    ) -> Any:
        """An inventory field: like _read but not cached, and other errors are logged.

        ``on``: call it on another handle of the GPU (a MIG device's) than its own."""
        if fn is None:
            return None
        try:
            return fn(gpu.handle if on is None else on, *args)
        except self._error_type as exc:
            code = self._code(exc)
            if code in FIELD_UNSUPPORTED:
                return None
            name = getattr(fn, "__name__", "nvml")
            self._raise_if_gone(gpu, exc, name)
            log.warning("GPU %d (%s): %s failed: %s", gpu.index, gpu.uuid, name, exc)
            return None

    def _raise_if_gone(self, gpu: GpuHandle, exc: BaseException, function: str) -> None:
        """Raise the translated error when ``exc`` says the GPU is lost or needs a reset,
        or NVML itself is gone: what no single field read may swallow."""
        code = self._code(exc)
        if code in (NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED) or (
            code in UNAVAILABLE_AFTER_INIT
        ):
            raise self._translate(exc, function, gpu.index, gpu.uuid) from exc

    def _extend_info(self, gpu: GpuHandle, info: GpuInfo) -> GpuInfo:
        """What a piece adds to a GPU's static facts (:mod:`.mig`); each piece that
        overrides it calls ``super()`` first."""
        return info

    def _mig_samples(self, gpu: GpuHandle) -> list[MigSample]:
        """A reading of each MIG device of the GPU, for its sample (:mod:`.mig`)."""
        return []

    def uuid_of(self, index: int) -> str:
        """The UUID of the GPU at ``index`` (cached)."""
        return (self._gpus.get(index) or self._load(index)).uuid

    # --- system ---------------------------------------------------------------

    def system_info(self) -> SystemInfo:
        driver = self._system_field(self._f_driver_version, "nvmlSystemGetDriverVersion")
        cuda = self._system_field(self._f_cuda_version, "nvmlSystemGetCudaDriverVersion")
        nvml = self._system_field(self._f_nvml_version, "nvmlSystemGetNVMLVersion")
        return SystemInfo(
            driver_version=text(driver) if driver is not None else None,
            cuda_driver_version=cuda_version_string(int(cuda)) if cuda is not None else None,
            nvml_version=text(nvml) if nvml is not None else None,
        )

    def _system_field(self, fn: Callable[..., Any] | None, name: str) -> Any:
        if fn is None:
            return None
        try:
            return fn()
        except self._error_type as exc:
            if self._code(exc) in FIELD_UNSUPPORTED:
                return None
            raise self._translate(exc, name) from exc

    def device_count(self) -> int:
        return int(self._call(self._f_count, "nvmlDeviceGetCount"))
