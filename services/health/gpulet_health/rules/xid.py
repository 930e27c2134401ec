"""XID rules: an XID (an NVML event, or a kernel-log line) classified by the catalogue.

Application XIDs and info/warning XIDs are reported only (a one-off event); critical
and fatal ones raise the sticky ``xid:<code>``, whose repeats are occurrences.

Storms
------
A repeat of one (GPU, XID, message) inside its de-duplication window is only counted
(:meth:`~gpulet_health.dedup.Deduplicator.absorb`), before any event is built, so a
storm costs little and yields one event a window with the exact count. The message is
the kernel log's text with the pid and process name taken out (:func:`variant`): a new
message is a window of its own and is published at once. NVML events carry no message.

By-products
-----------
XID 45 (preemptive cleanup) is logged when the driver tears down a process's channels:
after a killed application, or after another fault took them down. XID 43 (GPU stopped
processing) follows other faults too. Either one, within
``health.xid_byproduct_window_s`` after another XID on the GPU, or while an XID
condition of the GPU is active, counts as *evidence* for that fault: the condition's
``evidence_count`` and its next summary's go up, and nothing is reported for it. NVIDIA's
catalogue: when another XID comes with a 45, act on the other one. A 45 alone is
reported with its catalogue entry (info); a 43 alone as an application XID.

Repeats
-------
A warning XID (not one that already makes the GPU unhealthy; not an info one, the
catalogue's no-action codes such as 63, which the remap rule reads; not one whose
immediate bucket is RESTART_APP, such as 94, which a job restart fixes), seen in
``health.xid_repeat_count`` separate bursts (each de-duplication window that
publishes is a burst) within ``health.xid_repeat_window_s``, raises the sticky
``xid_repeated:<code>`` (critical, operator_check): a warning that keeps coming back
is a GPU to look at. 45 and the application XIDs never count: NVSentinel's version of
this rule turned XID 45 into 672 fatal events in 3 hours on a 288-node fleet.

MIG
---
An NVML XID event that names a GPU instance (and a compute instance) belongs to that
MIG device only (:func:`mig_target`): its condition is ``xid:<code>@<MIG UUID>``,
confined to the MIG device (``Condition.mig_device``), so the GPU and its other MIG
devices stay healthy. An XID without gi/ci (NVML's 0xFFFFFFFF) is the whole GPU's,
and so every MIG device's on it. A gi/ci the inventory does not know is the GPU's.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field

import msgspec

from gpulet_common.nvml.adapter import NvmlEvent
from gpulet_health.catalogue import XidInfo
from gpulet_health.dedup import DedupKey, Emit
from gpulet_health.rules.base import Family, memo
from gpulet_health.state import Condition, GpuState

# What an XID condition says where the driver does not report the recovery action.
NO_RECOVERY_FIELD = (
    "the driver reports no recovery action (NVML field 230, R570+): the GPU returns to "
    "service on a GPU reset seen or gpulet health clear, as before"
)
UNSUPPORTED = "unsupported"
# XIDs that follow other faults: evidence for them, not faults of their own.
BYPRODUCT_XIDS: frozenset[int] = frozenset({43, 45})
# XID 45 never counts for the repeat rule (nor do the application XIDs).
PREEMPTIVE_CLEANUP = 45
# NVIDIA's bucket for faults a job restart fixes (the GPU stays in service): like the
# application XIDs, their repeats say more about the workload than about the GPU.
RESTART_APP = "RESTART_APP"
MAX_VARIANT_CHARS = 200

_PID_NAME = re.compile(r"\b(?:pid|name)=(?:'[^']*'|<[^>]*>|[^,]*)(?:,\s*|$)")


def _no_change(gpu: GpuState, what: str) -> str:
    """What a report-only XID does to the health, in words that agree with the event's
    ``healthy`` (the GPU's health as it is): nothing."""
    if gpu.healthy:
        return f"{what} stays healthy"
    causes = sorted(n for n, c in gpu.conditions.items() if c.unhealthy and not c.mig_device)
    why = ", ".join(causes) if causes else "it is not present"
    return f"the GPU's health is unchanged: unhealthy ({why})"


def variant(detail: str) -> str:
    """A kernel-log XID's message with the pid and process name taken out."""
    return _PID_NAME.sub("", detail).strip(" ,")[:MAX_VARIANT_CHARS]


@dataclass(slots=True)
class _Fault:
    code: int
    at: float
    key: DedupKey
    variant: str
    condition: str  # the condition it raised or repeated, "" for a report


@dataclass(slots=True)
class _Memo:
    last: _Fault | None = None
    # Per XID, when each of its bursts began (the repeat rule), at most xid_repeat_count.
    bursts: dict[int, collections.deque[float]] = field(default_factory=dict)


class Xid(Family):
    name = "xid"
    event_kinds = frozenset({"xid"})

    def nvml_event(self, gpu: GpuState, event: NvmlEvent, now: float) -> list[Emit]:
        if "xid" not in event.kinds:
            return []
        return self.observe(gpu, event.event_data, now, mig=mig_target(gpu, event))

    def reset(self, gpu: GpuState) -> None:
        gpu.memo.pop(self.name, None)

    def observe(
        self,
        gpu: GpuState,
        code: int,
        now: float,
        seen_in: str = "",
        detail: str = "",
        mig: tuple[str, str] | None = None,
    ) -> list[Emit]:
        """An XID on a GPU; ``seen_in`` says where, when not from an NVML event, and
        ``detail`` is the kernel log's text after the code. ``mig``: the MIG device
        (UUID, how to name it) it is confined to."""
        if mig is not None:
            return self._observe_mig(gpu, code, now, mig)
        mine = memo(gpu, self.name, _Memo)
        if code in BYPRODUCT_XIDS:
            other = self._fault_before(gpu, mine, now)
            if other is not None:
                return self._evidence(gpu, other, code, now)
        verdict = self.kit.catalogue.lookup(code)
        info = verdict.info
        raises = verdict.unhealthy
        key: DedupKey = (gpu.uuid, f"xid:{code}" if raises else f"report:xid:{code}")
        var = variant(detail)
        if code not in BYPRODUCT_XIDS:
            mine.last = _Fault(code, now, key, var, f"xid:{code}" if raises else "")
        if (not raises or key[1] in gpu.conditions) and self.kit.absorb(key, var, now):
            return []  # a repeat inside its window: counted
        out: list[Emit] = []
        if (
            not raises
            and info.severity == "warning"
            and info.immediate != RESTART_APP
            and not verdict.application
            and code != PREEMPTIVE_CLEANUP
        ):
            out += self._repeats(gpu, mine, code, now)
        where = f"; {seen_in}" if seen_in else ""
        no_field = raises and gpu.recovery == UNSUPPORTED
        message = "; ".join(
            p for p in (var, f"classified by {info.source}", NO_RECOVERY_FIELD * no_field) if p
        )
        if not raises:
            why = "an application error" if verdict.application else info.severity
            healthy = f" ({why}: {_no_change(gpu, 'the GPU')}){where}"
            emits = self._report(gpu, f"xid:{code}", code, info, healthy, now, message)
        else:
            emits = self.kit.raise_(
                gpu,
                _xid_condition(f"xid:{code}", code, info, where, now, message),
                now,
                repeats=True,
            )
        recovery = gpu.recovery if gpu.recovery != UNSUPPORTED else ""
        return [
            e._replace(
                variant=var, event=msgspec.structs.replace(e.event, recovery_action=recovery)
            )
            if e.op in ("raise", "offer")
            else e
            for e in emits
        ] + out

    def _observe_mig(
        self, gpu: GpuState, code: int, now: float, mig: tuple[str, str]
    ) -> list[Emit]:
        verdict = self.kit.catalogue.lookup(code)
        info = verdict.info
        name = f"xid:{code}@{mig[0]}"
        where = f" on MIG device {mig[1]}"
        if not verdict.unhealthy:
            key: DedupKey = (gpu.uuid, f"report:{name}")
            if self.kit.absorb(key, "", now):
                return []
            healthy = f"{where} ({_no_change(gpu, 'the MIG device')})"
            return self._report(gpu, name, code, info, healthy, now)
        if name in gpu.conditions and self.kit.absorb((gpu.uuid, name), "", now):
            return []
        message = f"classified by {info.source}; the GPU and its other MIG devices are not affected"
        condition = _xid_condition(name, code, info, where, now, message, mig_device=mig[0])
        return self.kit.raise_(gpu, condition, now, repeats=True)

    def _report(
        self,
        gpu: GpuState,
        name: str,
        code: int,
        info: XidInfo,
        healthy: str,
        now: float,
        message: str = "",
    ) -> list[Emit]:
        """The one-off report of an XID that leaves the GPU (or its MIG device) healthy;
        ``healthy`` follows the description in the reason and says so."""
        reason = f"XID {code}: {info.description}{healthy}"
        return self.kit.report(
            gpu,
            name,
            now,
            "xid",
            info.severity,
            reason,
            action=info.action,
            value=float(code),
            xid=code,
            message=message,
        )

    def _fault_before(self, gpu: GpuState, mine: _Memo, now: float) -> _Fault | None:
        """The fault a by-product XID follows: the last other XID on the GPU within the
        window, else its latest active XID condition; None when it stands alone."""
        last = mine.last
        if last is not None and 0 <= now - last.at <= self.s.xid_byproduct_window_s:
            return last
        active = [
            c
            for c in gpu.conditions.values()
            if c.kind == "xid" and c.xid is not None and c.xid not in BYPRODUCT_XIDS
        ]
        if not active:
            return None
        cond = max(active, key=lambda c: c.since)
        assert cond.xid is not None
        return _Fault(cond.xid, cond.since, (gpu.uuid, cond.condition), "", cond.condition)

    def _evidence(self, gpu: GpuState, other: _Fault, code: int, now: float) -> list[Emit]:
        cond = gpu.conditions.get(other.condition) if other.condition else None
        if cond is not None:
            cond.evidence += 1
            if cond.evidence == 1:
                self.kit.touch(gpu, now)  # stored once; later counts ride along
        # The event is never published: the dedup stage only counts it for `other`.
        event = self.kit.event(gpu, "", now, "xid", "info", f"XID {code}")
        return [Emit("evidence", other.key, event, other.variant, code)]

    def _repeats(self, gpu: GpuState, mine: _Memo, code: int, now: float) -> list[Emit]:
        limit = self.s.xid_repeat_count
        if limit <= 0:
            return []
        bursts = mine.bursts.setdefault(code, collections.deque(maxlen=limit))
        bursts.append(now)
        window = self.s.xid_repeat_window_s
        if len(bursts) < limit or now - bursts[0] > window:
            return []
        return self.kit.raise_(
            gpu,
            Condition(
                condition=f"xid_repeated:{code}",
                kind="xid",
                severity="critical",
                reason=(
                    f"XID {code} in {limit} separate bursts within {window:.0f}s "
                    "(health.xid_repeat_count): a recurring fault"
                ),
                action="operator_check",
                since=now,
                sticky=True,
                observed_value=float(code),
                xid=code,
            ),
            now,
        )


def mig_target(gpu: GpuState, event: NvmlEvent) -> tuple[str, str] | None:
    """The MIG device an XID event names by gi/ci (UUID, a description); None: the GPU.

    A GPU instance without a compute instance names its MIG device when the GPU
    instance holds one only. Ids the GPU's last known MIG devices do not have: the GPU.
    """
    gi, ci = event.gpu_instance_id, event.compute_instance_id
    info = gpu.info
    if gi is None or info is None or info.mig_mode != "enabled":
        return None
    found = [
        d
        for d in info.mig_devices
        if d.gpu_instance_id == gi and (ci is None or d.compute_instance_id == ci)
    ]
    if len(found) != 1:
        return None
    d = found[0]
    return d.uuid, f"{d.uuid} (gi {gi}, ci {d.compute_instance_id}, {d.profile or 'MIG'})"


def _xid_condition(
    name: str,
    code: int,
    info: XidInfo,
    where: str,
    now: float,
    message: str,
    *,
    mig_device: str = "",
) -> Condition:
    """The sticky condition an XID that makes a GPU (or one MIG device) unhealthy raises."""
    return Condition(
        condition=name,
        kind="xid",
        severity=info.severity,
        reason=f"XID {code}: {info.description}{where}",
        action=info.action,
        since=now,
        sticky=True,
        observed_value=float(code),
        xid=code,
        message=message,
        mig_device=mig_device,
    )
