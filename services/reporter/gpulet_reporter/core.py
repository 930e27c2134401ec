"""From inputs to an intent on offer: the reporter minus its transports.

:class:`ReporterCore` holds the node's inventory and :class:`HealthView`, rebuilds the
:class:`DesiredState` on every input, and offers it to the :class:`Debouncer` only
when it differs from the previous one -- the stream of unchanged inputs (1 Hz
republished inventories, health states rewritten with the same verdict) stops here
and costs no more than a comparison.

It knows nothing of NATS or of the API server, which is what lets the fleet bench
drive a thousand of them in one process with simulated inputs, while the service
feeds it from the bus. Everything here is synchronous and never blocks.

No intent exists before the first usable inventory: an agent that has not heard from
the collector yet must not tell the scheduler that the node has no GPUs. A degraded
inventory (NVML unavailable, no GPUs listed) likewise leaves the last intent alone.

A GPU the health service reports as not present (lost, removed, missing at start)
stays in the intent, unhealthy, although the inventory no longer lists it: the health
service remembers the GPUs a node is expected to have, and its state names them
(``GpuHealth.info``, ``present: false`` in its KV entry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import GpuHealth, GpuInfo, Inventory
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_reporter.debounce import Debouncer
from gpulet_reporter.desired import DesiredState, build_desired, fallback_pcie_root
from gpulet_reporter.health_view import HealthView
from gpulet_reporter.labels import NodeFacts

log = logging.getLogger("gpulet.reporter")


class ReporterCore:
    def __init__(
        self,
        node: str,
        settings: ReporterSettings,
        *,
        pcie_root: Callable[[str], str] = fallback_pcie_root,
        on_degraded: Callable[[str], None] | None = None,
        facts: NodeFacts | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self._facts = facts or NodeFacts()
        self._settings = settings
        self._pcie_root = pcie_root
        self._on_degraded = on_degraded or (lambda _detail: None)
        self.health = HealthView()
        self.inventory: Inventory | None = None
        self.desired: DesiredState | None = None
        self.debouncer: Debouncer[DesiredState] = Debouncer(
            settings.quiet_window_s, settings.max_delay_s, clock=clock
        )
        self._input_log = RateLimitedLog(log, per_minute=10)
        # Every GPU an inventory or a health state described, by UUID.
        self._identity: dict[str, GpuInfo] = {}
        # GPUs the health service says are not present (kept in the Device).
        self._absent: set[str] = set()
        # Each GPU's last verified reset by remediation (the entry's gpulet.io/last-reset).
        self._last_reset: dict[str, str] = {}

    def on_inventory(self, inventory: Inventory) -> None:
        if inventory.node != self.node:
            self._input_log.warning(
                "ignored an inventory of node %r on our subject (we are %r)",
                inventory.node,
                self.node,
            )
            return
        if inventory.degraded_reason and not inventory.gpus:
            if self.inventory is None:
                self._on_degraded(f"no usable inventory: {inventory.degraded_reason}")
            # Keep the last good Device: a passing NVML failure is not "no GPUs".
            return
        self.inventory = inventory
        for gpu in inventory.gpus:
            self._identity[gpu.uuid] = gpu
        self._rebuild()

    def on_health(self, uuid: str, health: GpuHealth | None) -> None:
        """One GPU's state as the health service keeps it (None: it has none)."""
        changed = False
        if health is not None and health.info is not None and health.info.uuid == uuid:
            self._identity[uuid] = health.info
        absent = health is not None and not health.present
        if absent and uuid not in self._absent:
            self._absent.add(uuid)
            changed = True
        elif not absent and uuid in self._absent:
            # Back, or forgotten by the health service (taken out on purpose).
            self._absent.discard(uuid)
            changed = True
        if self.health.apply(uuid, health) or changed:
            self._rebuild()

    def on_last_reset(self, uuid: str, text: str) -> None:
        if self._last_reset.get(uuid, "") != text:
            if text:
                self._last_reset[uuid] = text
            else:
                self._last_reset.pop(uuid, None)
            self._rebuild()

    def on_replicas(self, replicas: dict[str, int]) -> None:
        """The allocator's time-slicing replicas of each GPU (GFD's sharing labels)."""
        if replicas != self._facts.replicas:
            self._facts = msgspec.structs.replace(self._facts, replicas=dict(replicas))
            self._rebuild()

    def absent_gpus(self) -> list[GpuInfo]:
        """The GPUs kept in the Device although the inventory does not list them."""
        listed = {g.uuid for g in self.inventory.gpus} if self.inventory else set()
        return sorted(
            (self._identity[u] for u in self._absent if u in self._identity and u not in listed),
            key=lambda g: (g.index, g.uuid),
        )

    def _rebuild(self) -> None:
        inventory = self.inventory
        if inventory is None:
            return
        try:
            desired = build_desired(
                inventory,
                self.health.snapshot(),
                gfd_labels=self._settings.gfd_labels,
                pcie_root=self._pcie_root,
                absent=self.absent_gpus(),
                facts=self._facts,
                last_resets=self._last_reset,
            )
        except (ValueError, TypeError, OverflowError) as exc:
            # A malformed inventory that passed the decoder's checks: keep the last
            # intent rather than crash the service over one bad message.
            self._input_log.warning("cannot build the Device from the inventory: %s", exc)
            return
        if desired != self.desired:
            self.desired = desired
            self.debouncer.submit(desired)
