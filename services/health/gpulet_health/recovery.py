"""The GPU recovery action the driver asks for (NVML field 230), and reading it.

Design
------
From the R570 driver branch on, NVML says what a GPU needs to recover:
``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (field 230; it replaced the R560 fields 226
and 227). The kernel log says the same with XID 154 ("GPU recovery action changed from
0x0 (None) to 0x4 (Drain and Reset)"). :func:`action_name` names a value, :func:`kind`
says how a GPU that needs it returns to service (the rule in
:mod:`gpulet_health.rules.recovery`), and :func:`read` reads the field through the NVML
adapter's module (blocking: call it off the event loop). Each returned entry has its
own ``nvmlReturn``: NOT_SUPPORTED (an older driver) reads as None, and then gpulet keeps
its behaviour from before the field (a sticky XID ends on a reset seen, or a clear).

Values (pynvml ``NVML_GPU_RECOVERY_ACTION_*``): 0 NONE, 1 GPU_RESET, 2 NODE_REBOOT,
3 DRAIN_P2P, 4 DRAIN_AND_RESET (12.570.86); 5 RECOVER_IMEX_DOMAIN (13.610.43; named
GPU_RESET_BUS in 13.580.65 and dropped in 13.590.48); 6 BUS_RESET, 7 SYSTEM_REBOOT
(13.615.71). An unknown value escalates: it is held like a reboot.
"""

from __future__ import annotations

import re
from typing import Any, Final, Literal

FIELD_ID: Final = 230
NONE: Final = "none"

NAMES: Final[dict[int, str]] = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}

# How a GPU that needs the action returns to service.
ReturnKind = Literal["reset", "reboot", "clears"]
_RESET: Final = frozenset({"gpu_reset", "drain_and_reset", "bus_reset"})
_CLEARS: Final = frozenset({"drain_p2p", "recover_imex_domain"})

_NAMES: Final = frozenset(NAMES.values())
_UNKNOWN = re.compile(r"unknown_[0-9]{1,20}")

# XID 154's log text: "GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)".
_XID_154 = re.compile(r"recovery action changed from 0x([0-9a-fA-F]+).*? to 0x([0-9a-fA-F]+)")


def action_name(value: int) -> str:
    return NAMES.get(value, f"unknown_{value}")


def kind(name: str) -> ReturnKind:
    """``reset``: held until a GPU reset is seen and the field reads NONE; ``reboot``:
    until the node's boot id changes (unknown values too: they escalate); ``clears``:
    until the field reads NONE."""
    if name in _RESET:
        return "reset"
    if name in _CLEARS:
        return "clears"
    return "reboot"


def known(name: str) -> str:
    """``name`` if it is one this module gives (a value's name, ``unknown_<n>``) or
    ``unsupported``; else "" (a reading kept in the KV bucket is decoded totally)."""
    if name in _NAMES or name == "unsupported" or _UNKNOWN.fullmatch(name):
        return name
    return ""


def from_xid_154(detail: str) -> int | None:
    """The new value from an XID 154 log line's text, or None."""
    found = _XID_154.search(detail)
    return int(found.group(2), 16) if found else None


def read(nvml: Any, index: int) -> int | None:
    """Field 230 of GPU ``index`` through an NVML module (pynvml or the mock); None where
    the driver does not report it. NVML errors other than NOT_SUPPORTED propagate."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    [answer] = nvml.nvmlDeviceGetFieldValues(handle, [FIELD_ID])
    if int(answer.nvmlReturn) != 0:  # NVML_SUCCESS
        return None
    value = answer.value.ullVal if hasattr(answer.value, "ullVal") else answer.value.uiVal
    return int(value)
