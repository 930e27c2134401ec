"""Per-call NVML latency for the mock: what each call costs on a real GPU.

Why
---
A mock that answers every call in microseconds hides what sampling really costs. On a
real H100 (measured for gpulet on an H100 80GB HBM3, driver 580.159.04, CUDA 13.0,
nvidia-ml-py 13.615.71: the figures of the profile table below; the calls are NVIDIA's,
https://docs.nvidia.com/deploy/nvml-api/) the first read of a field travels to the GPU's
firmware and costs milliseconds, later reads are cheap, and a few calls stay dear on
every read (thresholds, ECC mode, the energy counter, field-value batches). The ``h100``
profile replays those figures, so that benchmarks and the slow-cadence design can be
judged against the mock honestly.

How the time is spent
---------------------
Real NVML spends the time *on the calling thread, as CPU* (CPU time equalled wall
time in every measurement) and outside Python's GIL (ctypes releases it). The mock
does the same: it hashes a 4 KiB buffer until the thread's CPU clock has advanced by
the call's cost. ``hashlib`` releases the GIL for buffers over 2 KiB, so eight GPUs
read from eight threads spend their latency in parallel, as on real hardware, and a
CPU meter sees the cost.

Profile table
-------------
Each entry is ``(first_call_ms, later_calls_ms)`` as (low, high) ranges; the cost of
one call is drawn uniformly (seeded, deterministic) from the range. "First" is per
(function, GPU, arguments): reading GPU 0's SM clock first does not warm GPU 0's
memory clock. Functions not in the table cost :data:`DEFAULT_MS`. GPM costs were
*not* measured on the real H100 and are an estimate, marked as such below.
"""

from __future__ import annotations

import functools
import hashlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Final

Range = tuple[float, float]

_IDENTITY: Final[tuple[Range, Range]] = ((0.05, 0.17), (0.015, 0.05))
_FIRMWARE: Final[tuple[Range, Range]] = ((1.5, 3.6), (0.01, 0.09))
_NOT_SUPPORTED_ON_H100: Final[tuple[Range, Range]] = ((0.2, 0.7), (0.07, 0.14))

H100: Final[dict[str, tuple[Range, Range]]] = {
    # Identity: 15-50 µs once warm.
    "nvmlDeviceGetCount": _IDENTITY,
    "nvmlDeviceGetHandleByIndex": _IDENTITY,
    "nvmlDeviceGetHandleByUUID": _IDENTITY,
    "nvmlDeviceGetHandleByPciBusId": _IDENTITY,
    "nvmlDeviceGetUUID": _IDENTITY,
    "nvmlDeviceGetPciInfo": _IDENTITY,
    "nvmlDeviceGetPciInfo_v3": _IDENTITY,
    "nvmlDeviceGetName": _IDENTITY,
    "nvmlDeviceGetMinorNumber": _IDENTITY,
    "nvmlDeviceGetIndex": _IDENTITY,
    # Firmware round trips: dear the first time, then cached by the driver.
    "nvmlDeviceGetTemperature": _FIRMWARE,
    "nvmlDeviceGetPowerUsage": _FIRMWARE,
    "nvmlDeviceGetClockInfo": _FIRMWARE,
    "nvmlDeviceGetTotalEccErrors": _FIRMWARE,
    "nvmlDeviceGetRemappedRows": _FIRMWARE,
    "nvmlDeviceGetCurrentClocksEventReasons": _FIRMWARE,
    "nvmlDeviceGetCurrentClocksThrottleReasons": _FIRMWARE,
    "nvmlDeviceGetUtilizationRates": _FIRMWARE,
    "nvmlDeviceGetMemoryInfo": ((0.16, 0.16), (0.17, 0.19)),
    "nvmlDeviceGetRetiredPagesPendingStatus": _NOT_SUPPORTED_ON_H100,
    "nvmlDeviceGetNumaNodeId": _NOT_SUPPORTED_ON_H100,
    # Dear on every call.
    "nvmlDeviceGetTemperatureThreshold": ((0.65, 0.65), (0.66, 0.70)),
    "nvmlDeviceGetEccMode": ((2.1, 2.1), (0.58, 0.62)),
    "nvmlDeviceGetTotalEnergyConsumption": ((3.5, 3.5), (3.5, 6.5)),
    # 12 fields measured 4.8 ms every time.
    "nvmlDeviceGetFieldValues": ((4.8, 4.8), (4.6, 5.0)),
    "nvmlDeviceGetCpuAffinity": ((15.6, 15.6), (0.06, 0.06)),
    "nvmlDeviceGetCpuAffinityWithinScope": ((15.6, 15.6), (0.06, 0.06)),
    "nvmlDeviceGetModuleId": ((0.3, 0.45), (0.3, 0.45)),
    # ESTIMATE, not measured (the measured H100 was a PCIe card without NVLink): the
    # state of one link, assumed a round trip to the GPU's firmware on every call, as
    # dear as nvmlDeviceGetEccMode (the measured call closest in kind).
    "nvmlDeviceGetNvLinkState": ((0.58, 0.62), (0.58, 0.62)),
    # ESTIMATE, not measured: GPM reads a block of performance counters per call;
    # assumed as dear as a field-value batch for the sample and cheap to compute.
    "nvmlGpmSampleGet": ((1.0, 2.0), (1.0, 2.0)),
    "nvmlGpmMetricsGet": ((0.05, 0.1), (0.05, 0.1)),
}
DEFAULT_MS: Final[tuple[Range, Range]] = ((0.02, 0.05), (0.02, 0.05))
PROFILES: Final[dict[str, dict[str, tuple[Range, Range]]]] = {"none": {}, "h100": H100}

_BUFFER: Final = bytes(4096)


def spend_cpu(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time without holding the GIL."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        hashlib.sha256(_BUFFER)


class LatencyProfile:
    """Decides and spends the cost of each call; thread-safe."""

    def __init__(self, name: str, seed: int = 0) -> None:
        if name not in PROFILES:
            raise ValueError(f"unknown NVML latency profile {name!r} (known: {sorted(PROFILES)})")
        self.name = name
        self._table = PROFILES[name]
        self._rng = random.Random(f"{seed}:latency")
        self._seen: set[tuple[Any, ...]] = set()
        self._lock = threading.Lock()
        self.spent_s = 0.0
        self.calls = 0

    @property
    def active(self) -> bool:
        return bool(self._table)

    def cost_s(self, function: str, key: tuple[Any, ...]) -> float:
        first, later = self._table.get(function, DEFAULT_MS)
        with self._lock:
            fresh = key not in self._seen
            if fresh:
                self._seen.add(key)
            low, high = first if fresh else later
            cost = self._rng.uniform(low, high) / 1000.0
            self.spent_s += cost
            self.calls += 1
        return cost

    def wrap(self, function: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` that first spends the call's cost (handles keyed by their slot)."""

        @functools.wraps(fn)
        def timed(*args: Any) -> Any:
            key = (function, *(getattr(a, "slot", a) for a in args if _hashable(a)))
            spend_cpu(self.cost_s(function, key))
            return fn(*args)

        return timed


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
