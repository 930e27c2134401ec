"""Publishing health events: JetStream first, the disk buffer when that fails.

Design
------
One task owns publishing, so order is kept without locks: events arrive from the rule
engine through a bounded memory object stream and leave in that order.

* Each event is published to JetStream on ``gpu.health.<node>`` with
  ``Nats-Msg-Id = <node>:<event_id>`` (scoped to the node: a stream shared by several
  nodes never drops one node's event for another's id). A JetStream publish is an
  ordinary NATS publish that the ``GPU_HEALTH`` stream also stores, so a plain
  ``nats sub 'gpu.health.*'`` sees every event live, and a consumer that was away
  replays them from the stream.
* When NATS is not connected, the publish is not acked within
  ``stream.publish_timeout_s``, or the stream is missing, the event goes to the
  :class:`~gpulet_health.buffer.DiskBuffer`, and so does every later event until the
  buffer is drained -- which keeps the order. Draining re-publishes with the same ids:
  an event whose ack was lost but that did reach the stream is dropped there as a
  duplicate.
* When the buffer refuses an event (full), the drop is recorded, counted
  (``gpulet.health.events_dropped``) and logged; once the backlog is published, a
  ``buffer_overflow`` event says how many events were lost and when, so consumers know
  to re-read the current state (``gpulet.health.state.<node>`` or the KV bucket).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import msgspec
import nats.errors
from anyio.streams.memory import MemoryObjectReceiveStream
from opentelemetry import metrics

from gpulet_common import subjects
from gpulet_common.bootid import read_boot_id
from gpulet_common.bus import Bus
from gpulet_common.codec import HEALTH_EVENT
from gpulet_common.lifecycle import take_queued
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import HealthEvent
from gpulet_common.telemetry import create_counters
from gpulet_health.buffer import DiskBuffer, Overflow
from gpulet_health.dedup import EventIds

log = logging.getLogger("gpulet.health.publisher")

_DRAIN_BATCH = 256
_RETRY_MIN_S = 0.1
_RETRY_MAX_S = 5.0
# How often a publisher with a backlog checks whether NATS is back.
_RECONNECT_POLL_S = 0.05
# Shutdown has a 2 s budget; saving the queue to disk may take at most this much.
_SHUTDOWN_SAVE_S = 1.0


class PublishFailed(Exception):
    pass


class HealthPublisher:
    def __init__(
        self,
        bus: Bus,
        node: str,
        buffer: DiskBuffer,
        *,
        publish_timeout_s: float,
        ensure_stream: Callable[[], Awaitable[None]],
        meter: metrics.Meter,
        ids: EventIds | None = None,
    ) -> None:
        self._bus = bus
        self._node = node
        self._ids = ids or EventIds()
        self._subject = subjects.health(node)
        self._buffer = buffer
        self._timeout_s = publish_timeout_s
        self._ensure_stream = ensure_stream
        self._stream_ok = True
        self._retry_at = 0.0
        self._retry_s = _RETRY_MIN_S
        self._drop_log = RateLimitedLog(log, per_minute=10)
        self._published, self._buffered, self._dropped = create_counters(
            meter,
            ("gpulet.health.events_published", "Health events acknowledged by JetStream"),
            (
                "gpulet.health.events_buffered",
                "Health events written to the on-disk buffer (NATS unreachable)",
            ),
            (
                "gpulet.health.events_dropped",
                "Health events dropped because the on-disk buffer was full",
            ),
        )
        meter.create_observable_gauge(
            "gpulet.health.buffer_pending",
            callbacks=[lambda _o: [metrics.Observation(self._buffer.pending)]],
            description="Health events in the on-disk buffer, waiting to be published",
        )
        self.published_count = 0
        self._inflight: HealthEvent | None = None

    @property
    def backlog(self) -> int:
        return self._buffer.pending

    async def run(
        self,
        receive: MemoryObjectReceiveStream[HealthEvent],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        async with receive:
            task_status.started()
            try:
                while True:
                    if self._has_backlog() and self._can_try():
                        await self._drain()
                    event: HealthEvent | None = None
                    # Only the wait is bounded: cancelling a publish half-way would
                    # lose the event.
                    with anyio.move_on_after(self._wait_s()):
                        try:
                            event = await receive.receive()
                        except anyio.EndOfStream:
                            return
                    if event is None:
                        continue
                    await self._handle_tracked(event)
                    # Take what else is queued without waiting, to keep latency flat in
                    # a storm (the loop above would otherwise re-check the backlog).
                    if not await take_queued(receive, self._handle_tracked):
                        return
            finally:
                await self._save_unpublished(receive)

    async def _handle_tracked(self, event: HealthEvent) -> None:
        self._inflight = event
        await self._handle(event)
        self._inflight = None

    async def _save_unpublished(self, receive: MemoryObjectReceiveStream[HealthEvent]) -> None:
        """On the way out, put what is still queued (and the event being published
        when we were cancelled) in the disk buffer: the next start publishes it."""
        events = [self._inflight] if self._inflight is not None else []
        while True:
            try:
                events.append(receive.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        if not events:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(_SHUTDOWN_SAVE_S) as scope:
            for event in events:
                await anyio.to_thread.run_sync(self._buffer.append, event)
        if scope.cancelled_caught:
            log.error("shutting down: could not save every unpublished health event in time")
        else:
            log.info("shutting down: %d unpublished health event(s) kept on disk", len(events))

    # --- decisions -------------------------------------------------------------------

    def _has_backlog(self) -> bool:
        return self._buffer.pending > 0 or self._buffer.overflow is not None

    def _can_try(self) -> bool:
        return self._bus.is_connected and time.monotonic() >= self._retry_at

    def _wait_s(self) -> float:
        if not self._has_backlog():
            return float("inf")
        if not self._bus.is_connected:
            return _RECONNECT_POLL_S
        return max(0.0, self._retry_at - time.monotonic())

    def _failed(self, exc: BaseException) -> None:
        self._retry_at = time.monotonic() + self._retry_s
        self._retry_s = min(self._retry_s * 2, _RETRY_MAX_S)
        if isinstance(exc, nats.errors.NoRespondersError):
            # Nobody stores gpu.health.*: the stream is missing (deleted, or JetStream
            # was not ready at start). Create it before the next attempt.
            self._stream_ok = False
        log.warning(
            "publishing health events failed (%s: %s); buffering on disk", type(exc).__name__, exc
        )

    def _succeeded(self) -> None:
        self._retry_s = _RETRY_MIN_S
        self._retry_at = 0.0

    # --- publishing ------------------------------------------------------------------

    async def _publish(self, event: HealthEvent) -> None:
        if not self._stream_ok:
            try:
                await self._ensure_stream()
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                raise PublishFailed(str(exc)) from exc
            self._stream_ok = True
        stamped = msgspec.structs.replace(event, published_at=time.time())
        try:
            await self._bus.js_publish(
                self._subject,
                stamped,
                HEALTH_EVENT,
                msg_id=subjects.event_msg_id(self._node, event.event_id),
                timeout_s=self._timeout_s,
            )
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            self._failed(exc)
            raise PublishFailed(str(exc)) from exc
        self._published.add(1, {"kind": event.kind})
        self.published_count += 1
        self._succeeded()

    async def _handle(self, event: HealthEvent) -> None:
        if self._has_backlog() or not self._can_try():
            await self._store(event)
            return
        try:
            await self._publish(event)
        except PublishFailed:
            await self._store(event)

    async def _store(self, event: HealthEvent) -> None:
        stored = await anyio.to_thread.run_sync(self._buffer.append, event)
        if stored:
            self._buffered.add(1, {"kind": event.kind})
            return
        self._dropped.add(1, {"kind": event.kind})
        self._drop_log.warning(
            "health event buffer full (%d events, %d bytes): dropped %s event %s for GPU %s; "
            "a buffer_overflow event will report the loss",
            self._buffer.pending,
            self._buffer.size_bytes,
            event.kind,
            event.event_id,
            event.gpu_uuid or "-",
        )

    async def _drain(self) -> None:
        while self._buffer.pending and self._can_try():
            batch = await anyio.to_thread.run_sync(self._buffer.peek, _DRAIN_BATCH)
            if not batch:
                break
            done = 0
            try:
                for event, lines in batch:
                    await self._publish(event)
                    done = lines
            except PublishFailed:
                pass
            finally:
                if done:
                    await anyio.to_thread.run_sync(self._buffer.commit, done)
            if done != batch[-1][1]:
                return
        overflow = self._buffer.overflow
        if overflow is not None and not self._buffer.pending and self._can_try():
            try:
                await self._publish(self._overflow_event(overflow))
            except PublishFailed:
                return
            await anyio.to_thread.run_sync(self._buffer.clear_overflow, overflow)
            log.error(
                "reported the loss of %d health event(s) dropped while the buffer was full",
                overflow.dropped,
            )

    def _overflow_event(self, overflow: Overflow) -> HealthEvent:
        first = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(overflow.first_at))
        last = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(overflow.last_at))
        return HealthEvent(
            event_id=self._ids(self._node, "buffer_overflow", overflow.first_at, overflow.dropped),
            node=self._node,
            gpu_uuid="",
            kind="buffer_overflow",
            severity="critical",
            # A node-level event: it says nothing about any GPU's health.
            healthy=True,
            reason=(
                f"{overflow.dropped} health event(s) observed between {first} and {last} were "
                "dropped: NATS was unreachable and the on-disk buffer was full"
            ),
            message=(
                f"re-read the current state: request {subjects.health_state(self._node)} or "
                "read the gpu_health KV bucket"
            ),
            action="operator_check",
            observed_value=float(overflow.dropped),
            observed_at=overflow.last_at,
            node_boot_id=read_boot_id(),
            condition_since=overflow.first_at,
        )
