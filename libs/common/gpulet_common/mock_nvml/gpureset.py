"""The mock's GPU processes, PCIe link, and the reset ``nvidia-smi --gpu-reset`` does.

Design
------
Remediation by reset (docs/health.md, "Reset") waits until NVML shows no compute or
graphics process on the GPU, resets it, and checks it came back as it was. The mock
models what that needs:

* **processes**: ``gpulet mock inject --gpu N --fault process --value PID`` starts a
  process on the GPU (``duration_s``: it exits after that long; absent: it never
  exits). ``nvmlDeviceGetComputeRunningProcesses`` lists them (each with ``pid`` and
  ``usedGpuMemory``, as pynvml's structure); ``nvmlDeviceGetGraphicsRunningProcesses``
  lists none (the mock has no graphics clients).
* **the PCIe link**: ``nvmlDeviceGetCurrPcieLinkGeneration`` / ``...Width`` answer
  gen 5 x16 (an H100 SXM's link) unless a reset brought it back narrower.
* **the reset** (:meth:`MockResets.gpu_reset`, by PCI bus id, what the executor's mock
  backend calls): refused with ``NVML_ERROR_IN_USE`` while a process holds the GPU, as
  ``nvidia-smi --gpu-reset`` refuses; otherwise the GPU is reset (the ``reset`` fault's
  effects: volatile ECC counters and XIDs clear, a lost GPU returns), the recovery
  action (field 230) reads NONE unless it asked for a reboot, and the GPU gets a **new
  handle** (the old one answers INVALID_ARGUMENT, as a handle of a previous enumeration
  does).
* **a reset that goes wrong**: ``--fault reset_fail`` (``value``: how many of the next
  resets fail, default 1) makes a reset fail with ``NVML_ERROR_UNKNOWN`` and leaves the
  GPU as it was; ``--fault reset_hang --duration-s S`` makes the next reset block S
  seconds (real time) and then fail with ``NVML_ERROR_TIMEOUT``; ``--fault
  reset_degrade --value W`` makes the next reset bring the link back at width W (a
  verify must catch it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final

import pynvml

from gpulet_common.mock_nvml.device import Slot, err
from gpulet_common.mock_nvml.faults import MockFaults
from gpulet_common.mock_nvml.faultspec import FaultSpec

RESET_FAULTS: Final = ("process", "reset_fail", "reset_hang", "reset_degrade")
LINK_GEN: Final = 5
LINK_WIDTH: Final = 16
# A process's memory on the GPU, as NVML reports it (bytes).
PROCESS_MEMORY: Final = 1 << 30


@dataclass(slots=True)
class MockProcess:
    """pynvml's ``c_nvmlProcessInfo_t`` as the adapter reads it."""

    pid: int
    usedGpuMemory: int = PROCESS_MEMORY  # NVML's names
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass(slots=True)
class ResetState:
    """One slot's processes (pid -> mock time it exits) and reset knobs."""

    processes: dict[int, float] = field(default_factory=dict)
    fail_next: int = 0
    hang_next_s: float = 0.0
    degrade_to: int | None = None
    link_width: int = LINK_WIDTH
    resets: int = 0


