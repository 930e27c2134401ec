"""The collector service: publishes the node's GPU inventory and periodic samples.

Flow
----
1. Open NVML (shared per process). Without NVML the service runs *degraded*: it
   publishes an inventory with ``degraded_reason`` set and retries opening NVML with
   back-off (``nvml.retry_min_s`` doubling to ``nvml.retry_max_s``), so a driver that
   loads later is picked up without a restart. Where NVML is expected (the driver is
   not loaded yet, or the backend was named) the service is *starting*, so not ready
   on ``/readyz``, with the reason, until NVML starts.
2. Publish the inventory on ``gpu.inventory.<node>``; answer inventory requests on
   ``gpulet.inventory.request.<node>`` (and republish, so late subscribers catch up).
3. Every ``sample_period_s`` read every GPU in parallel (:mod:`.sampler`) and publish
   one :class:`SampleBatch` on ``gpu.samples.<node>``. Ticks are drift-free; a period
   that overran is skipped rather than queued.
4. When the GPU count changes (hot-add, removal) the inventory is rebuilt and
   republished with a new ``generation``. The count is NVML's (``nvmlDeviceGetCount``),
   compared with the count the inventory was built from, not with the GPUs it lists: a
   lost GPU is still counted by NVML but cannot be listed, and comparing with the list
   rebuilt and republished the inventory every period. Such a GPU is not dropped: the
   inventory carries NVML's count (``nvml_count``) and lists it in ``unreadable``, by
   index with what identity could still be read, for the health service to raise. While
   a GPU is left out (lost), the inventory is rebuilt to see it come back, first after
   ``SKIPPED_RETRY_S``, then at twice the last wait while the same GPUs stay left out
   (at most ``SKIPPED_RETRY_MAX_S``; a change starts again from the first wait), and
   published only if it changed; the adapter logs a GPU left out once, when it is
   first left out or its reason changes, not at every look: the inventory is published on real
   change only (plus the unsolicited ``inventory_republish_s`` and answers to requests).
   A GPU that went and came back between two counts (a reset that re-enumerates it, a
   driver reload, a hot-plug) is seen too: its old handle is void, the adapter fetches
   the handle at that index again, and a sample that names another GPU than the
   inventory at that index rebuilds the inventory (that batch is not published). No
   restart is needed for any of it.
5. Every ``slow_period_s`` a period also reads the slow fields (energy, PCIe
   replays, NVLink counters, GPM activity: milliseconds per GPU on real NVML); other
   periods repeat their last values. Such a period also re-reads the state of every
   NVLink seen up (one NVML call per link) when the GPU's NVLink error counters moved
   or ``nvlink_state_period_s`` has passed; when the links up differ from what the
   published inventory says, the inventory is rebuilt and republished: a link that
   went down leaves its pair's ``nvlinks`` (the allocator stops counting it) and is
   listed in ``nvlinks_down`` (the health service warns), and one that came back
   returns. Such a period also re-reads the MIG mode and MIG devices of every
   MIG-capable GPU (a few NVML calls per GPU), and rebuilds the inventory when they
   changed: instances created or destroyed are seen without a restart.
6. With ``dcgm_metrics`` (default) ``/metrics`` also serves dcgm-exporter's
   ``DCGM_FI_*`` metrics (:mod:`.dcgm`); the last XID of each GPU comes from the
   health events on ``gpu.health.<node>``, and with ``pod_labels`` the GPUs a
   container holds carry its pod, namespace and container, as the allocator's
   ``pods`` endpoint tells (:mod:`.pods`; the allocator reads kubelet's PodResources).

Every inventory and batch carries the collector's own order: ``seq`` (one counter
for both, from 1) and ``boot_id`` (random per process). Consumers order by them,
never by a timestamp (:mod:`gpulet_common.ordering`).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time

import anyio
import anyio.abc
import msgspec

from gpulet_collector.dcgm import DcgmExporter
from gpulet_collector.gauges import GpuGauges
from gpulet_collector.pods import PodAttribution
from gpulet_collector.sampler import NVML_UNAVAILABLE, ParallelSampler
from gpulet_common import codec, subjects
from gpulet_common.bus import Delivery
from gpulet_common.messages import GpuSample, HealthEvent, Inventory, InventoryRequest, SampleBatch
from gpulet_common.nvml.adapter import NvmlAdapter
from gpulet_common.nvml.errors import NvmlError, NvmlUnavailable
from gpulet_common.runtime import NVML_RETRY_MAX_S, NvmlHandle, Runtime, RuntimeService
from gpulet_common.settings import CollectorSettings
from gpulet_common.telemetry import add_exposition, remove_exposition

log = logging.getLogger("gpulet.collector")

# First retry of NVML after it vanished at run time; doubles up to NVML_RETRY_MAX_S.
NVML_REINIT_MIN_S = 1.0
# While NVML counts GPUs the inventory could not list, look again this often.
SKIPPED_RETRY_S = 1.0
SKIPPED_RETRY_MAX_S = 30.0


class CollectorService(RuntimeService[CollectorSettings]):
    name = "collector"

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime, runtime.settings.collector)
        self._generation = 0
        self._boot_id = secrets.token_hex(8)
        self._seq = itertools.count(1)
        self._inventory = Inventory(node=self._node, nvml_backend="none")
        self._adapter: NvmlAdapter | None = None
        self._gauges = GpuGauges(runtime.meter)
        self.dcgm = DcgmExporter(self._node)
        self._next_slow = 0.0
        self._sample_count = runtime.meter.create_counter(
            "gpulet.collector.samples", description="GPU samples taken"
        )
        self._sample_errors = runtime.meter.create_counter(
            "gpulet.collector.sample_errors", description="GPU samples that failed"
        )
        self._sampler: ParallelSampler | None = None
        self._next_reinit = 0.0
        self._reinit_delay = NVML_REINIT_MIN_S / 2
        # NVML's GPU count when the inventory was built, and the GPUs it left out.
        self._nvml_count: int | None = None
        self._skipped: dict[int, str] = {}
        self._next_skipped_retry = 0.0
        self._skipped_delay = SKIPPED_RETRY_S
        #: Inventories published (every publish, requests and republishes included).
        self.inventory_publishes = 0

    @property
    def inventory(self) -> Inventory:
        return self._inventory

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        handle = await self._rt.nvml.get()
        if self._settings.dcgm_metrics:
            add_exposition(self.dcgm.render)
        try:
            await self._run(handle, task_status)
        finally:
            remove_exposition(self.dcgm.render)

    async def _run(self, handle: NvmlHandle, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self._serve_inventory_requests)
            if self._settings.dcgm_metrics:
                await tg.start(self._follow_xids)
            if handle.adapter is None:
                reason = handle.reason or "NVML unavailable"
                self._rt.status.set(self.name, handle.state, handle.detail)
                await self._publish_inventory(
                    Inventory(node=self._node, degraded_reason=reason, nvml_backend="none")
                )
                task_status.started()
                adapter = await self._rt.nvml.wait_available(
                    lambda h: self._rt.status.set(self.name, h.state, h.detail)
                )
                await self._adopt(adapter)
            else:
                # Started means the first inventory is out: consumers can rely on it.
                await self._adopt(handle.adapter)
                task_status.started()
            self._rt.status.set(self.name, "ready", f"{len(self._inventory.gpus)} GPUs")
            if self._settings.dcgm_metrics and self._settings.pod_labels:
                attribution = PodAttribution(
                    self._rt.bus,
                    self._node,
                    self._settings.pod_resources_poll_s,
                    # GPUs and MIG devices (per-GPU-instance series get their holders).
                    lambda: {
                        u
                        for g in self._inventory.gpus
                        for u in (g.uuid, *(d.uuid for d in g.mig_devices))
                    },
                    self.dcgm.update_holders,
                    self._rt.status,
                )
                await tg.start(attribution.run)
            await self._sample_forever()

    async def _adopt(self, adapter: NvmlAdapter) -> None:
        self._adapter = adapter

        def read(index: int, slow: bool) -> GpuSample:
            every_s = self._settings.nvlink_state_period_s
            return adapter.sample(index, slow=slow, nvlink_state_every_s=every_s)

        self._sampler = ParallelSampler(
            read,
            count=adapter.device_count,
            call_timeout_s=self._rt.settings.nvml.call_timeout_s,
            worker_threads=self._settings.worker_threads,
        )
        await self._refresh_inventory("start")

    async def _refresh_inventory(self, why: str, *, force: bool = True) -> None:
        """Rebuild the inventory; publish it if ``force`` or if it changed."""
        adapter = self._adapter
        if adapter is None:
            return
        generation = self._generation + 1
        try:
            inventory, skipped = await anyio.to_thread.run_sync(
                adapter.inventory_report, self._node, generation
            )
        except NvmlUnavailable as exc:
            inventory, skipped = (
                Inventory(
                    node=self._node,
                    generation=generation,
                    degraded_reason=str(exc),
                    nvml_backend="none",
                ),
                {},
            )
            self._rt.status.set(self.name, "degraded", str(exc))
        else:
            self._nvml_count = len(inventory.gpus) + len(skipped)
        if skipped and set(skipped) == set(self._skipped):
            self._skipped_delay = min(self._skipped_delay * 2, SKIPPED_RETRY_MAX_S)
        else:
            self._skipped_delay = SKIPPED_RETRY_S
        self._skipped = skipped
        self._next_skipped_retry = time.monotonic() + self._skipped_delay
        if not force and _same(inventory, self._inventory):
            return
        self._generation = generation
        log.info(
            "inventory generation %d (%s): %d GPUs%s",
            generation,
            why,
            len(inventory.gpus),
            f", {len(skipped)} left out ({', '.join(map(str, sorted(skipped)))})"
            if skipped
            else "",
        )
        await self._publish_inventory(inventory)

    async def _reinit_nvml(self, adapter: NvmlAdapter, why: str) -> None:
        """NVML vanished under us: say so, and try to initialise it again (rate-limited)."""
        self._rt.status.set(self.name, "degraded", why)
        now = time.monotonic()
        if now < self._next_reinit:
            return
        self._reinit_delay = min(self._reinit_delay * 2, NVML_RETRY_MAX_S)
        self._next_reinit = now + self._reinit_delay
        try:
            await anyio.to_thread.run_sync(adapter.init)
        except NvmlUnavailable as exc:
            log.warning("NVML still unavailable: %s (next try in %.0fs)", exc, self._reinit_delay)
            return
        log.info("NVML is back; rebuilding the inventory")
        self._reinit_delay = NVML_REINIT_MIN_S / 2
        self._next_reinit = 0.0
        await self._refresh_inventory("NVML re-initialised")
        self._rt.status.set(self.name, "ready", f"{len(self._inventory.gpus)} GPUs")

    async def _publish_inventory(self, inventory: Inventory) -> None:
        inventory = msgspec.structs.replace(
            inventory, published_at=time.time(), seq=next(self._seq), boot_id=self._boot_id
        )
        self._inventory = inventory
        self._gauges.update_inventory(inventory)
        self.inventory_publishes += 1
        self.dcgm.update_inventory(inventory)
        await self._rt.bus.publish(subjects.inventory(self._node), inventory, codec.INVENTORY)

    async def _serve_inventory_requests(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async def answer(_request: Delivery[InventoryRequest]) -> Inventory:
            await self._publish_inventory(self._inventory)
            return self._inventory

        await self._rt.bus.serve(
            subjects.inventory_request(self._node),
            answer,
            codec.INVENTORY_REQUEST,
            codec.INVENTORY,
            task_status=task_status,
        )

    async def _sample_forever(self) -> None:
        period = self._settings.sample_period_s
        republish = self._settings.inventory_republish_s
        next_tick = time.monotonic()
        next_republish = next_tick + republish
        while True:
            await self.sample_once()
            if republish and time.monotonic() >= next_republish:
                next_republish = time.monotonic() + republish
                await self._publish_inventory(self._inventory)
            next_tick += period
            now = time.monotonic()
            if next_tick < now:
                skipped = int((now - next_tick) // period) + 1
                log.debug("sampling overran; skipping %d period(s)", skipped)
                next_tick += skipped * period
            await anyio.sleep(next_tick - now)

    async def sample_once(self, slow: bool | None = None) -> SampleBatch | None:
        """One period; ``slow`` (default: when ``slow_period_s`` has passed) reads the
        slow fields too."""
        adapter, sampler = self._adapter, self._sampler
        if adapter is None or sampler is None:
            return None
        if slow is None:
            now = time.monotonic()
            slow = now >= self._next_slow
            if slow:
                self._next_slow = now + self._settings.slow_period_s
        gpus = [(g.index, g.uuid) for g in self._inventory.gpus]
        count, samples = await sampler.sample(gpus, slow)
        batch = SampleBatch(
            node=self._node,
            timestamp=time.time(),
            samples=samples,
            inventory_generation=self._inventory.generation,
            seq=next(self._seq),
            boot_id=self._boot_id,
        )
        if any(s.uuid != uuid for s, (_, uuid) in zip(samples, gpus, strict=True)):
            # A GPU answers at another index than the inventory says: one went and came
            # back (re-enumerated) between two counts. Such a batch may name a GPU twice
            # (its new index and its old, still-valid handle): not published; the
            # inventory is rebuilt (every handle fetched again) for the next period.
            await self._refresh_inventory("a GPU answers at another index", force=False)
            return None
        if samples and all((s.error or "").startswith(NVML_UNAVAILABLE) for s in samples):
            await self._reinit_nvml(adapter, samples[0].error or "")
        errors = sum(1 for s in samples if s.error)
        self._sample_count.add(len(samples) - errors)
        if errors:
            self._sample_errors.add(errors)
        self._gauges.update_samples(batch)
        self.dcgm.update_samples(batch)
        await self._rt.bus.publish(subjects.samples(self._node), batch, codec.SAMPLES)
        if count is not None and count != self._nvml_count:
            await self._refresh_inventory("GPU count changed", force=False)
        elif self._skipped and time.monotonic() >= self._next_skipped_retry:
            await self._refresh_inventory("looking for GPUs left out", force=False)
        elif slow and self._nvlinks_changed(adapter):
            await self._refresh_inventory("NVLink state changed", force=False)
        elif slow and await self._mig_changed(adapter):
            await self._refresh_inventory("MIG layout changed", force=False)
        return batch

    def _nvlinks_changed(self, adapter: NvmlAdapter) -> bool:
        """Whether a GPU's NVLinks up (as the slow read found them) differ from the
        published inventory's."""
        for gpu in self._inventory.gpus:
            up = adapter.nvlinks_up(gpu.uuid)
            if up is not None and up != frozenset(gpu.nvlinks_up):
                return True
        return False

    async def _mig_changed(self, adapter: NvmlAdapter) -> bool:
        """Whether a MIG-capable GPU's MIG mode or devices differ from the published
        inventory's (read off the event loop, given up after the NVML call timeout)."""
        gpus = [g for g in self._inventory.gpus if g.mig_capable]
        if not gpus:
            return False

        def differs() -> bool:
            for gpu in gpus:
                try:
                    if adapter.mig_changed(gpu):
                        return True
                except NvmlError as exc:  # a lost GPU: its samples say so
                    log.debug("MIG state of GPU %d unread: %s", gpu.index, exc)
            return False

        with anyio.move_on_after(self._rt.settings.nvml.call_timeout_s):
            return await anyio.to_thread.run_sync(differs, abandon_on_cancel=True)
        return False

    async def _follow_xids(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep each GPU's last XID (DCGM_FI_DEV_XID_ERRORS) from the health events."""
        async with self._rt.bus.subscribe(
            subjects.health(self._node), codec.HEALTH_EVENT, node=self._node
        ) as events:
            task_status.started()
            async for delivery in events:
                self._note_xid(delivery.value)

    def _note_xid(self, event: HealthEvent) -> None:
        if event.kind != "xid" or event.xid is None or event.node != self._node:
            return
        # Only GPUs of our inventory: an event naming another GPU is not believed.
        if any(g.uuid == event.gpu_uuid for g in self._inventory.gpus):
            self.dcgm.record_xid(event.gpu_uuid, event.xid)


def _same(a: Inventory, b: Inventory) -> bool:
    """Equal but for the generation, the publication time and the sender's order."""

    def plain(inventory: Inventory) -> Inventory:
        return msgspec.structs.replace(inventory, generation=0, published_at=0.0, seq=0, boot_id="")

    return plain(a) == plain(b)
