"""The scan stage: which GPUs NVML has, handed to the rule engine.

Design
------
:class:`GpuScanner` reads every GPU's identity from NVML on a worker thread (handles,
UUIDs, thresholds, supported events; ``SCAN_TIMEOUT_S`` at most, a hung GPU is given
up for the round) at start, when the count changes, when an observation names an
unknown GPU, when a GPU is lost, and when the collector's inventory differs from the
engine's (:meth:`request`). While a GPU is lost or gone it scans every
``GONE_RESCAN_S`` to see it come back without any event.

It also owns the NVML event thread's watch list (:mod:`.events_source`): a new or
returning GPU is registered for events *before* anyone is told about it, so whoever
reacts to ``gpu_added`` can count on that GPU's events being seen; so is every GPU
again when a scan finds GPUs at other indices than before (a GPU went and came back
between two counts: its old handle, and the events registered with it, are void). And
it keeps the
list of GPUs the node is expected to have on disk (:mod:`.known`) up to date, and the
PCI address of every GPU ever seen (the kernel log names GPUs by PCI address).
"""

from __future__ import annotations

import logging
import time

import anyio

from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import GpuInfo, HealthEvent
from gpulet_common.nvml.adapter import NvmlAdapter
from gpulet_common.nvml.errors import NvmlUnavailable
from gpulet_common.settings.health import HealthSettings
from gpulet_health.counted import scan_gpus
from gpulet_health.emit import EventStage
from gpulet_health.events_source import NvmlEventSource, Registered
from gpulet_health.kmsg import pci_key
from gpulet_health.known import KnownGpus
from gpulet_health.rules import RuleEngine

log = logging.getLogger("gpulet.health")

# A GPU scan that takes longer than this (a hung GPU) is given up for this round.
SCAN_TIMEOUT_S = 10.0
# While a GPU is lost or removed, scan this often to see it come back even without
# an event.
GONE_RESCAN_S = 5.0
MIN_RESCAN_GAP_S = 0.05


