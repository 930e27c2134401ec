"""The NVML adapter's MIG piece: a GPU's MIG mode and its MIG devices.

What is read
------------
For every GPU of the inventory (:meth:`MigReader._extend_info`), and again when the
collector looks for a layout change (:meth:`MigReader.mig_changed`, on its slow period):

* ``nvmlDeviceGetMaxMigDeviceCount``: MIG-capable when > 0 (7 on A100/H100/B200, 0 on
  a T4 or an L40S);
* ``nvmlDeviceGetMigMode``: the current and the pending mode (a change applies at the
  next GPU reset);
* with MIG enabled, each slot ``i < max`` of ``nvmlDeviceGetMigDeviceHandleByIndex``,
  and of each MIG device its UUID, GPU-instance and compute-instance ids, memory,
  attributes (multiprocessors, engines, slices) and profile name.

NOT_SUPPORTED (a GPU without MIG), FUNCTION_NOT_FOUND (an old driver or binding) and
NO_PERMISSION leave the fields absent; NOT_FOUND is an empty slot. None of them is an
error. GPU_IS_LOST and NVML going away raise as everywhere in the adapter; any other
failure of one MIG device leaves that device out, logged.

Samples
-------
The handles of the MIG devices are kept from the last read; each sample of the GPU
reads every MIG device's ``nvmlDeviceGetMemoryInfo`` through them
(:meth:`MigReader._mig_samples`, for dcgm-exporter's per-GPU-instance memory metrics).
A handle that fails (the MIG device was destroyed) is dropped until the layout is read
again.

Profile names
-------------
Named as NVML's tools name them (``NVIDIA/go-nvlib:pkg/nvlib/device/mig_profile.go``):
``<g>g.<gb>gb`` when the compute instance spans its GPU instance, ``<c>c.<g>g.<gb>gb``
otherwise, ``+me`` for the media-extension GPU instance profiles; GB is the device's
share of the GPU's memory rounded up to an eighth, times the GPU's memory in whole GB
(:func:`profile_gb`). The mock NVML names its profiles with the same functions.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from gpulet_common.messages import GpuInfo, MigDevice, MigSample
from gpulet_common.nvml.calls import (
    FIELD_UNSUPPORTED,
    Backend,
    GpuHandle,
    NvmlCalls,
    log,
    text,
)
from gpulet_common.nvml.errors import NVML_ERROR_INVALID_ARGUMENT

# NVML_ERROR_NOT_FOUND: an empty MIG slot.
NVML_ERROR_NOT_FOUND: Final = 6
# At most this many MIG devices are asked for per GPU, whatever NVML's count says.
MAX_MIG_SLOTS: Final = 64
_GIB: Final = 1024**3


def profile_gb(memory_mib: int, total_bytes: int) -> int:
    """The GB of a profile name: the device's memory as a share of the GPU's, rounded
    up to an eighth, times the GPU's memory in whole GB (rounded up), rounded."""
    if total_bytes <= 0:
        return 0
    eighths = -(-memory_mib * 1024 * 1024 * 8 // total_bytes)  # a ceiling, in integers
    total_gb = -(-total_bytes // _GIB)
    return int(eighths * total_gb / 8 + 0.5)


def profile_name(c: int, g: int, gb: int, media: bool) -> str:
    """``1g.10gb``, ``1c.2g.20gb``, ``1g.10gb+me``."""
    suffix = "+me" if media else ""
    return f"{g}g.{gb}gb{suffix}" if c == g else f"{c}c.{g}g.{gb}gb{suffix}"


class MigReader(NvmlCalls):
    """A GPU's MIG mode and MIG devices, added to its :class:`GpuInfo`."""

    def __init__(self, nvml_module: Any, backend: Backend = "nvml") -> None:
        super().__init__(nvml_module, backend)
        bind, const = self._bind, self._const
        self._f_max_mig = bind("nvmlDeviceGetMaxMigDeviceCount")
        self._f_mig_mode = bind("nvmlDeviceGetMigMode")
        self._f_mig_handle = bind("nvmlDeviceGetMigDeviceHandleByIndex")
        self._f_gi_id = bind("nvmlDeviceGetGpuInstanceId")
        self._f_ci_id = bind("nvmlDeviceGetComputeInstanceId")
        self._f_attributes = bind("nvmlDeviceGetAttributes_v2") or bind("nvmlDeviceGetAttributes")
        self._f_gi_by_id = bind("nvmlDeviceGetGpuInstanceById")
        self._f_gi_info = bind("nvmlGpuInstanceGetInfo")
        self._c_mig_enable = const("NVML_DEVICE_MIG_ENABLE", 1)
        # GPU UUID -> its MIG devices and their handles, as last read (for samples).
        self._mig_handles: dict[str, tuple[tuple[MigDevice, Any], ...]] = {}
        self._c_media_profiles = frozenset(
            {
                const("NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1", 0x7),
                const("NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1", 0x8),
            }
        )

    def _extend_info(self, gpu: GpuHandle, info: GpuInfo) -> GpuInfo:
        return self._with_mig(gpu, super()._extend_info(gpu, info))

    def mig_changed(self, info: GpuInfo) -> bool:
        """Whether a MIG-capable GPU's MIG state differs from ``info``'s: instances
        created or destroyed, a mode change. Raises as the inventory does (a lost GPU)."""
        if not info.mig_capable:
            return False
        gpu = self._gpus.get(info.index) or self._load(info.index)
        if gpu.uuid != info.uuid:
            return True
        bare = msgspec.structs.replace(info, mig_mode=None, mig_mode_pending=None, mig_devices=[])
        now = self._with_mig(gpu, bare)
        return (now.mig_mode, now.mig_mode_pending, now.mig_devices) != (
            info.mig_mode,
            info.mig_mode_pending,
            info.mig_devices,
        )

    def _with_mig(self, gpu: GpuHandle, info: GpuInfo) -> GpuInfo:
        max_count = self._opt(gpu, self._f_max_mig)
        mode = self._opt(gpu, self._f_mig_mode)
        fields: dict[str, Any] = {}
        if max_count is not None:
            fields["mig_max_devices"] = int(max_count)
        found: list[tuple[MigDevice, Any]] = []
        if mode is not None:
            current, pending = int(mode[0]), int(mode[1])
            fields["mig_mode"] = "enabled" if current == self._c_mig_enable else "disabled"
            fields["mig_mode_pending"] = "enabled" if pending == self._c_mig_enable else "disabled"
            if current == self._c_mig_enable and max_count:
                found = self._mig_devices(gpu, int(max_count), info)
                fields["mig_devices"] = [device for device, _ in found]
        self._mig_handles[gpu.uuid] = tuple(found)
        return msgspec.structs.replace(info, **fields) if fields else info

    def _mig_samples(self, gpu: GpuHandle) -> list[MigSample]:
        """Each MIG device's memory, through the handles the last inventory read. A
        handle that fails (the MIG device was destroyed since) is dropped until the next
        inventory; only a lost GPU or NVML going away raises."""
        entries = self._mig_handles.get(gpu.uuid)
        fn = self._f_memory
        if not entries or fn is None:
            return []
        out: list[MigSample] = []
        stale: list[str] = []
        for device, handle in entries:
            try:
                memory = fn(handle)
            except self._error_type as exc:
                if self._code(exc) not in FIELD_UNSUPPORTED:
                    self._raise_if_gone(gpu, exc, "nvmlDeviceGetMemoryInfo")
                    log.debug("GPU %d: MIG device %s unreadable: %s", gpu.index, device.uuid, exc)
                    stale.append(device.uuid)
                    continue
                memory = None
            out.append(
                MigSample(
                    uuid=device.uuid,
                    gpu_instance_id=device.gpu_instance_id,
                    compute_instance_id=device.compute_instance_id,
                    memory_used_bytes=int(memory.used) if memory is not None else None,
                    memory_free_bytes=int(memory.free) if memory is not None else None,
                )
            )
        if stale:
            self._mig_handles[gpu.uuid] = tuple(e for e in entries if e[0].uuid not in stale)
        return out

    def _mig_devices(
        self, gpu: GpuHandle, count: int, info: GpuInfo
    ) -> list[tuple[MigDevice, Any]]:
        fn = self._f_mig_handle
        if fn is None:
            return []
        devices: list[tuple[MigDevice, Any]] = []
        for index in range(min(count, MAX_MIG_SLOTS)):
            try:
                handle = fn(gpu.handle, index)
            except self._error_type as exc:
                code = self._code(exc)
                if code == NVML_ERROR_NOT_FOUND:
                    continue  # an empty slot
                if code in FIELD_UNSUPPORTED or code == NVML_ERROR_INVALID_ARGUMENT:
                    break
                self._raise_if_gone(gpu, exc, "nvmlDeviceGetMigDeviceHandleByIndex")
                log.warning("GPU %d: MIG slot %d unreadable: %s", gpu.index, index, exc)
                continue
            device = self._mig_device(gpu, index, handle, info)
            if device is not None:
                devices.append((device, handle))
        return devices

    def _mig_device(
        self, gpu: GpuHandle, index: int, handle: Any, info: GpuInfo
    ) -> MigDevice | None:
        uuid = self._opt(gpu, self._f_uuid, on=handle)
        gi = self._opt(gpu, self._f_gi_id, on=handle)
        ci = self._opt(gpu, self._f_ci_id, on=handle)
        if not uuid or gi is None or ci is None:
            log.warning(
                "GPU %d: MIG device %d has no UUID or instance ids: left out", gpu.index, index
            )
            return None
        attributes = self._opt(gpu, self._f_attributes, on=handle)
        memory = self._opt(gpu, self._f_memory, on=handle)
        fields: dict[str, Any] = {}
        if memory is not None:
            fields["memory_total_bytes"] = int(memory.total)
        if attributes is not None:
            c = int(attributes.computeInstanceSliceCount)
            g = int(attributes.gpuInstanceSliceCount)
            gb = profile_gb(int(attributes.memorySizeMB), info.memory_total_bytes)
            media = self._media(gpu, int(gi))
            fields.update(
                profile=profile_name(c, g, gb, media) if c and g and gb else "",
                multiprocessors=int(attributes.multiprocessorCount),
                slices_gi=g,
                slices_ci=c,
                copy_engines=int(attributes.sharedCopyEngineCount),
                decoders=int(attributes.sharedDecoderCount),
                encoders=int(attributes.sharedEncoderCount),
                jpegs=int(attributes.sharedJpegCount),
                ofas=int(attributes.sharedOfaCount),
            )
        return MigDevice(
            uuid=text(uuid),
            index=index,
            gpu_instance_id=int(gi),
            compute_instance_id=int(ci),
            **fields,
        )

    def _media(self, gpu: GpuHandle, gi: int) -> bool:
        """Whether the GPU instance has media extensions (its profile id says so)."""
        instance = self._opt(gpu, self._f_gi_by_id, gi)
        if instance is None or self._f_gi_info is None:
            return False
        details = self._opt(gpu, self._f_gi_info, on=instance)
        return details is not None and int(details.profileId) in self._c_media_profiles
