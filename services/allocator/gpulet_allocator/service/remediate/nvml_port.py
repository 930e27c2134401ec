"""What remediation by reset reads of a GPU through NVML, by UUID: :class:`NvmlGpu`.

Each call looks the GPU up by its UUID again (``nvmlDeviceGetHandleByUUID``): a reset
gives the GPU a new handle, and the verify's first proof is that re-discovery finds
the same UUID. Every call is blocking and runs in a worker thread
(``anyio.to_thread``), so a hung GPU blocks a thread, never the event loop. The module
is pynvml or the mock NVML (the same calls). An NVML error reads as "not known"
(None, or an empty answer), never as an exception: the machine decides what a missing
answer means (a verify fails on it; waiting for idle keeps waiting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import anyio
import pynvml

from gpulet_common.heal import GpuIdentity

RECOVERY_FIELD: Final = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
_UNCORRECTED: Final = 1  # NVML_MEMORY_ERROR_TYPE_UNCORRECTED
_VOLATILE: Final = 0  # NVML_VOLATILE_ECC
_LINK_TYPE_SWITCH: Final = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH


@dataclass(frozen=True, slots=True)
class Topology:
    # Bus ids of the GPUs joined to this one by direct NVLinks.
    direct_peers: list[str]
    nvswitch: bool
    compute_major: int


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlGpu:
    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    def _handle(self, uuid: str) -> Any:
        return self._nvml.nvmlDeviceGetHandleByUUID(uuid)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)

    async def identity(self, uuid: str) -> GpuIdentity | None:
        return await self._run(self._identity, uuid)  # type: ignore[no-any-return]

    def _identity(self, uuid: str) -> GpuIdentity | None:
        nvml = self._nvml
        try:
            handle = self._handle(uuid)
            found = _text(nvml.nvmlDeviceGetUUID(handle))
            bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
            name = _text(nvml.nvmlDeviceGetName(handle))
            memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        except pynvml.NVMLError:
            return None
        gen = width = None
        try:
            gen = int(nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))
            width = int(nvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
        except pynvml.NVMLError:
            pass
        return GpuIdentity(
            uuid=found,
            bus_id=bus_id,
            name=name,
            memory_total=memory,
            link_gen=gen,
            link_width=width,
        )

    async def processes(self, uuid: str) -> list[int] | None:
        """PIDs of the GPU's compute and graphics processes; None when unreadable."""
        return await self._run(self._processes, uuid)  # type: ignore[no-any-return]

    def _processes(self, uuid: str) -> list[int] | None:
        try:
            handle = self._handle(uuid)
            found = list(self._nvml.nvmlDeviceGetComputeRunningProcesses(handle))
            found += list(self._nvml.nvmlDeviceGetGraphicsRunningProcesses(handle))
        except pynvml.NVMLError:
            return None
        return sorted({int(p.pid) for p in found})

    async def recovery_action(self, uuid: str) -> int | None:
        """Field 230's value; None when the driver does not report it or it is unreadable."""
        return await self._run(self._recovery_action, uuid)  # type: ignore[no-any-return]

    def _recovery_action(self, uuid: str) -> int | None:
        try:
            entry = self._nvml.nvmlDeviceGetFieldValues(self._handle(uuid), [RECOVERY_FIELD])[0]
        except (pynvml.NVMLError, IndexError):
            return None
        if entry.nvmlReturn != pynvml.NVML_SUCCESS:
            return None
        return int(entry.value.uiVal)

    async def volatile_uncorrected(self, uuid: str) -> int | None:
        return await self._run(self._volatile, uuid)  # type: ignore[no-any-return]

    def _volatile(self, uuid: str) -> int | None:
        try:
            return int(
                self._nvml.nvmlDeviceGetTotalEccErrors(self._handle(uuid), _UNCORRECTED, _VOLATILE)
            )
        except pynvml.NVMLError:
            return None

    async def topology(self, uuid: str) -> Topology | None:
        return await self._run(self._topology, uuid)  # type: ignore[no-any-return]

    def _topology(self, uuid: str) -> Topology | None:
        nvml = self._nvml
        try:
            handle = self._handle(uuid)
            major = int(nvml.nvmlDeviceGetCudaComputeCapability(handle)[0])
        except pynvml.NVMLError:
            return None
        peers: list[str] = []
        switch = False
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                kind = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
                if kind == _LINK_TYPE_SWITCH:
                    switch = True
                else:
                    peers.append(_text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
            except pynvml.NVMLError:
                break
        return Topology(direct_peers=peers, nvswitch=switch, compute_major=major)
