"""The health service: sees every GPU fault quickly, says what to do, recovers by itself.

Flow
----
One task group, all of it structured (nothing outlives the service):

* **NVML events** (:mod:`.events_source`): a worker thread waits for XID, ECC and
  GPU-unavailable events with a short timeout and watches the GPU count;
* **samples**: the collector's ``gpu.samples.<node>`` (temperature, throttle reasons,
  ECC counters, remapped rows, "lost"), in the collector's own order: a batch older
  than the newest seen (``seq`` / ``boot_id``, :mod:`gpulet_common.ordering`) is
  dropped and counted, so batches delivered late after a NATS outage cannot make a
  lost GPU flap lost/recovered;
* **GPU list**: a scan of NVML (handles, UUIDs, thresholds, supported events) at start,
  when the count changes, when an NVML event or a sample names an unknown GPU, when a
  GPU is lost, and when the collector publishes an inventory that differs from ours
  (it is also asked for one at start, so start order does not matter; inventories too
  are taken in the collector's order); the collector's inventory also says which
  NVLinks are up and which went down (:mod:`.rules.nvlink`);
* the **rule engine** (:mod:`.rules`) turns all of that into events and state;
* the **publisher** (:mod:`.publisher`) sends events to JetStream in order, through
  the disk buffer when NATS is away;
* the **state store** (:mod:`.kv`) keeps each GPU's health in the ``gpu_health`` KV
  bucket, and two endpoints answer ``gpulet.health.state.<node>`` (current state) and
  ``gpulet.health.clear.<node>`` (operator clears sticky conditions);
* a **tick** flushes de-duplication summaries and ages the correctable-ECC window;
* the **kernel log** (:mod:`.kmsg`): ``NVRM: Xid`` records, a second source of XIDs
  that also gives back those logged while the agent was down. An XID that both sources
  see is reported once (the first source wins).
* the GPUs the node is expected to have are remembered (:mod:`.known`, and in the KV
  bucket): one that the first scan does not find raises ``gpu_missing`` and stays
  listed, not present and unhealthy, until it is back.

Without NVML the service runs *degraded* and retries, like the collector.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import anyio
import anyio.abc
import nats.errors
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from opentelemetry import metrics

from gpulet_common import codec, subjects
from gpulet_common.bus import BusError, Delivery, Refused
from gpulet_common.lifecycle import idle_disabled
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import (
    GpuHealth,
    GpuInfo,
    HealthClearRequest,
    HealthEvent,
    HealthState,
    HealthStateRequest,
    Inventory,
    InventoryRequest,
    SampleBatch,
)
from gpulet_common.nvml.adapter import NvmlAdapter
from gpulet_common.nvml.errors import NvmlUnavailable
from gpulet_common.ordering import SenderOrder
from gpulet_common.runtime import Runtime
from gpulet_health.buffer import DiskBuffer
from gpulet_health.counted import GpuScan, scan_gpus
from gpulet_health.events_source import (
    CountChanged,
    EventReceived,
    LostSignal,
    NvmlDown,
    NvmlEventSource,
    NvmlUp,
    Registered,
    SourceItem,
)
from gpulet_health.fleet_relay import run_relay
from gpulet_health.fleet_status import FleetStatusPublisher
from gpulet_health.kmsg import (
    CrossSourceDedup,
    Cursor,
    KmsgReader,
    KmsgXid,
    boot_id,
    boot_wall_time,
    pci_key,
)
from gpulet_health.known import KnownGpus
from gpulet_health.kv import StateStore
from gpulet_health.publisher import HealthPublisher
from gpulet_health.rules import RuleEngine, UnknownCondition, UnknownGpu

log = logging.getLogger("gpulet.health")

# Events between the rule engine and the publisher. A full queue makes the producers
# wait (backpressure), it never drops.
EVENT_QUEUE = 4096
SOURCE_QUEUE = 1024
# A GPU scan that takes longer than this (a hung GPU) is given up for this round.
SCAN_TIMEOUT_S = 10.0
# While a GPU is lost or removed, scan this often to see it come back even without
# the collector's samples.
GONE_RESCAN_S = 5.0
MIN_RESCAN_GAP_S = 0.05


class HealthService:
    name = "health"

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self._settings = runtime.settings.health
        self._node = runtime.node
        self.engine = RuleEngine(self._node, self._settings)
        directory = self._settings.buffer.directory or str(
            Path(runtime.settings.state_dir) / "health-buffer"
        )
        self.buffer = DiskBuffer(
            Path(directory),
            max_bytes=self._settings.buffer.max_bytes,
            max_events=self._settings.buffer.max_events,
            segment_bytes=self._settings.buffer.segment_bytes,
        )
        self.known = KnownGpus(
            Path(runtime.settings.state_dir) / "health" / "gpus.json", self._node
        )
        self._known_log = RateLimitedLog(log, per_minute=2)
        self.store = StateStore(
            runtime.bus,
            self._node,
            history=self._settings.stream.kv_history,
            timeout_s=runtime.settings.nats.request_timeout_s,
        )
        self.publisher = HealthPublisher(
            runtime.bus,
            self._node,
            self.buffer,
            publish_timeout_s=self._settings.stream.publish_timeout_s,
            ensure_stream=self._ensure_stream,
            meter=runtime.meter,
        )
        # The node's summary for the hub's fleet view (docs/fleet.md).
        self.fleet_status = FleetStatusPublisher(
            runtime.bus,
            self._node,
            lambda: self.engine.state(time.time(), None),
            runtime.settings.fleet,
        )
        self._events_send: MemoryObjectSendStream[HealthEvent]
        self._events_recv: MemoryObjectReceiveStream[HealthEvent]
        self._events_send, self._events_recv = anyio.create_memory_object_stream[HealthEvent](
            EVENT_QUEUE
        )
        self._adapter: NvmlAdapter | None = None
        self._source: NvmlEventSource | None = None
        self._rescan = anyio.Event()
        self._last_scan_count: int | None = None
        self._nvml_down = False
        # What the event thread registered, per GPU index (for logs and tests), and
        # for which watch generation.
        self.registered: dict[int, int] = {}
        self._registered_generation = -1
        self._registration = anyio.Event()
        # Every PCI address a GPU of this node has had (kept after a loss: XID 79 is
        # logged for a GPU that NVML no longer answers for), for the kernel log's XIDs.
        self._pci: dict[tuple[int, int, int], str] = {}
        self._xid_dedup = CrossSourceDedup(self._settings.kmsg.dedup_window_s)
        # Set when the state a previous run left could not be read (said in /readyz).
        self._restore_problem = ""
        self._state_dir = Path(runtime.settings.state_dir)
        self._sample_order = SenderOrder()
        self._inventory_order = SenderOrder()
        self._late_samples = runtime.meter.create_counter(
            "gpulet.health.samples_late",
            description="Sample batches dropped: older than the newest seen from the collector",
        )
        self._event_counter = runtime.meter.create_counter(
            "gpulet.health.events", description="Health events produced, by kind and severity"
        )
        # Labels of each GPU as the collector's gauges carry them (dcgm-exporter style), so
        # alert rules can join health with temperature and the like.
        self._gpu_labels: dict[str, dict[str, str]] = {}
        runtime.meter.create_observable_gauge(
            "gpulet.gpu.healthy",
            [self._observe_health],
            unit="1",
            description="1 while the GPU is healthy, 0 while any unhealthy condition is active",
        )
        runtime.meter.create_observable_gauge(
            "gpulet.gpu.conditions",
            [self._observe_conditions],
            unit="1",
            description="Active health conditions of the GPU, by kind and severity",
        )

    # --- lifecycle -------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        if not self._settings.enabled:
            await idle_disabled(self.name, "health.enabled", self._rt.status, task_status)
        await anyio.to_thread.run_sync(self.buffer.open)
        try:
            await self._prepare_jetstream()
            handle = await self._rt.nvml.get()
            async with anyio.create_task_group() as tg:
                await tg.start(self.publisher.run, self._events_recv)
                await tg.start(self.store.run, self._snapshot)
                await tg.start(self._serve_state)
                await tg.start(self._serve_clear)
                await tg.start(self._consume_samples)
                await tg.start(self._consume_inventory)
                await tg.start(self._rescan_loop)
                tg.start_soon(self._tick_loop)
                if handle.adapter is not None:
                    await self._adopt(tg, handle.adapter)
                    self._update_status()
                else:
                    reason = handle.reason or "NVML unavailable"
                    self._rt.status.set(self.name, "degraded", reason)
                    await self._emit(self.engine.observe_nvml_unavailable(reason, time.time()))
                    tg.start_soon(self._wait_for_nvml, tg)
                tg.start_soon(self._ask_collector)
                tg.start_soon(self._kmsg_loop)
                if self._rt.settings.fleet.status_enabled:
                    await tg.start(self.fleet_status.run)
                if self._rt.settings.fleet.relay_enabled:
                    tg.start_soon(
                        run_relay,
                        self._rt.settings.nats,
                        self._node,
                        self._rt.settings.fleet,
                        self._rt.meter,
                    )
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.buffer.close)

    async def _prepare_jetstream(self) -> None:
        """Stream and KV bucket, and the state a previous run left; best effort."""
        try:
            with anyio.fail_after(self._rt.settings.nats.request_timeout_s * 2):
                await self._ensure_stream()
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            # The publisher retries (and buffers on disk) until the stream exists.
            log.warning("cannot create the health stream %s yet: %s", subjects.HEALTH_STREAM, exc)
        restored = await self.store.load(within_s=self._settings.stream.restore_timeout_s)
        if restored is None:
            self._restore_problem = (
                "the previous health state (gpu_health KV) could not be read: conditions "
                "raised before this start (a fatal XID) may be missing until seen again"
            )
        elif restored:
            self.engine.restore(restored)
            log.info(
                "restored the health state of %d GPU(s) (%d unhealthy)",
                len(restored),
                sum(1 for h in restored if not h.healthy),
            )
        known = await anyio.to_thread.run_sync(self.known.load)
        added = self.engine.expect(known.gpus)
        (log.info if known.gpus or "does not exist" in known.detail else log.warning)(
            "GPUs this node is expected to have: %s (%d not in the KV state)", known.detail, added
        )

    async def _ensure_stream(self) -> None:
        stream = self._settings.stream
        await self._rt.bus.ensure_stream(
            subjects.HEALTH_STREAM,
            list(subjects.HEALTH_STREAM_SUBJECTS),
            max_age_s=stream.max_age_s,
            max_bytes=stream.max_bytes,
            duplicate_window_s=stream.duplicate_window_s,
        )

    async def _adopt(self, tg: anyio.abc.TaskGroup, adapter: NvmlAdapter) -> None:
        self._adapter = adapter
        await self._scan("start")
        self._source = NvmlEventSource(
            adapter,
            timeout_ms=self._settings.event_wait_timeout_ms,
            device_poll_s=self._settings.device_poll_s,
        )
        self._source.watch(self._watch_list(), self._last_scan_count)
        send, receive = anyio.create_memory_object_stream[SourceItem](SOURCE_QUEUE)
        await tg.start(self._consume_source, receive)
        await tg.start(self._source.run, send)

    async def _wait_for_nvml(self, tg: anyio.abc.TaskGroup) -> None:
        adapter = await self._rt.nvml.wait_available()
        await self._emit(self.engine.observe_nvml_available(time.time()))
        await self._adopt(tg, adapter)
        self._update_status()

    def _update_status(self) -> None:
        if self._nvml_down:
            return
        present = [g for g in self.engine.gpus.values() if g.present]
        unhealthy = sum(1 for g in self.engine.gpus.values() if not g.healthy)
        detail = f"{len(present)} GPUs watched, {unhealthy} unhealthy"
        if self.publisher.backlog:
            # No count here: the detail would change (and be logged) with every event;
            # gpulet_health_buffer_pending has the number.
            detail += ", NATS unreachable: events buffered on disk"
        if self._restore_problem:
            self._rt.status.set(self.name, "degraded", f"{detail}; {self._restore_problem}")
            return
        self._rt.status.set(self.name, "ready", detail)

    # --- the engine's output -----------------------------------------------------------

    async def _emit(self, events: list[HealthEvent]) -> None:
        for event in events:
            self._event_counter.add(1, {"kind": event.kind, "severity": event.severity})
            if event.kind not in ("recovered", "cleared", "gpu_added"):
                log.log(
                    logging.WARNING if not event.healthy else logging.INFO,
                    "GPU %s (%s): %s [%s, action %s]",
                    event.gpu_index,
                    event.gpu_uuid,
                    event.reason,
                    event.severity,
                    event.action,
                )
            else:
                log.info(
                    "GPU %s (%s): %s: %s", event.gpu_index, event.gpu_uuid, event.kind, event.reason
                )
            await self._queue(event)
        dirty = self.engine.take_dirty()
        if dirty:
            self.store.mark(dirty)
            self._update_status()
        if self.engine.rescan_wanted:
            self.engine.rescan_wanted = False
            self._rescan.set()

    async def _queue(self, event: HealthEvent) -> None:
        # send_nowait first: it is no checkpoint, so a cancellation (shutdown) cannot
        # drop an event between the engine producing it and the queue holding it; the
        # publisher saves what is queued when it stops.
        try:
            try:
                self._events_send.send_nowait(event)
            except anyio.WouldBlock:
                await self._events_send.send(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            log.error(  # noqa: TRY400 - an expected end, not a bug: no traceback
                "shutting down: health event %s (%s, GPU %s) could not be queued",
                event.event_id,
                event.kind,
                event.gpu_uuid,
            )

    def _snapshot(self, uuid: str) -> GpuHealth | None:
        gpu = self.engine.gpus.get(uuid)
        return gpu.snapshot() if gpu is not None else None

    def _watch_list(self) -> list[int]:
        return sorted(
            g.index
            for g in self.engine.gpus.values()
            if g.present and g.index is not None and "lost" not in g.conditions
        )

    # --- GPU scans -------------------------------------------------------------------

    def _scan_blocking(self, adapter: NvmlAdapter) -> GpuScan:
        return scan_gpus(adapter)

    async def _scan(self, why: str) -> None:
        adapter = self._adapter
        if adapter is None:
            return
        previous = self.engine.index_map()
        previous_count = self._last_scan_count
        scanned_at = time.time()
        try:
            with anyio.fail_after(SCAN_TIMEOUT_S):
                scan = await anyio.to_thread.run_sync(
                    self._scan_blocking, adapter, abandon_on_cancel=True
                )
        except TimeoutError:
            log.warning("GPU scan (%s) took longer than %.0fs; will retry", why, SCAN_TIMEOUT_S)
            return
        except NvmlUnavailable as exc:
            log.warning("GPU scan (%s) failed: %s", why, exc.reason)
            return
        now = time.time()
        count, found, lost = scan.count, scan.found, scan.lost
        self._last_scan_count = count
        self._learn_pci(found)
        events: list[HealthEvent] = []
        for index, uuid in lost:
            if uuid is None and previous_count == count:
                uuid = previous.get(index)
            if uuid is not None:
                events += self.engine.observe_lost(
                    uuid, now, "GPU_IS_LOST while reading its identity", scanned_at=scanned_at
                )
        events += self.engine.observe_inventory(found, now, scanned_at=scanned_at)
        events += self.engine.observe_unreadable(scan.unreadable, count, found, now)
        log.debug(
            "GPU scan (%s): %d GPUs, %d answering, %d lost", why, count, len(found), len(lost)
        )
        await self._emit_watched(events, count)
        await self._remember()

    async def _remember(self) -> None:
        """Keep the list of expected GPUs on disk up to date."""
        gpus = self.engine.expected()
        if not self.known.changed(gpus):
            return
        try:
            await anyio.to_thread.run_sync(self.known.save, gpus)
        except OSError as exc:
            self._known_log.warning("cannot save the expected GPUs to %s: %s", self.known.path, exc)

    async def _emit_watched(self, events: list[HealthEvent], count: int | None) -> None:
        """Emit, after updating the event thread's GPU list.

        A new or returning GPU is registered before anyone is told about it: whoever
        reacts to gpu_added can count on that GPU's events being seen. (Not for use
        from the task that consumes the event thread's items: it would wait for
        itself.)
        """
        if self._source is not None:
            added = any(e.kind == "gpu_added" for e in events)
            generation = self._source.watch(self._watch_list(), count, force=added)
            if added:
                await self._await_registration(generation)
        await self._emit(events)

    async def _await_registration(self, generation: int) -> None:
        # The thread re-registers between two waits; a hung GPU may hold it longer, so
        # this only waits a few wait timeouts.
        limit = max(1.0, 5 * self._settings.event_wait_timeout_ms / 1000)
        with anyio.move_on_after(limit):
            while self._registered_generation < generation:
                await self._registration.wait()

    async def _rescan_loop(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            gone = any(not g.present or "lost" in g.conditions for g in self.engine.gpus.values())
            with anyio.move_on_after(GONE_RESCAN_S if gone else float("inf")):
                await self._rescan.wait()
            self._rescan = anyio.Event()
            await self._scan("change")
            # A scan may ask for another (its result was overtaken by newer news);
            # spacing them keeps a GPU that keeps doing that from spinning the loop.
            await anyio.sleep(MIN_RESCAN_GAP_S)

    # --- inputs ----------------------------------------------------------------------

    async def _consume_source(
        self,
        receive: MemoryObjectReceiveStream[SourceItem],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        async with receive:
            async for item in receive:
                await self._handle_source(item)

    async def _handle_source(self, item: SourceItem) -> None:
        engine = self.engine
        if isinstance(item, EventReceived):
            event = item.event
            xid = event.xid
            if (
                xid is not None
                and event.gpu_uuid is not None
                and not self._xid_dedup.admit("nvml", event.gpu_uuid, xid, time.monotonic())
            ):
                return  # the kernel log reported this XID first
            await self._emit(engine.observe_nvml_event(event))
        elif isinstance(item, LostSignal):
            uuid = item.uuid
            if uuid is None and item.index is not None:
                uuid = engine.index_map().get(item.index)
            if uuid is not None:
                await self._emit(engine.observe_lost(uuid, item.timestamp, item.detail))
            # Also when NVML did not say which GPU: the scan finds out.
            self._rescan.set()
        elif isinstance(item, CountChanged):
            log.info("GPU count changed to %d", item.count)
            self._rescan.set()
        elif isinstance(item, Registered):
            self.registered = dict(item.masks)
            self._registered_generation = item.generation
            self._registration.set()
            self._registration = anyio.Event()
            log.debug("NVML events registered: %s", {i: hex(m) for i, m in item.masks.items()})
        elif isinstance(item, NvmlDown):
            self._nvml_down = True
            self._rt.status.set(self.name, "degraded", f"NVML unavailable: {item.reason}")
            await self._emit(engine.observe_nvml_unavailable(item.reason, item.timestamp))
        elif isinstance(item, NvmlUp):
            self._nvml_down = False
            await self._emit(engine.observe_nvml_available(item.timestamp))
            self._update_status()
            self._rescan.set()

    async def _consume_samples(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with self._rt.bus.subscribe(
            subjects.samples(self._node), codec.SAMPLES, node=self._node
        ) as stream:
            task_status.started()
            async for delivery in stream:
                await self._on_samples(delivery.value)

    async def _on_samples(self, batch: SampleBatch) -> None:
        if batch.node != self._node:
            return
        if not self._sample_order.accept(batch.boot_id, batch.seq):
            self._late_samples.add(1)
            log.debug("dropped a late sample batch (seq %d of %s)", batch.seq, batch.boot_id)
            return
        events: list[HealthEvent] = []
        for sample in batch.samples:
            events += self.engine.observe_sample(sample)
        if any(e.kind == "gpu_added" for e in events):
            # A lost GPU answers again: watch it before saying so.
            await self._emit_watched(events, self._last_scan_count)
        else:
            await self._emit(events)

    async def _consume_inventory(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with self._rt.bus.subscribe(
            subjects.inventory(self._node), codec.INVENTORY, node=self._node
        ) as stream:
            task_status.started()
            async for delivery in stream:
                if self._on_inventory(delivery.value):
                    # NVLinks up and down are the collector's word (its inventory).
                    await self._emit(self.engine.observe_nvlinks(delivery.value.gpus, time.time()))

    def _labels(self, uuid: str, index: int | None) -> dict[str, str]:
        return self._gpu_labels.get(uuid) or {
            "gpu": "" if index is None else str(index),
            "UUID": uuid,
            "Hostname": self._node,
        }

    def _observe_health(self, _options: metrics.CallbackOptions) -> list[metrics.Observation]:
        return [
            metrics.Observation(1.0 if gpu.healthy else 0.0, self._labels(gpu.uuid, gpu.index))
            for gpu in list(self.engine.gpus.values())
            if gpu.uuid
        ]

    def _observe_conditions(self, _options: metrics.CallbackOptions) -> list[metrics.Observation]:
        counts: dict[tuple[str, str, str], int] = {}
        indices: dict[str, int | None] = {}
        for gpu in list(self.engine.gpus.values()):
            indices[gpu.uuid] = gpu.index
            for condition in list(gpu.conditions.values()):
                wire = condition.wire()
                key = (gpu.uuid, wire.kind, wire.severity)
                counts[key] = counts.get(key, 0) + 1
        return [
            metrics.Observation(
                float(n), {**self._labels(uuid, indices[uuid]), "kind": kind, "severity": sev}
            )
            for (uuid, kind, sev), n in counts.items()
        ]

    def _on_inventory(self, inventory: Inventory) -> bool:
        """Take the collector's inventory; False when it is not this node's, degraded,
        or older than one already seen."""
        if inventory.node != self._node or inventory.degraded_reason is not None:
            return False
        if not self._inventory_order.accept(inventory.boot_id, inventory.seq):
            return False  # an older one of the collector's, delivered late
        self._gpu_labels = {
            g.uuid: {
                "gpu": str(g.index),
                "UUID": g.uuid,
                "pci_bus_id": g.pci_bus_id,
                "modelName": g.name,
                "Hostname": inventory.node,
            }
            for g in inventory.gpus
        }
        self._learn_pci(inventory.gpus)
        theirs = {(g.index, g.uuid) for g in inventory.gpus}
        ours = {(i, u) for i, u in self.engine.index_map().items()}
        if theirs != ours:
            log.info(
                "the collector's inventory (generation %d) differs from ours: rescanning",
                inventory.generation,
            )
            self._rescan.set()
        return True

    def _learn_pci(self, gpus: list[GpuInfo]) -> None:
        for gpu in gpus:
            key = pci_key(gpu.pci_bus_id) if gpu.pci_bus_id else None
            if key is not None:
                self._pci[key] = gpu.uuid

    async def _kmsg_loop(self) -> None:
        """XIDs from the kernel log, from its ring buffer on; degraded without access."""
        cfg = self._settings.kmsg
        component = "health.kmsg"
        path = cfg.path or ("/dev/kmsg" if self._rt.settings.nvml.backend != "mock" else "")
        if not cfg.enabled or not path:
            return
        cursor = await anyio.to_thread.run_sync(
            Cursor, self._state_dir / "health-kmsg.cursor", boot_id()
        )
        reader = KmsgReader(path, cursor)
        try:
            await anyio.to_thread.run_sync(reader.open)
        except OSError as exc:
            self._rt.status.set(
                component,
                "degraded",
                f"cannot read the kernel log {path} ({exc.strerror or exc}): XIDs come "
                "from NVML events only, and XIDs from while the agent was down are missed",
            )
            return
        self._rt.status.set(component, "ready", f"reading XIDs from {path}")
        boot = boot_wall_time()
        try:
            while True:
                if not self.engine.gpus:  # nothing to tie a PCI address to yet
                    await anyio.sleep(cfg.poll_s)
                    continue
                try:
                    xids = await anyio.to_thread.run_sync(reader.poll)
                except OSError as exc:
                    self._rt.status.set(component, "degraded", f"reading {path}: {exc}")
                    await anyio.sleep(max(cfg.poll_s, 5.0))
                    continue
                for xid in xids:
                    await self._on_kmsg_xid(xid, boot)
                if xids:
                    await anyio.to_thread.run_sync(reader.commit, xids[-1].seq)
                else:
                    await anyio.sleep(cfg.poll_s)
        finally:
            reader.close()

    async def _on_kmsg_xid(self, xid: KmsgXid, boot: float) -> None:
        uuid = self._pci.get(xid.pci)
        if uuid is None:
            log.warning(
                "kernel log XID %d for PCI %04x:%02x:%02x, not a GPU of this node: ignored",
                xid.xid,
                *xid.pci,
            )
            return
        if not self._xid_dedup.admit("kmsg", uuid, xid.xid, time.monotonic()):
            return  # NVML reported it first
        now = time.time()
        logged_at = boot + xid.usec / 1e6
        ago = max(0.0, now - logged_at)
        seen_in = "from the kernel log" + (f", logged {ago:.0f} s earlier" if ago >= 2 else "")
        await self._emit(self.engine.observe_xid(uuid, xid.xid, now, seen_in=seen_in))

    async def _ask_collector(self) -> None:
        # The reply is also published on gpu.inventory.<node>, where we listen.
        try:
            await self._rt.bus.request(
                subjects.inventory_request(self._node),
                InventoryRequest(reason="health service start"),
                codec.INVENTORY_REQUEST,
                codec.INVENTORY,
                timeout_s=2.0,
            )
        except BusError as exc:
            log.debug("no inventory from the collector at start: %s", exc)

    async def _tick_loop(self) -> None:
        while True:
            await anyio.sleep(self._settings.tick_s)
            await self._emit(self.engine.tick(time.time()))
            self._update_status()

    # --- endpoints -------------------------------------------------------------------

    async def _serve_state(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async def answer(request: Delivery[HealthStateRequest]) -> HealthState:
            gpu = request.value.gpu
            try:
                return self.engine.state(time.time(), gpu)
            except UnknownGpu:
                raise Refused("unknown_gpu", self._unknown_gpu(gpu or "")) from None

        await self._rt.bus.serve(
            subjects.health_state(self._node),
            answer,
            codec.HEALTH_STATE_REQUEST,
            codec.HEALTH_STATE,
            task_status=task_status,
        )

    async def _serve_clear(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async def answer(request: Delivery[HealthClearRequest]) -> HealthState:
            value = request.value
            if not value.gpu.strip():
                raise Refused("invalid_request", "gpu must be a GPU UUID or index")
            if value.condition is not None and not value.condition.strip():
                raise Refused("invalid_request", "condition must not be empty")
            now = time.time()
            try:
                gpu, events = self.engine.clear(value.gpu, value.condition, now, value.requested_by)
            except UnknownGpu:
                raise Refused("unknown_gpu", self._unknown_gpu(value.gpu)) from None
            except UnknownCondition:
                gpu = self.engine.find(value.gpu)
                active = ", ".join(sorted(gpu.conditions)) or "none"
                raise Refused(
                    "unknown_condition",
                    f"GPU {value.gpu} has no active condition {value.condition!r} "
                    f"(active: {active})",
                ) from None
            log.info(
                "%s cleared %s on GPU %s (%d condition(s))",
                value.requested_by,
                value.condition or "the sticky conditions",
                gpu.uuid,
                len([e for e in events if e.kind == "cleared"]),
            )
            await self._emit(events)
            await self._remember()
            return HealthState(node=self._node, gpus=[gpu.snapshot()], updated_at=now)

        await self._rt.bus.serve(
            subjects.health_clear(self._node),
            answer,
            codec.HEALTH_CLEAR_REQUEST,
            codec.HEALTH_STATE,
            task_status=task_status,
        )

    def _unknown_gpu(self, ref: str) -> str:
        known = ", ".join(
            f"{g.index}={g.uuid}"
            for g in sorted(self.engine.gpus.values(), key=lambda g: g.index or 0)
        )
        return f"no GPU {ref!r} on node {self._node} (known: {known or 'none'})"
