"""Recovery rule: the action the driver asks for holds the GPU until there is evidence.

Where the driver reports the GPU's recovery action (NVML field 230, R570 and later;
XID 154 in the kernel log, :mod:`gpulet_health.recovery`), any action other than NONE
raises the condition ``recovery_action`` (critical; kind ``xid``, XID 154), which keeps
the GPU out of service until the evidence the action calls for is seen -- never on a
timer:

* GPU_RESET, DRAIN_AND_RESET, BUS_RESET: a GPU reset has been observed since (volatile
  ECC counters going back, pending remaps applied, a lost GPU answering again) **and**
  the field reads NONE again, in either order (the NONE reading comes from the NVML
  event thread, the reset from the samples: whichever is taken in last ends the hold);
* NODE_REBOOT, SYSTEM_REBOOT, and any value this gpulet does not know (it escalates):
  the node's boot id (``/proc/sys/kernel/random/boot_id``) differs from the one the
  condition was raised in -- checked on every tick, so after a restart the state read
  back from the KV bucket ends at once;
* DRAIN_P2P, RECOVER_IMEX_DOMAIN: the field reads NONE again.

NONE lets the GPU return: it raises nothing and ends a hold whose evidence is complete.
The condition is not sticky, so a GPU reset alone does not end it (it ends the sticky
XID conditions, as before); ``gpulet health clear`` still does. Every XID event carries
the last action read (``HealthEvent.recovery_action``). A driver that does not report
the field keeps the behaviour from before it, and the XID condition's message says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpulet_common.messages import Action
from gpulet_health.dedup import Emit
from gpulet_health.recovery import NONE, ReturnKind, action_name, kind
from gpulet_health.rules.base import Family, memo, where
from gpulet_health.state import Condition, GpuState

CONDITION = "recovery_action"
XID_RECOVERY = 154
UNSUPPORTED = "unsupported"

_ACTIONS: dict[ReturnKind, Action] = {
    "reset": "reset_gpu",
    "reboot": "reboot",
    "clears": "operator_check",
}
_KINDS: dict[str, ReturnKind] = {a: k for k, a in _ACTIONS.items()}
_EVIDENCE: dict[ReturnKind, str] = {
    "reset": "until a GPU reset is seen and the driver reads NONE again",
    "reboot": "until the node reboots (its boot id changes)",
    "clears": "until the driver reads NONE again",
}


@dataclass(slots=True)
class _Memo:
    reset_seen: bool = False


class Recovery(Family):
    name = "recovery"

    def reset(self, gpu: GpuState) -> None:
        memo(gpu, self.name, _Memo).reset_seen = True

    def after_reset(self, gpu: GpuState, now: float) -> list[Emit]:
        """The field read NONE before the reset was seen: both pieces of evidence are in
        (the readings and the samples that show a reset come by separate paths, in
        either order; the field is not read again once it reads NONE)."""
        active = gpu.conditions.get(CONDITION)
        if active is None or gpu.recovery != NONE or _KINDS.get(active.action) != "reset":
            return []
        return self.kit.end(
            gpu, CONDITION, now, "the driver's recovery action reads NONE and a GPU reset was seen"
        )

    def observe(self, gpu: GpuState, value: int | None, now: float) -> list[Emit]:
        """The field read (or an XID 154 seen): None where the driver lacks it."""
        if value is None:
            gpu.recovery = UNSUPPORTED
            return []
        name = action_name(value)
        gpu.recovery = name
        active = gpu.conditions.get(CONDITION)
        mine = memo(gpu, self.name, _Memo)
        if name == NONE:
            if active is None:
                return []
            held = _KINDS.get(active.action, "reboot")
            if held == "clears" or (held == "reset" and mine.reset_seen):
                why = "a GPU reset was seen and " if held == "reset" else ""
                return self.kit.end(
                    gpu, CONDITION, now, f"{why}the driver's recovery action reads NONE"
                )
            return []  # still waiting for the reset, or for a reboot
        if active is not None and (
            active.observed_value == float(value)
            # Read back from the KV bucket (no value kept): the same kind of hold.
            or (active.observed_value is None and _KINDS.get(active.action) == kind(name))
        ):
            return []
        out: list[Emit] = []
        if active is not None:
            out += self.kit.end(gpu, CONDITION, now, f"superseded: the driver now asks {name}")
        mine.reset_seen = False
        how = kind(name)
        out += self.kit.raise_(
            gpu,
            Condition(
                condition=CONDITION,
                kind="xid",
                severity="critical",
                reason=(
                    f"{where(gpu)}: the driver asks for recovery action {name} "
                    f"(NVML field 230 = {value}); held {_EVIDENCE[how]}"
                ),
                action=_ACTIONS[how],
                since=now,
                observed_value=float(value),
                xid=XID_RECOVERY,
                boot_id=self.kit.boot_id,
            ),
            now,
        )
        return out

    def tick(self, gpu: GpuState, now: float) -> list[Emit]:
        active = gpu.conditions.get(CONDITION)
        boot = self.kit.boot_id
        if active is None or not boot or not active.boot_id or active.boot_id == boot:
            return []
        if _KINDS.get(active.action, "reboot") != "reboot":
            return []
        return self.kit.end(
            gpu, CONDITION, now, f"the node rebooted (boot id {active.boot_id} -> {boot})"
        )
