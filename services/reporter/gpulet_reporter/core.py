"""From inputs to an intent on offer: the reporter minus its transports.

:class:`ReporterCore` holds the node's inventory and :class:`HealthView`, rebuilds the
:class:`DesiredState` on every input, and offers it to the :class:`Debouncer` only
when it differs from the previous one -- the stream of unchanged inputs (1 Hz
republished inventories, repeated health reports, periodic snapshots) stops here and
costs no more than a comparison.

It knows nothing of NATS or of the API server, which is what lets the fleet bench
drive a thousand of them in one process with simulated inputs, while the service
feeds it from the bus. Everything here is synchronous and never blocks.

No intent exists before the first usable inventory: an agent that has not heard from
the collector yet must not tell the scheduler that the node has no GPUs. A degraded
inventory (NVML unavailable, no GPUs listed) likewise leaves the last intent alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import HealthEvent, HealthState, Inventory
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_reporter.debounce import Debouncer
from gpulet_reporter.desired import DesiredState, NodeFacts, build_desired, fallback_pcie_root
from gpulet_reporter.health_view import HealthView

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
            settings.quiet_window_s, settings.max_delay_s
        )
        self._input_log = RateLimitedLog(log, per_minute=10)

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
        self.health.forget({g.uuid for g in inventory.gpus})
        self._rebuild()

    def on_health_event(self, event: HealthEvent) -> None:
        if event.node != self.node:
            return
        if self.health.apply_event(event):
            self._rebuild()

    def on_health_state(self, state: HealthState) -> None:
        if state.node not in ("", self.node):
            return
        if self.health.apply_state(state):
            self._rebuild()

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
                facts=self._facts,
            )
        except (ValueError, TypeError, OverflowError) as exc:
            # A malformed inventory that passed the decoder's checks: keep the last
            # intent rather than crash the service over one bad message.
            self._input_log.warning("cannot build the Device from the inventory: %s", exc)
            return
        if desired != self.desired:
            self.desired = desired
            self.debouncer.submit(desired)
