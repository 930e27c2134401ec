"""What every rule family shares: the family interface and the conditions kit.

Design
------
A *family* (:class:`Family`) watches one kind of fault: it overrides the inputs it cares
about and changes a GPU's conditions only through the :class:`Kit` (``raise_``, ``end``,
``report``), which return :class:`~gpulet_health.dedup.Emit` items, not published
events: the engine de-duplicates them afterwards. What a family remembers of a GPU (a
counter's last value, a rate window) lives on the GPU's state under the family's name
(:func:`memo`), so it goes with the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar, Literal, TypeVar

import msgspec

from gpulet_common.messages import Action, GpuSample, HealthEvent, HealthKind, Severity
from gpulet_common.nvml.adapter import NvmlEvent
from gpulet_common.settings.health import HealthSettings
from gpulet_health.catalogue import XidCatalogue
from gpulet_health.dedup import DedupKey, Emit, EventIds
from gpulet_health.state import Condition, GpuState

EndKind = Literal["recovered", "cleared"]
M = TypeVar("M")


def where(gpu: GpuState) -> str:
    """How a rule's reason names the GPU: ``GPU 3``, or ``the GPU`` without an index."""
    return f"GPU {gpu.index}" if gpu.index is not None else "the GPU"


def memo(gpu: GpuState, name: str, make: type[M]) -> M:
    """The family ``name``'s memory of ``gpu`` (a fresh ``make()`` the first time)."""
    found = gpu.memo.get(name)
    if not isinstance(found, make):
        found = make()
        gpu.memo[name] = found
    return found


