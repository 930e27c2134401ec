"""The mock's GPU recovery action: NVML field 230 and its event.

Design
------
From the R570 driver branch on, NVML reports the action a GPU needs to recover,
``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (field id 230, read with
``nvmlDeviceGetFieldValues``): 0 NONE, 1 GPU_RESET, 2 NODE_REBOOT, 3 DRAIN_P2P,
4 DRAIN_AND_RESET (later drivers add 5 RECOVER_IMEX_DOMAIN, 6 BUS_RESET, 7
SYSTEM_REBOOT). A change is announced by the event ``nvmlEventTypeGpuRecoveryAction``
(0x8000) and, in the kernel log, by XID 154. Older drivers answer the field with
NOT_SUPPORTED.

:class:`RecoveryModel` is that state for the mock, one value per GPU slot:

* supported when the scenario's driver is R570 or later (``[system] driver_version``);
  otherwise the field reads NOT_SUPPORTED and injection is refused, as on such a driver;
* ``gpulet mock inject --gpu N --fault recovery_action --value 1`` sets it (and the
  mock delivers the 0x8000 event to the event sets that registered it);
* a GPU reset (``--fault reset``) sets it back to NONE, as the driver does once the
  reset it asked for is done; NODE_REBOOT is not cleared by a GPU reset (the mock has no
  reboot: a new mock is a new boot).

The mock (:mod:`.mock`) holds one model and calls :meth:`~RecoveryModel.field`,
:meth:`~RecoveryModel.inject` and :meth:`~RecoveryModel.on_reset` from its field read,
fault injection and GPU reset.
"""

from __future__ import annotations

from typing import Final

FIELD_ID: Final = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
EVENT_BIT: Final = 0x8000  # nvmlEventTypeGpuRecoveryAction
FIRST_DRIVER_BRANCH: Final = 570
NONE: Final = 0
NODE_REBOOT: Final = 2
SYSTEM_REBOOT: Final = 7
# Values a GPU reset does not clear.
_SURVIVE_RESET: Final = frozenset({NODE_REBOOT, SYSTEM_REBOOT})
_MAX_VALUE: Final = 0xFFFF


def driver_branch(version: str) -> int:
    """``"570.86.10"`` -> 570; 0 when unreadable."""
    head = version.strip().split(".", 1)[0]
    return int(head) if head.isdigit() else 0


class RecoveryModel:
    """Each GPU slot's recovery action, as the driver would report it."""

    def __init__(self, driver_version: str) -> None:
        self.supported = driver_branch(driver_version) >= FIRST_DRIVER_BRANCH
        self._actions: dict[int, int] = {}

    def field(self, slot: int) -> int | None:
        """The field's value for a slot; None (NOT_SUPPORTED) on older drivers."""
        return self._actions.get(slot, NONE) if self.supported else None

    def inject(self, slot: int, value: float | None) -> tuple[bool, str]:
        """Set a slot's recovery action; (applied, detail)."""
        if not self.supported:
            return False, "the driver reports no recovery action (field 230 needs R570+)"
        if value is not None and not float(value).is_integer():
            return False, f"recovery action {value} is not a whole number"
        action = int(value) if value is not None else NONE
        if not 0 <= action <= _MAX_VALUE:
            return False, f"recovery action {action} out of range"
        self._actions[slot] = action
        return True, f"recovery action {action} on GPU {slot}"

    def on_reset(self, slot: int) -> None:
        """A GPU reset is done: the action it asked for no longer applies."""
        if self._actions.get(slot, NONE) not in _SURVIVE_RESET:
            self._actions.pop(slot, None)
