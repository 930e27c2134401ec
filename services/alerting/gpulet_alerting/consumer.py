"""``gpulet alerts``: a durable consumer of the health stream that delivers alerts.

Design
------
A JetStream *durable pull consumer* on ``GPU_HEALTH`` (subject filter
``gpu.health.*`` by default) fetches events in order and hands each to every sink:

* **stdout**: one JSON line per event (the event as published);
* **webhooks**: each event POSTed as JSON to every ``alerts.webhooks`` URL;
* **Alertmanager**: events become alerts POSTed to ``<url>/api/v2/alerts``.

A message is acked only once every sink has it; a sink that fails is retried with
exponential back-off (``retry_initial_s`` .. ``retry_max_s``) while the message's ack
deadline is extended, and a sink that already succeeded is not called again. So
delivery is at-least-once and in order: a consumer that was down (or a webhook that
was) gets everything it missed when it comes back. A 4xx answer other than 408/429 is
permanent (retrying the same body cannot help): it is logged and counted, not retried.

The sinks are in :mod:`.sinks` and :mod:`.alertmanager`; ``gpulet alerts --hub`` (the
fleet) in :mod:`.fleet_alerts`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, TextIO

import anyio
import anyio.abc
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import metrics

from gpulet_alerting.alertmanager import AlertmanagerSink
from gpulet_alerting.sinks import (
    AlertSink,
    DeliveryError,
    PermanentDeliveryError,
    StdoutSink,
    WebhookSink,
)
from gpulet_common import subjects
from gpulet_common.bus import Bus, fetch_ready, kv_keys
from gpulet_common.codec import GPU_HEALTH, HEALTH_EVENT
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import GpuHealth
from gpulet_common.settings.health import AlertSettings
from gpulet_common.telemetry import create_counters

log = logging.getLogger("gpulet.alerts")

_FETCH_BATCH = 64
_FETCH_TIMEOUT_S = 1.0


class AlertsConsumer:
    def __init__(
        self,
        bus: Bus,
        settings: AlertSettings,
        sinks: Sequence[AlertSink],
        *,
        meter: metrics.Meter | None = None,
        stream: str = subjects.HEALTH_STREAM,
        max_deliver: int = -1,
        max_ack_pending: int | None = None,
    ) -> None:
        self._bus = bus
        self._settings = settings
        self._sinks = list(sinks)
        # The node's GPU_HEALTH by default; the hub's GPU_FLEET for `gpulet alerts
        # --hub` (gpulet_alerting.fleet_alerts), with bounded redelivery.
        self._stream = stream
        self._max_deliver = max_deliver
        self._max_ack_pending = max_ack_pending
        meter = meter or metrics.get_meter("gpulet.alerts")
        self._delivered, self._failures, self._malformed = create_counters(
            meter,
            ("gpulet.alerts.delivered", "Health events delivered to a sink"),
            ("gpulet.alerts.delivery_failures", "Failed deliveries (retried unless permanent)"),
            ("gpulet.alerts.malformed", "Stream messages that were not health events"),
        )
        # Once per event (and retry): rate-limited, the count in the metrics above.
        self._event_log = RateLimitedLog(log, per_minute=20)
        self.processed = 0

    @classmethod
    def from_settings(
        cls,
        bus: Bus,
        settings: AlertSettings,
        *,
        out: TextIO | None = None,
        meter: metrics.Meter | None = None,
    ) -> AlertsConsumer:
        sinks: list[AlertSink] = []
        if settings.stdout:
            sinks.append(StdoutSink(out))
        sinks += [WebhookSink(url, timeout_s=settings.http_timeout_s) for url in settings.webhooks]
        sinks += [
            AlertmanagerSink(
                url,
                timeout_s=settings.http_timeout_s,
                resend_interval_s=settings.resend_interval_s,
                transient_alert_s=settings.transient_alert_s,
            )
            for url in settings.alertmanager_urls
        ]
        return cls(bus, settings, sinks, meter=meter)

    @property
    def sinks(self) -> list[AlertSink]:
        return self._sinks

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        subscription = await self._subscribe()
        await self._reconcile()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._resend_loop)
            task_status.started()
            try:
                await self._consume(subscription)
            finally:
                tg.cancel_scope.cancel()

    async def _subscribe(self) -> Any:
        s = self._settings
        config = ConsumerConfig(
            durable_name=s.durable,
            deliver_policy=DeliverPolicy.ALL if s.start_at == "all" else DeliverPolicy.NEW,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=s.ack_wait_s,
            max_deliver=self._max_deliver,
            filter_subject=s.subject,
        )
        if self._max_ack_pending is not None:
            config.max_ack_pending = self._max_ack_pending
        delay = s.retry_initial_s
        while True:
            try:
                return await self._bus.jetstream.pull_subscribe(
                    s.subject, durable=s.durable, stream=self._stream, config=config
                )
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                # Typically the stream does not exist yet: no health service ran.
                log.warning(
                    "cannot consume %s from stream %s yet (%s); retrying in %.1fs",
                    s.subject,
                    self._stream,
                    exc,
                    delay,
                )
                await anyio.sleep(delay)
                delay = min(delay * 2, s.retry_max_s)

    async def _reconcile(self) -> None:
        managers = [s for s in self._sinks if isinstance(s, AlertmanagerSink)]
        if not managers or not self._settings.reconcile_from_kv:
            return
        healths = await self._read_kv()
        now = time.time()
        for sink in managers:
            alerts = sink.reconcile(healths, now)
            if not alerts:
                continue
            try:
                await sink.post(alerts)
            except (DeliveryError, PermanentDeliveryError) as exc:
                log.warning(
                    "reconciling %s failed (the periodic re-send retries): %s", sink.name, exc
                )

    async def _read_kv(self) -> list[tuple[str, GpuHealth]]:
        wanted = self._settings.subject.split(".")[-1]
        out: list[tuple[str, GpuHealth]] = []
        try:
            with anyio.fail_after(5):
                kv = await self._bus.jetstream.key_value(subjects.HEALTH_KV_BUCKET)
                # The stream's subject list, not kv.keys() (a race under load: kv_keys).
                keys = await kv_keys(self._bus.jetstream, subjects.HEALTH_KV_BUCKET)
                for key in keys:
                    node_token = key.split(".", 1)[0]
                    if wanted not in ("*", ">") and node_token != wanted:
                        continue
                    try:
                        entry = await kv.get(key)
                    except (nats.js.errors.KeyDeletedError, nats.js.errors.KeyNotFoundError):
                        continue
                    if entry.value is None:
                        continue
                    try:
                        node = subjects.untoken(node_token)
                        health = GPU_HEALTH.decode(
                            entry.value, limits=self._bus.limits, now=time.time()
                        )
                    except (ValueError, msgspec.DecodeError):
                        continue  # a key or value we did not write: not ours to report
                    out.append((node, health))
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            log.warning("cannot read the current health state from KV: %s", exc)
        return out

    async def _resend_loop(self) -> None:
        while True:
            await anyio.sleep(self._settings.resend_interval_s)
            for sink in self._sinks:
                try:
                    await sink.resend(time.time())
                except (DeliveryError, PermanentDeliveryError) as exc:
                    log.warning("re-sending firing alerts to %s failed: %s", sink.name, exc)

    async def _consume(self, subscription: Any) -> None:
        while True:
            try:
                # Not fetch(batch): it holds a message back until the batch is full
                # or the timeout passed (up to 1 s of latency per alert).
                messages: list[Msg] = await fetch_ready(
                    subscription, _FETCH_BATCH, _FETCH_TIMEOUT_S
                )
            except (nats.errors.TimeoutError, TimeoutError):
                # nats-py raises either when a fetch ends empty; the builtin one is an
                # OSError, which must not count as a failed fetch (warning + back-off).
                continue
            except (nats.errors.Error, OSError) as exc:
                log.warning("fetching health events failed: %s", exc)
                await anyio.sleep(self._settings.retry_initial_s)
                continue
            for msg in messages:
                await self._process(msg)

    async def _process(self, msg: Msg) -> None:
        # Checked like any bus message (size, depth, node against subject, clock); a
        # message that fails is counted and logged by the bus and never redelivered.
        # It stays in the stream: a replay meets it again and drops it again.
        delivery = self._bus.decode(msg, HEALTH_EVENT)
        if delivery is None:
            self._malformed.add(1)
            try:
                await msg.term()
            except (nats.errors.Error, OSError) as exc:
                log.debug("terminating a bad message failed: %s", exc)
            return
        event = delivery.value
        pending = list(self._sinks)
        delay = self._settings.retry_initial_s
        while pending:
            failed: list[AlertSink] = []
            for sink in pending:
                try:
                    await sink.deliver(event)
                    self._delivered.add(1, {"sink": sink.name.split(" ")[0]})
                except PermanentDeliveryError as exc:
                    self._failures.add(1, {"sink": sink.name.split(" ")[0], "permanent": True})
                    self._event_log.error(
                        "%s rejected event %s for good: %s", sink.name, event.event_id, exc
                    )
                except DeliveryError as exc:
                    self._failures.add(1, {"sink": sink.name.split(" ")[0], "permanent": False})
                    self._event_log.warning(
                        "%s: delivery of %s failed (%s); retrying in %.1fs",
                        sink.name,
                        event.event_id,
                        exc,
                        delay,
                    )
                    failed.append(sink)
            pending = failed
            if pending:
                # Keep the message ours while we retry, so it is not redelivered meanwhile.
                try:
                    await msg.in_progress()
                except (nats.errors.Error, OSError) as exc:
                    log.debug("extending the ack deadline failed: %s", exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, self._settings.retry_max_s)
        try:
            await msg.ack()
        except (nats.errors.Error, OSError) as exc:
            # Delivered but not acked: it comes again, and every sink is idempotent
            # for a repeat (same event id, same alert labels).
            self._event_log.warning("acking %s failed: %s", event.event_id, exc)
        self.processed += 1
