"""The exceptions of the NVML adapter.

Why our own types
-----------------
``pynvml`` raises one ``NVMLError`` subclass per return code. Callers (collector,
health service) do not care about twenty codes; they care about four situations,
each with its own reaction:

* :class:`NvmlUnavailable` -- NVML as a whole cannot be used (library missing, driver
  not loaded, no permission, not initialised, library/driver mismatch). The service
  keeps running *degraded* and publishes the reason.
* :class:`GpuLostError` -- one GPU is gone (``GPU_IS_LOST``, fallen off the bus). The
  other GPUs are fine.
* :class:`GpuResetRequired` -- one GPU answers but needs a reset first.
* :class:`NvmlCallError` -- anything else, naming the NVML function and code.

``NOT_SUPPORTED`` never becomes an exception: the adapter turns it into a ``None``
field, because an unsupported counter is a property of the hardware, not a failure.

Layering: this module depends on nothing, so that both the adapter and its callers
can import it without pulling in ``pynvml``.
"""

from __future__ import annotations

# NVML return codes the adapter reacts to. They are fixed by the NVML C API, so
# hard-coding them keeps this module free of a pynvml import.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999

# Codes that mean "NVML as a whole is unusable", with the sentence an operator reads
# in the degraded reason.
UNAVAILABLE_REASONS: dict[int, str] = {
    NVML_ERROR_LIBRARY_NOT_FOUND: (
        "NVML library not found (libnvidia-ml.so.1 could not be loaded: no NVIDIA driver "
        "on this host, or the container was not started with the NVIDIA runtime)"
    ),
    NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
    NVML_ERROR_NO_PERMISSION: "no permission to open the NVIDIA devices (/dev/nvidia*)",
    NVML_ERROR_UNINITIALIZED: "NVML is not initialised",
    NVML_ERROR_FUNCTION_NOT_FOUND: (
        "a required NVML function is missing (driver older than the Python bindings)"
    ),
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "NVML library and kernel driver versions differ (reload the driver or reboot)"
    ),
}


class NvmlError(Exception):
    """Base of every exception raised by the adapter."""


class NvmlUnavailable(NvmlError):
    """NVML cannot be used at all; the service should run degraded and say why."""

    def __init__(self, reason: str, code: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


class GpuLostError(NvmlError):
    """One GPU is lost (``GPU_IS_LOST``, fallen off the bus).

    ``index`` and ``uuid`` are None when NVML did not say which GPU, as happens when
    ``nvmlEventSetWait`` itself reports the loss.
    """

    def __init__(self, index: int | None, uuid: str | None, detail: str = "") -> None:
        what = f"GPU {index if index is not None else '?'}"
        if uuid:
            what += f" ({uuid})"
        super().__init__(f"{what} is lost" + (f": {detail}" if detail else ""))
        self.index = index
        self.uuid = uuid
        self.detail = detail


class NvmlCallError(NvmlError):
    """An NVML call failed with a code that has no dedicated exception."""

    def __init__(self, function: str, code: int, message: str, index: int | None = None) -> None:
        where = f" on GPU {index}" if index is not None else ""
        super().__init__(f"{function}{where} failed: {message} (NVML code {code})")
        self.function = function
        self.code = code
        self.message = message
        self.index = index


class GpuResetRequired(NvmlCallError):
    """The GPU answers ``RESET_REQUIRED``: it must be reset before it is usable."""
