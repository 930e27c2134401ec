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

Across a restart of the service: the hold is read back from the KV bucket with its boot
id and whether a reset was seen (``Condition.reset_seen``), and the field is read again
for every GPU it holds (:meth:`RuleEngine.recovery_holds`, the NVML event thread's
``ask_recovery``), since no event may come. The last reading is read back too, to show,
never as evidence: only a reading taken after the restart ends a hold. A reset while the
service was down is seen only where it leaves a trace (a pending remap applied, a lost
GPU answering): the volatile ECC counters it compares start afresh. So a reset hold that
reads NONE after a restart with no reset seen stays held (fail closed), and says so in
its reason and, once two samples show no reset, in a warning event; the next reset
seen, or a clear, ends it.

NONE lets the GPU return: it raises nothing and ends a hold whose evidence is complete.
The condition is not sticky, so a GPU reset alone does not end it (it ends the sticky
XID conditions, as before); ``gpulet health clear`` still does. Every XID event, and
every event of the hold, carries the last action read (``HealthEvent.recovery_action``).
A driver that does not report the field keeps the behaviour from before it, and the XID
condition's message says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from gpulet_common.messages import Action, GpuSample
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


# A held GPU's reason says how far its evidence got after this separator.
_NOW = "; now: "
_UNPROVEN = "the driver reads NONE again, but no GPU reset has been seen since the hold was raised"
_RESTARTED = (
    " or since gpulet restarted (a reset while gpulet was down leaves no proof: the "
    "volatile ECC counters it compares start afresh)"
)
_UNTIL = (
    "; held until a reset is seen (volatile ECC counters going back, pending remaps "
    "applied, the GPU answering again after a loss) or `gpulet health clear`"
)
_RESET_SEEN = "a GPU reset was seen; held until the driver reads NONE again"


@dataclass(slots=True)
class _Memo:
    # The field was read in this run. A reading read back from the KV bucket is shown,
    # never taken as evidence: the driver may have asked again while gpulet was down.
    read: bool = False
    # A hold read back that reads NONE with no reset seen: when that was read, and the
    # samples taken in since (the warning waits for two, see sample()); whether said.
    unproven_at: float | None = None
    samples: int = 0
    warned: bool = False


class Recovery(Family):
    name = "recovery"

    def after_reset(self, gpu: GpuState, now: float) -> list[Emit]:
        """A GPU reset was seen: it ends a reset hold whose field already read NONE (the
        readings and the samples that show a reset come by separate paths, in either
        order; the field is not read again once it reads NONE); else the hold keeps it
        (``Condition.reset_seen``, in the KV bucket too) for the NONE to come."""
        active = gpu.conditions.get(CONDITION)
        if active is None or _KINDS.get(active.action) != "reset":
            return []
        if gpu.recovery == NONE and memo(gpu, self.name, _Memo).read:
            return self._carry(
                gpu,
                self.kit.end(
                    gpu,
                    CONDITION,
                    now,
                    "the driver's recovery action reads NONE and a GPU reset was seen",
                ),
            )
        if not active.reset_seen:
            active.reset_seen = True
            self.kit.touch(gpu, now)
        self._progress(gpu, active, now)
        return []

    def observe(self, gpu: GpuState, value: int | None, now: float) -> list[Emit]:
        """The field read (or an XID 154 seen): None where the driver lacks it."""
        name = UNSUPPORTED if value is None else action_name(value)
        if gpu.recovery != name:  # kept in the KV bucket, shown by `gpulet health`
            gpu.recovery = name
            self.kit.touch(gpu, now)
        if value is None:
            return []
        memo(gpu, self.name, _Memo).read = True
        return self._carry(gpu, self._observe(gpu, value, name, now))

    def _observe(self, gpu: GpuState, value: int, name: str, now: float) -> list[Emit]:
        active = gpu.conditions.get(CONDITION)
        if name == NONE:
            if active is None:
                return []
            held = _KINDS.get(active.action, "reboot")
            if held == "clears" or (held == "reset" and active.reset_seen):
                why = "a GPU reset was seen and " if held == "reset" else ""
                return self.kit.end(
                    gpu, CONDITION, now, f"{why}the driver's recovery action reads NONE"
                )
            self._progress(gpu, active, now)  # waiting for the reset, or a reboot
            return []
        if active is not None and (
            active.observed_value == float(value)
            # Read back from the KV bucket (no value kept): the same kind of hold.
            or (active.observed_value is None and _KINDS.get(active.action) == kind(name))
        ):
            active.observed_value = float(value)
            self._progress(gpu, active, now)
            return []
        out: list[Emit] = []
        if active is not None:
            out += self.kit.end(gpu, CONDITION, now, f"superseded: the driver now asks {name}")
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

    def _progress(self, gpu: GpuState, active: Condition, now: float) -> None:
        """A reset hold's reason says how far its evidence got: a reset seen, or the
        field reading NONE with no reset seen -- after a restart that may stay so (fail
        closed; a warning event says it once, see :meth:`sample`)."""
        if _KINDS.get(active.action) != "reset":
            return
        mine = memo(gpu, self.name, _Memo)
        unproven = not active.reset_seen and gpu.recovery == NONE and mine.read
        if active.reset_seen:
            note = _RESET_SEEN
        elif unproven:
            note = _UNPROVEN + (_RESTARTED if active.restored else "") + _UNTIL
        else:
            note = ""
        if not (unproven and active.restored):
            mine.unproven_at = None
        elif mine.unproven_at is None and not mine.warned:
            mine.unproven_at, mine.samples = now, 0
        reason = active.reason.split(_NOW)[0] + (_NOW + note if note else "")
        if reason != active.reason:
            active.reason = reason
            self.kit.touch(gpu, now)

    def sample(self, gpu: GpuState, sample: GpuSample, now: float) -> list[Emit]:
        """The warning that a hold read back stays held on NONE alone waits for the
        second sample taken after the reading (the first may have read the counters
        before it): the families that see a reset in a sample come before this one, so
        a reset done after the counters' first reading in this run has ended the hold by
        then (the common order: the NONE reading comes first)."""
        mine = memo(gpu, self.name, _Memo)
        if mine.unproven_at is None or now <= mine.unproven_at:
            return []
        mine.samples += 1
        if mine.samples < 2:
            return []
        mine.unproven_at, mine.warned = None, True
        active = gpu.conditions.get(CONDITION)
        if active is None or not active.restored or active.reset_seen or gpu.recovery != NONE:
            return []
        reason = active.reason.split(_NOW)[-1]
        return self._carry(
            gpu,
            self.kit.report(
                gpu,
                f"{CONDITION}:unproven",
                now,
                "xid",
                "warning",
                f"{where(gpu)} stays held after the restart: {reason}",
                action=active.action,
                xid=XID_RECOVERY,
            ),
        )

    def _carry(self, gpu: GpuState, emits: list[Emit]) -> list[Emit]:
        """The events of the hold carry the action last read, as XID events do."""
        action = gpu.recovery if gpu.recovery != UNSUPPORTED else ""
        return [
            e._replace(event=msgspec.structs.replace(e.event, recovery_action=action))
            for e in emits
        ]

    def tick(self, gpu: GpuState, now: float) -> list[Emit]:
        active = gpu.conditions.get(CONDITION)
        boot = self.kit.boot_id
        if active is None or not boot or not active.boot_id or active.boot_id == boot:
            return []
        if _KINDS.get(active.action, "reboot") != "reboot":
            return []
        return self._carry(
            gpu,
            self.kit.end(
                gpu, CONDITION, now, f"the node rebooted (boot id {active.boot_id} -> {boot})"
            ),
        )
