"""A fake ``pynvml``: the same function names, return shapes and exceptions.

Why a module-shaped fake
------------------------
The NVML adapter receives the NVML module as a parameter. Handing it a
:class:`MockNvml` instead of ``pynvml`` runs *the adapter's real code* -- error
translation, unsupported-field caching, topology, events -- on a machine without a
GPU. For that to mean anything the fake must behave like the bindings:

* the same function names and arguments (``nvmlDeviceGetTotalEccErrors(h, type,
  counter)``) and return shapes (objects with ``.total/.free/.used``, ``.busId``,
  ``.gpu/.memory``; event data with ``.device/.eventType/.eventData``; ``str`` for
  text, as nvidia-ml-py 13 returns);
* the real exceptions: ``pynvml.NVMLError(code)``, which ``pynvml`` maps to its
  ``NVMLError_*`` subclass, so ``except pynvml.NVMLError_GpuIsLost`` works;
* the constants: every ``NVML_*`` / ``nvml*`` constant of ``pynvml`` is readable on
  the mock (``__getattr__``); functions the mock lacks raise ``AttributeError``, which
  the adapter treats like a driver without that function.

State and time
--------------
The node comes from a :class:`~gpulet_common.mock_nvml.scenario.Scenario`. Time is
seconds since the mock was created, read from an injectable clock (``time.monotonic``
by default, :class:`ManualClock` in tests). The fault timeline is evaluated lazily, at
every call, so a test that moves a manual clock sees the faults due by then; and
``nvmlEventSetWait_v2`` sleeps at most until the next timeline entry is due, so an
event from the timeline wakes a waiter on time.

GPUs are addressed by *slot*: their position in the scenario (hot-added GPUs take the
next slots). NVML indices are the positions among the GPUs currently present, so
they shift when a GPU disappears -- as they would after a re-enumeration.

Live injection
--------------
Scenario timelines play faults at fixed times; demos and end-to-end tests also need
to break a GPU *now* ("inject XID 79 on GPU 3 and watch the Device CR turn
unhealthy"). :meth:`MockNvml.inject` takes a wire request
(:class:`~gpulet_common.messages.MockInjectRequest`, from ``gpulet.mock.inject.<node>``)
and applies the same :class:`~gpulet_common.mock_nvml.scenario.FaultSpec` the timeline
uses, so a fault behaves identically whether scheduled or injected.

Request fields by fault (``gpu`` is the scenario slot, see above):

=================  ==============================================================
fault              value / duration_s
=================  ==============================================================
``xid``            value = XID number (required)
``ecc_sbe``        value = count (default 1)
``ecc_dbe``        value = count (default 1)
``temperature``    value = target C (absent: back to baseline); duration_s = hold
``lost``           duration_s = how long (absent: until ``reset``)
``fall_off_bus``   --  (XID 79, lost, GPU count drops; ``reset`` brings it back)
``remove``         --  (GPU count drops; ``hot_add`` with gpu brings it back)
``hot_add``        gpu absent: a new GPU; gpu = a removed slot: it comes back
``remap_pending``  value = rows (default 1)
``remap_failure``  --
``hang``           duration_s = seconds every call on the GPU blocks (required)
``clock_event``    value = clock-event reason bits (0x80 power brake; 0 ends it)
``nvlink_down``    value = the GPU's NVLink number (absent: all its NVLinks); both
                   ends of a link go down, each counting one NVLink recovery
                   error; duration_s = how long (absent: until up)
``nvlink_up``      value = the GPU's NVLink number (absent: all its NVLinks)
``nvml_vanish``    value = NVML code 12/9/4/1 (default 12); duration_s optional
``nvml_return``    --
``reset``          --  (clears volatile ECC, XIDs, pending remaps, lost, hang)
=================  ==============================================================

Threading: one lock (a Condition) guards all state. No call sleeps while holding it:
a hung GPU blocks only the threads calling into that GPU.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import pynvml

from gpulet_common.messages import MockInjectReply, MockInjectRequest
from gpulet_common.mock_nvml.latency import LatencyProfile
from gpulet_common.mock_nvml.scenario import (
    EVENT_TYPES,
    FAULT_KINDS,
    NVLINK_MAX_LINKS,
    FaultSpec,
    GpuSpec,
    Scenario,
    check_fault,
    fill_identity,
    hot_add_spec,
    level_matrix,
    load_scenario,
    nvlink_matrix,
    parse_level,
    vanish_code,
)

log = logging.getLogger("gpulet.mock_nvml")

_EV_SBE: Final = EVENT_TYPES["single_bit_ecc"]
_EV_DBE: Final = EVENT_TYPES["double_bit_ecc"]
_EV_XID: Final = EVENT_TYPES["xid"]
_EV_GPU_UNAVAILABLE: Final = EVENT_TYPES["gpu_unavailable"]
_ECC_EVENTS: Final = _EV_SBE | _EV_DBE

_THROTTLE_THERMAL: Final = (
    pynvml.nvmlClocksEventReasonSwThermalSlowdown | pynvml.nvmlClocksEventReasonHwThermalSlowdown
)
_ENABLED: Final[int] = pynvml.NVML_FEATURE_ENABLED
_DISABLED: Final[int] = pynvml.NVML_FEATURE_DISABLED
_XID_FALLEN_OFF_BUS: Final = 79
# Real NVML buffers a bounded number of events per set; so does the mock.
_EVENT_QUEUE_LEN: Final = 1024
# Safety bound on wake-ups inside one nvmlEventSetWait_v2 (the deadline ends it first).
_MAX_WAIT_ROUNDS: Final = 100_000
_NVSWITCH_COUNT: Final = 4
# Room for metrics in one GPM request (pynvml's array is larger; the adapter asks 3).
_GPM_METRIC_SLOTS: Final = 16
# Energy counter at mock start (mJ): the GPU has been up a while.
_ENERGY_AT_START_MJ: Final = 3_600_000_000

# Everything of pynvml that is not a function: constants and NVMLError classes.
_CONSTANTS: Final[dict[str, Any]] = {
    name: value
    for name, value in vars(pynvml).items()
    if not name.startswith("_")
    and (
        isinstance(value, int | float | str)
        or (isinstance(value, type) and issubclass(value, pynvml.NVMLError))
    )
}


def _err(code: int) -> pynvml.NVMLError:
    # NVMLError.__new__ turns the code into the matching NVMLError_* subclass.
    return pynvml.NVMLError(code)


class ManualClock:
    """A clock that moves only when told to: ``clock.advance(5)``.

    After advancing, call :meth:`MockNvml.tick` (or any NVML call) so the mock plays
    the faults now due and wakes event waiters.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        with self._lock:
            self._now += seconds
            return self._now


