"""The rule-driving stage: every input of the health service, handed to the rule engine.

Design
------
:class:`RuleDriver` owns the service's inputs, each a task of the service's group:

* **NVML events** (:mod:`.events_source`, on its worker thread): XIDs, ECC and
  GPU-unavailable events, a GPU lost, the count changed, NVML down and back;
* **samples**: the collector's ``gpu.samples.<node>`` in the collector's own order: a
  batch older than the newest seen (``seq`` / ``boot_id``, :mod:`gpulet_common.ordering`)
  is dropped and counted (``gpulet.health.samples_late``), so batches delivered late
  after a NATS outage cannot make a lost GPU flap lost/recovered;
* **inventories**: the collector's ``gpu.inventory.<node>``, in its order; one that
  differs from the engine's GPU list asks for a scan, and its NVLinks up and down are
  the collector's word (:mod:`.rules.nvlink`);
* **the kernel log** (:mod:`.kmsg`): ``NVRM: Xid`` records, a second source of XIDs
  that also gives back those logged while the agent was down. An XID that both
  sources see is reported once (the first source wins, :class:`~.kmsg.CrossSourceDedup`).

What the engine answers goes to the publish stage (:class:`~.emit.EventStage`), or
through the scanner when a GPU came back (it must be watched before it is announced).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream
from opentelemetry import metrics

from gpulet_common import codec, subjects
from gpulet_common.bootid import read_boot_id
from gpulet_common.codec import Codec
from gpulet_common.lifecycle import take_queued
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import HealthEvent, Inventory, SampleBatch
from gpulet_common.ordering import SenderOrder
from gpulet_common.settings.health import HealthSettings
from gpulet_common.telemetry import StatusBoard
from gpulet_health.events_source import (
    CountChanged,
    EventReceived,
    LostSignal,
    Registered,
    SourceItem,
)
from gpulet_health.gauges import HealthGauges
from gpulet_health.kmsg import (
    CrossSourceDedup,
    Cursor,
    KmsgReader,
    KmsgXid,
    boot_wall_time,
)
from gpulet_health.stages import HealthStages

# Source items handled one after another without yielding to the event loop.
SOURCE_BURST = 256

log = logging.getLogger("gpulet.health")

KMSG_COMPONENT = "health.kmsg"
T = TypeVar("T")


class RuleDriver:
    def __init__(
        self,
        stages: HealthStages,
        *,
        settings: HealthSettings,
        gauges: HealthGauges,
        status: StatusBoard,
        meter: metrics.Meter,
        on_nvml: Callable[[str | None], None],
    ) -> None:
        """``on_nvml(reason)``: NVML went down (a reason) or came back (None)."""
        self._s = stages
        self._settings = settings
        self._gauges = gauges
        self._status = status
        self._on_nvml = on_nvml
        self._xid_dedup = CrossSourceDedup(settings.kmsg.dedup_window_s)
        self._sample_order = SenderOrder()
        self._inventory_order = SenderOrder()
        self._late_samples = meter.create_counter(
            "gpulet.health.samples_late",
            description="Sample batches dropped: older than the newest seen from the collector",
        )
        # Once per kernel log record for a PCI address not of this node: rate-limited.
        self._kmsg_log = RateLimitedLog(log, per_minute=10)

    # --- NVML events -----------------------------------------------------------------

    async def consume_source(
        self,
        receive: MemoryObjectReceiveStream[SourceItem],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        async with receive:
            async for item in receive:
                await self._handle_source(item)
                # What is queued behind it is taken without a checkpoint per item (one
                # each would cost a turn of the event loop: in an XID storm the thread
                # then waits for room while NVML's own queue overflows and drops a
                # newer, different fault); at most SOURCE_BURST, then a checkpoint.
                if not await take_queued(receive, self._handle_source, SOURCE_BURST):
                    return

    async def _handle_source(self, item: SourceItem) -> None:
        engine = self._s.engine
        if isinstance(item, EventReceived):
            event = item.event
            xid = event.xid
            if (
                xid is not None
                and event.gpu_uuid is not None
                and not self._xid_dedup.admit("nvml", event.gpu_uuid, xid, time.monotonic())
            ):
                return  # the kernel log reported this XID first
            await self._s.stage.emit(engine.observe_nvml_event(event, item.recovery))
        elif isinstance(item, LostSignal):
            uuid = item.uuid
            if uuid is None and item.index is not None:
                uuid = engine.index_map().get(item.index)
            if uuid is not None:
                await self._s.stage.emit(engine.observe_lost(uuid, item.timestamp, item.detail))
            # Also when NVML did not say which GPU: the scan finds out.
            self._s.scanner.request()
        elif isinstance(item, CountChanged):
            log.info("GPU count changed to %d", item.count)
            self._s.scanner.request()
        elif isinstance(item, Registered):
            self._s.scanner.registered_now(item)
        elif item.down_reason is not None:  # NvmlChanged: NVML went away
            reason = item.down_reason
            self._on_nvml(reason)
            await self._s.stage.emit(engine.observe_nvml_unavailable(reason, item.timestamp))
        else:  # NvmlChanged: NVML came back
            self._on_nvml(None)
            await self._s.stage.emit(engine.observe_nvml_available(item.timestamp))
            self._on_nvml(None)  # the status as of after the events
            self._s.scanner.request()

    # --- the collector ---------------------------------------------------------------

    async def consume_samples(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        await self._consume(
            subjects.samples(self._s.node), codec.SAMPLES, self.on_samples, task_status
        )

    async def _consume(
        self,
        subject: str,
        message_codec: Codec[T],
        handle: Callable[[T], Awaitable[None]],
        task_status: anyio.abc.TaskStatus[None],
    ) -> None:
        """Hand every message of this node's ``subject`` to ``handle``, in order."""
        async with self._s.bus.subscribe(subject, message_codec, node=self._s.node) as stream:
            task_status.started()
            async for delivery in stream:
                await handle(delivery.value)

    async def on_samples(self, batch: SampleBatch) -> None:
        if batch.node != self._s.node:
            return
        if not self._sample_order.accept(batch.boot_id, batch.seq):
            self._late_samples.add(1)
            log.debug("dropped a late sample batch (seq %d of %s)", batch.seq, batch.boot_id)
            return
        events: list[HealthEvent] = []
        for sample in batch.samples:
            events += self._s.engine.observe_sample(sample)
        if any(e.kind == "gpu_added" for e in events):
            # A lost GPU answers again: watch it before saying so.
            await self._s.scanner.emit_watched(events, self._s.scanner.last_count)
        else:
            await self._s.stage.emit(events)

    async def consume_inventory(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        await self._consume(
            subjects.inventory(self._s.node), codec.INVENTORY, self._on_inventory, task_status
        )

    async def _on_inventory(self, inventory: Inventory) -> None:
        if self.on_inventory(inventory):
            # NVLinks up and down are the collector's word (its inventory).
            await self._s.stage.emit(self._s.engine.observe_nvlinks(inventory.gpus, time.time()))

    def on_inventory(self, inventory: Inventory) -> bool:
        """Take the collector's inventory; False when it is not this node's, degraded,
        or older than one already seen."""
        if inventory.node != self._s.node or inventory.degraded_reason is not None:
            return False
        if not self._inventory_order.accept(inventory.boot_id, inventory.seq):
            return False  # an older one of the collector's, delivered late
        self._gauges.take_labels(inventory)
        self._s.scanner.learn_pci(inventory.gpus)
        theirs = {(g.index, g.uuid) for g in inventory.gpus}
        ours = {(i, u) for i, u in self._s.engine.index_map().items()}
        if theirs != ours:
            log.info(
                "the collector's inventory (generation %d) differs from ours: rescanning",
                inventory.generation,
            )
            self._s.scanner.request()
        return True

    # --- the kernel log --------------------------------------------------------------

    async def kmsg_loop(self, state_dir: Path, backend: str) -> None:
        """XIDs from the kernel log, from its ring buffer on; degraded without access."""
        cfg = self._settings.kmsg
        path = cfg.path or ("/dev/kmsg" if backend != "mock" else "")
        if not cfg.enabled or not path:
            return
        cursor = await anyio.to_thread.run_sync(
            Cursor, state_dir / "health-kmsg.cursor", read_boot_id()
        )
        reader = KmsgReader(path, cursor)
        try:
            await anyio.to_thread.run_sync(reader.open)
        except OSError as exc:
            self._status.set(
                KMSG_COMPONENT,
                "degraded",
                f"cannot read the kernel log {path} ({exc.strerror or exc}): XIDs come "
                "from NVML events only, and XIDs from while the agent was down are missed",
            )
            return
        self._status.set(KMSG_COMPONENT, "ready", f"reading XIDs from {path}")
        boot = boot_wall_time()
        try:
            while True:
                if not self._s.engine.gpus:  # nothing to tie a PCI address to yet
                    await anyio.sleep(cfg.poll_s)
                    continue
                try:
                    xids = await anyio.to_thread.run_sync(reader.poll)
                except OSError as exc:
                    self._status.set(KMSG_COMPONENT, "degraded", f"reading {path}: {exc}")
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
        uuid = self._s.scanner.pci.get(xid.pci)
        if uuid is None:
            self._kmsg_log.warning(
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
        await self._s.stage.emit(
            self._s.engine.observe_xid(uuid, xid.xid, now, seen_in=seen_in, detail=xid.detail)
        )
