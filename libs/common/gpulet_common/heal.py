"""Remediation by reset: each GPU's state machine and fault history, as kept in the
node's NATS KV, and the rule that retires a repeat offender.

The allocator runs the machine (``gpulet_allocator.service.remediate.heal``); the
health CLI shows it (``gpulet health remediation``) and clears a retired GPU
(``gpulet health clear --retired``). Neither service may import the other, so the
contract is here. JSON in the KV bucket :data:`HEAL_KV_BUCKET`, one key per GPU
(:func:`heal_key`) for the machine and one (:func:`history_key`) for its history;
fields are only ever added, with defaults.

The machine
-----------
``quarantined -> evicting -> waiting_idle -> resetting -> verifying -> returned``, and
two ends that keep the GPU out of service: ``escalated`` (a reset that failed, a verify
that failed, a process that never left, a NODE_REBOOT action, a reset that would need
peers) and ``retired`` (a repeat offender, until an operator clears it). docs/health.md,
"Remediation by reset", draws it. Every transition is written (compare-and-set on the
key's revision) *before* the step it starts, so a restart resumes at the step it was
in; a restart found in ``resetting`` does not know whether the reset ran, and goes on
to ``verifying`` rather than reset a second time.

The history
-----------
At most :data:`HISTORY_LIMIT` entries per GPU, the newest kept: each fatal fault that
started a machine, each reset that passed its verify, each reset (or verify) that
failed. :func:`retire_reason` applies the rule (defaults in
:class:`~gpulet_common.settings.remediation.RetireRule`).
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from gpulet_common import subjects
from gpulet_common.codec import Codec
from gpulet_common.messages import Action, ActiveCondition, GpuHealth

HEAL_KV_BUCKET: Final = "gpulet_heal"
HISTORY_LIMIT: Final = 32

HealState = Literal[
    "quarantined",
    "evicting",
    "waiting_idle",
    "resetting",
    "verifying",
    "returned",
    "escalated",
    "retired",
]
# The states that keep the GPU out of service.
OUT_OF_SERVICE: Final = frozenset(
    {"quarantined", "evicting", "waiting_idle", "resetting", "verifying", "escalated", "retired"}
)
# The states the machine leaves by itself.
ACTIVE: Final = frozenset({"quarantined", "evicting", "waiting_idle", "resetting", "verifying"})
HistoryKind = Literal["fault", "reset", "reset_failed"]


class GpuIdentity(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a reset must give back unchanged: who the GPU is and its PCIe link."""

    uuid: str
    bus_id: str = ""
    name: str = ""
    memory_total: int = 0
    link_gen: int | None = None
    link_width: int | None = None

    def differences(self, after: GpuIdentity) -> list[str]:
        """How ``after`` differs from this one ("name A -> B"), empty when it does not;
        a field this one does not know (a baseline from the inventory, of a GPU NVML
        could not read) is not compared."""
        found = []
        for field in ("uuid", "name", "memory_total", "link_gen", "link_width"):
            was, now = getattr(self, field), getattr(after, field)
            if was not in (None, "", 0) and was != now:
                found.append(f"{field} {was} -> {now}")
        return found


class HealRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One GPU's machine."""

    gpu_uuid: str
    state: HealState
    # What started it: the fault's condition and catalogue entry ("xid:79 XID 79 ...").
    cause: str = ""
    gpu_index: int | None = None
    bus_id: str = ""
    # Wall-clock seconds (this node's clock) when the machine started, entered its
    # state, and the deadline of the state's wait (idle timeout, settle window).
    started_at: float = 0.0
    since: float = 0.0
    deadline: float = 0.0
    # The identity read at quarantine, which the verify compares with.
    baseline: GpuIdentity | None = None
    # How many resets were started for this fault (at most one: never twice).
    resets: int = 0
    # The PIDs that held the GPU when waiting for idle timed out.
    pids: list[int] = []
    # Why it escalated, or the verify's findings; the last step's outcome otherwise.
    detail: str = ""
    # Each transition, "state@time: detail", the newest last (bounded).
    steps: list[str] = []
    # The GPU's last reset that passed its verify: "<RFC 3339 time> <cause>" (kept by
    # the next machine too); the Device CR entry's gpulet.io/last-reset.
    last_reset: str = ""
    # The node's boot id when the record was last written: an escalated GPU waits for
    # a reboot, and a record from an earlier boot says it came.
    boot_id: str = ""


class HistoryEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    kind: HistoryKind
    at: float
    detail: str = ""


class FaultHistory(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One GPU's history, and whether it is retired (an RMA candidate)."""

    gpu_uuid: str
    entries: list[HistoryEntry] = []
    retired: bool = False
    retired_at: float = 0.0
    retired_reason: str = ""

    def add(self, kind: HistoryKind, at: float, detail: str = "") -> None:
        self.entries.append(HistoryEntry(kind=kind, at=at, detail=detail[:200]))
        del self.entries[:-HISTORY_LIMIT]

    def summary(self) -> str:
        """The history in one line, as the Device CR, the condition and the alert say."""
        counts = {k: sum(1 for e in self.entries if e.kind == k) for k in ("fault", "reset")}
        failed = sum(1 for e in self.entries if e.kind == "reset_failed")
        return f"{counts['fault']} fatal fault(s), {counts['reset']} reset(s), {failed} failed"


def retire_reason(
    history: FaultHistory, now: float, *, faults: int, window_s: float, failed_resets: int
) -> str | None:
    """Why the GPU is a repeat offender, or None: ``faults`` fatal faults within
    ``window_s`` seconds of ``now``, or ``failed_resets`` failed resets in all its
    (bounded) history."""
    recent = [e for e in history.entries if e.kind == "fault" and now - e.at < window_s]
    if faults > 0 and len(recent) >= faults:
        return f"RMA candidate: {len(recent)} fatal faults within {window_s:g} s"
    failed = [e for e in history.entries if e.kind == "reset_failed"]
    if failed_resets > 0 and len(failed) >= failed_resets:
        return f"RMA candidate: {len(failed)} failed resets"
    return None


def heal_key(node: str, gpu_uuid: str) -> str:
    return f"{subjects.token(node)}.machine.{subjects.token(gpu_uuid)}"


def history_key(node: str, gpu_uuid: str) -> str:
    return f"{subjects.token(node)}.history.{subjects.token(gpu_uuid)}"


def machine_prefix(node: str) -> str:
    return f"{subjects.token(node)}.machine."


# --- what the node sees: the quarantine as a condition ----------------------------------

QUARANTINE_KIND: Final = "remediation"
_OVERLAY: Final[dict[str, tuple[str, Action]]] = {
    "escalated": ("needs_reboot", "reboot"),
    "retired": ("retired", "hardware_inspection"),
}


def quarantine_condition(record: HealRecord) -> ActiveCondition | None:
    """The condition that holds the GPU out of service while its machine says so
    (``remediation:quarantined``, ``remediation:needs_reboot``,
    ``remediation:retired``); None once it is back in service."""
    if record.state not in OUT_OF_SERVICE:
        return None
    name, action = _OVERLAY.get(record.state, ("quarantined", "reset_gpu"))
    detail = record.detail if record.state in ("escalated", "retired") else record.cause
    return ActiveCondition(
        condition=f"{QUARANTINE_KIND}:{name}",
        kind="remediation",
        severity="critical",
        reason=f"gpulet remediation: {record.state}",
        message=(detail or record.cause)[:500],
        action=action,
        sticky=True,
        since=record.started_at,
    )


def overlay(health: GpuHealth | None, record: HealRecord) -> GpuHealth | None:
    """``health`` as the node's consumers must see it while ``record`` holds the GPU:
    unhealthy, with the quarantine's condition (the device plugin says Unhealthy, the
    DRA slice taints it ``NoSchedule``, the node condition names it)."""
    condition = quarantine_condition(record)
    if condition is None:
        return health
    if health is None:
        return GpuHealth(
            gpu_uuid=record.gpu_uuid,
            gpu_index=record.gpu_index,
            healthy=False,
            conditions=[condition],
        )
    return msgspec.structs.replace(
        health, healthy=False, conditions=[*health.conditions, condition]
    )


HEAL_RECORD = Codec(HealRecord)
FAULT_HISTORY = Codec(FaultHistory)
