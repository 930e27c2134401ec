"""Remediation by reset (``remediation.mode = "reset"``): each failed GPU's state machine.

States and why (the records are :mod:`gpulet_common.heal`'s; docs/health.md,
"Remediation by reset", draws the machine):

1. ``quarantined``: the GPU is taken out of service at once (:class:`Quarantine`
   ``hold``: Unhealthy to the device plugin, a NoSchedule taint in the DRA slice), and
   its identity is read as the baseline the verify compares with. A GPU that NVIDIA's
   rules say cannot be reset alone (:func:`.reset_exec.alone_problem`) escalates here.
2. ``evicting``: the pods that hold it leave. The eviction itself is the remediation
   loop's, as in mode ``evict`` (the Eviction API, the breaker, PodDisruptionBudgets
   retried); this state waits until :class:`Evictions` counts no holder left.
3. ``waiting_idle``: NVML shows no compute or graphics process, within
   ``remediation.reset.idle_timeout_s``; past it, the machine stops and escalates naming
   the PIDs.
4. ``resetting``: the record says ``resetting`` (``resets`` + 1) *before* the executor
   is called. A machine found in ``resetting`` (a restart during the reset) does not
   know whether the reset ran and goes on to ``verifying``: a GPU is never reset twice
   for one fault. A reset that fails or hangs escalates.
5. ``verifying``: re-discovery by UUID, field 230 NONE (a NODE_REBOOT escalates), no
   uncorrected volatile ECC error (the counters start fresh on a reset), the identity
   (name, memory, PCIe link generation and width) as before, and no new fault of the
   GPU within ``remediation.reset.settle_s``. Any finding escalates.
6. ``returned``: :class:`Quarantine` ``release`` (taint removed, Healthy,
   ``gpulet.io/last-reset`` with time and cause, an Event on the Node).

``escalated`` keeps the GPU quarantined and tells the node (``escalate``: a condition,
the ``gpulet.io/needs-reboot`` taint, an Event); gpulet never reboots a node.
``retired`` (the history's rule, :func:`gpulet_common.heal.retire_reason`) keeps it out
of service until an operator clears the history's ``retired`` flag.

Every transition is written to the store (compare-and-set) before its action; one
whose write loses the race is dropped and re-read on the next pass. Times in records
are this node's wall clock (they must survive a restart); nothing here trusts a clock
from elsewhere. :meth:`Healer.run_pass` returns when it next needs to look.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Protocol

from gpulet_allocator.service.remediate.reset_exec import ResetExecutor, alone_problem
from gpulet_common.bootid import read_boot_id
from gpulet_common.heal import (
    ACTIVE,
    OUT_OF_SERVICE,
    QUARANTINE_KIND,
    FaultHistory,
    GpuIdentity,
    HealRecord,
    HealState,
    HistoryKind,
    retire_reason,
)
from gpulet_common.remediation import Fault
from gpulet_common.settings.remediation import ResetSettings

if TYPE_CHECKING:  # NVML's bindings stay out of the allocator unless mode is reset
    from gpulet_allocator.service.remediate.nvml_port import Topology

log = logging.getLogger("gpulet.allocator.remediation.heal")

STEPS_KEPT: Final = 20
# How often a waiting state looks again (holders, processes).
POLL_S: Final = 1.0
NODE_REBOOT_ACTIONS: Final = frozenset({2, 7})  # NODE_REBOOT, SYSTEM_REBOOT
NONE_ACTION: Final = 0
# GPU_RESET, DRAIN_AND_RESET, BUS_RESET: what a GPU reset answers.
RESET_ACTIONS: Final = frozenset({1, 4, 6})
_FELL_OFF_BUS: Final = 79


class Conflict(Exception):
    """The record changed under us (another writer): re-read on the next pass."""


class HealStore(Protocol):
    async def get(self, gpu_uuid: str) -> tuple[HealRecord | None, int]: ...
    async def put(self, record: HealRecord, revision: int) -> int: ...
    async def records(self) -> list[HealRecord]: ...
    async def history(self, gpu_uuid: str) -> tuple[FaultHistory, int]: ...
    async def put_history(self, history: FaultHistory, revision: int) -> int: ...


class GpuPort(Protocol):
    async def identity(self, uuid: str) -> GpuIdentity | None: ...
    async def processes(self, uuid: str) -> list[int] | None: ...
    async def recovery_action(self, uuid: str) -> int | None: ...
    async def volatile_uncorrected(self, uuid: str) -> int | None: ...
    async def topology(self, uuid: str) -> Topology | None: ...


class Evictions(Protocol):
    async def holders_left(self, gpu_uuid: str) -> int:
        """How many pods still hold the GPU (terminating ones included)."""
        ...


class Quarantine(Protocol):
    async def hold(self, gpu_uuid: str, reason: str) -> None: ...
    async def release(self, gpu_uuid: str, last_reset: str, *, verified: bool = False) -> None:
        """Back in service; ``verified``: after a reset that passed its verify."""
        ...

    async def escalate(self, gpu_uuid: str, reason: str) -> None: ...
    async def retire(self, gpu_uuid: str, reason: str, history: FaultHistory) -> None: ...


def resettable(fault: Fault) -> bool:
    """Whether a reset may cure the fault: NVIDIA's RESET_GPU (the action ``reset_gpu``,
    from the catalogue or field 230), or a GPU lost, gone from NVML's list or fallen
    off the bus (XID 79 is NVIDIA's RESTART_BM, but such a GPU often returns on a
    reset; one is tried, and field 230 reading NODE_REBOOT or a failed reset
    escalates)."""
    return (
        fault.action == "reset_gpu"
        or fault.kind in ("gpu_lost", "gpu_missing", "gpu_removed")
        or fault.xid == _FELL_OFF_BUS
    )


def cause_of(fault: Fault) -> str:
    return f"{fault.condition} ({fault.entry})"


class Healer:
    def __init__(
        self,
        settings: ResetSettings,
        store: HealStore,
        gpu: GpuPort,
        executor: ResetExecutor,
        evictions: Evictions,
        quarantine: Quarantine,
        *,
        known: Callable[[str], GpuIdentity | None] = lambda _uuid: None,
        faults_since: Callable[[str, float], list[str]] = lambda _uuid, _t: [],
        clock: Callable[[], float] = time.time,
        boot_id: Callable[[], str] = read_boot_id,
    ) -> None:
        self.settings = settings
        self._boot_id = boot_id
        self.store = store
        self.gpu = gpu
        self.executor = executor
        self.evictions = evictions
        self.quarantine = quarantine
        self._known = known
        self._faults_since = faults_since
        self._clock = clock
        #: Resets started by this Healer (tests check none ran twice).
        self.resets_started = 0
        #: The machines that hold their GPU out of service, as of the last pass (the
        #: gpu_state gauge: escalated and retired GPUs alert).
        self.out_of_service: dict[str, HealRecord] = {}

    # --- one pass ----------------------------------------------------------------------

    async def run_pass(self, faults: list[Fault]) -> float | None:
        """Start machines for new faults, advance every active one; the next time to
        look (None: nothing waits)."""
        for fault in faults:
            # A MIG device's fault is not a reset's; the quarantine's own condition
            # (the node view's overlay) is this machine, not a new fault.
            if fault.kind == QUARANTINE_KIND:
                continue
            if fault.device == fault.gpu_uuid or not fault.device:
                try:
                    await self.start(fault)
                except Conflict:
                    continue
        wake: list[float] = []
        for record in await self.store.records():
            self._note(record)
            if record.state not in ACTIVE and record.state not in ("escalated", "retired"):
                continue
            try:
                at = await self.advance(record.gpu_uuid)
            except Conflict:
                at = self._clock() + POLL_S
            if at is not None:
                wake.append(at)
        return min(wake) if wake else None

    def _note(self, record: HealRecord) -> None:
        if record.state in OUT_OF_SERVICE:
            self.out_of_service[record.gpu_uuid] = record
        else:
            self.out_of_service.pop(record.gpu_uuid, None)

    async def start(self, fault: Fault) -> HealRecord | None:
        """Begin a machine for the fault's GPU unless one is under way or the GPU is
        out of service already; returns the new record."""
        record, revision = await self.store.get(fault.gpu_uuid)
        if record is not None and record.state != "returned":
            return None
        if record is not None and fault.since <= record.started_at:
            return None  # the fault this machine already cured (its condition may linger)
        now = self._clock()
        fresh = HealRecord(
            gpu_uuid=fault.gpu_uuid,
            state="quarantined",
            cause=cause_of(fault),
            gpu_index=fault.gpu_index,
            started_at=now,
            since=now,
        )
        fresh.steps = [f"quarantined@{now:.3f}: {fresh.cause}"]
        fresh.last_reset = record.last_reset if record is not None else ""
        revision = await self.store.put(fresh, revision)
        history = await self._record_history(fault.gpu_uuid, "fault", fresh.cause)
        why = self._retire_reason(history)
        if why is not None:
            await self.quarantine.hold(fault.gpu_uuid, fresh.cause)
            await self._retire(fresh, revision, why, history)
        elif not resettable(fault):
            await self.quarantine.hold(fault.gpu_uuid, fresh.cause)
            await self._escalate(fresh, revision, f"{fresh.cause} needs more than a GPU reset")
        # Otherwise the pass advances it at once: quarantined holds the GPU.
        return fresh

    async def active(self, gpu_uuid: str) -> bool:
        """Whether the GPU's machine is under way (quarantined ... verifying)."""
        record, _ = await self.store.get(gpu_uuid)
        return record is not None and record.state in ACTIVE

    async def step_of(self, fault: Fault) -> tuple[str, str]:
        """Where the fault's GPU stands, for the dry run: (step, why)."""
        record, _ = await self.store.get(fault.gpu_uuid)
        if record is None or (record.state == "returned" and fault.since > record.started_at):
            if fault.kind == QUARANTINE_KIND:
                return "", ""
            if not resettable(fault):
                return "would quarantine and escalate", "no GPU reset cures it"
            return "would quarantine", "then evict, wait idle, reset, verify"
        return record.state, record.detail

    async def advance(self, gpu_uuid: str) -> float | None:
        """Advance one machine as far as it goes now; when to look again."""
        record, revision = await self.store.get(gpu_uuid)
        if record is None:
            return None
        state = record.state
        if state == "quarantined":
            return await self._quarantined(record, revision)
        if state == "evicting":
            return await self._evicting(record, revision)
        if state == "waiting_idle":
            return await self._waiting_idle(record, revision)
        if state == "resetting":
            # Found in resetting: a restart during the reset. Whether it ran is not
            # known; the verify says whether the GPU is well, and no second reset runs.
            return await self._to_verify(
                record, revision, "restarted during the reset: verifying, not resetting again"
            )
        if state == "verifying":
            return await self._verifying(record, revision)
        if state == "retired":
            history, _ = await self.store.history(gpu_uuid)
            if not history.retired:
                await self._return(record, revision, "retirement cleared by an operator")
        if state == "escalated" and record.boot_id and record.boot_id != self._boot_id():
            # The reboot it asked for came: the GPU is the health service's again.
            await self._return(record, revision, f"the node rebooted (was boot {record.boot_id})")
        return None

    # --- the states --------------------------------------------------------------------

    async def _quarantined(self, record: HealRecord, revision: int) -> float | None:
        # Again after a restart: hold is idempotent, and the baseline is read once.
        await self.quarantine.hold(record.gpu_uuid, record.cause)
        action = await self.gpu.recovery_action(record.gpu_uuid)
        if action is not None and action not in {NONE_ACTION, *RESET_ACTIONS}:
            # NODE_REBOOT, SYSTEM_REBOOT, DRAIN_P2P, IMEX or unknown: not a GPU reset.
            await self._escalate(
                record, revision, f"the driver's recovery action (field 230) is {action}"
            )
            return None
        baseline = record.baseline or await self.gpu.identity(record.gpu_uuid)
        baseline = baseline or self._known(record.gpu_uuid)
        if baseline is None or not baseline.bus_id:
            await self._escalate(record, revision, "the GPU's bus id is not known: cannot reset")
            return None
        topology = await self.gpu.topology(record.gpu_uuid)
        if topology is not None:
            problem = alone_problem(
                topology.direct_peers, topology.nvswitch, topology.compute_major
            )
            if problem is not None:
                await self._escalate(record, revision, problem)
                return None
        record.baseline, record.bus_id = baseline, baseline.bus_id
        revision = await self._move(record, revision, "evicting", f"bus id {baseline.bus_id}")
        return await self._evicting(record, revision)

    async def _evicting(self, record: HealRecord, revision: int) -> float | None:
        left = await self.evictions.holders_left(record.gpu_uuid)
        if left > 0:
            return self._clock() + POLL_S
        deadline = self._clock() + self.settings.idle_timeout_s
        revision = await self._move(
            record, revision, "waiting_idle", "no pod holds it", deadline=deadline
        )
        return await self._waiting_idle(record, revision)

    async def _waiting_idle(self, record: HealRecord, revision: int) -> float | None:
        pids = await self.gpu.processes(record.gpu_uuid)
        now = self._clock()
        # None: NVML cannot list them (a GPU off the bus); nvidia-smi refuses a reset
        # of a GPU in use, so the reset is the check then.
        if pids:
            if now < record.deadline:
                return min(record.deadline, now + POLL_S)
            record.pids = pids
            await self._escalate(
                record,
                revision,
                f"processes still hold the GPU after {self.settings.idle_timeout_s:g}s: "
                f"PIDs {', '.join(map(str, pids))}",
            )
            return None
        record.resets += 1
        revision = await self._move(record, revision, "resetting", f"reset {record.resets}")
        self.resets_started += 1
        outcome = await self.executor.reset(record.bus_id)
        if not outcome.ok:
            await self._failed(record, revision, f"the reset failed: {outcome.detail}")
            return None
        return await self._to_verify(record, revision, outcome.detail or "reset")

    async def _to_verify(self, record: HealRecord, revision: int, detail: str) -> float | None:
        deadline = self._clock() + self.settings.settle_s
        revision = await self._move(record, revision, "verifying", detail, deadline=deadline)
        return await self._verifying(record, revision)

    async def _verifying(self, record: HealRecord, revision: int) -> float | None:
        uuid = record.gpu_uuid
        action = await self.gpu.recovery_action(uuid)
        if action in NODE_REBOOT_ACTIONS:
            await self._failed(record, revision, f"the driver asks for a node reboot ({action})")
            return None
        findings = self._findings(record, await self.gpu.identity(uuid), action)
        volatile = await self.gpu.volatile_uncorrected(uuid)
        if volatile:
            findings.append(f"{volatile} uncorrected volatile ECC error(s) after the reset")
        findings += [f"new fault {f}" for f in self._faults_since(uuid, record.since)]
        if findings:
            await self._failed(record, revision, "the verify failed: " + "; ".join(findings))
            return None
        if self._clock() < record.deadline:
            return record.deadline
        await self._return(record, revision, f"verified after a {self.settings.settle_s:g}s settle")
        return None

    def _findings(
        self, record: HealRecord, found: GpuIdentity | None, action: int | None
    ) -> list[str]:
        if found is None:
            return ["re-discovery does not find the GPU by its UUID"]
        findings = []
        if action not in (None, NONE_ACTION):
            findings.append(f"recovery action (field 230) reads {action}, not NONE")
        if record.baseline is not None:
            findings += [f"changed: {d}" for d in record.baseline.differences(found)]
        return findings

    # --- ends --------------------------------------------------------------------------

    async def _return(self, record: HealRecord, revision: int, detail: str) -> None:
        """Back in service: after its verify (a reset to record), or once an operator
        cleared a retirement or the reboot an escalation asked for came."""
        verified = record.state == "verifying"
        now = self._clock()
        if verified:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
            record.last_reset = f"{stamp} {record.cause}"
        await self._move(record, revision, "returned", detail)
        await self.quarantine.release(
            record.gpu_uuid, record.last_reset or detail, verified=verified
        )
        if verified:
            await self._record_history(record.gpu_uuid, "reset", record.cause)
        log.warning("GPU %s back in service: %s", record.gpu_uuid, detail)

    async def _failed(self, record: HealRecord, revision: int, why: str) -> None:
        """A reset or its verify failed: escalate, count it, and retire a repeat offender."""
        revision = await self._escalate(record, revision, why)
        history = await self._record_history(record.gpu_uuid, "reset_failed", why)
        reason = self._retire_reason(history)
        if reason is not None:
            await self._retire(record, revision, reason, history)

    async def _escalate(self, record: HealRecord, revision: int, why: str) -> int:
        record.detail = why
        revision = await self._move(record, revision, "escalated", why)
        log.error("GPU %s escalated (stays quarantined): %s", record.gpu_uuid, why)
        await self.quarantine.escalate(record.gpu_uuid, why)
        return revision

    async def _retire(
        self, record: HealRecord, revision: int, why: str, history: FaultHistory
    ) -> None:
        record.detail = f"{why} ({history.summary()})"
        await self._move(record, revision, "retired", record.detail)
        history, hrev = await self.store.history(record.gpu_uuid)
        if not history.retired:
            history.retired, history.retired_at, history.retired_reason = (
                True,
                self._clock(),
                why,
            )
            await self.store.put_history(history, hrev)
        log.error("GPU %s retired: %s", record.gpu_uuid, record.detail)
        await self.quarantine.retire(record.gpu_uuid, why, history)

    # --- the store ---------------------------------------------------------------------

    async def _move(
        self,
        record: HealRecord,
        revision: int,
        state: HealState,
        detail: str,
        *,
        deadline: float = 0.0,
    ) -> int:
        now = self._clock()
        record.state, record.since, record.deadline = state, now, deadline
        record.boot_id = self._boot_id()
        record.steps = [*record.steps, f"{state}@{now:.3f}: {detail[:200]}"][-STEPS_KEPT:]
        if state not in ("escalated", "retired"):
            record.detail = detail[:300]
        revision = await self.store.put(record, revision)
        self._note(record)
        return revision

    async def _record_history(self, gpu_uuid: str, kind: HistoryKind, detail: str) -> FaultHistory:
        history, revision = await self.store.history(gpu_uuid)
        history.add(kind, self._clock(), detail)
        await self.store.put_history(history, revision)
        return history

    def _retire_reason(self, history: FaultHistory) -> str | None:
        if history.retired:
            return history.retired_reason or "retired"
        rule = self.settings.retire
        return retire_reason(
            history,
            self._clock(),
            faults=rule.faults,
            window_s=rule.window_s,
            failed_resets=rule.failed_resets,
        )
