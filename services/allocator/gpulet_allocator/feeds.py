"""Following a node's GPU inventory and health on the bus, whatever the start order.

Why
---
Both the allocator and the device plugin need the node's GPUs (``gpu.inventory.<node>``)
and their health (``gpu.health.<node>``). Publishers may have started long before us
(their last message is gone) or may start after us, so :class:`NodeFeed` subscribes
first and then *asks* -- the collector for its inventory, the health service for its
state -- retrying with back-off until each answers once. Events that arrive meanwhile
are applied as they come; a state answer older than an event already applied for a
GPU does not overwrite it.

Health semantics: ``HealthEvent.healthy`` is the GPU's overall health after the event
(the health service derives it from every active condition), so the latest event
wins, recovery included. A GPU reported not present is unhealthy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import anyio.abc

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, BusError
from gpulet_common.messages import (
    HealthEvent,
    HealthState,
    HealthStateRequest,
    Inventory,
    InventoryRequest,
)

log = logging.getLogger("gpulet.allocator.feed")

ASK_TIMEOUT_S = 1.0
ASK_MAX_DELAY_S = 30.0


class NodeFeed:
    def __init__(
        self,
        bus: Bus,
        node: str,
        *,
        on_inventory: Callable[[Inventory], None],
        on_health: Callable[[str, bool], None],
        retry_s: float = 2.0,
        who: str = "allocator",
    ) -> None:
        self._bus = bus
        self._node = node
        self._on_inventory = on_inventory
        self._on_health = on_health
        self._retry_s = retry_s
        self._who = who
        self._last_event_at: dict[str, float] = {}
        self.inventory_seen = anyio.Event()
        self.health_seen = False

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with (
            self._bus.subscribe(
                subjects.inventory(self._node), codec.INVENTORY, node=self._node
            ) as inventories,
            self._bus.subscribe(
                subjects.health(self._node), codec.HEALTH_EVENT, node=self._node
            ) as events,
            anyio.create_task_group() as tg,
        ):

            async def follow_inventory() -> None:
                async for delivery in inventories:
                    self._inventory(delivery.value)

            async def follow_health() -> None:
                async for delivery in events:
                    self._event(delivery.value)

            tg.start_soon(follow_inventory)
            tg.start_soon(follow_health)
            tg.start_soon(self._ask_inventory)
            tg.start_soon(self._ask_health)
            task_status.started()

    def _inventory(self, inventory: Inventory) -> None:
        self._on_inventory(inventory)
        self.inventory_seen.set()

    def _event(self, event: HealthEvent) -> None:
        previous = self._last_event_at.get(event.gpu_uuid, 0.0)
        if event.observed_at < previous:
            return  # an older event delivered late
        self._last_event_at[event.gpu_uuid] = event.observed_at
        self.health_seen = True
        self._on_health(event.gpu_uuid, event.healthy)

    def _state(self, state: HealthState) -> None:
        for gpu in state.gpus:
            if gpu.updated_at and gpu.updated_at < self._last_event_at.get(gpu.gpu_uuid, 0.0):
                continue
            self._on_health(gpu.gpu_uuid, gpu.healthy and gpu.present)
        self.health_seen = True

    async def _ask_inventory(self) -> None:
        delay = self._retry_s
        while not self.inventory_seen.is_set():
            try:
                inventory = await self._bus.request(
                    subjects.inventory_request(self._node),
                    InventoryRequest(reason=f"{self._who} start"),
                    codec.INVENTORY_REQUEST,
                    codec.INVENTORY,
                    timeout_s=ASK_TIMEOUT_S,
                )
            except BusError as exc:
                log.debug(
                    "%s: no inventory yet (%s); asking again in %.1f s", self._who, exc, delay
                )
            else:
                self._inventory(inventory)
                return
            with anyio.move_on_after(delay):
                await self.inventory_seen.wait()
            delay = min(delay * 2, ASK_MAX_DELAY_S)

    async def _ask_health(self) -> None:
        delay = self._retry_s
        while True:
            try:
                state = await self._bus.request(
                    subjects.health_state(self._node),
                    HealthStateRequest(),
                    codec.HEALTH_STATE_REQUEST,
                    codec.HEALTH_STATE,
                    timeout_s=ASK_TIMEOUT_S,
                )
            except BusError as exc:
                log.debug(
                    "%s: no health state yet (%s); asking again in %.1f s", self._who, exc, delay
                )
            else:
                self._state(state)
                # Ask again after every reconnection to NATS: health events published
                # while we were cut off never reach us (core NATS delivers at most
                # once), and nothing else would tell us of a GPU that failed meanwhile.
                # Found by tests/faults/test_nats_outage.py.
                await self._bus.wait_reconnected()
                delay = self._retry_s
                continue
            await anyio.sleep(delay)
            delay = min(delay * 2, ASK_MAX_DELAY_S)
