"""The reporter service: the node's Device CR and GPU node labels, from the bus.

Flow
----
1. Subscribe to ``gpu.inventory.<node>`` and ``gpu.health.<node>`` before anything
   else, so nothing published after start is missed.
2. Ask for what was published before we started: the collector's inventory
   (``gpulet.inventory.request.<node>``) and the health service's state
   (``gpulet.health.state.<node>``). Neither has to be there: without an answer we
   ask again later with back-off, so start order does not matter. The health state is
   asked again every reconcile interval, which corrects a missed event.
3. Every input goes to the :class:`ReporterCore`, which folds it into the inventory and
   the health view and rebuilds the intent; only an intent that differs from the
   previous one reaches the :class:`Debouncer`.
4. The :class:`WriteLoop` takes debounced intents and applies them through a sink --
   :class:`KubeWriter` against the API server, or :class:`OfflineSink` when there is
   no cluster -- in a task of its own, so the bus side never waits for the API.

No write happens before the first usable inventory (see :mod:`gpulet_reporter.core`).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import nats.errors
from kubernetes_asyncio import client as k8s_client

from gpulet_common import codec, subjects
from gpulet_common.bus import BusError, Delivery
from gpulet_common.lifecycle import idle_disabled
from gpulet_common.messages import (
    HealthEvent,
    HealthState,
    HealthStateRequest,
    Inventory,
    InventoryRequest,
)
from gpulet_common.runtime import Runtime
from gpulet_reporter.core import ReporterCore
from gpulet_reporter.debounce import Debouncer
from gpulet_reporter.desired import DesiredState
from gpulet_reporter.facts import DMI_PRODUCT_NAME, node_facts, read_machine_type
from gpulet_reporter.health_view import HealthView
from gpulet_reporter.kube import SERVICE_ACCOUNT_DIR, KubeConfigError, KubeTarget, load_target
from gpulet_reporter.metrics import ReporterMetrics
from gpulet_reporter.offline import OfflineSink
from gpulet_reporter.pcie import make_resolver
from gpulet_reporter.writer import KubeWriter, Sink, WriteLoop

log = logging.getLogger("gpulet.reporter")

REQUEST_TIMEOUT_S = 2.0
MAX_ASK_INTERVAL_S = 300.0


class ReporterService:
    name = "reporter"

    def __init__(
        self,
        runtime: Runtime,
        *,
        env: dict[str, str] | None = None,
        sa_dir: Path = SERVICE_ACCOUNT_DIR,
        sysfs_pci_devices: Path | None = None,
        machine_type_file: Path = DMI_PRODUCT_NAME,
    ) -> None:
        self._rt = runtime
        self._settings = runtime.settings.reporter
        self._node = runtime.node
        self._env = env
        self._sa_dir = sa_dir
        self.metrics = ReporterMetrics(runtime.meter)
        self.core = ReporterCore(
            self._node,
            self._settings,
            pcie_root=make_resolver(sysfs_pci_devices)
            if sysfs_pci_devices is not None
            else make_resolver(),
            on_degraded=lambda detail: runtime.status.set(self.name, "degraded", detail),
            facts=node_facts(runtime.settings, read_machine_type(machine_type_file)),
        )
        self.target: KubeTarget | None = None
        self.sink: Sink | None = None
        self.loop: WriteLoop | None = None

    # The core's state, for tests and the CLI.
    @property
    def inventory(self) -> Inventory | None:
        return self.core.inventory

    @property
    def desired(self) -> DesiredState | None:
        return self.core.desired

    @property
    def debouncer(self) -> Debouncer[DesiredState]:
        return self.core.debouncer

    @property
    def health(self) -> HealthView:
        return self.core.health

    # -- lifecycle ---------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        if not self._settings.enabled:
            await idle_disabled(self.name, "reporter.enabled", self._rt.status, task_status)
        bus = self._rt.bus
        async with (
            bus.subscribe(subjects.inventory(self._node), codec.INVENTORY) as inventories,
            bus.subscribe(subjects.health(self._node), codec.HEALTH_EVENT) as events,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(self._consume_inventory, inventories)
            tg.start_soon(self._consume_health, events)
            tg.start_soon(self._ask_inventory)
            tg.start_soon(self._ask_health)
            tg.start_soon(self._write)
            task_status.started()

    # -- inputs ------------------------------------------------------------------

    async def _consume_inventory(self, stream: Any) -> None:
        delivery: Delivery[Inventory]
        async for delivery in stream:
            self.on_inventory(delivery.value)

    async def _consume_health(self, stream: Any) -> None:
        delivery: Delivery[HealthEvent]
        async for delivery in stream:
            self.on_health_event(delivery.value)

    def on_inventory(self, inventory: Inventory) -> None:
        self.core.on_inventory(inventory)

    def on_health_event(self, event: HealthEvent) -> None:
        self.core.on_health_event(event)

    def on_health_state(self, state: HealthState) -> None:
        self.core.on_health_state(state)

    # -- asking for state published before we started ------------------------------

    async def _ask_inventory(self) -> None:
        delay = self._settings.request_retry_s
        while self.inventory is None:
            try:
                inventory = await self._rt.bus.request(
                    subjects.inventory_request(self._node),
                    InventoryRequest(reason="reporter start"),
                    codec.INVENTORY_REQUEST,
                    codec.INVENTORY,
                    timeout_s=REQUEST_TIMEOUT_S,
                )
            except (BusError, nats.errors.Error, OSError) as exc:
                log.debug("inventory request unanswered (%s); asking again in %.0fs", exc, delay)
            else:
                self.on_inventory(inventory)
                if self.inventory is not None:
                    return
            await anyio.sleep(delay)
            delay = min(delay * 2, MAX_ASK_INTERVAL_S)

    async def _ask_health(self) -> None:
        retry = self._settings.request_retry_s
        refresh = self._settings.reconcile_interval_s or MAX_ASK_INTERVAL_S
        delay = retry
        while True:
            try:
                state = await self._rt.bus.request(
                    subjects.health_state(self._node),
                    HealthStateRequest(),
                    codec.HEALTH_STATE_REQUEST,
                    codec.HEALTH_STATE,
                    timeout_s=REQUEST_TIMEOUT_S,
                )
            except (BusError, nats.errors.Error, OSError) as exc:
                log.debug("health state request unanswered (%s); asking again in %.0fs", exc, delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, max(retry, refresh))
                continue
            self.on_health_state(state)
            delay = retry
            # Ask again at the next reconcile, or at once after a reconnection to NATS:
            # the health events published while we were cut off (or drained from the
            # health service's disk buffer before our subscription was back) never
            # reach us, and without this the Device stayed wrong until the reconcile
            # (5 min). Found by tests/faults/test_nats_outage.py.
            with anyio.move_on_after(refresh * random.uniform(0.9, 1.1)):
                await self._rt.bus.wait_reconnected()

    # -- output ------------------------------------------------------------------

    async def _resolve_target(self) -> KubeTarget:
        delay = self._settings.request_retry_s
        while True:
            try:
                return await load_target(
                    self._settings,
                    nvml_backend=self._rt.settings.nvml.backend,
                    env=self._env,
                    sa_dir=self._sa_dir,
                )
            except KubeConfigError as exc:
                self._rt.status.set(self.name, "degraded", f"no usable cluster config: {exc}")
                await anyio.sleep(delay)
                delay = min(delay * 2, MAX_ASK_INTERVAL_S)

    def _offline_dir(self) -> Path:
        if self._settings.offline_output_dir:
            return Path(self._settings.offline_output_dir).expanduser()
        return Path(self._rt.settings.state_dir or ".") / "reporter"

    def _status(self, state: str, detail: str) -> None:
        if state == "degraded":
            self._rt.status.set(self.name, "degraded", detail)
        else:
            self._rt.status.set(self.name, "ready", detail)

    async def _write(self) -> None:
        target = self.target = await self._resolve_target()
        if target.offline:
            sink = OfflineSink(
                self._offline_dir(), self._node, self._settings, reason=target.offline_reason
            )
            log.warning(
                "no cluster (%s): the Device this node would apply goes to %s and the log",
                target.offline_reason,
                sink.device_path,
            )
            self._rt.status.set(self.name, "ready", f"no cluster; writing {sink.device_path}")
            await self._run_loop(sink)
            return
        log.info(
            "reporting Device %s and node labels to %s (%s)",
            self._node,
            target.server,
            target.source,
        )
        api = k8s_client.ApiClient(target.configuration)
        try:
            await self._run_loop(
                KubeWriter(api, self._node, self._settings, self.metrics, server=target.server)
            )
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await api.close()

    async def _run_loop(self, sink: Sink) -> None:
        self.sink = sink
        self.loop = WriteLoop(
            sink, self.debouncer, self._settings, self.metrics, on_status=self._status
        )
        await self.loop.run()
