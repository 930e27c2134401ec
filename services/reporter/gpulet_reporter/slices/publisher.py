"""The ResourceSlice publisher: node read model → debounce → :class:`SliceWriter`.

Flow
----
* :meth:`SlicePublisher.attach` listens to a :class:`~gpulet_common.nodeview.NodeView`:
  every change of the inventory or of a GPU's health submits a :class:`SliceInput`
  to a :class:`~gpulet_reporter.debounce.Debouncer` (quiet window, maximum delay,
  latest wins). A GPU that appears or disappears, a fault, a recovery: each is a new
  input, so the pool follows the node without a restart. The device plugin adapter
  calls :meth:`set_held` when the GPUs it holds change (mode ``both``).
* A :class:`~gpulet_reporter.writer.WriteLoop` applies the newest input through the
  writer, which writes only what differs from what the API server holds: at rest no
  write at all, and each failure is retried with back-off until it sticks.
* A watch on the node's slices of our driver notices a slice that someone else
  deleted or changed (kubelet deletes a node's slices when it starts): it forgets the
  observation and submits the last input again, so the pool is back within the
  debounce. A watched slice that is exactly what gpulet last applied (its own write,
  seen before the write's answer) is taken as observed, without a re-read. The loop's
  reconcile timer (``resync_s``) re-lists even when the watch is
  down. Each time a watch opens (the first, or again after it ended or failed) the
  slices are read again too, since nothing tells what happened while none was open. Watch lines are
  decoded totally; one bad line is counted, never fatal.

Nothing known is lowered before it is known: until the allocator's first ``held``
answer (``await_held``: mode ``both``, or time-slicing on) the device-plugin and
time-sliced taints the API server holds are kept, and until the health service's state
was read (``await_health``) so are its fault taints. A restart of the agent therefore
never opens a window in which a held or faulty GPU looks free; new taints are still
published at once.

An inventory that NVML could not read (``degraded_reason``) is not published: it would
delete the pool on a transient NVML failure; the last pool stays until a usable one
arrives (the health service taints the GPUs meanwhile if they are really gone).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace as dataclass_replace

import anyio
from opentelemetry import metrics

from gpulet_common.kube_watch import keep_watching, watch_lines
from gpulet_common.kubeapi import KubeClient, watch_event
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.nodeview import NodeChange, NodeView
from gpulet_common.settings.dra import DraSettings
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_reporter.debounce import Debouncer
from gpulet_reporter.metrics import ReporterMetrics
from gpulet_reporter.slices.writer import SliceInput, SliceWriter
from gpulet_reporter.writer import NodeClient, WriteLoop

log = logging.getLogger("gpulet.reporter.slices")

WATCH_BACKOFF_MAX_S = 30.0


def loop_settings(settings: DraSettings) -> ReporterSettings:
    """The write loop's knobs, from the DRA section."""
    return ReporterSettings(
        quiet_window_s=settings.quiet_window_s,
        max_delay_s=settings.max_delay_s,
        reconcile_interval_s=settings.resync_s,
        api_timeout_s=settings.api_timeout_s,
        backoff_base_s=settings.backoff_base_s,
        backoff_max_s=settings.backoff_max_s,
        field_manager=settings.field_manager,
    )


