"""The rule engine: observations in, health events and per-GPU state out.

Design
------
The engine is pure and synchronous: no I/O, no clock of its own (every input carries
its time), no threads. The service feeds it and publishes what it returns; tests
drive it directly. All inputs arrive on the event loop, so it needs no lock.

Inputs
  * NVML events (:meth:`observe_nvml_event`): XID, single- and double-bit ECC,
    GPU unavailable;
  * the collector's samples (:meth:`observe_sample`): temperature, throttle reasons,
    ECC counters, remapped rows, a sample error "lost";
  * the GPU list (:meth:`observe_inventory`): removal, hot-add, a GPU coming back;
  * a lost GPU (:meth:`observe_lost`) and NVML as a whole going away/coming back;
  * operator clears (:meth:`clear`) and the housekeeping tick (:meth:`tick`).

Rules (defaults in :mod:`gpulet_common.settings.health`)
  * **XID**: classified by :mod:`.catalogue`. Application XIDs and info/warning
    XIDs are reported only; critical/fatal ones raise the sticky ``xid:<code>``.
  * **Uncorrectable ECC**: a double-bit event, or a rise of the volatile uncorrected
    counter not already announced by an event, raises the sticky ``ecc_uncorrectable``
    (fatal, reset the GPU).
  * **Correctable ECC rate**: single-bit errors (events, and counter deltas not
    already counted from events) in a sliding window; above ``sbe_rate_per_hour`` a
    warning ``ecc_correctable_rate``, cleared when the rate falls to half of it.
  * **Row remapping**: pending (or retired pages pending, on older GPUs) raises
    ``remap_pending`` (critical, reset the GPU); a failed remap raises
    ``remap_failure`` (fatal, hardware inspection). Both follow NVML's flags; NVML
    does not say how many rows are pending, so the reason gives no such count (only
    the rows remapped so far, named as that).
  * **Thermal**: above ``threshold_c`` the GPU is unhealthy (``thermal``); at the
    GPU's NVML slowdown threshold, or throttled for temperature, a warning
    (``thermal_slowdown``; the reason says which: the GPU's SW/HW thermal slowdown
    clock-event bit, or the temperature against the threshold); at its shutdown
    threshold unhealthy
    (``thermal_shutdown``). Each clears only after ``recover_samples`` consecutive
    samples below its threshold minus ``hysteresis_c``, so a temperature oscillating
    around a threshold gives one raise, not a stream of raise/recover pairs.
  * **Lost / removed / added**: GPU_IS_LOST, the GpuUnavailable event or a sample
    that says "lost" raise ``lost``; a GPU missing from the GPU list raises
    ``removed`` (present=False). A new GPU gives ``gpu_added``.
  * **Missing at start**: a GPU the node had before (restored from the KV bucket, or
    from the health service's list of expected GPUs, :meth:`expect`) that the first
    scan does not find raises ``missing`` (``gpu_missing``, critical,
    present=False): a GPU lost or gone while the agent was down is not silently
    dropped. It ends like ``removed``, when the GPU is listed again. An operator who
    took a GPU out on purpose clears its ``missing``/``removed``/``lost`` condition
    (:meth:`clear`): a GPU that is not present is then forgotten.
  * **Reset observed**: volatile ECC counters going back, pending remaps clearing, or
    a lost/removed GPU answering again mean the GPU was reset: every sticky condition
    of that GPU ends (``recovered``), and the counters take a new baseline.

What the engine cannot see: a reset of a GPU whose only sticky condition is an XID
and whose volatile ECC counters were already zero leaves no trace in NVML; such a
condition needs ``gpulet health clear``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from gpulet_common.messages import (
    Action,
    GpuHealth,
    GpuInfo,
    GpuSample,
    HealthEvent,
    HealthKind,
    HealthState,
    Severity,
)
from gpulet_common.nvml.adapter import (
    CLOCK_EVENTS_HW_SLOWDOWN,
    CLOCK_EVENTS_THERMAL,
    EVENT_DOUBLE_BIT_ECC,
    EVENT_GPU_UNAVAILABLE,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID,
    NvmlEvent,
    clock_event_names,
)
from gpulet_common.settings.health import HealthSettings
from gpulet_health.catalogue import XidCatalogue
from gpulet_health.dedup import Deduplicator, event_id
from gpulet_health.state import STICKY_KINDS, Condition, GpuState

log = logging.getLogger("gpulet.health.rules")

# Conditions of a GPU that is not there; clearing one of them while the GPU is not
# present forgets the GPU (it was taken out of the node on purpose).
GONE_CONDITIONS = frozenset({"lost", "removed", "missing"})


EndKind = Literal["recovered", "cleared"]


class UnknownGpu(LookupError):
    pass


class UnknownCondition(LookupError):
    pass


class RuleEngine:
    def __init__(
        self, node: str, settings: HealthSettings, catalogue: XidCatalogue | None = None
    ) -> None:
        self.node = node
        self._s = settings
        self.catalogue = catalogue or XidCatalogue.from_settings(settings)
        self.gpus: dict[str, GpuState] = {}
        self._dedup = Deduplicator(settings.dedup_window_s)
        self._dirty: set[str] = set()
        self._inventory_seen = False
        # Set when an observation suggests the GPU list changed; the service rescans.
        self.rescan_wanted = False

    # --- queries -------------------------------------------------------------------

    def take_dirty(self) -> set[str]:
        dirty, self._dirty = self._dirty, set()
        return dirty

    def find(self, ref: str) -> GpuState:
        """A GPU by UUID, or by index (a number)."""
        state = self.gpus.get(ref)
        if state is not None:
            return state
        if ref.strip().isdigit():
            index = int(ref)
            candidates = [g for g in self.gpus.values() if g.index == index]
            # After a removal two GPUs may have held the index: prefer the present one.
            candidates.sort(key=lambda g: not g.present)
            if candidates:
                return candidates[0]
        raise UnknownGpu(ref)

    def snapshot(self, uuid: str) -> GpuHealth:
        return self.gpus[uuid].snapshot()

    def state(self, now: float, gpu: str | None = None) -> HealthState:
        gpus = [self.find(gpu)] if gpu is not None else self._ordered()
        return HealthState(node=self.node, gpus=[g.snapshot() for g in gpus], updated_at=now)

    def _ordered(self) -> list[GpuState]:
        return sorted(
            self.gpus.values(),
            key=lambda g: (not g.present, g.index if g.index is not None else 1 << 30, g.uuid),
        )

    def index_map(self) -> dict[int, str]:
        """NVML index -> UUID of the present GPUs."""
        return {g.index: g.uuid for g in self.gpus.values() if g.present and g.index is not None}

    # --- restore -------------------------------------------------------------------

    def restore(self, healths: Iterable[GpuHealth]) -> None:
        """Take over the state a previous run left in the KV bucket (before any input)."""
        for health in healths:
            self.gpus[health.gpu_uuid] = GpuState.restore(health)

    def expect(self, gpus: Iterable[GpuInfo]) -> int:
        """GPUs the node had before (before the first scan); returns how many are new.

        Those not restored already are taken as present, as the previous run last saw
        them: the first scan tells whether they still are (else ``missing``).
        """
        added = 0
        for info in gpus:
            if info.uuid and info.uuid not in self.gpus:
                self.gpus[info.uuid] = GpuState(uuid=info.uuid, index=info.index, info=info)
                added += 1
        return added

    def expected(self) -> list[GpuInfo]:
        """Every GPU this node is known to have (present or not), as last described."""
        return sorted(
            (g.info for g in self.gpus.values() if g.info is not None),
            key=lambda i: (i.index, i.uuid),
        )

    # --- building events -------------------------------------------------------------

    def _touch(self, gpu: GpuState, now: float) -> None:
        gpu.updated_at = max(gpu.updated_at, now)
        self._dirty.add(gpu.uuid)

    def _event(
        self,
        gpu: GpuState,
        *,
        eid: str,
        kind: HealthKind,
        severity: Severity,
        reason: str,
        now: float,
        action: Action = "none",
        condition: str = "",
        message: str = "",
        value: float | None = None,
        threshold: float | None = None,
        xid: int | None = None,
        since: float | None = None,
        condition_kind: HealthKind | None = None,
        condition_severity: Severity | None = None,
    ) -> HealthEvent:
        return HealthEvent(
            event_id=eid,
            node=self.node,
            gpu_uuid=gpu.uuid,
            gpu_index=gpu.index,
            kind=kind,
            severity=severity,
            healthy=gpu.healthy,
            reason=reason,
            message=message,
            action=action,
            observed_value=value,
            threshold=threshold,
            xid=xid,
            condition=condition,
            observed_at=now,
            condition_since=since,
            condition_kind=condition_kind,
            condition_severity=condition_severity,
        )

    def _raise(
        self, gpu: GpuState, cond: Condition, now: float, *, repeats: bool
    ) -> list[HealthEvent]:
        """Raise ``cond``; if already active, count a repeat (edge conditions only)."""
        key = (gpu.uuid, cond.condition)
        active = gpu.conditions.get(cond.condition)
        if active is None:
            gpu.conditions[cond.condition] = cond
            gpu.below.pop(cond.condition, None)
            self._touch(gpu, now)
            event = self._condition_event(
                gpu,
                cond,
                now,
                eid=event_id(self.node, gpu.uuid, "raise", cond.condition, cond.since),
            )
            # A fresh condition is always published; its window folds later repeats.
            return self._dedup.close(key) + self._dedup.offer(key, event)
        if not repeats:
            return []
        event = self._condition_event(
            gpu,
            active,
            now,
            eid=event_id(self.node, gpu.uuid, "occurrence", cond.condition, now),
            reason=cond.reason,
            value=cond.observed_value,
        )
        return self._dedup.offer(key, event)

    def _condition_event(
        self,
        gpu: GpuState,
        cond: Condition,
        now: float,
        *,
        eid: str,
        reason: str | None = None,
        value: float | None = None,
    ) -> HealthEvent:
        return self._event(
            gpu,
            eid=eid,
            kind=cond.kind,
            severity=cond.severity,
            reason=reason or cond.reason,
            message=cond.message,
            now=now,
            action=cond.action,
            condition=cond.condition,
            value=value if value is not None else cond.observed_value,
            threshold=cond.threshold,
            xid=cond.xid,
            since=cond.since,
            condition_kind=cond.kind,
            condition_severity=cond.severity,
        )

    def _end(
        self,
        gpu: GpuState,
        condition: str,
        now: float,
        reason: str,
        *,
        how: EndKind = "recovered",
        value: float | None = None,
    ) -> list[HealthEvent]:
        cond = gpu.conditions.pop(condition, None)
        if cond is None:
            return []
        gpu.below.pop(condition, None)
        self._touch(gpu, now)
        out = [self._refresh(gpu, e) for e in self._dedup.close((gpu.uuid, condition))]
        out.append(
            self._event(
                gpu,
                eid=event_id(self.node, gpu.uuid, "end", condition, cond.since),
                kind=how,
                severity="info",
                reason=reason,
                now=now,
                condition=condition,
                value=value,
                threshold=cond.threshold,
                xid=cond.xid,
                since=cond.since,
                condition_kind=cond.kind,
                condition_severity=cond.severity,
            )
        )
        return out

    def _report(
        self,
        gpu: GpuState,
        key: str,
        now: float,
        *,
        kind: HealthKind,
        severity: Severity,
        reason: str,
        action: Action = "none",
        value: float | None = None,
        xid: int | None = None,
    ) -> list[HealthEvent]:
        """A one-off fact that raises no condition (de-duplicated by ``key``)."""
        self._touch(gpu, now)
        event = self._event(
            gpu,
            eid=event_id(self.node, gpu.uuid, "report", key, now),
            kind=kind,
            severity=severity,
            reason=reason,
            now=now,
            action=action,
            value=value,
            xid=xid,
        )
        return self._dedup.offer((gpu.uuid, "report:" + key), event)

    def _refresh(self, gpu: GpuState, event: HealthEvent) -> HealthEvent:
        """A delayed (summary) event carries the GPU's health as of now."""
        if event.healthy == gpu.healthy and event.gpu_index == gpu.index:
            return event
        return msgspec.structs.replace(event, healthy=gpu.healthy, gpu_index=gpu.index)

    def _reset_observed(self, gpu: GpuState, now: float, why: str) -> list[HealthEvent]:
        out: list[HealthEvent] = []
        for name, cond in list(gpu.conditions.items()):
            if cond.sticky:
                out += self._end(gpu, name, now, f"GPU reset observed ({why})")
        gpu.counters.volatile_corrected = None
        gpu.counters.volatile_uncorrected = None
        gpu.counters.sbe_event_credit = 0
        gpu.counters.dbe_event_credit = 0
        return out

    # --- the GPU list ----------------------------------------------------------------

    def observe_inventory(
        self, gpus: Sequence[GpuInfo], now: float, *, scanned_at: float | None = None
    ) -> list[HealthEvent]:
        """The GPUs NVML lists and that answer. Missing known GPUs are removed.

        ``scanned_at`` is when the scan began: a scan takes a while, and what was
        learnt meanwhile (a sample from a GPU the scan missed, a loss reported after
        it began) is newer than its result. Such GPUs are left as they are and a new
        scan is asked for.
        """
        first = not self._inventory_seen
        self._inventory_seen = True
        started = scanned_at if scanned_at is not None else now
        out: list[HealthEvent] = []
        seen = {g.uuid for g in gpus}
        for info in gpus:
            gpu = self.gpus.get(info.uuid)
            if gpu is None:
                gpu = GpuState(uuid=info.uuid, index=info.index, info=info, last_answer=started)
                self.gpus[info.uuid] = gpu
                self._touch(gpu, now)
                if not first:
                    out += self._added(
                        gpu, now, f"GPU {info.index} ({info.name or 'GPU'}) was added"
                    )
                continue
            gpu.last_answer = max(gpu.last_answer, started)
            if gpu.index != info.index or gpu.info != info:
                gpu.index, gpu.info = info.index, info
                self._touch(gpu, now)
            gone = [
                gpu.conditions[c] for c in ("lost", "removed", "missing") if c in gpu.conditions
            ]
            if any(c.since > started for c in gone):
                self.rescan_wanted = True
                continue
            out += self._back(gpu, now, "it is in the node's GPU list again")
        for gpu in self.gpus.values():
            if gpu.uuid in seen or not gpu.present:
                continue
            if gpu.last_answer > started:
                self.rescan_wanted = True
                continue
            where = f"GPU {gpu.index}" if gpu.index is not None else "the GPU"
            if first:
                out += self._missing(gpu, now, where, len(gpus))
                continue
            out += self._remove(
                gpu, now, f"{where} is no longer in the node's GPU list (NVML count dropped)"
            )
        return out

    def _missing(self, gpu: GpuState, now: float, where: str, answering: int) -> list[HealthEvent]:
        gpu.present = False
        info = gpu.info
        what = f" ({info.name}, bus {info.pci_bus_id})" if info and info.pci_bus_id else ""
        return self._raise(
            gpu,
            Condition(
                condition="missing",
                kind="gpu_missing",
                severity="critical",
                reason=(
                    f"{where}{what} was on this node before but is missing at start: "
                    f"{answering} GPU(s) answer NVML (lost, fallen off the bus or removed "
                    "while the agent was down)"
                ),
                action="operator_check",
                since=now,
            ),
            now,
            repeats=False,
        )

    def _remove(self, gpu: GpuState, now: float, reason: str) -> list[HealthEvent]:
        gpu.present = False
        return self._raise(
            gpu,
            Condition(
                condition="removed",
                kind="gpu_removed",
                severity="critical",
                reason=reason,
                action="operator_check",
                since=now,
            ),
            now,
            repeats=False,
        )

    def _added(self, gpu: GpuState, now: float, reason: str) -> list[HealthEvent]:
        return [
            self._event(
                gpu,
                eid=event_id(self.node, gpu.uuid, "added", now),
                kind="gpu_added",
                severity="info",
                reason=reason,
                now=now,
            )
        ]

    def _back(self, gpu: GpuState, now: float, why: str) -> list[HealthEvent]:
        """The GPU answers: end removed/lost; that it came back means it was reset."""
        out: list[HealthEvent] = []
        was_gone = not gpu.present or any(
            c in gpu.conditions for c in ("removed", "missing", "lost")
        )
        if not was_gone:
            return out
        returned = not gpu.present
        gpu.present = True
        self._touch(gpu, now)
        out += self._end(gpu, "removed", now, f"the GPU is back: {why}")
        out += self._end(gpu, "missing", now, f"the GPU is back: {why}")
        out += self._end(gpu, "lost", now, f"the GPU answers again: {why}")
        out += self._reset_observed(gpu, now, "the device came back after being lost or removed")
        if returned:
            # Last, so that it carries the GPU's health after the recoveries.
            where = f"GPU {gpu.index}" if gpu.index is not None else "the GPU"
            out += self._added(gpu, now, f"{where} is back")
        self.rescan_wanted = True
        return out

    def observe_lost(
        self, uuid: str, now: float, detail: str, *, scanned_at: float | None = None
    ) -> list[HealthEvent]:
        """The GPU is lost: unhealthy, and out of the usable GPU list (removed)."""
        gpu = self.gpus.get(uuid)
        if gpu is None:
            return []
        self.rescan_wanted = True
        if scanned_at is not None and gpu.last_answer > scanned_at:
            return []  # it answered after the scan that says it is lost began
        where = f"GPU {gpu.index}" if gpu.index is not None else "the GPU"
        out = self._raise(
            gpu,
            Condition(
                condition="lost",
                kind="gpu_lost",
                severity="critical",
                reason=f"{where} is lost: {detail}",
                action="reboot",
                since=now,
            ),
            now,
            repeats=False,
        )
        if gpu.present:
            out += self._remove(gpu, now, f"{where} was taken out of the GPU list: it is lost")
        return out

    def observe_nvml_unavailable(self, reason: str, now: float) -> list[HealthEvent]:
        out: list[HealthEvent] = []
        for gpu in self._ordered():
            if not gpu.present:
                continue
            out += self._raise(
                gpu,
                Condition(
                    condition="nvml",
                    kind="nvml_unavailable",
                    severity="critical",
                    reason=f"NVML is unavailable, the GPU cannot be watched: {reason}",
                    action="operator_check",
                    since=now,
                ),
                now,
                repeats=False,
            )
        return out

    def observe_nvml_available(self, now: float) -> list[HealthEvent]:
        out: list[HealthEvent] = []
        for gpu in self._ordered():
            out += self._end(gpu, "nvml", now, "NVML answers again")
        return out

    # --- NVML events -----------------------------------------------------------------

    def _resolve(self, uuid: str | None, index: int | None) -> GpuState | None:
        if uuid is not None and uuid in self.gpus:
            return self.gpus[uuid]
        if index is not None:
            found = self.index_map().get(index)
            if found is not None:
                return self.gpus[found]
        return None

    def observe_nvml_event(self, event: NvmlEvent) -> list[HealthEvent]:
        gpu = self._resolve(event.gpu_uuid, event.gpu_index)
        if gpu is None:
            log.warning(
                "NVML event %#x for an unknown GPU (%s, %s): rescanning",
                event.event_type,
                event.gpu_index,
                event.gpu_uuid,
            )
            self.rescan_wanted = True
            return []
        now = event.timestamp
        out: list[HealthEvent] = []
        kind = event.event_type
        if kind & EVENT_XID:
            out += self.observe_xid(gpu.uuid, event.event_data, now)
        if kind & EVENT_DOUBLE_BIT_ECC:
            gpu.counters.dbe_event_credit += 1
            out += self._uncorrectable(gpu, now, "NVML double-bit ECC event", None)
        if kind & EVENT_SINGLE_BIT_ECC:
            gpu.counters.sbe_event_credit += 1
            gpu.sbe_window.add(now, 1)
            out += self._sbe_rate(gpu, now)
        if kind & EVENT_GPU_UNAVAILABLE:
            out += self.observe_lost(gpu.uuid, now, "NVML GpuUnavailable event")
        return out

    def observe_xid(
        self, uuid: str, code: int, now: float, *, seen_in: str = ""
    ) -> list[HealthEvent]:
        """An XID on a GPU; ``seen_in`` says where, when not from an NVML event."""
        gpu = self.gpus.get(uuid)
        if gpu is None:
            return []
        verdict = self.catalogue.lookup(code)
        info = verdict.info
        where = f"; {seen_in}" if seen_in else ""
        if not verdict.unhealthy:
            why = (
                "an application error: the GPU stays healthy"
                if verdict.application
                else f"{info.severity}: the GPU stays healthy"
            )
            return self._report(
                gpu,
                f"xid:{code}",
                now,
                kind="xid",
                severity=info.severity,
                reason=f"XID {code}: {info.description} ({why}){where}",
                action=info.action,
                value=float(code),
                xid=code,
            )
        return self._raise(
            gpu,
            Condition(
                condition=f"xid:{code}",
                kind="xid",
                severity=info.severity,
                reason=f"XID {code}: {info.description}{where}",
                action=info.action,
                since=now,
                sticky=True,
                observed_value=float(code),
                xid=code,
                message=f"classified by {info.source}",
            ),
            now,
            repeats=True,
        )

    def _uncorrectable(
        self, gpu: GpuState, now: float, how: str, count: float | None
    ) -> list[HealthEvent]:
        return self._raise(
            gpu,
            Condition(
                condition="ecc_uncorrectable",
                kind="ecc_uncorrectable",
                severity="fatal",
                reason=f"uncorrectable (double-bit) ECC error: {how}",
                action="reset_gpu",
                since=now,
                sticky=True,
                observed_value=count,
            ),
            now,
            repeats=True,
        )

    def _sbe_rate(self, gpu: GpuState, now: float) -> list[HealthEvent]:
        window_s = self._s.ecc.sbe_window_s
        per_hour = self._s.ecc.sbe_rate_per_hour
        count = gpu.sbe_window.total(now, window_s)
        rate = count * 3600.0 / window_s
        active = "ecc_correctable_rate" in gpu.conditions
        if not active and rate > per_hour:
            return self._raise(
                gpu,
                Condition(
                    condition="ecc_correctable_rate",
                    kind="ecc_correctable_rate",
                    severity="warning",
                    reason=(
                        f"{count} correctable (single-bit) ECC errors in the last {window_s:g}s: "
                        f"{rate:.0f}/h, above {per_hour:g}/h"
                    ),
                    action="operator_check",
                    since=now,
                    observed_value=rate,
                    threshold=per_hour,
                ),
                now,
                repeats=False,
            )
        if active and rate <= per_hour / 2:
            return self._end(
                gpu,
                "ecc_correctable_rate",
                now,
                f"correctable ECC rate down to {rate:.0f}/h (cleared at half of {per_hour:g}/h)",
                value=rate,
            )
        return []

    # --- samples -------------------------------------------------------------------

    def observe_sample(self, sample: GpuSample) -> list[HealthEvent]:
        gpu = self.gpus.get(sample.uuid)
        now = sample.timestamp
        if gpu is None:
            self.rescan_wanted = True
            return []
        if sample.error == "lost":
            return self.observe_lost(gpu.uuid, now, "GPU_IS_LOST while sampling")
        if sample.error is not None:
            # A timeout or an odd error on one field says nothing about health yet.
            return []
        gpu.last_answer = max(gpu.last_answer, now)
        out = self._back(gpu, now, "a sample was read")
        if sample.index != gpu.index and gpu.present:
            gpu.index = sample.index
            self._touch(gpu, now)
        out += self._ecc(gpu, sample, now)
        out += self._remap(gpu, sample, now)
        out += self._thermal(gpu, sample, now)
        out += self._clock_slowdown(gpu, sample, now)
        return out

    def _clock_slowdown(self, gpu: GpuState, sample: GpuSample, now: float) -> list[HealthEvent]:
        """HW slowdown or power brake: a warning while NVML reports it; the SW power cap
        (a GPU at its power limit under load) and the thermal reasons are not this rule."""
        if sample.throttle_reasons is None:
            return []
        condition = "clock_slowdown"
        bits = sample.throttle_reasons & CLOCK_EVENTS_HW_SLOWDOWN
        active = condition in gpu.conditions
        if bits and not active:
            names = clock_event_names(bits, CLOCK_EVENTS_HW_SLOWDOWN)
            return self._raise(
                gpu,
                Condition(
                    condition=condition,
                    kind="clock_slowdown",
                    severity="warning",
                    reason=f"the GPU reports {names}: the hardware holds its clocks down",
                    action="operator_check",
                    since=now,
                    observed_value=float(sample.throttle_reasons),
                    message=(
                        "check the power supply and the node's power-brake signal (HW "
                        "slowdown is also asserted by thermal protection)"
                    ),
                ),
                now,
                repeats=False,
            )
        if bits:
            gpu.below[condition] = 0
            return []
        if not active:
            return []
        count = gpu.below.get(condition, 0) + 1
        gpu.below[condition] = count
        if count < self._s.thermal.recover_samples:
            return []
        gpu.below.pop(condition, None)
        return self._end(gpu, condition, now, "NVML no longer reports a HW slowdown")

    def _ecc(self, gpu: GpuState, sample: GpuSample, now: float) -> list[HealthEvent]:
        c = gpu.counters
        vc, vu = sample.ecc_volatile_corrected, sample.ecc_volatile_uncorrected
        went_back = [
            f"{name} {old} -> {new}"
            for name, old, new in (
                ("corrected", c.volatile_corrected, vc),
                ("uncorrected", c.volatile_uncorrected, vu),
            )
            if old is not None and new is not None and new < old
        ]
        out: list[HealthEvent] = []
        if went_back:
            out += self._reset_observed(
                gpu, now, "volatile ECC counters went back: " + ", ".join(went_back)
            )
        else:
            if (
                vu is not None
                and c.volatile_uncorrected is not None
                and vu > c.volatile_uncorrected
            ):
                delta = vu - c.volatile_uncorrected
                if c.dbe_event_credit:
                    # Already raised from the NVML event: the counter confirms it.
                    c.dbe_event_credit = 0
                else:
                    out += self._uncorrectable(
                        gpu,
                        now,
                        f"volatile uncorrected ECC counter rose by {delta} to {vu}",
                        float(vu),
                    )
            if vc is not None and c.volatile_corrected is not None and vc > c.volatile_corrected:
                delta = vc - c.volatile_corrected
                new = max(0, delta - c.sbe_event_credit)
                c.sbe_event_credit = 0
                if new:
                    gpu.sbe_window.add(now, new)
        if vc is not None:
            c.volatile_corrected = vc
        if vu is not None:
            c.volatile_uncorrected = vu
        if vc is not None or gpu.sbe_window or "ecc_correctable_rate" in gpu.conditions:
            out += self._sbe_rate(gpu, now)
        return out

    def _remap(self, gpu: GpuState, sample: GpuSample, now: float) -> list[HealthEvent]:
        out: list[HealthEvent] = []
        flags = (sample.remapped_rows_pending, sample.retired_pages_pending)
        if any(f is not None for f in flags):
            pending = any(bool(f) for f in flags)
            active = "remap_pending" in gpu.conditions
            if pending and not active:
                # NVML says only *that* a remap is pending, not how many rows; the
                # counts it has are of rows remapped so far, shown as such when known.
                if sample.remapped_rows_pending:
                    what = "NVML reports a row remap pending"
                    unc, corr = (
                        sample.remapped_rows_uncorrectable,
                        sample.remapped_rows_correctable,
                    )
                    if unc is not None and corr is not None:
                        what += (
                            f" (rows remapped so far: {unc} for uncorrectable errors, "
                            f"{corr} for correctable ones)"
                        )
                else:
                    what = "NVML reports a page retirement pending"
                out += self._raise(
                    gpu,
                    Condition(
                        condition="remap_pending",
                        kind="remap_pending",
                        severity="critical",
                        reason=f"{what}: the GPU must be reset to apply it",
                        action="reset_gpu",
                        since=now,
                        observed_value=(
                            float(sample.remapped_rows_uncorrectable)
                            if sample.remapped_rows_uncorrectable is not None
                            else None
                        ),
                    ),
                    now,
                    repeats=False,
                )
            elif not pending and active:
                out += self._end(
                    gpu, "remap_pending", now, "no remap pending any more: the GPU was reset"
                )
                out += self._reset_observed(gpu, now, "pending row remaps were applied")
        failed = sample.remapped_rows_failed
        if failed is not None:
            active = "remap_failure" in gpu.conditions
            if failed and not active:
                out += self._raise(
                    gpu,
                    Condition(
                        condition="remap_failure",
                        kind="remap_failure",
                        severity="fatal",
                        reason=(
                            "row remapping failed: the GPU memory cannot be repaired in the field"
                        ),
                        action="hardware_inspection",
                        since=now,
                    ),
                    now,
                    repeats=False,
                )
            elif not failed and active:
                out += self._end(
                    gpu, "remap_failure", now, "NVML no longer reports a remap failure"
                )
        return out

    def _thermal(self, gpu: GpuState, sample: GpuSample, now: float) -> list[HealthEvent]:
        temp = sample.temperature_c
        if temp is None:
            return []
        t = self._s.thermal
        throttled = bool((sample.throttle_reasons or 0) & CLOCK_EVENTS_THERMAL)
        info = gpu.info
        out: list[HealthEvent] = []
        out += self._level(
            gpu,
            now,
            temp,
            "thermal",
            "thermal",
            "critical",
            threshold=t.threshold_c,
            hot=temp > t.threshold_c,
            reason=f"GPU temperature {temp} C is above the limit of {t.threshold_c:g} C",
        )
        if not t.use_nvml_thresholds:
            return out
        slowdown = info.temp_slowdown_c if info is not None else None
        if slowdown is not None or throttled or "thermal_slowdown" in gpu.conditions:
            hot = (slowdown is not None and temp >= slowdown) or throttled
            if throttled:
                # Raised by the GPU's own clock-event bit: say so, and give the
                # temperature and threshold as facts beside it, not as the cause.
                names = clock_event_names(sample.throttle_reasons or 0, CLOCK_EVENTS_THERMAL)
                reason = (
                    f"the GPU reports thermal slowdown (clock-event reason {names}); "
                    f"temperature {temp} C"
                )
                if slowdown is not None:
                    reason += f", slowdown threshold {slowdown} C"
            elif slowdown is not None:
                reason = (
                    f"GPU temperature {temp} C reached the NVML slowdown threshold of {slowdown} C"
                )
            else:
                reason = f"GPU temperature {temp} C"
            out += self._level(
                gpu,
                now,
                temp,
                "thermal_slowdown",
                "thermal_slowdown",
                "warning",
                threshold=slowdown,
                hot=hot,
                reason=reason,
                blocked=throttled,
            )
        shutdown = info.temp_shutdown_c if info is not None else None
        if shutdown is not None:
            out += self._level(
                gpu,
                now,
                temp,
                "thermal_shutdown",
                "thermal_shutdown",
                "critical",
                threshold=shutdown,
                hot=temp >= shutdown,
                reason=(
                    f"GPU temperature {temp} C reached the NVML shutdown threshold of {shutdown} C"
                ),
            )
        return out

    def _level(
        self,
        gpu: GpuState,
        now: float,
        temp: float,
        condition: str,
        kind: HealthKind,
        severity: Severity,
        *,
        threshold: float | None,
        hot: bool,
        reason: str,
        blocked: bool = False,
    ) -> list[HealthEvent]:
        """A thermal condition with hysteresis and N consecutive samples to clear."""
        t = self._s.thermal
        if condition not in gpu.conditions:
            if not hot:
                return []
            return self._raise(
                gpu,
                Condition(
                    condition=condition,
                    kind=kind,
                    severity=severity,
                    reason=reason,
                    action="operator_check",
                    since=now,
                    observed_value=float(temp),
                    threshold=threshold,
                    message="check cooling: fans, airflow, inlet temperature, heatsink",
                ),
                now,
                repeats=False,
            )
        clear_below = threshold - t.hysteresis_c if threshold is not None else None
        cool = not blocked and (clear_below is None or temp < clear_below)
        if not cool:
            gpu.below[condition] = 0
            return []
        count = gpu.below.get(condition, 0) + 1
        gpu.below[condition] = count
        if count < t.recover_samples:
            return []
        below = f"below {clear_below:g} C " if clear_below is not None else ""
        return self._end(
            gpu,
            condition,
            now,
            f"GPU temperature {temp} C, {below}for {count} consecutive samples",
            value=float(temp),
        )

    # --- operator and housekeeping ---------------------------------------------------

    def clear(
        self, ref: str, condition: str | None, now: float, by: str = "operator"
    ) -> tuple[GpuState, list[HealthEvent]]:
        """Clear one condition, or every sticky condition, of a GPU."""
        gpu = self.find(ref)
        if condition is not None:
            if condition not in gpu.conditions:
                raise UnknownCondition(condition)
            names = [condition]
        else:
            names = [n for n, c in gpu.conditions.items() if c.sticky or c.kind in STICKY_KINDS]
        out: list[HealthEvent] = []
        if condition in GONE_CONDITIONS and not gpu.present:
            # Taken out of the node on purpose: not expected here any more.
            for name in list(gpu.conditions):
                out += self._end(
                    gpu,
                    name,
                    now,
                    f"cleared by {by}: the GPU is not present and is forgotten (no longer "
                    "expected on this node)",
                    how="cleared",
                )
            del self.gpus[gpu.uuid]
            self._dirty.add(gpu.uuid)  # its stored state goes too
            return gpu, out
        for name in names:
            out += self._end(gpu, name, now, f"cleared by {by}", how="cleared")
        return gpu, out

    def tick(self, now: float) -> list[HealthEvent]:
        out: list[HealthEvent] = []
        for event in self._dedup.tick(now):
            gpu = self.gpus.get(event.gpu_uuid)
            out.append(self._refresh(gpu, event) if gpu is not None else event)
        for gpu in self._ordered():
            if gpu.sbe_window or "ecc_correctable_rate" in gpu.conditions:
                out += self._sbe_rate(gpu, now)
        return out
