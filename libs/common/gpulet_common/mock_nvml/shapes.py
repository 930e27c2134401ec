"""The return shapes of ``pynvml`` that the mock NVML hands out.

Objects with the attributes of NVML's ctypes structures (``c_nvmlMemory_t``,
``nvmlPciInfo_t``, ``c_nvmlEventData_t``, ``c_nvmlFieldValue_t``, the GPM structures),
so that the adapter reads them exactly as it reads the real ones; and the opaque
device handle and event set.
"""

from __future__ import annotations

import collections
from typing import Any, Final

import pynvml

# Real NVML buffers a bounded number of events per set; so does the mock.
EVENT_QUEUE_LEN: Final = 1024
# Room for metrics in one GPM request (pynvml's array is larger; the adapter asks 3).
_GPM_METRIC_SLOTS: Final = 16


class MockDeviceHandle:
    """An opaque device handle; one object per GPU slot, returned by every lookup."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot

    def __repr__(self) -> str:
        return f"<MockDeviceHandle slot={self.slot}>"


class MockEventSet:
    __slots__ = ("freed", "lost_pending", "queue", "registered")

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.queue: collections.deque[MockEventData] = collections.deque(maxlen=EVENT_QUEUE_LEN)
        self.lost_pending = 0
        self.freed = False


class MockMemory:
    """Like ``c_nvmlMemory_t``."""

    __slots__ = ("free", "total", "used")

    def __init__(self, total: int, free: int, used: int) -> None:
        self.total = total
        self.free = free
        self.used = used


class MockUtilization:
    """Like ``c_nvmlUtilization_t``."""

    __slots__ = ("gpu", "memory")

    def __init__(self, gpu: int, memory: int) -> None:
        self.gpu = gpu
        self.memory = memory


class MockPciInfo:
    """Like ``nvmlPciInfo_t`` (``busId`` is the 8-digit-domain form, as a str)."""

    __slots__ = ("bus", "busId", "busIdLegacy", "device", "domain", "pciDeviceId", "pciSubSystemId")

    def __init__(self, bus_id: str, pci_device_id: int = 0) -> None:
        domain, bus, devfn = bus_id.split(":")
        self.busId = bus_id
        self.busIdLegacy = f"{int(domain, 16):04X}:{bus}:{devfn}"
        self.domain = int(domain, 16)
        self.bus = int(bus, 16)
        self.device = int(devfn.split(".")[0], 16)
        self.pciDeviceId = pci_device_id
        self.pciSubSystemId = 0


class MockEventData:
    """Like ``c_nvmlEventData_t``: no timestamp field, as in the real structure."""

    __slots__ = ("computeInstanceId", "device", "eventData", "eventType", "gpuInstanceId")

    def __init__(self, device: MockDeviceHandle, event_type: int, event_data: int) -> None:
        self.device = device
        self.eventType = event_type
        self.eventData = event_data
        self.gpuInstanceId = 0xFFFFFFFF
        self.computeInstanceId = 0xFFFFFFFF


class MockValue:
    """Like ``c_nvmlValue_t``: a union, every member readable."""

    __slots__ = ("dVal", "siVal", "sllVal", "uiVal", "ulVal", "ullVal", "usVal")

    def __init__(self, value: int) -> None:
        self.dVal = float(value)
        self.uiVal = self.ulVal = self.ullVal = self.sllVal = self.siVal = self.usVal = value


class MockFieldValue:
    """Like ``c_nvmlFieldValue_t``: one answer of ``nvmlDeviceGetFieldValues``."""

    __slots__ = (
        "fieldId",
        "latencyUsec",
        "nvmlReturn",
        "scopeId",
        "timestamp",
        "value",
        "valueType",
    )

    def __init__(self, field_id: int, code: int, value: int, timestamp_us: int) -> None:
        self.fieldId = field_id
        self.scopeId = 0
        self.timestamp = timestamp_us
        self.latencyUsec = 0
        self.nvmlReturn = code
        self.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        self.value = MockValue(value)


class MockGpmSample:
    """What ``nvmlGpmSampleAlloc`` returns; ``nvmlGpmSampleGet`` fills it."""

    __slots__ = ("at", "gpu_slot")

    def __init__(self) -> None:
        self.gpu_slot: int | None = None
        self.at = 0.0


class MockGpmMetric:
    __slots__ = ("metricId", "nvmlReturn", "value")

    def __init__(self) -> None:
        self.metricId = 0
        self.nvmlReturn = 0
        self.value = 0.0


class MockGpmMetricsGet:
    """Like ``c_nvmlGpmMetricsGet_t`` (the request and answer of ``nvmlGpmMetricsGet``)."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: Any = None
        self.sample2: Any = None
        self.metrics = [MockGpmMetric() for _ in range(_GPM_METRIC_SLOTS)]


class MockGpmSupport:
    __slots__ = ("isSupportedDevice", "version")

    def __init__(self, supported: bool) -> None:
        self.version = 1
        self.isSupportedDevice = int(supported)
