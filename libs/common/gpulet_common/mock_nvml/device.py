"""The mock NVML's device model: the node's GPUs, time, gating, and the mock's own API.

Every GPU of the scenario is a :class:`Slot`: its spec and everything that can happen
to it (lost, hung, ECC counts, remaps, a temperature program, NVLinks). GPUs are
addressed by *slot*, their position in the scenario (hot-added GPUs take the next
slots); NVML indices are the positions among the GPUs currently present, so they shift
when a GPU disappears, as they would after a re-enumeration.

:class:`MockCore` holds the slots and the clock, gates every NVML call (NVML there,
GPU not hung, GPU not lost: :meth:`MockCore._enter`), plays the scenario's timeline as
calls come in (:meth:`MockCore._advance`), and offers the mock's own API (live
injection, state snapshots, ``close``). The pynvml functions are in the pieces built
on it (:mod:`.identity`, :mod:`.readings`, :mod:`.events`), and what a fault does is
in :mod:`.faults`.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import pynvml

from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import MockInjectReply, MockInjectRequest
from gpulet_common.mock_nvml.faultspec import FAULT_KINDS, FaultSpec, check_fault
from gpulet_common.mock_nvml.recovery import RecoveryModel
from gpulet_common.mock_nvml.scenario import GpuSpec, Scenario
from gpulet_common.mock_nvml.shapes import MockDeviceHandle, MockEventSet
from gpulet_common.mock_nvml.topology import level_matrix, nvlink_matrix, parse_level

log = logging.getLogger("gpulet.mock_nvml")
# One per injection request from the bus: rate-limited.
_inject_log = RateLimitedLog(log, per_minute=30)

ENABLED: Final[int] = pynvml.NVML_FEATURE_ENABLED
DISABLED: Final[int] = pynvml.NVML_FEATURE_DISABLED
_NVSWITCH_COUNT: Final = 4

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


def err(code: int) -> pynvml.NVMLError:
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


class Ramp:
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


class Link:
    __slots__ = ("bus_id", "down_until", "peer", "remote_type")

    def __init__(self, remote_type: int, bus_id: str, peer: int | None) -> None:
        self.remote_type = remote_type
        self.bus_id = bus_id
        self.peer = peer
        # Fault nvlink_down: the link reads inactive until then (mock time).
        self.down_until = 0.0


class Slot:
    """One GPU of the mock node and everything that can happen to it."""

    def __init__(self, slot: int, spec: GpuSpec, seed: int) -> None:
        self.slot = slot
        self.spec = spec
        self.handle = MockDeviceHandle(slot)
        # Where NVML enumerates it among the GPUs present (see MockCore._reenumerate).
        self.order = float(slot)
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
        self.ramp: Ramp | None = None
        self.links: list[Link] = []
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


class MockCore:
    """The slots, the clock, the gate of every call and the mock's own API."""

    def __init__(
        self,
        scenario: Scenario,
        *,
        clock: Callable[[], float] | None = None,
        jitter: bool | None = None,
    ) -> None:
        self._scenario = scenario
        self._clock = clock or time.monotonic
        self._t0 = self._clock()
        self._jitter = self._scenario.jitter if jitter is None else jitter
        self._cond = threading.Condition(threading.Lock())
        self._closing = threading.Event()
        self._init_count = 0
        #: nvmlInit calls refused because the driver was not loaded yet.
        self.init_failures = 0
        self._vanished_until = 0.0
        self._vanish_code = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
        self._event_sets: list[MockEventSet] = []
        self.recovery = RecoveryModel(self._scenario.system.driver_version)
        self._timeline = sorted(self._scenario.timeline, key=lambda f: f.at)
        self._next_fault = 0

        count = len(self._scenario.gpus)
        self._slots = [
            Slot(i, spec, self._scenario.seed) for i, spec in enumerate(self._scenario.gpus)
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
                    slot.links.append(Link(0, peer.spec.bus_id, peer.slot))
            self._add_switch_links(slot)
        self._enumerated: list[Slot] = []
        self._reenumerate()

    # --- the mock's own API ---------------------------------------------------

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
            fault=request.fault,
            gpu=request.gpu,
            value=request.value,
            duration_s=request.duration_s,
            gi=request.gi,
            ci=request.ci,
        )
        applied, detail = self.apply(fault)
        if applied:
            _inject_log.info("mock NVML fault injected: %s", detail)
        else:
            _inject_log.warning("mock NVML fault %r rejected: %s", request.fault, detail)
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

    def apply_together(self, *faults: FaultSpec) -> list[tuple[bool, str]]:
        """Apply several faults as one step: no NVML call sees the node between them
        (a GPU that goes and comes back between two polls of the count)."""
        problems = [check_fault(f, len(self._slots), live=True) for f in faults]
        if any(p is not None for p in problems):
            return [(p is None, p or "not applied") for p in problems]
        with self._cond:
            now = self._advance()
            results = [self._apply(fault, now) for fault in faults]
            self._cond.notify_all()
        return results

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not defined on the class: pynvml's constants and
        # error classes. Unknown functions stay AttributeError, like a missing symbol.
        try:
            return _CONSTANTS[name]
        except KeyError:
            raise AttributeError(f"mock NVML has no attribute {name!r}") from None

    def _apply(self, fault: FaultSpec, start: float) -> tuple[bool, str]:
        """Apply a checked fault as of mock time ``start`` (lock held): :mod:`.faults`."""
        raise NotImplementedError

    def _apply_more(self, fault: FaultSpec, start: float) -> tuple[bool, str] | None:
        """A fault of another piece (:mod:`.mig`), or None; each override that does not
        know the fault hands it on to ``super()``."""
        return None

    # --- time, gating, timeline -----------------------------------------------

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
            raise err(self._vanish_code)
        if self._init_count == 0:
            raise err(pynvml.NVML_ERROR_UNINITIALIZED)

    def _system(self) -> float:
        with self._cond:
            now = self._advance()
            self._gate(now)
            return now

    def _slot_of(self, handle: Any) -> Slot:
        if not isinstance(handle, MockDeviceHandle) or not 0 <= handle.slot < len(self._slots):
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        slot = self._slots[handle.slot]
        if handle is not slot.handle:
            # A handle of a previous enumeration (before a removal and return, a
            # fall off the bus and reset, a driver reload): not a device any more.
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return slot

    def _renew_handle(self, slot: Slot) -> None:
        """The GPU came back as a new device (lock held): a new handle; the old one
        and the event registrations made with it are void."""
        slot.handle = MockDeviceHandle(slot.slot)
        for event_set in self._event_sets:
            event_set.registered.pop(slot.slot, None)

    def _enter(self, handle: Any, *, probe: bool = False) -> tuple[Slot, float]:
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
            raise err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return slot, now

    def _reenumerate(self) -> None:
        self._enumerated = sorted((s for s in self._slots if s.present), key=lambda s: s.order)

    def _add_switch_links(self, slot: Slot) -> None:
        for link in range(slot.spec.nvswitch_links):
            switch_bus = f"00000000:{0xA0 + link % _NVSWITCH_COUNT:02X}:00.0"
            slot.links.append(Link(pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH, switch_bus, None))

    # --- readings the pieces share --------------------------------------------

    def _jitter_unit(self, slot: Slot) -> float:
        """A deterministic value in [-1, 1) from the slot's seeded generator."""
        return slot.rng.random() * 2.0 - 1.0 if self._jitter else 0.0

    def _temperature_c(self, slot: Slot, now: float) -> int:
        value = slot.temperature(now)
        if slot.ramp is None:
            value += round(self._jitter_unit(slot))
        return round(value)

    def _thermal_slowdown(self, slot: Slot, now: float) -> bool:
        limit = slot.spec.temp_slowdown_c
        return limit is not None and slot.temperature(now) >= limit
