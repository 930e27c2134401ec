"""The publish stage's entry: what the rule engine says, counted, logged and queued.

Design
------
Every list of events the rule engine returns goes through :meth:`EventStage.emit`, in
the order the engine produced them: counted (``gpulet.health.events`` by kind and
severity), logged (a fault at WARNING, a recovery at INFO), and put on the bounded
queue that the :class:`~gpulet_health.publisher.HealthPublisher` drains in order. A
full queue makes the producer wait (backpressure); it never drops. After the events,
the GPUs whose state changed are marked for the KV store, and a scan is asked for
when an observation suggested that the GPU list changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from opentelemetry import metrics

from gpulet_common.messages import HealthEvent
from gpulet_health.kv import StateStore
from gpulet_health.rules import RuleEngine

log = logging.getLogger("gpulet.health")

# Events between the rule engine and the publisher. A full queue makes the producers
# wait (backpressure), it never drops.
EVENT_QUEUE = 4096


class EventStage:
    def __init__(
        self,
        engine: RuleEngine,
        store: StateStore,
        meter: metrics.Meter,
        *,
        on_state_change: Callable[[], None],
        on_rescan_wanted: Callable[[], None],
    ) -> None:
        self._engine = engine
        self._store = store
        self._on_state_change = on_state_change
        self._on_rescan_wanted = on_rescan_wanted
        self._send: MemoryObjectSendStream[HealthEvent]
        self.receive: MemoryObjectReceiveStream[HealthEvent]
        self._send, self.receive = anyio.create_memory_object_stream[HealthEvent](EVENT_QUEUE)
        self._counter = meter.create_counter(
            "gpulet.health.events", description="Health events produced, by kind and severity"
        )

    async def emit(self, events: list[HealthEvent]) -> None:
        for event in events:
            self._counter.add(1, {"kind": event.kind, "severity": event.severity})
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
        dirty = self._engine.take_dirty()
        if dirty:
            self._store.mark(dirty)
            self._on_state_change()
        if self._engine.rescan_wanted:
            self._engine.rescan_wanted = False
            self._on_rescan_wanted()

    async def _queue(self, event: HealthEvent) -> None:
        # send_nowait first: it is no checkpoint, so a cancellation (shutdown) cannot
        # drop an event between the engine producing it and the queue holding it; the
        # publisher saves what is queued when it stops.
        try:
            try:
                self._send.send_nowait(event)
            except anyio.WouldBlock:
                await self._send.send(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            log.error(  # noqa: TRY400 - an expected end, not a bug: no traceback
                "shutting down: health event %s (%s, GPU %s) could not be queued",
                event.event_id,
                event.kind,
                event.gpu_uuid,
            )
