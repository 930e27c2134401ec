"""The mock NVML's MIG piece: MIG mode, GPU and compute instance tables, MIG devices.

Each GPU with a ``[gpus.mig]`` table (:mod:`.migspec`) has a table of GPU instances
(id, profile id, placement) and, per GPU instance, its compute instances: one MIG
device each, handed out by ``nvmlDeviceGetMigDeviceHandleByIndex`` in slot order, an
empty slot answering NOT_FOUND. A MIG device handle answers what real NVML answers on
one: its UUID (``MIG-<uuid>``), its memory (used in proportion to its GPU's reading),
its attributes (multiprocessors, engines,
slices), its GPU-instance and compute-instance ids and its parent. A GPU without the
table answers NOT_SUPPORTED for the mode and 0 for the maximum MIG device count, as a
T4 does on real NVML.

A pending mode that differs from the current one (``pending`` in the table) is what
``nvmlDeviceGetMigMode`` reports until the GPU is reset; the mock keeps it pending. The
fault ``mig`` replaces a GPU's table while the mock runs (instances created or
destroyed, a mode change), for the collector to see without a restart.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import pynvml

from gpulet_common.mock_nvml.device import Slot, err
from gpulet_common.mock_nvml.faultspec import FaultSpec
from gpulet_common.mock_nvml.identity import MockInventory
from gpulet_common.mock_nvml.migspec import (
    SMS_PER_SLICE,
    MigSpec,
    Profile,
    check_mig,
    memory_mib,
    mig_uuid,
    parse_profile,
)
from gpulet_common.mock_nvml.readings import MockReadings
from gpulet_common.mock_nvml.shapes import MockDeviceHandle, MockMemory

# GPU instance profile ids by slices (nvml.h); the media-extension ones by slices too.
_GI_PROFILES: Final = {
    1: pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE,
    6: pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE,
    7: pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE,
    8: pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE,
}
_GI_MEDIA_PROFILES: Final = {
    1: pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,
    2: pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1,
}


@dataclass(frozen=True, slots=True)
class MigEntry:
    """One MIG device of the mock: compute instance ``ci`` of GPU instance ``gi``."""

    index: int
    gi: int
    ci: int
    uuid: str
    profile: Profile
    memory_mib: int
    gi_profile_id: int
    placement_start: int


class MockMigHandle:
    """A MIG device handle: its parent's slot and its place in the tables."""

    __slots__ = ("entry", "parent")

    def __init__(self, parent: MockDeviceHandle, entry: MigEntry) -> None:
        self.parent = parent
        self.entry = entry

    def __repr__(self) -> str:
        return f"<MockMigHandle slot={self.parent.slot} gi={self.entry.gi} ci={self.entry.ci}>"


class MockGpuInstance:
    """Like ``c_nvmlGpuInstance_t``: an opaque GPU instance handle."""

    __slots__ = ("gi", "parent")

    def __init__(self, parent: MockDeviceHandle, gi: int) -> None:
        self.parent = parent
        self.gi = gi


class MockPlacement:
    __slots__ = ("size", "start")

    def __init__(self, start: int, size: int) -> None:
        self.start = start
        self.size = size


class MockGpuInstanceInfo:
    """Like ``c_nvmlGpuInstanceInfo_t``."""

    __slots__ = ("device", "id", "placement", "profileId")

    def __init__(self, device: MockDeviceHandle, entry: MigEntry) -> None:
        self.device = device
        self.id = entry.gi
        self.profileId = entry.gi_profile_id
        self.placement = MockPlacement(entry.placement_start, entry.profile.g)


class MockDeviceAttributes:
    """Like ``c_nvmlDeviceAttributes`` (engine counts made up, plausible)."""

    __slots__ = (
        "computeInstanceSliceCount",
        "gpuInstanceSliceCount",
        "memorySizeMB",
        "multiprocessorCount",
        "sharedCopyEngineCount",
        "sharedDecoderCount",
        "sharedEncoderCount",
        "sharedJpegCount",
        "sharedOfaCount",
    )

    def __init__(self, c: int, g: int, memory_mib: int, media: bool) -> None:
        self.multiprocessorCount = c * SMS_PER_SLICE
        self.sharedCopyEngineCount = g
        self.sharedDecoderCount = g // 2 + (1 if media else 0)
        self.sharedEncoderCount = 0
        self.sharedJpegCount = 1 if media or g == 7 else 0
        self.sharedOfaCount = 1 if media or g == 7 else 0
        self.gpuInstanceSliceCount = g
        self.computeInstanceSliceCount = c
        self.memorySizeMB = memory_mib