# --- return shapes of pynvml ------------------------------------------------------


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
        self.queue: collections.deque[MockEventData] = collections.deque(maxlen=_EVENT_QUEUE_LEN)
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


# --- per-GPU state ----------------------------------------------------------------


class _Ramp:
    """A temperature program: from -> to over ramp_s, held, then back to the baseline."""

    __slots__ = ("back_s", "from_c", "hold_s", "ramp_s", "start", "to_c")

    def __init__(
        self, start: float, from_c: float, to_c: float, ramp_s: float, hold_s: float, back_s: float
    ) -> None:
        self.start = start
        self.from_c = from_c
        self.to_c = to_c
        self.ramp_s = ramp_s
        self.hold_s = hold_s
        self.back_s = back_s

    def at(self, now: float, baseline: float) -> float | None:
        """Temperature at ``now``, or None once the program is over."""
        t = now - self.start
        if t < self.ramp_s:
            return self.from_c + (self.to_c - self.from_c) * t / self.ramp_s
        t -= self.ramp_s
        if t < self.hold_s:
            return self.to_c
        t -= self.hold_s
        if t < self.back_s:
            return self.to_c + (baseline - self.to_c) * t / self.back_s
        return None


class _Link:
    __slots__ = ("bus_id", "down_until", "peer", "remote_type")

    def __init__(self, remote_type: int, bus_id: str, peer: int | None) -> None:
        self.remote_type = remote_type
        self.bus_id = bus_id
        self.peer = peer
        # Fault nvlink_down: the link reads inactive until then (mock time).
        self.down_until = 0.0


class _Slot:
    """One GPU of the mock node and everything that can happen to it."""

    def __init__(self, slot: int, spec: GpuSpec, seed: int) -> None:
        self.slot = slot
        self.spec = spec
        self.handle = MockDeviceHandle(slot)
        self.present = True
        self.fell_off = False
        self.lost_until = math.inf if spec.lost_at_start else 0.0
        # While lost: whether nvmlDeviceGetHandleByIndex still gives the handle (and
        # nvmlDeviceGetPciInfo still answers), as GpuSpec.lost_at_start = "calls" says.
        self.lost_keeps_handle = spec.lost_at_start == "calls"
        self.hang_until = 0.0
        self.ecc_volatile = [0, 0]  # corrected, uncorrected
        self.ecc_aggregate = [0, 0]
        self.remap_correctable = 0
        self.remap_uncorrectable = 0
        self.remap_pending = False
        self.remap_failure = False
        self.retired_pending = False
        self.ramp: _Ramp | None = None
        self.links: list[_Link] = []
        self.xids: list[int] = []
        # Slow-field counters (nvmlDeviceGetFieldValues): PCIe replays and the NVLink
        # error totals (CRC flit, CRC data, replay, recovery).
        self.pcie_replays = 0
        self.nvlink_errors = [0, 0, 0, 0]
        # Injected clock-event reason bits, reported until clock_events_until.
        self.clock_events = 0
        self.clock_events_until = 0.0
        # String seeds hash deterministically (unlike hash() of a str).
        self.rng = random.Random(f"{seed}:{slot}:jitter")

    def lost(self, now: float) -> bool:
        return now < self.lost_until

    def temperature(self, now: float) -> float:
        ramp = self.ramp
        if ramp is not None:
            value = ramp.at(now, self.spec.temperature_c)
            if value is not None:
                return value
            self.ramp = None
        return float(self.spec.temperature_c)