class GpuScanner:
    def __init__(
        self, engine: RuleEngine, stage: EventStage, known: KnownGpus, settings: HealthSettings
    ) -> None:
        self._engine = engine
        self._stage = stage
        self.known = known
        self._settings = settings
        self._known_log = RateLimitedLog(log, per_minute=2)
        self.adapter: NvmlAdapter | None = None
        self.source: NvmlEventSource | None = None
        self._rescan = anyio.Event()
        self.last_count: int | None = None
        # What the event thread registered, per GPU index (for logs and tests), and
        # for which watch generation.
        self.registered: dict[int, int] = {}
        # How many times the event thread (re-)registered (for tests).
        self.registrations = 0
        self._registered_generation = -1
        self._registration = anyio.Event()
        # NVML index -> UUID of the GPUs when the event thread's watch list was set.
        self._watched_map: dict[int, str] = {}
        # Every PCI address a GPU of this node has had (kept after a loss: XID 79 is
        # logged for a GPU that NVML no longer answers for), for the kernel log's XIDs.
        self.pci: dict[tuple[int, int, int], str] = {}

    def request(self) -> None:
        """Scan soon (the rescan loop takes it)."""
        self._rescan.set()

    def start_source(self, adapter: NvmlAdapter) -> NvmlEventSource:
        """The NVML event thread for ``adapter``, watching the GPUs scanned so far."""
        self.source = NvmlEventSource(
            adapter,
            timeout_ms=self._settings.event_wait_timeout_ms,
            device_poll_s=self._settings.device_poll_s,
        )
        self.source.watch(self.watch_list(), self.last_count)
        self.source.ask_recovery(self._engine.recovery_holds())
        self._watched_map = self._engine.index_map()
        return self.source

    def watch_list(self) -> list[int]:
        return sorted(
            g.index
            for g in self._engine.gpus.values()
            if g.present and g.index is not None and "lost" not in g.conditions
        )

    def learn_pci(self, gpus: list[GpuInfo]) -> None:
        for gpu in gpus:
            key = pci_key(gpu.pci_bus_id) if gpu.pci_bus_id else None
            if key is not None:
                self.pci[key] = gpu.uuid

    def registered_now(self, item: Registered) -> None:
        """The event thread (re-)registered its GPUs."""
        self.registered = dict(item.masks)
        self.registrations += 1
        self._registered_generation = item.generation
        self._registration.set()
        self._registration = anyio.Event()
        log.debug("NVML events registered: %s", {i: hex(m) for i, m in item.masks.items()})

    # --- scans -----------------------------------------------------------------------

    async def scan(self, why: str) -> None:
        adapter = self.adapter
        if adapter is None:
            return
        previous = self._engine.index_map()
        previous_count = self.last_count
        scanned_at = time.time()
        try:
            with anyio.fail_after(SCAN_TIMEOUT_S):
                scan = await anyio.to_thread.run_sync(scan_gpus, adapter, abandon_on_cancel=True)
        except TimeoutError:
            log.warning("GPU scan (%s) took longer than %.0fs; will retry", why, SCAN_TIMEOUT_S)
            return
        except NvmlUnavailable as exc:
            log.warning("GPU scan (%s) failed: %s", why, exc.reason)
            return
        now = time.time()
        count, found, lost = scan.count, scan.found, scan.lost
        self.last_count = count
        self.learn_pci(found)
        events: list[HealthEvent] = []
        for index, uuid in lost:
            if uuid is None and previous_count == count:
                uuid = previous.get(index)
            if uuid is not None:
                events += self._engine.observe_lost(
                    uuid, now, "GPU_IS_LOST while reading its identity", scanned_at=scanned_at
                )
        events += self._engine.observe_inventory(found, now, scanned_at=scanned_at)
        events += self._engine.observe_unreadable(scan.unreadable, count, found, now)
        log.debug(
            "GPU scan (%s): %d GPUs, %d answering, %d lost", why, count, len(found), len(lost)
        )
        # A GPU at another index than before went and came back (re-enumerated, a new
        # handle): its events are registered again even when the count never changed.
        # (Compared with the map the events were registered for: a sample may have
        # told the engine the new index first.)
        moved = self._engine.index_map() != self._watched_map
        await self.emit_watched(events, count, force=moved)
        await self.remember()

    async def remember(self) -> None:
        """Keep the list of expected GPUs on disk up to date."""
        gpus = self._engine.expected()
        if not self.known.changed(gpus):
            return
        try:
            await anyio.to_thread.run_sync(self.known.save, gpus)
        except OSError as exc:
            self._known_log.warning("cannot save the expected GPUs to %s: %s", self.known.path, exc)

    async def emit_watched(
        self, events: list[HealthEvent], count: int | None, *, force: bool = False
    ) -> None:
        """Emit, after updating the event thread's GPU list.

        A new or returning GPU is registered before anyone is told about it: whoever
        reacts to gpu_added can count on that GPU's events being seen. (Not for use
        from the task that consumes the event thread's items: it would wait for
        itself.)
        """
        if self.source is not None:
            added = force or any(e.kind == "gpu_added" for e in events)
            generation = self.source.watch(self.watch_list(), count, force=added)
            # Indices may have moved: the recovery holds are read again where they are.
            self.source.ask_recovery(self._engine.recovery_holds())
            self._watched_map = self._engine.index_map()
            if added:
                await self._await_registration(generation)
        await self._stage.emit(events)

    async def _await_registration(self, generation: int) -> None:
        # The thread re-registers between two waits; a hung GPU may hold it longer, so
        # this only waits a few wait timeouts.
        limit = max(1.0, 5 * self._settings.event_wait_timeout_ms / 1000)
        with anyio.move_on_after(limit):
            while self._registered_generation < generation:
                await self._registration.wait()

    async def rescan_loop(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            gone = any(not g.present or "lost" in g.conditions for g in self._engine.gpus.values())
            with anyio.move_on_after(GONE_RESCAN_S if gone else float("inf")):
                await self._rescan.wait()
            self._rescan = anyio.Event()
            await self.scan("change")
            # A scan may ask for another (its result was overtaken by newer news);
            # spacing them keeps a GPU that keeps doing that from spinning the loop.
            await anyio.sleep(MIN_RESCAN_GAP_S)
