"""The NVML adapter: the only code of gpulet that calls NVML.

Why an adapter
--------------
NVML speaks in return codes, ctypes structures and opaque handles, and differs by
driver generation (a function may be missing, a counter may be unsupported). The
services want typed answers -- :class:`~gpulet_common.messages.GpuInfo`,
:class:`~gpulet_common.messages.Inventory`, :class:`~gpulet_common.messages.GpuSample`
-- and four kinds of failure (see :mod:`gpulet_common.nvml.errors`). The adapter is
the translation layer between the two, and nothing else in gpulet imports ``pynvml``.

The NVML module is a constructor parameter
------------------------------------------
:class:`NvmlAdapter` never imports ``pynvml`` itself: it receives a module-like
object. In production that is ``pynvml``; in tests and on machines without a GPU it
is :class:`gpulet_common.mock_nvml.MockNvml`, which has the same function names, the
same return shapes and raises the real ``pynvml.NVMLError`` subclasses. So the mock
exercises exactly the code that runs against the driver.

Pieces, one concern each
------------------------
:class:`NvmlAdapter` is the sum of pieces that share one base and nothing else:

* :mod:`.calls` (:class:`~.calls.NvmlCalls`, the base): binding NVML's functions, error
  translation, the per-GPU cache (handles, unsupported fields; a failed field drops the
  cached handle so the next call fetches it again), the lifecycle and the system facts;
* :mod:`.topology` (:class:`~.topology.NvLinkReader`): NVLink state and PCIe levels;
* :mod:`.inventory` (:class:`~.inventory.InventoryReader`): the node's GPUs, and the
  GPUs NVML counts that cannot be read;
* :mod:`.sampling` (:class:`~.sampling.Sampler`): samples, field values and GPM;
* :mod:`.events` (:class:`~.events.EventReader`): event registration and the wait;
* :mod:`.mig` (:class:`~.mig.MigReader`): MIG mode and MIG devices, added to each GPU's
  facts through the base's ``_extend_info`` hook.

Each piece binds the NVML functions it calls and keeps its own caches; a new concern
is a new piece beside these, listed in the bases of :class:`NvmlAdapter`.

Threading
---------
All methods block; callers run them in worker threads, several at a time (one GPU
per thread, so that a hung GPU delays only itself). No lock is ever held while NVML
is called: the lock only guards the short updates of the caches. Lookups in the
caches are plain ``dict.get`` calls, which are atomic. Two threads sampling the
*same* GPU at once are safe but may both call an unsupported function once more.
"""

from __future__ import annotations

from typing import Any

from gpulet_common.nvml.calls import Backend, SystemInfo, cuda_version_string, handle_key
from gpulet_common.nvml.events import (
    EVENT_CLOCK,
    EVENT_DOUBLE_BIT_ECC,
    EVENT_ECC_MASK,
    EVENT_GPU_UNAVAILABLE,
    EVENT_KINDS,
    EVENT_PSTATE,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID,
    HEALTH_EVENT_MASK,
    EventKind,
    EventReader,
    NvmlEvent,
)
from gpulet_common.nvml.inventory import InventoryReader
from gpulet_common.nvml.mig import MigReader
from gpulet_common.nvml.sampling import (
    CLOCK_EVENT_HW_POWER_BRAKE,
    CLOCK_EVENT_HW_SLOWDOWN,
    CLOCK_EVENT_HW_THERMAL,
    CLOCK_EVENT_NAMES,
    CLOCK_EVENT_SW_POWER_CAP,
    CLOCK_EVENT_SW_THERMAL,
    CLOCK_EVENTS_HW_SLOWDOWN,
    CLOCK_EVENTS_THERMAL,
    GPM_METRIC_IDS,
    SLOW_FIELD_IDS,
    Sampler,
    clock_event_names,
)
from gpulet_common.nvml.topology import NVLINK_ERROR_FIELDS, normalize_bus_id

# What gpulet imports from here; each name lives in the piece that owns it.
__all__ = [
    "CLOCK_EVENTS_HW_SLOWDOWN",
    "CLOCK_EVENTS_THERMAL",
    "CLOCK_EVENT_HW_POWER_BRAKE",
    "CLOCK_EVENT_HW_SLOWDOWN",
    "CLOCK_EVENT_HW_THERMAL",
    "CLOCK_EVENT_NAMES",
    "CLOCK_EVENT_SW_POWER_CAP",
    "CLOCK_EVENT_SW_THERMAL",
    "EVENT_CLOCK",
    "EVENT_DOUBLE_BIT_ECC",
    "EVENT_ECC_MASK",
    "EVENT_GPU_UNAVAILABLE",
    "EVENT_KINDS",
    "EVENT_PSTATE",
    "EVENT_SINGLE_BIT_ECC",
    "EVENT_XID",
    "GPM_METRIC_IDS",
    "HEALTH_EVENT_MASK",
    "NVLINK_ERROR_FIELDS",
    "SLOW_FIELD_IDS",
    "Backend",
    "EventKind",
    "NvmlAdapter",
    "NvmlEvent",
    "SystemInfo",
    "clock_event_names",
    "cuda_version_string",
    "handle_key",
    "normalize_bus_id",
]


class NvmlAdapter(MigReader, InventoryReader, Sampler, EventReader):
    """Typed, thread-safe access to NVML (real ``pynvml`` or the mock): every piece."""

    def __init__(self, nvml_module: Any, backend: Backend = "nvml") -> None:
        super().__init__(nvml_module, backend)