class MockNvml:
    """A module-like fake of ``pynvml`` playing a scenario (see the module docstring)."""

    def __init__(
        self,
        scenario: Scenario | str | Path = "dgx-h100",
        *,
        clock: Callable[[], float] | None = None,
        jitter: bool | None = None,
        latency: str | None = None,
    ) -> None:
        self._scenario = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
        # Per-call latency (mock_nvml/latency.py): the scenario's unless given.
        self.latency = LatencyProfile(
            latency or self._scenario.system.latency_profile, self._scenario.seed
        )
        if self.latency.active:
            for name in dir(type(self)):
                if name.startswith("nvml") and callable(getattr(type(self), name)):
                    setattr(self, name, self.latency.wrap(name, getattr(self, name)))
        self._clock = clock or time.monotonic
        self._t0 = self._clock()
        self._jitter = self._scenario.jitter if jitter is None else jitter
        self._cond = threading.Condition(threading.Lock())
        self._closing = threading.Event()
        self._init_count = 0
        self._vanished_until = 0.0
        self._vanish_code = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
        self._event_sets: list[MockEventSet] = []
        self._timeline = sorted(self._scenario.timeline, key=lambda f: f.at)
        self._next_fault = 0

        count = len(self._scenario.gpus)
        self._slots = [
            _Slot(i, spec, self._scenario.seed) for i, spec in enumerate(self._scenario.gpus)
        ]
        levels = level_matrix(self._scenario.topology, count)
        self._levels: dict[tuple[int, int], int] = {
            (a, b): levels[a][b] for a in range(count) for b in range(count)
        }
        self._default_level = parse_level(self._scenario.topology.default_level)
        direct = nvlink_matrix(self._scenario.topology, count)
        for slot in self._slots:
            for peer in self._slots:
                for _ in range(direct[slot.slot][peer.slot]):
                    slot.links.append(_Link(0, peer.spec.bus_id, peer.slot))
            self._add_switch_links(slot)
        self._enumerated: list[_Slot] = []
        self._reenumerate()

    # --- the mock's own API ----------------------------------------------------------

    @property
    def scenario(self) -> Scenario:
        return self._scenario

    @property
    def faults(self) -> tuple[str, ...]:
        """The fault kinds :meth:`inject` accepts."""
        return FAULT_KINDS

    def inject(self, request: MockInjectRequest) -> MockInjectReply:
        """Apply the requested fault now (see "Live injection"); never raises."""
        fault = FaultSpec(
            fault=request.fault, gpu=request.gpu, value=request.value, duration_s=request.duration_s
        )
        applied, detail = self.apply(fault)
        if applied:
            log.info("mock NVML fault injected: %s", detail)
        else:
            log.warning("mock NVML fault %r rejected: %s", request.fault, detail)
        return MockInjectReply(applied=applied, detail=detail)

    @property
    def slot_count(self) -> int:
        """GPU slots ever seen (present or not): the valid ``gpu`` values of faults."""
        return len(self._slots)

    def elapsed(self) -> float:
        """Seconds of mock time since creation."""
        return self._clock() - self._t0

    def tick(self) -> None:
        """Play the timeline up to now and wake event waiters (after moving the clock)."""
        with self._cond:
            self._advance()
            self._cond.notify_all()

    def close(self) -> None:
        """Release every blocked call (hung GPUs, event waits): for test teardown."""
        self._closing.set()
        with self._cond:
            self._cond.notify_all()

    def slot_uuid(self, slot: int) -> str:
        return self._slots[slot].spec.uuid

    def slot_state(self, slot: int) -> dict[str, Any]:
        """A snapshot of one slot's dynamic state (for tests and ``gpulet mock`` tools)."""
        with self._cond:
            now = self._advance()
            s = self._slots[slot]
            return {
                "uuid": s.spec.uuid,
                "present": s.present,
                "lost": s.lost(now),
                "fell_off_bus": s.fell_off,
                "hung": now < s.hang_until,
                "temperature_c": s.temperature(now),
                "ecc_volatile": tuple(s.ecc_volatile),
                "ecc_aggregate": tuple(s.ecc_aggregate),
                "remap_pending": s.remap_pending,
                "remap_failure": s.remap_failure,
                "retired_pages_pending": s.retired_pending,
                "xids": list(s.xids),
                "nvlinks_down": [i for i, link in enumerate(s.links) if now < link.down_until],
            }

    def apply(self, fault: FaultSpec) -> tuple[bool, str]:
        """Apply one fault now (live injection); (applied, detail)."""
        problem = check_fault(fault, len(self._slots), live=True)
        if problem is not None:
            return False, problem
        with self._cond:
            now = self._advance()
            applied, detail = self._apply(fault, now)
            self._cond.notify_all()
        return applied, detail

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not defined on the class: pynvml's constants and
        # error classes. Unknown functions stay AttributeError, like a missing symbol.
        try:
            return _CONSTANTS[name]
        except KeyError:
            raise AttributeError(f"mock NVML has no attribute {name!r}") from None

    # --- internals: time, gating, timeline -----------------------------------------

    def _now(self) -> float:
        return self._clock() - self._t0

    def _advance(self) -> float:
        """Apply the timeline entries due by now (lock held); returns now."""
        now = self._now()
        timeline = self._timeline
        while self._next_fault < len(timeline) and timeline[self._next_fault].at <= now:
            fault = timeline[self._next_fault]
            self._next_fault += 1
            applied, detail = self._apply(fault, fault.at)
            if applied:
                log.info("mock NVML t=%.3fs: %s", fault.at, detail)
            else:
                log.warning("mock NVML t=%.3fs: %s not applied: %s", fault.at, fault.fault, detail)
            self._cond.notify_all()
        return now

    def _next_due(self) -> float | None:
        if self._next_fault < len(self._timeline):
            return self._timeline[self._next_fault].at
        return None

    def _gate(self, now: float) -> None:
        if now < self._vanished_until:
            raise _err(self._vanish_code)
        if self._init_count == 0:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)

    def _system(self) -> float:
        with self._cond:
            now = self._advance()
            self._gate(now)
            return now

    def _slot_of(self, handle: Any) -> _Slot:
        if not isinstance(handle, MockDeviceHandle) or not 0 <= handle.slot < len(self._slots):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._slots[handle.slot]

    def _enter(self, handle: Any, *, probe: bool = False) -> tuple[_Slot, float]:
        """Gate a device call: NVML there, GPU not hung (else block), GPU not lost.

        ``probe``: a call that a GPU lost with ``lost_keeps_handle`` still answers
        (getting its handle, its PCI info)."""
        with self._cond:
            now = self._advance()
            self._gate(now)
            slot = self._slot_of(handle)
            wait = slot.hang_until - now
        if wait > 0:
            # Sleep once for the remaining hang, outside the lock; with a manual clock
            # this is real time, which is what a test of a hung call wants.
            self._closing.wait(wait)
            with self._cond:
                now = self._advance()
                self._gate(now)
        if not slot.present or (slot.lost(now) and not (probe and slot.lost_keeps_handle)):
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return slot, now

    def _reenumerate(self) -> None:
        self._enumerated = [s for s in self._slots if s.present]

    def _add_switch_links(self, slot: _Slot) -> None:
        for link in range(slot.spec.nvswitch_links):
            switch_bus = f"00000000:{0xA0 + link % _NVSWITCH_COUNT:02X}:00.0"
            slot.links.append(_Link(pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH, switch_bus, None))

    # --- internals: faults ---------------------------------------------------------

    def _emit(self, slot: _Slot, event_type: int, data: int) -> int:
        delivered = 0
        for event_set in self._event_sets:
            if not event_set.freed and event_set.registered.get(slot.slot, 0) & event_type:
                event_set.queue.append(MockEventData(slot.handle, event_type, data))
                delivered += 1
        return delivered

    def _announce_lost(self, slot: _Slot) -> None:
        # Drivers with the GpuUnavailable event report a loss as an event; older ones
        # make nvmlEventSetWait fail with GPU_IS_LOST.
        for event_set in self._event_sets:
            registered = event_set.registered.get(slot.slot, 0)
            if event_set.freed or not registered:
                continue
            if registered & _EV_GPU_UNAVAILABLE:
                event_set.queue.append(MockEventData(slot.handle, _EV_GPU_UNAVAILABLE, 0))
            else:
                event_set.lost_pending += 1

    def _new_slot(self, overrides: dict[str, Any] | None) -> _Slot:
        template = self._slots[0].spec
        spec = hot_add_spec(template, overrides)
        index = len(self._slots)
        used = {s.spec.bus_id for s in self._slots}
        minor = max((s.spec.minor or 0) for s in self._slots) + 1
        spec = fill_identity(
            spec, seed=self._scenario.seed, slot=index, used_buses=used, minor=minor
        )
        slot = _Slot(index, spec, self._scenario.seed)
        for other in self._slots:
            self._levels[(index, other.slot)] = self._default_level
            self._levels[(other.slot, index)] = self._default_level
        self._levels[(index, index)] = 0
        self._add_switch_links(slot)
        self._slots.append(slot)
        return slot

    def _apply(self, fault: FaultSpec, start: float) -> tuple[bool, str]:
        """Apply a checked fault as of mock time ``start`` (lock held)."""
        kind = fault.fault
        duration = fault.duration_s
        if kind == "nvml_vanish":
            code = vanish_code(fault)
            self._vanished_until = start + duration if duration is not None else math.inf
            self._vanish_code = code
            # The library is gone: whoever comes back must nvmlInit again.
            self._init_count = 0
            return True, f"NVML vanished (every call fails with NVML code {code})"
        if kind == "nvml_return":
            self._vanished_until = 0.0
            return True, "NVML is back (callers must nvmlInit again)"
        if kind == "hot_add":
            if fault.gpu is None:
                if not self._slots:
                    return False, "hot_add needs a GPU in the scenario to copy"
                slot = self._new_slot(fault.spec)
                self._reenumerate()
                return True, f"hot-added GPU {slot.slot} ({slot.spec.uuid}, {slot.spec.bus_id})"
            slot = self._slots[fault.gpu]
            if slot.present:
                return False, f"GPU {fault.gpu} is present already"
            slot.present, slot.fell_off, slot.lost_until = True, False, 0.0
            self._reenumerate()
            return True, f"GPU {fault.gpu} ({slot.spec.uuid}) is back"
        assert fault.gpu is not None  # check_fault: every other kind names a GPU
        slot = self._slots[fault.gpu]
        name = f"GPU {slot.slot} ({slot.spec.uuid})"
        if kind == "reset":
            return self._reset(slot, name)
        if not slot.present:
            return False, f"{name} is not present"
        spec = slot.spec
        count = int(fault.value) if fault.value is not None else 1
        if kind == "xid":
            xid = int(fault.value or 0)
            slot.xids.append(xid)
            delivered = self._emit(slot, _EV_XID, xid)
            return True, f"XID {xid} on {name} (delivered to {delivered} event sets)"
        if kind in ("ecc_sbe", "ecc_dbe"):
            if not spec.ecc_enabled:
                return False, f"ECC is not enabled on {name}"
            kind_index = 0 if kind == "ecc_sbe" else 1
            slot.ecc_volatile[kind_index] += count
            slot.ecc_aggregate[kind_index] += count
            if kind == "ecc_dbe" and spec.retired_pages:
                slot.retired_pending = True
            self._emit(slot, _EV_SBE if kind == "ecc_sbe" else _EV_DBE, 0)
            return True, f"{count} {'single' if kind_index == 0 else 'double'}-bit ECC on {name}"
        if kind == "temperature":
            if fault.value is None:
                slot.ramp = None
                return True, f"{name} back to its baseline temperature"
            from_c = fault.from_c if fault.from_c is not None else slot.temperature(start)
            hold = duration if duration is not None else math.inf
            slot.ramp = _Ramp(start, from_c, fault.value, fault.ramp_s, hold, fault.back_s)
            return (
                True,
                f"{name} temperature {from_c:g} -> {fault.value:g} C over {fault.ramp_s:g}s",
            )
        if kind == "lost":
            slot.lost_until = start + duration if duration is not None else math.inf
            self._announce_lost(slot)
            return True, f"{name} is lost" + (f" for {duration:g}s" if duration is not None else "")
        if kind == "fall_off_bus":
            slot.xids.append(_XID_FALLEN_OFF_BUS)
            self._emit(slot, _EV_XID, _XID_FALLEN_OFF_BUS)
            self._announce_lost(slot)
            slot.lost_until = math.inf
            slot.present, slot.fell_off = False, True
            self._reenumerate()
            return True, f"{name} fell off the bus (XID 79; GPU count now {len(self._enumerated)})"
        if kind == "remove":
            slot.present = False
            self._reenumerate()
            return True, f"{name} removed (GPU count now {len(self._enumerated)})"
        if kind in ("remap_pending", "remap_failure"):
            if not spec.remapped_rows:
                return False, f"{name} ({spec.name}) does not support row remapping"
            if kind == "remap_pending":
                slot.remap_uncorrectable += count
                slot.remap_pending = True
                return (
                    True,
                    f"{count} row(s) remapped for uncorrectable errors on {name}, remap pending",
                )
            slot.remap_failure = True
            return True, f"row remapping failed on {name}"
        if kind == "hang":
            assert duration is not None  # check_fault requires it
            slot.hang_until = start + duration
            return True, f"{name} hangs for {duration:g}s"
        if kind == "pcie_replay":
            slot.pcie_replays += count
            return True, f"{count} PCIe replay(s) on {name} (counter now {slot.pcie_replays})"
        if kind == "nvlink_error":
            if not slot.links:
                return False, f"{name} has no NVLink"
            slot.nvlink_errors = [n + count for n in slot.nvlink_errors]
            return True, f"{count} NVLink CRC flit/data, replay and recovery error(s) on {name}"
        if kind in ("nvlink_down", "nvlink_up"):
            return self._nvlink_fault(slot, name, fault, start)
        if kind == "clock_event":
            slot.clock_events = int(fault.value or 0)
            slot.clock_events_until = start + duration if duration is not None else math.inf
            return True, f"{name} reports clock-event reasons {slot.clock_events:#x}" + (
                f" for {duration:g}s" if duration is not None else ""
            )
        return False, f"unknown fault {kind!r} (known: {', '.join(FAULT_KINDS)})"

    def _link_ends(self, slot: _Slot, link: int) -> list[tuple[_Slot, _Link]]:
        """Both ends of one link: the k-th link from A to B is the k-th from B to A
        (as the scenario built them); a link into an NVSwitch has one end here."""
        nvlink = slot.links[link]
        if nvlink.peer is None:
            return [(slot, nvlink)]
        peer = self._slots[nvlink.peer]
        k = sum(1 for other in slot.links[:link] if other.peer == nvlink.peer)
        back = [other for other in peer.links if other.peer == slot.slot]
        return [(slot, nvlink), *((peer, end) for end in back[k : k + 1])]

    def _nvlink_fault(
        self, slot: _Slot, name: str, fault: FaultSpec, start: float
    ) -> tuple[bool, str]:
        """nvlink_down / nvlink_up: one link (value) or all of the GPU's, both ends."""
        links = range(len(slot.links)) if fault.value is None else [int(fault.value)]
        if not slot.links:
            return False, f"{name} has no NVLinks"
        if fault.value is not None and not 0 <= int(fault.value) < len(slot.links):
            return False, f"{name} has NVLinks 0-{len(slot.links) - 1}, not {int(fault.value)}"
        down = fault.fault == "nvlink_down"
        duration = fault.duration_s
        until = (start + duration if duration is not None else math.inf) if down else 0.0
        for link in links:
            for owner, end in self._link_ends(slot, link):
                end.down_until = until
                if down:
                    # A link fails after recovery attempts: each end counts one.
                    owner.nvlink_errors[3] += 1
        which = "every NVLink" if fault.value is None else f"NVLink {int(fault.value)}"
        if not down:
            return True, f"{which} of {name} is up"
        return True, f"{which} of {name} is down" + (
            f" for {duration:g}s" if duration is not None else ""
        )

    def _reset(self, slot: _Slot, name: str) -> tuple[bool, str]:
        if not slot.present and not slot.fell_off:
            return False, f"{name} was removed; hot_add brings it back"
        slot.ecc_volatile = [0, 0]
        slot.lost_keeps_handle = False
        # The PCIe and NVLink error counters start again from 0 too.
        slot.pcie_replays, slot.nvlink_errors = 0, [0, 0, 0, 0]
        slot.remap_pending = False
        slot.retired_pending = False
        slot.xids.clear()
        slot.lost_until = 0.0
        slot.hang_until = 0.0
        if slot.fell_off:
            slot.present, slot.fell_off = True, False
            self._reenumerate()
        for event_set in self._event_sets:
            kept = [e for e in event_set.queue if e.device is not slot.handle]
            event_set.queue.clear()
            event_set.queue.extend(kept)
        return True, f"{name} reset"

    # --- readings --------------------------------------------------------------------

    def _jitter_unit(self, slot: _Slot) -> float:
        """A deterministic value in [-1, 1) from the slot's seeded generator."""
        return slot.rng.random() * 2.0 - 1.0 if self._jitter else 0.0

    def _temperature_c(self, slot: _Slot, now: float) -> int:
        value = slot.temperature(now)
        if slot.ramp is None:
            value += round(self._jitter_unit(slot))
        return round(value)

    def _thermal_slowdown(self, slot: _Slot, now: float) -> bool:
        limit = slot.spec.temp_slowdown_c
        return limit is not None and slot.temperature(now) >= limit

    # === pynvml API ====================================================================

    # --- init / system ---------------------------------------------------------------

    def nvmlInit(self) -> None:
        with self._cond:
            now = self._advance()
            if now < self._vanished_until:
                raise _err(self._vanish_code)
            self._init_count += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.nvmlInit()

    def nvmlShutdown(self) -> None:
        with self._cond:
            now = self._advance()
            self._gate(now)
            self._init_count -= 1

    def nvmlErrorString(self, result: int) -> str:
        return str(pynvml.NVMLError._errcode_to_string.get(result, "Unknown Error"))

    def nvmlSystemGetDriverVersion(self) -> str:
        self._system()
        return self._scenario.system.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._system()
        return self._scenario.system.cuda_driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.nvmlSystemGetCudaDriverVersion()

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._system()
        return self._scenario.system.nvml_version

    # --- enumeration -----------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        with self._cond:
            self._gate(self._advance())
            return len(self._enumerated)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> MockDeviceHandle:
        with self._cond:
            self._gate(self._advance())
            if not 0 <= index < len(self._enumerated):
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            handle = self._enumerated[index].handle
        self._enter(handle, probe=True)
        return handle

    def _find(self, match: Callable[[_Slot], bool]) -> MockDeviceHandle:
        with self._cond:
            self._gate(self._advance())
            found = [s for s in self._enumerated if match(s)]
            if not found:
                raise _err(pynvml.NVML_ERROR_NOT_FOUND)
            handle = found[0].handle
        self._enter(handle)
        return handle

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> MockDeviceHandle:
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        return self._find(lambda s: s.spec.uuid == wanted)

    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> MockDeviceHandle:
        text = pciBusId.decode() if isinstance(pciBusId, bytes) else pciBusId
        wanted = text.strip().upper()
        if wanted.count(":") == 2:
            domain, rest = wanted.split(":", 1)
            wanted = f"{int(domain, 16):08X}:{rest}"
        elif wanted.count(":") == 1:
            wanted = "00000000:" + wanted
        return self._find(lambda s: s.spec.bus_id == wanted)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        slot, _ = self._enter(handle)
        with self._cond:
            return self._enumerated.index(slot)

    # --- identity --------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._enter(handle)[0].spec.uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._enter(handle)[0].spec.name

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        minor = self._enter(handle)[0].spec.minor
        return minor if minor is not None else 0

    def nvmlDeviceGetSerial(self, handle: Any) -> str:
        return self._enter(handle)[0].spec.serial

    def nvmlDeviceGetBoardId(self, handle: Any) -> int:
        board_id = self._enter(handle)[0].spec.board_id
        return board_id if board_id is not None else 0

    def nvmlDeviceGetModuleId(self, handle: Any) -> int:
        module_id = self._enter(handle)[0].spec.module_id
        if module_id is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return module_id

    def nvmlDeviceGetPciInfo(self, handle: Any) -> MockPciInfo:
        spec = self._enter(handle, probe=True)[0].spec
        return MockPciInfo(spec.bus_id, spec.pci_device_id)

    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> MockPciInfo:
        return self.nvmlDeviceGetPciInfo(handle)

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        return self._enter(handle)[0].spec.compute_capability

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        numa = self._enter(handle)[0].spec.numa_node
        if numa is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return numa

    def _affinity_words(self, handle: Any, cpu_set_size: int) -> list[int]:
        spec = self._enter(handle)[0].spec
        words = [0] * cpu_set_size
        for cpu in spec.cpus:
            if cpu // 64 < cpu_set_size:
                words[cpu // 64] |= 1 << (cpu % 64)
        return words

    def nvmlDeviceGetCpuAffinityWithinScope(
        self, handle: Any, cpuSetSize: int, scope: int
    ) -> list[int]:
        return self._affinity_words(handle, cpuSetSize)

    def nvmlDeviceGetCpuAffinity(self, handle: Any, cpuSetSize: int) -> list[int]:
        return self._affinity_words(handle, cpuSetSize)

    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]:
        enabled = self._enter(handle)[0].spec.ecc_enabled
        if enabled is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        state = _ENABLED if enabled else _DISABLED
        return [state, state]

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        spec = self._enter(handle)[0].spec
        value = {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: spec.temp_shutdown_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: spec.temp_slowdown_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: spec.temp_mem_max_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: spec.temp_gpu_max_c,
        }.get(threshold)
        if value is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        return self._enter(handle)[0].spec.event_mask

    # --- topology --------------------------------------------------------------------

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        a, _ = self._enter(device1)
        b, _ = self._enter(device2)
        return self._levels[(a.slot, b.slot)]

    def _link(self, handle: Any, link: int) -> tuple[_Slot, _Link]:
        slot, _ = self._enter(handle)
        if not slot.links:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < min(len(slot.links), NVLINK_MAX_LINKS):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return slot, slot.links[link]

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        _, nvlink = self._link(device, link)
        with self._cond:
            now = self._now()
            if now < nvlink.down_until:  # fault nvlink_down
                return _DISABLED
            if nvlink.peer is None:
                return _ENABLED
            # A link to a GPU that is gone is down.
            peer = self._slots[nvlink.peer]
            alive = peer.present and not peer.lost(now)
        return _ENABLED if alive else _DISABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> MockPciInfo:
        return MockPciInfo(self._link(device, link)[1].bus_id)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        return self._link(handle, link)[1].remote_type

    # --- samples ---------------------------------------------------------------------

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
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
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
        raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        if not self._scenario.system.clocks_event_reasons:
            self._system()
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
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
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if errorType not in (0, 1) or counterType not in (0, 1):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        counters = (
            slot.ecc_volatile if counterType == pynvml.NVML_VOLATILE_ECC else slot.ecc_aggregate
        )
        return counters[errorType]

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        slot, _ = self._enter(device)
        if not slot.spec.remapped_rows:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return (
            slot.remap_correctable,
            slot.remap_uncorrectable,
            int(slot.remap_pending),
            int(slot.remap_failure),
        )

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        slot, _ = self._enter(device)
        if not slot.spec.retired_pages:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _ENABLED if slot.retired_pending else _DISABLED

    # --- slow fields: field values, energy, PCIe replays, GPM -------------------------

    def _energy_mj(self, slot: _Slot, now: float) -> int:
        return _ENERGY_AT_START_MJ + round(slot.spec.power_w * 1000 * now)

    def _field(self, slot: _Slot, now: float, field_id: int) -> int | None:
        """One field's value, or None when this GPU does not support it."""
        spec = slot.spec
        nvlink = bool(slot.links)
        if field_id == pynvml.NVML_FI_DEV_MEMORY_TEMP:
            return spec.memory_temperature_c
        if field_id == pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
            return self._energy_mj(slot, now)
        if field_id == pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER:
            return slot.pcie_replays
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

    def _gpm_supported(self, slot: _Slot) -> bool:
        return slot.spec.compute_capability >= (9, 0)

    def nvmlGpmQueryDeviceSupport(self, device: Any) -> MockGpmSupport:
        slot, _ = self._enter(device)
        return MockGpmSupport(self._gpm_supported(slot))

    def nvmlGpmSampleAlloc(self) -> MockGpmSample:
        self._system()
        return MockGpmSample()

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        if not isinstance(gpmSample, MockGpmSample):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> MockGpmSample:
        slot, now = self._enter(device)
        if not isinstance(gpmSample, MockGpmSample):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not self._gpm_supported(slot):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
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
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
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

    # --- events ----------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> MockEventSet:
        event_set = MockEventSet()
        with self._cond:
            self._gate(self._advance())
            self._event_sets.append(event_set)
        return event_set

    def _event_set(self, eventSet: Any) -> MockEventSet:
        if not isinstance(eventSet, MockEventSet) or eventSet.freed:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return eventSet

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        slot, _ = self._enter(handle)
        event_set = self._event_set(eventSet)
        spec = slot.spec
        if eventTypes & ~spec.event_mask:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if eventTypes & _ECC_EVENTS and not spec.ecc_enabled:
            # ECC events exist only while ECC is on, whatever the supported mask says.
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._cond:
            event_set.registered[slot.slot] = event_set.registered.get(slot.slot, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> MockEventData:
        event_set = self._event_set(eventSet)
        deadline = time.monotonic() + max(0, timeoutms) / 1000.0
        with self._cond:
            for _ in range(_MAX_WAIT_ROUNDS):
                now = self._advance()
                self._gate(now)
                if event_set.freed:
                    raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
                if event_set.lost_pending:
                    event_set.lost_pending -= 1
                    raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
                if event_set.queue:
                    return event_set.queue.popleft()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closing.is_set():
                    break
                due = self._next_due()
                if due is not None:
                    # Wake when the next timeline fault is due, to deliver it on time.
                    remaining = min(remaining, max(due - now, 0.0005))
                self._cond.wait(remaining)
        raise _err(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> MockEventData:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        event_set = self._event_set(eventSet)
        with self._cond:
            event_set.freed = True
            if event_set in self._event_sets:
                self._event_sets.remove(event_set)
            self._cond.notify_all()