class MockMig(MockInventory, MockReadings):
    """``nvmlDeviceGetMigMode`` ... ``nvmlGpuInstanceGetInfo``; MIG handles in the
    identity and memory calls; the ``mig`` fault."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # MIG tables changed since the start (fault ``mig``), by slot.
        self._mig_now: dict[int, MigSpec] = {}

    def _mig_spec(self, slot: Slot) -> MigSpec | None:
        return self._mig_now.get(slot.slot, slot.spec.mig)

    def _apply_more(self, fault: FaultSpec, start: float) -> tuple[bool, str] | None:
        if fault.fault != "mig":
            return super()._apply_more(fault, start)
        assert fault.gpu is not None  # check_fault: it names a GPU
        slot = self._slots[fault.gpu]
        name = f"GPU {slot.slot} ({slot.spec.uuid})"
        if slot.spec.mig is None:
            return False, f"{name} ({slot.spec.name}) has no MIG"
        try:
            spec = msgspec.convert(fault.spec, MigSpec)
        except msgspec.ValidationError as exc:
            return False, f"MIG table for {name}: {exc}"
        problem = check_mig(spec, slot.spec.memory_total_mib)
        if problem is not None:
            return False, f"MIG table for {name}: {problem}"
        self._mig_now[slot.slot] = spec
        return (
            True,
            f"{name}: MIG {spec.mode} (pending {spec.pending_mode}), {len(spec.devices)} device(s)",
        )

    def _mig_table(self, slot: Slot) -> list[MigEntry]:
        """The slot's MIG devices in slot order (GPU instance, then compute instance)."""
        mig = self._mig_spec(slot)
        if mig is None or mig.mode != "enabled":
            return []
        entries: list[MigEntry] = []
        starts: dict[int, int] = {}
        for device in sorted(mig.devices, key=lambda d: (d.gi, d.ci)):
            profile = parse_profile(device.profile)
            if device.gi not in starts:
                starts[device.gi] = sum(
                    parse_profile(d.profile).g
                    for d in {d.gi: d for d in mig.devices if d.gi < device.gi}.values()
                )
            media = _GI_MEDIA_PROFILES.get(profile.g) if profile.media else None
            entries.append(
                MigEntry(
                    index=len(entries),
                    gi=device.gi,
                    ci=device.ci,
                    uuid=device.uuid
                    or mig_uuid(self._scenario.seed, slot.slot, device.gi, device.ci),
                    profile=profile,
                    memory_mib=memory_mib(profile, slot.spec.memory_total_mib),
                    gi_profile_id=media if media is not None else _GI_PROFILES.get(profile.g, 0),
                    placement_start=starts[device.gi],
                )
            )
        return entries

    def _mig_slot(self, device: Any) -> Slot:
        """The parent GPU of a MIG call (a full GPU handle), with MIG support."""
        slot, _ = self._enter(device)
        if self._mig_spec(slot) is None:
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return slot

    def _mig_entry(self, handle: MockMigHandle) -> MigEntry:
        slot, _ = self._enter(handle.parent)
        if handle.entry not in self._mig_table(slot):
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # destroyed since
        return handle.entry

    # --- the parent GPU ---------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        mig = self._mig_spec(self._mig_slot(device))
        assert mig is not None
        on, off = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE
        return [on if mig.mode == "enabled" else off, on if mig.pending_mode == "enabled" else off]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        slot, _ = self._enter(device)
        mig = self._mig_spec(slot)
        return mig.max_devices if mig is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> MockMigHandle:
        slot = self._mig_slot(device)
        mig = self._mig_spec(slot)
        assert mig is not None
        if not 0 <= index < mig.max_devices:
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        table = self._mig_table(slot)
        if index >= len(table):
            raise err(pynvml.NVML_ERROR_NOT_FOUND)
        return MockMigHandle(slot.handle, table[index])

    def nvmlDeviceGetGpuInstanceById(self, device: Any, id: int) -> MockGpuInstance:
        slot = self._mig_slot(device)
        if not any(e.gi == id for e in self._mig_table(slot)):
            raise err(pynvml.NVML_ERROR_NOT_FOUND)
        return MockGpuInstance(slot.handle, id)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> MockGpuInstanceInfo:
        if not isinstance(gpuInstance, MockGpuInstance):
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        slot = self._mig_slot(gpuInstance.parent)
        for entry in self._mig_table(slot):
            if entry.gi == gpuInstance.gi:
                return MockGpuInstanceInfo(slot.handle, entry)
        raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    # --- a MIG device -------------------------------------------------------------------

    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> ctypes.c_uint:
        if isinstance(device, MockMigHandle):
            self._mig_entry(device)
            return ctypes.c_uint(1)
        self._enter(device)
        return ctypes.c_uint(0)

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        if not isinstance(device, MockMigHandle):
            self._enter(device)
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._mig_entry(device).gi

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        if not isinstance(device, MockMigHandle):
            self._enter(device)
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._mig_entry(device).ci

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> MockDeviceHandle:
        if not isinstance(migDevice, MockMigHandle):
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._mig_entry(migDevice)
        return migDevice.parent

    def nvmlDeviceGetAttributes_v2(self, device: Any) -> MockDeviceAttributes:
        if isinstance(device, MockMigHandle):
            entry = self._mig_entry(device)
            profile = entry.profile
            return MockDeviceAttributes(profile.c, profile.g, entry.memory_mib, profile.media)
        slot, _ = self._enter(device)
        return MockDeviceAttributes(0, 0, slot.spec.memory_total_mib, False)

    def nvmlDeviceGetAttributes(self, device: Any) -> MockDeviceAttributes:
        return self.nvmlDeviceGetAttributes_v2(device)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if isinstance(handle, MockMigHandle):
            return self._mig_entry(handle).uuid
        return super().nvmlDeviceGetUUID(handle)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> MockMemory:
        if isinstance(handle, MockMigHandle):
            total = self._mig_entry(handle).memory_mib * 1024 * 1024
            # Used as the GPU's own reading is used, in proportion (a scenario's memory
            # readings and faults show on its MIG devices too).
            parent = super().nvmlDeviceGetMemoryInfo(handle.parent, version)
            used = min(total, parent.used * total // parent.total) if parent.total else 0
            return MockMemory(total=total, free=total - used, used=used)
        return super().nvmlDeviceGetMemoryInfo(handle, version)
