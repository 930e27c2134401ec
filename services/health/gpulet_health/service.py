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

Without NVML the service runs *degraded* and retries with back-off, like the collector
(``nvml.retry_min_s`` doubling to ``nvml.retry_max_s``); where NVML is expected (a
driver not loaded yet) it is *starting*, not ready on ``/readyz``, with the reason.

Layout
------
:class:`HealthService` is the lifecycle only: it wires the stages, starts them in one
task group, restores what a previous run left (KV state, expected GPUs), adopts NVML
when it is (or becomes) available, and keeps the status board true. The stages live
beside it: the scan stage (:mod:`.scan`), the rule-driving stage (:mod:`.inputs`: NVML
events, samples, inventories, the kernel log), the publish stage (:mod:`.emit`, then
:mod:`.publisher`), the endpoints (:mod:`.endpoints`) and the gauges (:mod:`.gauges`);
:mod:`.stages` carries what the stages share.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import anyio
import anyio.abc
import nats.errors

from gpulet_common import codec, subjects
from gpulet_common.bootid import read_boot_id
from gpulet_common.bus import BusError
from gpulet_common.lifecycle import idle_disabled
from gpulet_common.messages import GpuHealth, InventoryRequest
from gpulet_common.nvml.adapter import NvmlAdapter
from gpulet_common.runtime import Runtime, RuntimeService
from gpulet_common.settings import HealthSettings
from gpulet_health.buffer import DiskBuffer
from gpulet_health.dedup import load_id_key
from gpulet_health.emit import EventStage
from gpulet_health.endpoints import HealthEndpoints
from gpulet_health.events_source import SourceItem
from gpulet_health.fleet_relay import run_relay
from gpulet_health.fleet_status import FleetStatusPublisher
from gpulet_health.gauges import HealthGauges
from gpulet_health.inputs import RuleDriver
from gpulet_health.known import KnownGpus
from gpulet_health.kv import StateStore
from gpulet_health.publisher import HealthPublisher
from gpulet_health.rules import RuleEngine
from gpulet_health.scan import GpuScanner
from gpulet_health.stages import HealthStages

log = logging.getLogger("gpulet.health")

SOURCE_QUEUE = 1024


class HealthService(RuntimeService[HealthSettings]):
    name = "health"

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime, runtime.settings.health)
        self._state_dir = Path(runtime.settings.state_dir)
        # The node's event-id key (gpulet_health.dedup): ids stable across restarts,
        # unguessable by anyone else. A tiny file read, once, at construction.
        id_key = load_id_key(self._state_dir / "health" / "event-id.key")
        self.engine = RuleEngine(self._node, self._settings, id_key=id_key, boot_id=read_boot_id())
        directory = self._settings.buffer.directory or str(self._state_dir / "health-buffer")
        self.buffer = DiskBuffer(
            Path(directory),
            max_bytes=self._settings.buffer.max_bytes,
            max_events=self._settings.buffer.max_events,
            segment_bytes=self._settings.buffer.segment_bytes,
        )
        self.known = KnownGpus(self._state_dir / "health" / "gpus.json", self._node)
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
            ids=self.engine.ids,
        )
        # The node's summary for the hub's fleet view (docs/fleet.md).
        self.fleet_status = FleetStatusPublisher(
            runtime.bus,
            self._node,
            lambda: self.engine.state(time.time(), None),
            runtime.settings.fleet,
        )
        self.stage = EventStage(
            self.engine,
            self.store,
            runtime.meter,
            on_state_change=self._update_status,
            on_rescan_wanted=lambda: self.scanner.request(),
        )
        self.scanner = GpuScanner(self.engine, self.stage, self.known, self._settings)
        stages = HealthStages(runtime.bus, self._node, self.engine, self.stage, self.scanner)
        self.inputs = RuleDriver(
            stages,
            settings=self._settings,
            gauges=HealthGauges(self.engine, self._node, runtime.meter),
            status=runtime.status,
            meter=runtime.meter,
            on_nvml=self._nvml_changed,
        )
        self.endpoints = HealthEndpoints(stages)
        self._nvml_down = False
        # Set when the state a previous run left could not be read (said in /readyz).
        self._restore_problem = ""

    @property
    def registered(self) -> dict[int, int]:
        """What the NVML event thread registered, per GPU index."""
        return self.scanner.registered

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
                await tg.start(self.publisher.run, self.stage.receive)
                await tg.start(self.store.run, self._snapshot)
                await tg.start(self.endpoints.serve_state)
                await tg.start(self.endpoints.serve_clear)
                await tg.start(self.inputs.consume_samples)
                await tg.start(self.inputs.consume_inventory)
                await tg.start(self.scanner.rescan_loop)
                tg.start_soon(self._tick_loop)
                if handle.adapter is not None:
                    await self._adopt(tg, handle.adapter)
                    self._update_status()
                else:
                    reason = handle.reason or "NVML unavailable"
                    # Said until NVML starts: not by _update_status (every tick).
                    self._nvml_down = True
                    self._rt.status.set(self.name, handle.state, handle.detail)
                    await self.stage.emit(self.engine.observe_nvml_unavailable(reason, time.time()))
                    tg.start_soon(self._wait_for_nvml, tg)
                tg.start_soon(self._ask_collector)
                tg.start_soon(
                    self.inputs.kmsg_loop, self._state_dir, self._rt.settings.nvml.backend
                )
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
        self.scanner.adapter = adapter
        await self.scanner.scan("start")
        source = self.scanner.start_source(adapter)
        send, receive = anyio.create_memory_object_stream[SourceItem](SOURCE_QUEUE)
        await tg.start(self.inputs.consume_source, receive)
        await tg.start(source.run, send)

    async def _wait_for_nvml(self, tg: anyio.abc.TaskGroup) -> None:
        adapter = await self._rt.nvml.wait_available(
            lambda h: self._rt.status.set(self.name, h.state, h.detail)
        )
        await self.stage.emit(self.engine.observe_nvml_available(time.time()))
        await self._adopt(tg, adapter)
        self._nvml_down = False
        self._update_status()

    def _nvml_changed(self, reason: str | None) -> None:
        """The event thread saw NVML go away (``reason``) or come back (None)."""
        self._nvml_down = reason is not None
        if reason is not None:
            self._rt.status.set(self.name, "degraded", f"NVML unavailable: {reason}")
        else:
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

    def _snapshot(self, uuid: str) -> GpuHealth | None:
        gpu = self.engine.gpus.get(uuid)
        return gpu.snapshot() if gpu is not None else None

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
            await self.stage.emit(self.engine.tick(time.time()))
            self._update_status()
