"""The rule engine: observations in, health events and per-GPU state out.

Design
------
The engine is pure and synchronous: no I/O, no clock of its own (every input carries
its time), no threads. The service feeds it and publishes what it returns; tests
drive it directly. All inputs arrive on the event loop, so it needs no lock.

Inputs: NVML events, read by name (``NvmlEvent.kinds``), never by bit; the collector's
samples; the GPU list, a lost GPU, NVML going away and coming back; XIDs from the kernel
log; operator clears and the housekeeping tick.

Rule families, one module each, whose docstrings state their rules (defaults in
:mod:`gpulet_common.settings.health`): :mod:`.xid`, :mod:`.ecc`, :mod:`.remap`,
:mod:`.thermal`, :mod:`.clocks`, :mod:`.link_errors` (PCIe and NVLink error-counter
rates), :mod:`.recovery` (the driver's recovery action holding a GPU until evidence:
:meth:`RuleEngine.observe_recovery_action`, and XID 154 from the kernel log),
:mod:`.nvlink` (links down, from the collector's inventory:
:meth:`RuleEngine.observe_nvlinks`), :mod:`.presence` (the GPU list, lost, removed and
missing GPUs, NVML unavailable), and :mod:`.unreadable` (GPUs NVML counts that do not
answer and that the node has no record of: :meth:`RuleEngine.observe_unreadable`). The
engine hands every input to the families, in the order of :data:`FAMILIES`, and passes
what they emit through the de-duplication stage (:meth:`.Deduplicator.apply`): repeats
are folded after the rules, never inside them.

Adding a family: a module with a :class:`~.base.Family` subclass that overrides the
inputs it watches (``sample``, ``nvml_event``, ``tick``, ``reset``) and changes
conditions only through the :class:`~.base.Kit` (``raise_``, ``end``, ``report``), and
one line in :data:`FAMILIES`.

A GPU reset observed (volatile ECC counters going back, pending remaps applied, a lost
GPU answering again) ends the GPU's sticky conditions, and every family takes new
baselines. A reset of a GPU whose only sticky condition is an XID and whose volatile
ECC counters were already zero leaves no trace in NVML: that needs ``gpulet health
clear``. Clearing ``missing``/``removed``/``lost`` of a GPU that is not present forgets
the GPU (it was taken out on purpose).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import (
    GpuHealth,
    GpuInfo,
    GpuSample,
    HealthEvent,
    HealthState,
    UnreadableGpu,
)
from gpulet_common.nvml.adapter import NvmlEvent
from gpulet_common.settings.health import HealthSettings
from gpulet_health.catalogue import XidCatalogue
from gpulet_health.dedup import DedupKey, Deduplicator, Emit, EventIds, refreshed
from gpulet_health.recovery import from_xid_154
from gpulet_health.rules.base import Family, Kit
from gpulet_health.rules.clocks import Clocks
from gpulet_health.rules.ecc import Ecc
from gpulet_health.rules.link_errors import LinkErrors
from gpulet_health.rules.nvlink import NvLink
from gpulet_health.rules.presence import GONE_CONDITIONS, Presence
from gpulet_health.rules.recovery import CONDITION as RECOVERY_HOLD
from gpulet_health.rules.recovery import XID_RECOVERY, Recovery
from gpulet_health.rules.remap import Remap
from gpulet_health.rules.thermal import Thermal
from gpulet_health.rules.unreadable import Unreadable, is_placeholder
from gpulet_health.rules.xid import Xid
from gpulet_health.state import STICKY_KINDS, GpuState

log = logging.getLogger("gpulet.health.rules")
# Once per NVML event for a GPU the engine does not know: rate-limited.
_unknown_log = RateLimitedLog(log, per_minute=10)

# The families between XID (first) and presence (last), in the order they see inputs.
FAMILIES: tuple[type[Family], ...] = (
    Ecc,
    Remap,
    Thermal,
    Clocks,
    LinkErrors,
)


class UnknownGpu(LookupError):
    pass


class NotPresent(LookupError):
    """Clearing a GPU's sticky conditions while it is not present: what keeps it listed
    is its ``missing``/``removed``/``lost`` condition (``args[0]``), which only clearing
    by name does (it forgets the GPU)."""


class UnknownCondition(LookupError):
    pass


class RuleEngine(Kit):
    def __init__(
        self,
        node: str,
        settings: HealthSettings,
        catalogue: XidCatalogue | None = None,
        *,
        id_key: bytes | None = None,
        boot_id: str = "",
    ) -> None:
        """``id_key``: the node's event-id key (:func:`~gpulet_health.dedup.load_id_key`);
        None: a random one (ids unique, not stable across restarts)."""
        super().__init__(
            node, settings, catalogue or XidCatalogue.from_settings(settings), EventIds(id_key)
        )
        self.boot_id = boot_id
        self._dedup = Deduplicator(settings.dedup_window_s, self.ids)
        self.xid, self.presence, self.nvlink = Xid(self), Presence(self), NvLink(self)
        self.recovery = Recovery(self)
        self.unreadable = Unreadable(self)
        self.families = [
            self.xid,
            *(family(self) for family in FAMILIES),
            self.recovery,
            self.nvlink,
            self.presence,
        ]

    # --- queries -------------------------------------------------------------------

    def take_dirty(self) -> set[str]:
        dirty, self.dirty = self.dirty, set()
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
        gpus = [self.find(gpu)] if gpu is not None else self.ordered()
        return HealthState(node=self.node, gpus=[g.snapshot() for g in gpus], updated_at=now)

    def recovery_holds(self) -> list[int]:
        """Indexes of the present GPUs the driver's recovery action holds (:mod:`.recovery`):
        the NVML event thread reads their field 230 again (a hold read back from the KV
        bucket has no reading of this run, and no XID may come to prompt one)."""
        return sorted(
            g.index
            for g in self.gpus.values()
            if g.present and g.index is not None and RECOVERY_HOLD in g.conditions
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
            (
                g.info
                for g in self.gpus.values()
                if g.info is not None and not is_placeholder(g.uuid)
            ),
            key=lambda i: (i.index, i.uuid),
        )

    # --- inputs --------------------------------------------------------------------

    def observe_inventory(
        self, gpus: Sequence[GpuInfo], now: float, *, scanned_at: float | None = None
    ) -> list[HealthEvent]:
        """The GPUs NVML lists and that answer. Missing known GPUs are removed.

        ``scanned_at`` is when the scan began: a scan takes a while, and what was
        learnt meanwhile (a sample from a GPU the scan missed, a loss reported after
        it began) is newer than its result. Such GPUs are left as they are and a new
        scan is asked for.
        """
        return self._dedup.apply(self.presence.inventory(gpus, now, scanned_at))

    def observe_unreadable(
        self, gpus: Sequence[UnreadableGpu], count: int, found: Sequence[GpuInfo], now: float
    ) -> list[HealthEvent]:
        """The GPUs NVML counts that do not answer, after the scan's GPU list
        (:meth:`observe_inventory`): :mod:`.unreadable`."""
        return self._dedup.apply(self.unreadable.observe(gpus, count, found, now))

    def observe_nvlinks(self, gpus: Sequence[GpuInfo], now: float) -> list[HealthEvent]:
        """The GPUs of the collector's inventory: their NVLinks up and down
        (:mod:`.nvlink`). GPUs this engine does not know are left to the GPU scans."""
        out: list[Emit] = []
        for info in gpus:
            gpu = self.gpus.get(info.uuid)
            if gpu is not None and gpu.present:
                out += self.nvlink.observe(gpu, info, now)
        return self._dedup.apply(out)

    def observe_lost(
        self, uuid: str, now: float, detail: str, *, scanned_at: float | None = None
    ) -> list[HealthEvent]:
        """The GPU is lost: unhealthy, and out of the usable GPU list (removed)."""
        gpu = self.gpus.get(uuid)
        if gpu is None:
            return []
        if scanned_at is not None and gpu.last_answer > scanned_at:
            self.rescan_wanted = True
            return []  # it answered after the scan that says it is lost began
        return self._dedup.apply(self.presence.lost(gpu, now, detail))

    def observe_nvml_unavailable(self, reason: str, now: float) -> list[HealthEvent]:
        return self._dedup.apply(self.presence.nvml_unavailable(reason, now))

    def observe_nvml_available(self, now: float) -> list[HealthEvent]:
        return self._dedup.apply(self.presence.nvml_available(now))

    def observe_nvml_event(self, event: NvmlEvent, recovery: int | None = -1) -> list[HealthEvent]:
        """An NVML event; ``recovery``: the GPU's recovery action (field 230) read with it
        (None: the driver does not report it; -1: not read)."""
        uuid = event.gpu_uuid
        if uuid not in self.gpus and event.gpu_index is not None:
            uuid = self.index_map().get(event.gpu_index)
        gpu = self.gpus.get(uuid) if uuid is not None else None
        if gpu is None:
            _unknown_log.warning(
                "NVML event %s for an unknown GPU (%s, %s): rescanning",
                sorted(event.kinds) or hex(event.event_type),
                event.gpu_index,
                event.gpu_uuid,
            )
            self.rescan_wanted = True
            return []
        now = event.timestamp
        kinds = event.kinds
        emits = self.recovery.observe(gpu, recovery, now) if recovery != -1 else []
        return self._dedup.apply(
            emits
            + [
                e
                for f in self.families
                if type(f).nvml_event is not Family.nvml_event
                and (f.event_kinds is None or f.event_kinds & kinds)
                for e in f.nvml_event(gpu, event, now)
            ]
        )

    def observe_xid(
        self, uuid: str, code: int, now: float, *, seen_in: str = "", detail: str = ""
    ) -> list[HealthEvent]:
        """An XID on a GPU; ``seen_in`` says where, when not from an NVML event;
        ``detail``: the kernel log's text after the code (pid, name, message)."""
        gpu = self.gpus.get(uuid)
        if gpu is None:
            return []
        emits: list[Emit] = []
        if code == XID_RECOVERY:  # the kernel log's form of the recovery action
            value = from_xid_154(detail)
            if value is not None:
                emits += self.recovery.observe(gpu, value, now)
        emits += self.xid.observe(gpu, code, now, seen_in, detail)
        return self._dedup.apply(emits)

    def observe_recovery_action(
        self, uuid: str, value: int | None, now: float
    ) -> list[HealthEvent]:
        """NVML field 230 read for a GPU (None: the driver does not report it)."""
        gpu = self.gpus.get(uuid)
        return self._dedup.apply(self.recovery.observe(gpu, value, now)) if gpu else []

    def absorb(self, key: DedupKey, variant: str, now: float) -> bool:
        return self._dedup.absorb(key, variant, now)

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
        if self.presence.gone(gpu):
            # Read before the loss was seen, maybe: only our own scan says it is back.
            self.rescan_wanted = True
            return []
        gpu.last_answer = max(gpu.last_answer, now)
        if sample.index != gpu.index:
            gpu.index = sample.index
            self.touch(gpu, now)
        return self._dedup.apply([e for f in self.families for e in f.sample(gpu, sample, now)])

    # --- operator and housekeeping ---------------------------------------------------

    def clear(
        self, ref: str, condition: str | None, now: float, by: str = "operator"
    ) -> tuple[GpuState, list[HealthEvent]]:
        """Clear one condition, or every sticky condition, of a GPU."""
        gpu = self.find(ref)
        if condition is not None and condition not in gpu.conditions:
            raise UnknownCondition(condition)
        gone = sorted(GONE_CONDITIONS.intersection(gpu.conditions))
        if condition is None and not gpu.present and gone:
            raise NotPresent(gone[0])
        out: list[Emit] = []
        if condition in GONE_CONDITIONS and not gpu.present:
            # Taken out of the node on purpose: not expected here any more.
            why = (
                f"cleared by {by}: the GPU is not present and is forgotten (no longer "
                "expected on this node)"
            )
            for name in list(gpu.conditions):
                out += self.end(gpu, name, now, why, how="cleared")
            del self.gpus[gpu.uuid]
            self.dirty.add(gpu.uuid)  # its stored state goes too
            return gpu, self._dedup.apply(out)
        names = (
            [condition]
            if condition is not None
            else [n for n, c in gpu.conditions.items() if c.sticky or c.kind in STICKY_KINDS]
        )
        for name in names:
            out += self.end(gpu, name, now, f"cleared by {by}", how="cleared")
        return gpu, self._dedup.apply(out)

    def tick(self, now: float) -> list[HealthEvent]:
        out: list[HealthEvent] = []
        for event in self._dedup.tick(now):
            gpu = self.gpus.get(event.gpu_uuid)
            out.append(refreshed(event, gpu.healthy, gpu.index) if gpu is not None else event)
        ticks = [e for gpu in self.ordered() for f in self.families for e in f.tick(gpu, now)]
        return out + self._dedup.apply(ticks)
