"""The faults of the mock NVML: their kinds, their spec, and the checks of a fault.

One :class:`FaultSpec` describes a fault whether it comes from a scenario's timeline
(``[[timeline]]``) or from live injection (``gpulet mock inject``); :func:`check_fault`
checks what can be checked without the node's state, for both. What a fault does is in
:mod:`gpulet_common.mock_nvml.faults`.
"""

from __future__ import annotations

import math
from typing import Any, Final

import msgspec

from gpulet_common.mock_nvml.topology import NVLINK_MAX_LINKS

# Every fault kind, for the timeline and for live injection.
FAULT_KINDS: Final = (
    "xid",
    "ecc_sbe",
    "ecc_dbe",
    "temperature",
    "lost",
    "fall_off_bus",
    "remove",
    "hot_add",
    "remap_pending",
    "remap_failure",
    "hang",
    "pcie_replay",
    "nvlink_error",
    "clock_event",
    "nvlink_down",
    "nvlink_up",
    "nvml_vanish",
    "nvml_return",
    "reset",
    "recovery_action",
    # mock_nvml/gpureset.py: processes on a GPU and how the next reset goes.
    "process",
    "reset_fail",
    "reset_hang",
    "reset_degrade",
)
# Faults that carry a table (``spec``): from the timeline or MockNvml.apply only, as a
# live injection request (gpulet.mock.inject.<node>) carries none.
SPEC_FAULTS: Final = ("mig",)
ALL_FAULT_KINDS: Final = (*FAULT_KINDS, *SPEC_FAULTS)
NODE_FAULTS: Final = frozenset({"nvml_vanish", "nvml_return"})
# Faults that need a GPU; hot_add takes one optionally (re-adding a removed GPU).
GPU_FAULTS: Final = frozenset(ALL_FAULT_KINDS) - NODE_FAULTS - {"hot_add"}

# nvml_vanish: which NVML error every call returns while NVML is gone.
VANISH_ERRORS: Final[dict[str, int]] = {
    "uninitialized": 1,
    "no_permission": 4,
    "driver_not_loaded": 9,
    "library_not_found": 12,
}


class FaultSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One fault: an entry of the timeline, or a live injection (``at`` ignored).

    ``gpu`` is the scenario index ("slot") of the GPU, stable while NVML indices shift
    when GPUs disappear; hot-added GPUs take the next slots. ``value`` is the XID, the
    error count (for ``nvlink_error``: each NVLink error counter of the GPU rises by
    it), the target temperature, the NVLink number (``nvlink_down``, ``nvlink_up``) or
    the NVML error code, by kind. For ``temperature``: ``from`` (default: the current
    temperature), ``ramp_s`` up,
    ``duration_s`` held (absent: for ever), ``back_s`` down to the baseline.
    """

    fault: str
    at: float = 0.0
    gpu: int | None = None
    value: float | None = None
    duration_s: float | None = None
    from_c: float | None = msgspec.field(default=None, name="from")
    ramp_s: float = 0.0
    back_s: float = 0.0
    # xid on one MIG device: its GPU-instance and compute-instance ids (the event data
    # carries them; absent: the whole GPU).
    gi: int | None = None
    ci: int | None = None
    # nvml_vanish: a name of VANISH_ERRORS, instead of a numeric value.
    error: str | None = None
    # hot_add of a new GPU: GpuSpec fields overriding a copy of the first GPU; mig: the
    # GPU's new MIG table (instances created or destroyed, a mode change).
    spec: dict[str, Any] | None = None


def _whole(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and float(value).is_integer()


def check_fault(fault: FaultSpec, gpu_count: int, *, live: bool) -> str | None:
    """What is wrong with ``fault`` on a node of ``gpu_count`` slots, or None.

    Checks what can be checked without the node's current state; whether the fault
    applies now (e.g. removing a GPU already removed) is decided when applying it.
    """
    kind = fault.fault
    if kind not in ALL_FAULT_KINDS:
        return f"unknown fault {kind!r} (known: {', '.join(ALL_FAULT_KINDS)})"
    if kind in GPU_FAULTS and fault.gpu is None:
        return f"fault {kind!r} needs a gpu"
    if kind not in NODE_FAULTS and fault.gpu is not None and not 0 <= fault.gpu < gpu_count:
        last = f"0-{gpu_count - 1}" if gpu_count else "none"
        return f"GPU {fault.gpu} does not exist (GPUs: {last})"
    if not live and fault.at < 0:
        return "'at' must be >= 0"
    if fault.duration_s is not None and not fault.duration_s >= 0:
        return "duration_s must be >= 0"
    if fault.spec is not None and kind not in ("hot_add", "mig"):
        return "'spec' is only for hot_add and mig"
    if kind == "mig" and fault.spec is None:
        return "fault 'mig' needs spec = the GPU's new MIG table (mode, pending, devices)"
    if (fault.gi is None) != (fault.ci is None) or (fault.gi is not None and kind != "xid"):
        return "gi and ci go together, and only with fault 'xid' (an XID on one MIG device)"
    if fault.gi is not None and not (
        0 <= fault.gi < 0xFFFFFFFF and 0 <= (fault.ci or 0) < 0xFFFFFFFF
    ):
        return "gi and ci must be >= 0"
    value = fault.value
    if kind == "xid":
        if not _whole(value) or value is None or value < 0:
            return "fault 'xid' needs value = the XID number (a whole number >= 0)"
    elif kind in ("ecc_sbe", "ecc_dbe", "remap_pending", "pcie_replay", "nvlink_error"):
        if value is not None and (not _whole(value) or value < 1):
            return f"fault {kind!r}: value is a count, a whole number >= 1"
    elif kind == "temperature":
        if value is None and not live:
            return "fault 'temperature' needs value = the target temperature (C)"
        if value is not None and not -50 <= value <= 200:
            return f"fault 'temperature': {value} C is not a plausible temperature"
        if fault.ramp_s < 0 or fault.back_s < 0:
            return "fault 'temperature': ramp_s and back_s must be >= 0"
    elif kind == "hang":
        if fault.duration_s is None or fault.duration_s <= 0:
            return "fault 'hang' needs duration_s > 0"
    elif kind == "clock_event":
        if value is None or not _whole(value) or not 0 <= value <= 0xFFFF:
            return (
                "fault 'clock_event' needs value = the clock-event reason bits the GPU "
                "reports (0x8 HW slowdown, 0x80 power brake, 0x4 SW power cap; 0 ends it)"
            )
    elif kind in ("nvlink_down", "nvlink_up"):
        if value is not None and (not _whole(value) or not 0 <= value < NVLINK_MAX_LINKS):
            return (
                f"fault {kind!r}: value is the GPU's NVLink number (0-{NVLINK_MAX_LINKS - 1}); "
                "absent: every NVLink of the GPU"
            )
    elif kind == "hot_add":
        if value is not None and (value not in (0, 1) or fault.gpu is None):
            return (
                "fault 'hot_add': value 1 (with gpu) brings the GPU back enumerated after "
                "the others, at a new NVML index; 0 or absent: at its place"
            )
    elif kind == "nvml_vanish":
        if fault.error is not None and fault.error not in VANISH_ERRORS:
            return f"unknown NVML error {fault.error!r} (known: {', '.join(VANISH_ERRORS)})"
        if value is not None and (not _whole(value) or int(value) not in VANISH_ERRORS.values()):
            return (
                f"fault 'nvml_vanish': value {value} is not one of the NVML codes "
                f"{sorted(VANISH_ERRORS.values())}"
            )
    return None


def vanish_code(fault: FaultSpec) -> int:
    if fault.error is not None:
        return VANISH_ERRORS[fault.error]
    if fault.value is not None:
        return int(fault.value)
    return VANISH_ERRORS["library_not_found"]
