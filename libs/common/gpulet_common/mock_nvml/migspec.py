"""MIG in a mock scenario: a GPU's MIG mode and its GPU and compute instances.

A GPU of a scenario may carry a ``[gpus.mig]`` table (or ``[gpu_defaults.mig]``)::

    [gpus.mig]
    mode = "enabled"          # current MIG mode: "enabled" or "disabled"
    pending = "enabled"       # after the next GPU reset (default: as ``mode``)
    max_devices = 7           # nvmlDeviceGetMaxMigDeviceCount
    devices = [               # one entry per MIG device: (GPU instance, compute instance)
      { gi = 1, ci = 0, profile = "3g.40gb" },
      { gi = 2, ci = 0, profile = "1c.2g.20gb" },   # a CI over part of its GI
      { gi = 3, ci = 0, profile = "1g.10gb+me" },   # media extensions
    ]

A GPU without the table has no MIG at all: ``nvmlDeviceGetMigMode`` answers
NOT_SUPPORTED and ``nvmlDeviceGetMaxMigDeviceCount`` 0, as real NVML does on a T4 (not
as NVIDIA's own mock, which answers "disabled" everywhere).

Profile names follow NVML's rules (``NVIDIA/go-nvlib:pkg/nvlib/device/mig_profile.go``,
implemented once, in :mod:`gpulet_common.nvml.mig`):
``<g>g.<gb>gb`` for a compute instance over all of its GPU instance's slices,
``<c>c.<g>g.<gb>gb`` otherwise, ``+me`` for the media-extension GPU instance profiles.
The mock gives each device a memory size that the naming rule turns back into the
profile's GB (:func:`memory_mib`), and made-up but plausible engine counts
(:class:`MigDeviceSpec`); the GPU instances' slices come from the profile.
"""

from __future__ import annotations

import hashlib
import re
import uuid as uuid_module
from typing import Final, Literal

import msgspec

from gpulet_common.nvml.mig import profile_gb

# nvmlDeviceGetMaxMigDeviceCount on a MIG-capable GPU (A100, H100, H200, B200).
MAX_MIG_DEVICES: Final = 7
_PROFILE: Final = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb(\+me)?$")
# Streaming multiprocessors per compute slice in the mock (an H100 SXM has 132 SMs in 7
# slices plus spare ones; an A100 108).
SMS_PER_SLICE: Final = 16

MigMode = Literal["enabled", "disabled"]


class MigDeviceSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One MIG device: a compute instance ``ci`` of the GPU instance ``gi``."""

    gi: int
    ci: int = 0
    profile: str
    # Left empty: generated from the scenario seed, the slot, gi and ci.
    uuid: str = ""


class MigSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    mode: MigMode = "disabled"
    pending: MigMode | None = None
    max_devices: int = MAX_MIG_DEVICES
    devices: list[MigDeviceSpec] = []

    @property
    def pending_mode(self) -> MigMode:
        return self.pending if self.pending is not None else self.mode


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed profile name: compute slices, GPU instance slices, GB, media extensions."""

    c: int
    g: int
    gb: int
    media: bool


def parse_profile(name: str) -> Profile:
    """``1g.10gb``, ``1c.2g.20gb``, ``1g.10gb+me``; raises ValueError."""
    match = _PROFILE.fullmatch(name.strip())
    if match is None:
        raise ValueError(
            f"MIG profile {name!r} is not <g>g.<gb>gb or <c>c.<g>g.<gb>gb (with +me optionally)"
        )
    g = int(match.group(2))
    c = int(match.group(1)) if match.group(1) else g
    gb = int(match.group(3))
    if not 1 <= c <= g <= 8 or gb < 1:
        raise ValueError(f"MIG profile {name!r}: needs 1 <= c <= g <= 8 and at least 1 GB")
    return Profile(c=c, g=g, gb=gb, media=bool(match.group(4)))


def memory_mib(profile: Profile, total_mib: int) -> int:
    """A memory size that the naming rule turns back into the profile's GB: a little
    below the profile's share of the GPU, as on real GPUs (the driver keeps some)."""
    total_gb = -(-total_mib // 1024)
    return profile.gb * total_mib * 98 // (total_gb * 100)


def mig_uuid(seed: int, slot: int, gi: int, ci: int) -> str:
    digest = hashlib.sha256(f"{seed}:{slot}:{gi}:{ci}:mig".encode()).digest()
    return f"MIG-{uuid_module.UUID(bytes=digest[:16])}"


def check_mig(spec: MigSpec, total_mib: int) -> str | None:
    """What is wrong with a GPU's MIG table, or None."""
    if not 0 <= spec.max_devices <= 64:
        return "max_devices must be within 0-64"
    if spec.devices and spec.mode != "enabled":
        return "MIG devices need mode = 'enabled'"
    if len(spec.devices) > spec.max_devices:
        return f"{len(spec.devices)} MIG devices, more than max_devices = {spec.max_devices}"
    seen: set[tuple[int, int]] = set()
    instances: dict[int, tuple[int, int]] = {}
    compute: dict[int, int] = {}
    for device in spec.devices:
        where = f"MIG device gi={device.gi} ci={device.ci}"
        if device.gi < 0 or device.ci < 0:
            return f"{where}: gi and ci must be >= 0"
        if (device.gi, device.ci) in seen:
            return f"{where} is listed twice"
        seen.add((device.gi, device.ci))
        try:
            profile = parse_profile(device.profile)
        except ValueError as exc:
            return f"{where}: {exc}"
        gpu_instance = (profile.g, profile.gb)
        if instances.setdefault(device.gi, gpu_instance) != gpu_instance:
            return f"{where}: GPU instance {device.gi} has another size in another entry"
        compute[device.gi] = compute.get(device.gi, 0) + profile.c
        if compute[device.gi] > profile.g:
            return f"{where}: the compute instances take more than GPU instance {device.gi}"
        if profile_gb(memory_mib(profile, total_mib), total_mib * 1024 * 1024) != profile.gb:
            return f"{where}: {profile.gb} GB does not fit this GPU's memory"
    # Seven compute slices (an 8-slice profile, where a GPU has one, takes the GPU alone).
    slices = sum(g for g, _ in instances.values())
    if slices > 7 and not (slices == 8 and len(instances) == 1):
        return f"the GPU instances take {slices} slices, more than the GPU's 7"
    return None
