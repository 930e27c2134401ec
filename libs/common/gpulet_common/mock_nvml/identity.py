"""The mock NVML's inventory functions: init, system, enumeration, identity, topology.

What the adapter's inventory reads (:mod:`gpulet_common.nvml.inventory` and
:mod:`gpulet_common.nvml.topology`), answered from the scenario's specs, with the real
error codes: NOT_SUPPORTED where the spec says a GPU lacks a feature, GPU_IS_LOST for a
lost GPU (a GPU lost with ``lost_at_start = "calls"`` still gives its handle and its
PCI info), INVALID_ARGUMENT beyond the last index or link.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml

from gpulet_common.mock_nvml.device import DISABLED, ENABLED, Link, MockCore, Slot, err
from gpulet_common.mock_nvml.shapes import MockDeviceHandle, MockPciInfo
from gpulet_common.mock_nvml.topology import NVLINK_MAX_LINKS


class MockInventory(MockCore):
    """``nvmlInit`` ... ``nvmlDeviceGetNvLinkRemoteDeviceType``."""

    def nvmlInit(self) -> None:
        with self._cond:
            now = self._advance()
            if now < self._vanished_until:
                raise err(self._vanish_code)
            if self._driver_not_loaded():
                raise err(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
            self._init_count += 1

    def _driver_not_loaded(self) -> bool:
        """The scenario's driver is not loaded yet ([system] init_failures,
        driver_loaded_file); counts one failed nvmlInit (lock held)."""
        system = self._scenario.system
        loaded = not system.driver_loaded_file or Path(system.driver_loaded_file).exists()
        if self.init_failures < system.init_failures or not loaded:
            self.init_failures += 1
            return True
        return False

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

    # --- enumeration ----------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        with self._cond:
            self._gate(self._advance())
            return len(self._enumerated)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> MockDeviceHandle:
        with self._cond:
            self._gate(self._advance())
            if not 0 <= index < len(self._enumerated):
                raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            handle = self._enumerated[index].handle
        self._enter(handle, probe=True)
        return handle

    def _find(self, match: Callable[[Slot], bool]) -> MockDeviceHandle:
        with self._cond:
            self._gate(self._advance())
            found = [s for s in self._enumerated if match(s)]
            if not found:
                raise err(pynvml.NVML_ERROR_NOT_FOUND)
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

    # --- identity -------------------------------------------------------------

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
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
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
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
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
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        state = ENABLED if enabled else DISABLED
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
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        return self._enter(handle)[0].spec.event_mask

    # --- topology -------------------------------------------------------------

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        a, _ = self._enter(device1)
        b, _ = self._enter(device2)
        return self._levels[(a.slot, b.slot)]

    def _link(self, handle: Any, link: int) -> tuple[Slot, Link]:
        slot, _ = self._enter(handle)
        if not slot.links:
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < min(len(slot.links), NVLINK_MAX_LINKS):
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return slot, slot.links[link]

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        _, nvlink = self._link(device, link)
        with self._cond:
            now = self._now()
            if now < nvlink.down_until:  # fault nvlink_down
                return DISABLED
            if nvlink.peer is None:
                return ENABLED
            # A link to a GPU that is gone is down.
            peer = self._slots[nvlink.peer]
            alive = peer.present and not peer.lost(now)
        return ENABLED if alive else DISABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> MockPciInfo:
        return MockPciInfo(self._link(device, link)[1].bus_id)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        return self._link(handle, link)[1].remote_type
