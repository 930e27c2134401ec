"""Access to NVML: the adapter (the only caller of ``pynvml``), its errors and the loader.

See :mod:`.adapter` for the design; :func:`open_nvml` is where services start.
"""

from gpulet_common.nvml.adapter import (
    EVENT_CLOCK,
    EVENT_DOUBLE_BIT_ECC,
    EVENT_ECC_MASK,
    EVENT_GPU_UNAVAILABLE,
    EVENT_PSTATE,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID,
    HEALTH_EVENT_MASK,
    NvmlAdapter,
    NvmlEvent,
    SystemInfo,
    cuda_version_string,
    normalize_bus_id,
)
from gpulet_common.nvml.errors import (
    GpuLostError,
    GpuResetRequired,
    NvmlCallError,
    NvmlError,
    NvmlUnavailable,
)
from gpulet_common.nvml.loader import MOCK_HINT, open_mock, open_nvml, parse_nvml_flag

__all__ = [
    "EVENT_CLOCK",
    "EVENT_DOUBLE_BIT_ECC",
    "EVENT_ECC_MASK",
    "EVENT_GPU_UNAVAILABLE",
    "EVENT_PSTATE",
    "EVENT_SINGLE_BIT_ECC",
    "EVENT_XID",
    "HEALTH_EVENT_MASK",
    "MOCK_HINT",
    "GpuLostError",
    "GpuResetRequired",
    "NvmlAdapter",
    "NvmlCallError",
    "NvmlError",
    "NvmlEvent",
    "NvmlUnavailable",
    "SystemInfo",
    "cuda_version_string",
    "normalize_bus_id",
    "open_mock",
    "open_nvml",
    "parse_nvml_flag",
]