class Kit:
    """The GPUs, and the only ways to change their conditions."""

    def __init__(
        self,
        node: str,
        settings: HealthSettings,
        catalogue: XidCatalogue,
        ids: EventIds | None = None,
    ) -> None:
        self.node = node
        # Every event id of this node (keyed: see gpulet_health.dedup).
        self.ids = ids or EventIds()
        # The node's boot id (/proc/sys/kernel/random/boot_id), given by the service:
        # every event carries it (HealthEvent.node_boot_id), and a hold until a reboot
        # compares it (rules/recovery.py). Empty: not known.
        self.boot_id = ""
        self.settings = settings
        self.catalogue = catalogue
        self.gpus: dict[str, GpuState] = {}
        self.families: list[Family] = []
        self.dirty: set[str] = set()
        # Set when an observation suggests the GPU list changed; the service rescans.
        self.rescan_wanted = False

    def ordered(self) -> list[GpuState]:
        return sorted(
            self.gpus.values(),
            key=lambda g: (not g.present, g.index if g.index is not None else 1 << 30, g.uuid),
        )

    def touch(self, gpu: GpuState, now: float) -> None:
        gpu.updated_at = max(gpu.updated_at, now)
        self.dirty.add(gpu.uuid)

    def event(
        self, gpu: GpuState, eid: str, now: float, kind: HealthKind, severity: Severity, reason: str
    ) -> HealthEvent:
        """An event about ``gpu`` that concerns no condition."""
        return HealthEvent(
            event_id=eid,
            node=self.node,
            gpu_uuid=gpu.uuid,
            gpu_index=gpu.index,
            kind=kind,
            severity=severity,
            healthy=gpu.healthy,
            reason=reason,
            observed_at=now,
            node_boot_id=self.boot_id,
        )

    def _about(
        self, gpu: GpuState, cond: Condition, eid: str, now: float, reason: str = ""
    ) -> HealthEvent:
        """An event about ``cond`` (its reason, unless another is given)."""
        return msgspec.structs.replace(
            self.event(gpu, eid, now, cond.kind, cond.severity, reason or cond.reason),
            action=cond.action,
            message=cond.message,
            observed_value=cond.observed_value,
            threshold=cond.threshold,
            xid=cond.xid,
            condition=cond.condition,
            condition_since=cond.since,
            condition_kind=cond.kind,
            condition_severity=cond.severity,
        )

    def raise_(
        self, gpu: GpuState, cond: Condition, now: float, *, repeats: bool = False
    ) -> list[Emit]:
        """Raise ``cond``; if already active, an occurrence (when it ``repeats``)."""
        key = (gpu.uuid, cond.condition)
        active = gpu.conditions.get(cond.condition)
        if active is None:
            gpu.conditions[cond.condition] = cond
            gpu.below.pop(cond.condition, None)
            self.touch(gpu, now)
            eid = self.ids(self.node, gpu.uuid, "raise", cond.condition, cond.since)
            return [Emit("raise", key, self._about(gpu, cond, eid, now))]
        if not repeats:
            return []
        eid = self.ids(self.node, gpu.uuid, "occurrence", cond.condition, now)
        event = self._about(gpu, active, eid, now, cond.reason)
        if cond.observed_value is not None:
            event = msgspec.structs.replace(event, observed_value=cond.observed_value)
        if cond.message and cond.message != event.message:  # e.g. an XID's new message
            event = msgspec.structs.replace(event, message=cond.message)
        return [Emit("offer", key, event)]

    def end(
        self,
        gpu: GpuState,
        condition: str,
        now: float,
        reason: str,
        *,
        how: EndKind = "recovered",
        value: float | None = None,
    ) -> list[Emit]:
        cond = gpu.conditions.pop(condition, None)
        if cond is None:
            return []
        gpu.below.pop(condition, None)
        self.touch(gpu, now)
        event = self._about(
            gpu, cond, self.ids(self.node, gpu.uuid, "end", condition, cond.since), now, reason
        )
        event = msgspec.structs.replace(
            event, kind=how, severity="info", action="none", message="", observed_value=value
        )
        return [Emit("end", (gpu.uuid, condition), event)]

    def report(
        self,
        gpu: GpuState,
        key: str,
        now: float,
        kind: HealthKind,
        severity: Severity,
        reason: str,
        *,
        action: Action = "none",
        value: float | None = None,
        xid: int | None = None,
        message: str = "",
    ) -> list[Emit]:
        """A one-off fact that raises no condition (de-duplicated by ``key``)."""
        self.touch(gpu, now)
        eid = self.ids(self.node, gpu.uuid, "report", key, now)
        event = self.event(gpu, eid, now, kind, severity, reason)
        event = msgspec.structs.replace(
            event, action=action, observed_value=value, xid=xid, message=message
        )
        return [Emit("offer", (gpu.uuid, "report:" + key), event)]

    def absorb(self, key: DedupKey, variant: str, now: float) -> bool:
        """Count a repeat of ``key`` inside its open de-duplication window, before any
        event is built (True: counted, nothing to emit). The engine implements it."""
        return False

    def reset_observed(self, gpu: GpuState, now: float, why: str) -> list[Emit]:
        """A GPU reset was seen: its sticky conditions end, every family starts afresh."""
        out: list[Emit] = []
        for name, cond in list(gpu.conditions.items()):
            if cond.sticky:
                out += self.end(gpu, name, now, f"GPU reset observed ({why})")
        for family in self.families:
            family.reset(gpu)
        for family in self.families:
            out += family.after_reset(gpu, now)
        return out

    def rate(
        self,
        gpu: GpuState,
        now: float,
        condition: str,
        rate: float,
        limit: float,
        raised: Callable[[], Condition],
        recovered: Callable[[], str],
    ) -> list[Emit]:
        """A rate condition: raised above ``limit``, ended once down to half of it."""
        active = condition in gpu.conditions
        if not active and rate > limit:
            return self.raise_(gpu, raised(), now)
        if active and rate <= limit / 2:
            return self.end(gpu, condition, now, recovered(), value=rate)
        return []

    def settled(self, gpu: GpuState, condition: str, calm: bool) -> int:
        """Consecutive calm samples of an active level condition (0 when not calm); it
        ends once they reach ``thermal.recover_samples``."""
        count = gpu.below.get(condition, 0) + 1 if calm else 0
        gpu.below[condition] = count
        return count


class Family:
    """One rule family: override the inputs it watches; each returns what it emits."""

    name: ClassVar[str]
    # The NVML event kinds its nvml_event watches (None: every event); the engine hands
    # it only those, so a storm of one kind costs the other families nothing.
    event_kinds: ClassVar[frozenset[str] | None] = None

    def __init__(self, kit: Kit) -> None:
        self.kit = kit
        self.s = kit.settings

    def sample(self, gpu: GpuState, sample: GpuSample, now: float) -> Iterable[Emit]:
        return []

    def nvml_event(self, gpu: GpuState, event: NvmlEvent, now: float) -> Iterable[Emit]:
        return []

    def tick(self, gpu: GpuState, now: float) -> Iterable[Emit]:
        return []

    def reset(self, gpu: GpuState) -> None:
        """A reset of ``gpu`` was observed: forget what no longer holds (baselines)."""

    def after_reset(self, gpu: GpuState, now: float) -> Iterable[Emit]:
        """What a reset of ``gpu`` ends once every family has forgotten its baselines: a
        condition whose other evidence came before the reset was seen."""
        return []