class SlicePublisher:
    def __init__(
        self,
        api: KubeClient,
        node: str,
        settings: DraSettings,
        *,
        meter: metrics.Meter | None = None,
        pcie_root: Callable[[str], str] | None = None,
        server: str = "",
        await_held: bool = False,
        await_health: bool = False,
    ) -> None:
        self._settings = settings
        loop = loop_settings(settings)
        self.metrics = ReporterMetrics(meter or metrics.get_meter("gpulet.dra"))
        self._client = NodeClient(
            api, node, loop, self.metrics, missing="slices carry no owner reference"
        )
        self.writer = SliceWriter(self._client, settings, pcie_root=pcie_root, server=server)
        self.debouncer: Debouncer[SliceInput] = Debouncer(
            settings.quiet_window_s, settings.max_delay_s
        )
        self._loop = WriteLoop(self.writer, self.debouncer, loop, self.metrics)
        self._view: NodeView | None = None
        self._held: frozenset[str] = frozenset()
        self._sliced: dict[str, int] = {}
        # Until the first ``held`` answer (and the health service's state), the taints
        # those facts lower are kept as the API server holds them (writer.kept_classes).
        self._held_known = not await_held
        self._await_health = await_health
        self.last: SliceInput | None = None
        self.watch_events = 0
        self.watches = 0
        self.repairs = 0
        self.bad_lines = 0
        self._log = RateLimitedLog(log, per_minute=4)

    # --- inputs --------------------------------------------------------------------

    def attach(self, view: NodeView) -> None:
        self._view = view
        view.listen(self._on_change)
        self._on_change(NodeChange(inventory=True))

    def _on_change(self, _change: NodeChange) -> None:
        view = self._view
        if view is None or view.inventory is None:
            return
        if view.inventory.degraded_reason:
            self._log.warning(
                "slices of %s kept as they are: the inventory is degraded (%s)",
                view.inventory.node,
                view.inventory.degraded_reason,
            )
            return
        self.submit(
            SliceInput(
                view.inventory,
                dict(view.healths()),
                self._held,
                dict(self._sliced),
                held_known=self._held_known,
                health_known=not self._await_health
                or (view.health_seen.is_set() and view.heal_seen.is_set()),
            )
        )

    def set_held(self, uuids: Iterable[str], replicas: Mapping[str, int] | None = None) -> None:
        """The GPUs the device plugin holds, and each GPU's time-slicing replicas (a GPU
        offered as more than one replica is time-sliced: tainted, not claimable)."""
        held = frozenset(uuids)
        sliced = {u: n for u, n in (replicas or {}).items() if n > 1}
        if held == self._held and sliced == self._sliced and self._held_known:
            return
        self._held, self._sliced, self._held_known = held, sliced, True
        if self.last is not None:
            self.submit(
                dataclass_replace(self.last, held=held, sliced=dict(sliced), held_known=True)
            )

    def submit(self, desired: SliceInput) -> None:
        if desired == self.last:
            return
        self.last = desired
        self.debouncer.submit(desired)

    def _repair(self, why: str) -> None:
        """Re-list the slices at the next write; with no write pending, start one. A
        pending write (a fault waiting out the quiet window) is left alone: submitting
        the same input again would restart its quiet window (a watch reopens every
        ``watch_timeout_s``, and that held a fault's taint back by another window)."""
        self.repairs += 1
        log.info("slices of %s: %s; publishing again", self.writer.node, why)
        self.writer.listed = False
        if self.last is not None and not self.debouncer.pending:
            self.debouncer.submit(self.last)

    # --- tasks ---------------------------------------------------------------------

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._loop.run)
            tg.start_soon(self._watch_forever)
            if self._await_health and self._view is not None:
                tg.start_soon(self._on_health_seen, self._view)

    async def _on_health_seen(self, view: NodeView) -> None:
        """The health service's first state and remediation's quarantines may change
        nothing in the view (no GPU faulty): render again anyway once both are read,
        since the kept health taints may go now."""
        await view.health_seen.wait()
        await view.heal_seen.wait()
        self._on_change(NodeChange())

    async def _watch_forever(self) -> None:
        await keep_watching(
            self._watch_once, self._log, "resourceslices", backoff_max_s=WATCH_BACKOFF_MAX_S
        )

    async def _watch_once(self) -> None:
        seconds = max(1, int(self._settings.watch_timeout_s))
        async with watch_lines(
            self.writer.api,
            self.writer.collection,
            field_selector=f"spec.nodeName={self.writer.node},spec.driver={self._settings.driver}",
            timeout_s=seconds,
            request_timeout_s=seconds + self._settings.api_timeout_s,
        ) as lines:
            # Whatever happened while no watch was open (before the first, during a
            # back-off) sent no event: now that one is open, read the slices again.
            self.watches += 1
            self._repair("a watch opened")
            async for line in lines:
                self._on_line(line)

    def _on_line(self, line: bytes) -> None:
        event = watch_event(line)
        if event is None:
            self.bad_lines += 1
            return
        self.watch_events += 1
        kind, obj = event
        meta, spec = obj.get("metadata"), obj.get("spec")
        meta = meta if isinstance(meta, dict) else {}
        spec = spec if isinstance(spec, dict) else {}
        name = meta.get("name")
        if kind not in ("ADDED", "MODIFIED", "DELETED") or not isinstance(name, str):
            return
        if spec.get("nodeName") != self.writer.node or spec.get("driver") != self._settings.driver:
            return  # not ours, whatever the server's selector let through
        held = self.writer.observed.get(name)
        if kind == "DELETED":
            # One we still want (a surplus slice we deleted ourselves is not wanted).
            if name in self.writer.wanted or self.writer.pool is None:
                self._repair(f"{name} was deleted")
            return
        version = meta.get("resourceVersion")
        if held is not None and (held.get("metadata") or {}).get("resourceVersion") == version:
            return
        if self.writer.accept_if_ours(name, obj):
            return  # our own write, seen before its answer: no re-read needed
        self._repair(f"{name} changed outside gpulet ({kind})")