class MockResets(MockFaults):
    """Processes, link and reset for the mock (see the module docstring)."""

    def _reset_state(self, slot: Slot) -> ResetState:
        states: dict[int, ResetState] | None = getattr(self, "_reset_states", None)
        if states is None:
            states = {}
            self._reset_states = states
        return states.setdefault(slot.slot, ResetState())

    def _apply_more(self, fault: FaultSpec, start: float) -> tuple[bool, str] | None:
        if fault.fault not in RESET_FAULTS:
            return super()._apply_more(fault, start)
        assert fault.gpu is not None  # check_fault: every one names a GPU
        slot = self._slots[fault.gpu]
        state = self._reset_state(slot)
        name = f"GPU {slot.slot} ({slot.spec.uuid})"
        if fault.fault == "process":
            pid = int(fault.value or 0)
            if pid <= 0:
                return False, "fault 'process' needs value = the PID (> 0)"
            ends = start + fault.duration_s if fault.duration_s is not None else math.inf
            state.processes[pid] = ends
            return True, f"process {pid} on {name}" + (
                f" for {fault.duration_s:g}s" if fault.duration_s is not None else ""
            )
        if fault.fault == "reset_fail":
            state.fail_next = int(fault.value) if fault.value else 1
            return True, f"the next {state.fail_next} reset(s) of {name} fail"
        if fault.fault == "reset_hang":
            state.hang_next_s = fault.duration_s or 3600.0
            return True, f"the next reset of {name} hangs {state.hang_next_s:g}s"
        width = int(fault.value or 0)
        if not 1 <= width <= LINK_WIDTH:
            return False, f"fault 'reset_degrade' needs value = a link width 1-{LINK_WIDTH}"
        state.degrade_to = width
        return True, f"the next reset of {name} brings its link back at x{width}"

    # --- NVML --------------------------------------------------------------------

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[MockProcess]:
        slot, now = self._enter(handle)
        with self._cond:
            state = self._reset_state(slot)
            state.processes = {p: t for p, t in state.processes.items() if t > now}
            return [MockProcess(pid) for pid in sorted(state.processes)]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any) -> list[MockProcess]:
        return self.nvmlDeviceGetComputeRunningProcesses(handle)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[MockProcess]:
        self._enter(handle)
        return []

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        self._enter(handle)
        return LINK_GEN

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        slot, _ = self._enter(handle)
        with self._cond:
            return self._reset_state(slot).link_width

    # --- the mock's own API --------------------------------------------------------

    def resets_of(self, slot: int) -> int:
        """How many resets of the slot succeeded (tests check a reset ran once)."""
        with self._cond:
            return self._reset_state(self._slots[slot]).resets

    def gpu_reset(self, bus_id: str) -> None:
        """Reset the GPU at ``bus_id`` as ``nvidia-smi --gpu-reset -i <bus id>`` does;
        raises the NVML error the reset ends with. Blocking (a hang sleeps)."""
        with self._cond:
            now = self._advance()
            self._gate(now)
            slot = self._by_bus_id(bus_id)
            state = self._reset_state(slot)
            state.processes = {p: t for p, t in state.processes.items() if t > now}
            if state.processes:
                raise err(pynvml.NVML_ERROR_IN_USE)
            hang, state.hang_next_s = state.hang_next_s, 0.0
            if not hang and state.fail_next > 0:
                state.fail_next -= 1
                raise err(pynvml.NVML_ERROR_UNKNOWN)
        if hang:
            self._closing.wait(hang)
            raise err(pynvml.NVML_ERROR_TIMEOUT)
        with self._cond:
            self.recovery.on_reset(slot.slot)
            self._reset(slot, f"GPU {slot.slot}")
            self._renew_handle(slot)
            if state.degrade_to is not None:
                state.link_width, state.degrade_to = state.degrade_to, None
            else:
                state.link_width = LINK_WIDTH
            state.resets += 1

    def _by_bus_id(self, bus_id: str) -> Slot:
        want = _normal_bus_id(bus_id)
        for slot in self._slots:
            if _normal_bus_id(slot.spec.bus_id) == want:
                if not slot.present and not slot.fell_off:
                    break
                return slot
        raise err(pynvml.NVML_ERROR_NOT_FOUND)


def _normal_bus_id(bus_id: str) -> str:
    """``00000000:3B:00.0`` and ``0000:3b:00.0`` are one device."""
    domain, _, rest = bus_id.strip().lower().rpartition(":")
    head, _, _bus = domain.partition(":")
    return f"{int(head or '0', 16):04x}:{_bus}:{rest}" if _bus else bus_id.strip().lower()
