"""The mock NVML's events: event sets, registration, the wait, and delivering events.

An event set keeps a bounded queue per set, as real NVML does. A fault delivers its
event to every set that registered the GPU for that type (:meth:`MockEvents._emit`); a
lost GPU is announced as a GpuUnavailable event where that type was registered, else
by making the next wait fail with GPU_IS_LOST (:meth:`MockEvents._announce_lost`), as
older drivers do. ``nvmlEventSetWait_v2`` sleeps at most until the next timeline entry
is due, so an event from the timeline wakes a waiter on time.
"""

from __future__ import annotations

import time
from typing import Any, Final

import pynvml

from gpulet_common.mock_nvml.device import MockCore, Slot, err
from gpulet_common.mock_nvml.scenario import EVENT_TYPES
from gpulet_common.mock_nvml.shapes import MockEventData, MockEventSet

EV_SBE: Final = EVENT_TYPES["single_bit_ecc"]
EV_DBE: Final = EVENT_TYPES["double_bit_ecc"]
EV_XID: Final = EVENT_TYPES["xid"]
EV_GPU_UNAVAILABLE: Final = EVENT_TYPES["gpu_unavailable"]
ECC_EVENTS: Final = EV_SBE | EV_DBE
# Safety bound on wake-ups inside one nvmlEventSetWait_v2 (the deadline ends it first).
_MAX_WAIT_ROUNDS: Final = 100_000


class MockEvents(MockCore):
    """``nvmlEventSetCreate`` ... ``nvmlEventSetFree``, and delivering events."""

    def _emit(
        self, slot: Slot, event_type: int, data: int, instance: tuple[int, int] | None = None
    ) -> int:
        """Queue an event in every set registered for it; ``instance``: the (gi, ci) of
        the MIG device it belongs to (None: the whole GPU)."""
        delivered = 0
        for event_set in self._event_sets:
            if not event_set.freed and event_set.registered.get(slot.slot, 0) & event_type:
                event = MockEventData(slot.handle, event_type, data)
                if instance is not None:
                    event.gpuInstanceId, event.computeInstanceId = instance
                event_set.queue.append(event)
                delivered += 1
        return delivered

    def _announce_lost(self, slot: Slot) -> None:
        # Drivers with the GpuUnavailable event report a loss as an event; older ones
        # make nvmlEventSetWait fail with GPU_IS_LOST.
        for event_set in self._event_sets:
            registered = event_set.registered.get(slot.slot, 0)
            if event_set.freed or not registered:
                continue
            if registered & EV_GPU_UNAVAILABLE:
                event_set.queue.append(MockEventData(slot.handle, EV_GPU_UNAVAILABLE, 0))
            else:
                event_set.lost_pending += 1

    def nvmlEventSetCreate(self) -> MockEventSet:
        event_set = MockEventSet()
        with self._cond:
            self._gate(self._advance())
            self._event_sets.append(event_set)
        return event_set

    def _event_set(self, eventSet: Any) -> MockEventSet:
        if not isinstance(eventSet, MockEventSet) or eventSet.freed:
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return eventSet

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        slot, _ = self._enter(handle)
        event_set = self._event_set(eventSet)
        spec = slot.spec
        if eventTypes & ~spec.event_mask:
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if eventTypes & ECC_EVENTS and not spec.ecc_enabled:
            # ECC events exist only while ECC is on, whatever the supported mask says.
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
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
                    raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
                if event_set.lost_pending:
                    event_set.lost_pending -= 1
                    raise err(pynvml.NVML_ERROR_GPU_IS_LOST)
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
        raise err(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> MockEventData:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        event_set = self._event_set(eventSet)
        with self._cond:
            event_set.freed = True
            if event_set in self._event_sets:
                self._event_sets.remove(event_set)
            self._cond.notify_all()
