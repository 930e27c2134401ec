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

Alertmanager mapping
--------------------
Every condition is one alert, identified by its labels ``alertname`` (from the kind:
``GpuXid``, ``GpuThermal``, ``GpuEccUncorrectable``, ...), ``node``, ``gpu`` (index),
``uuid``, ``condition`` and ``severity`` (plus ``xid`` for XIDs). Annotations carry
``summary`` (the reason), ``action``, ``description`` and the event id. ``startsAt`` is
when the condition began; while active the alert is re-sent every
``resend_interval_s`` with ``endsAt`` 4 intervals ahead (what Prometheus does), and
the ``recovered``/``cleared`` event resolves it by sending ``endsAt`` = the recovery
time. A GPU-level alert ``GpuUnhealthy`` fires while the GPU is unhealthy and resolves
when it is healthy again. One-off reports (application XIDs, a hot-added GPU, a
buffer overflow) are alerts that end after ``transient_alert_s``.

Label sets of firing alerts are remembered, so the resolve matches even if the GPU's
index changed in between. A consumer that starts without that memory (first start, or
a restart) first posts the current conditions from the ``gpu_health`` KV bucket
(``reconcile_from_kv``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Protocol, TextIO

import anyio
import anyio.abc
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import metrics

from gpulet_common import subjects
from gpulet_common.bus import Bus, fetch_ready
from gpulet_common.codec import GPU_HEALTH, HEALTH_EVENT
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import GpuHealth, HealthEvent
from gpulet_common.settings.health import AlertSettings

log = logging.getLogger("gpulet.alerts")

ALERT_NAMES: dict[str, str] = {
    "xid": "GpuXid",
    "ecc_uncorrectable": "GpuEccUncorrectable",
    "ecc_correctable_rate": "GpuEccCorrectableRate",
    "remap_pending": "GpuRowRemapPending",
    "remap_failure": "GpuRowRemapFailure",
    "thermal": "GpuThermal",
    "thermal_slowdown": "GpuThermalSlowdown",
    "thermal_shutdown": "GpuThermalShutdown",
    "clock_slowdown": "GpuClockSlowdown",
    "pcie_replay_rate": "GpuPcieReplayRate",
    "nvlink_error_rate": "GpuNvlinkErrorRate",
    "nvlink_down": "GpuNvLinkDown",
    "gpu_lost": "GpuLost",
    "gpu_removed": "GpuRemoved",
    "gpu_missing": "GpuMissing",
    "gpu_added": "GpuAdded",
    "nvml_unavailable": "GpuNvmlUnavailable",
    "buffer_overflow": "GpuHealthEventsLost",
}
UNHEALTHY_ALERT = "GpuUnhealthy"
END_KINDS = frozenset({"recovered", "cleared"})
_FETCH_BATCH = 64
_FETCH_TIMEOUT_S = 1.0


class DeliveryError(Exception):
    """A delivery that may succeed if retried."""


class PermanentDeliveryError(Exception):
    """A delivery that retrying cannot fix (the receiver rejected the body)."""


def rfc3339(ts: float) -> str:
    # Total: an event's time is its sender's word (1e18, NaN): clamp, never raise.
    ts = min(max(ts, 0.0), 253402300799.0) if ts == ts else 0.0
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def post_json(url: str, body: bytes, timeout_s: float) -> None:
    """POST (blocking); DeliveryError or PermanentDeliveryError on failure."""
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        if 400 <= exc.code < 500 and exc.code not in (408, 429):
            raise PermanentDeliveryError(f"{url}: HTTP {exc.code}: {detail}") from exc
        raise DeliveryError(f"{url}: HTTP {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        raise DeliveryError(f"{url}: {exc}") from exc


class AlertSink(Protocol):
    name: str

    async def deliver(self, event: HealthEvent) -> None: ...

    async def resend(self, now: float) -> None: ...


class StdoutSink:
    name = "stdout"

    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out

    async def deliver(self, event: HealthEvent) -> None:
        out = self._out or sys.stdout
        out.write(HEALTH_EVENT.encode(event).decode() + "\n")
        out.flush()

    async def resend(self, now: float) -> None:
        return None


class WebhookSink:
    def __init__(self, url: str, *, timeout_s: float) -> None:
        self.name = f"webhook {url}"
        self._url = url
        self._timeout_s = timeout_s

    async def deliver(self, event: HealthEvent) -> None:
        await anyio.to_thread.run_sync(
            post_json,
            self._url,
            HEALTH_EVENT.encode(event),
            self._timeout_s,
            abandon_on_cancel=True,
        )

    async def resend(self, now: float) -> None:
        return None


AlertKey = tuple[str, str, str]  # (node, uuid, condition or "" for GpuUnhealthy)


class AlertmanagerSink:
    """Alerts for Alertmanager's v2 API, with firing alerts re-sent periodically."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        resend_interval_s: float,
        transient_alert_s: float,
    ) -> None:
        self.name = f"alertmanager {base_url}"
        self._url = base_url.rstrip("/") + "/api/v2/alerts"
        self._timeout_s = timeout_s
        self._resend_s = resend_interval_s
        self._transient_s = transient_alert_s
        # Firing alerts, keyed by what they are about, with the payload last sent.
        self.active: dict[AlertKey, dict[str, Any]] = {}
        # The alerts computed for the event being delivered: computing them updates
        # the active set, so a retried POST must re-send these, not recompute.
        self._pending: tuple[tuple[str, str], list[dict[str, Any]]] | None = None

    # --- building alerts -------------------------------------------------------------

    def _labels(
        self,
        event_node: str,
        uuid: str,
        index: int | None,
        kind: str,
        condition: str,
        severity: str,
        xid: int | None,
    ) -> dict[str, str]:
        labels = {
            "alertname": ALERT_NAMES.get(kind, "GpuHealth"),
            "node": event_node,
            "severity": severity,
        }
        if uuid:
            labels["uuid"] = uuid
            labels["gpu"] = str(index) if index is not None else ""
        if condition:
            labels["condition"] = condition
        if xid is not None:
            labels["xid"] = str(xid)
        return {k: v for k, v in labels.items() if v}

    def _alert(
        self,
        labels: dict[str, str],
        *,
        summary: str,
        description: str,
        action: str,
        event_id: str,
        starts_at: float,
        ends_at: float,
    ) -> dict[str, Any]:
        annotations = {
            "summary": summary,
            "description": description,
            "action": action,
            "event_id": event_id,
        }
        return {
            "labels": labels,
            "annotations": {k: v for k, v in annotations.items() if v},
            "startsAt": rfc3339(starts_at),
            "endsAt": rfc3339(max(ends_at, starts_at)),
        }

    def alerts_for(self, event: HealthEvent, now: float) -> list[dict[str, Any]]:
        """The alerts to post for one event (and the active set updated)."""
        out: list[dict[str, Any]] = []
        ahead = now + 4 * self._resend_s
        if event.kind in END_KINDS:
            key: AlertKey = (event.node, event.gpu_uuid, event.condition)
            previous = self.active.pop(key, None)
            if previous is not None:
                labels = previous["labels"]
                starts = previous["startsAt"]
            else:
                labels = self._labels(
                    event.node,
                    event.gpu_uuid,
                    event.gpu_index,
                    event.condition_kind or "",
                    event.condition,
                    event.condition_severity or event.severity,
                    event.xid,
                )
                starts = rfc3339(event.condition_since or event.observed_at)
            resolved = self._alert(
                labels,
                summary=event.reason,
                description=event.message,
                action="none",
                event_id=event.event_id,
                starts_at=event.condition_since or event.observed_at,
                ends_at=event.observed_at,
            )
            resolved["startsAt"] = starts
            out.append(resolved)
        elif event.condition:
            key = (event.node, event.gpu_uuid, event.condition)
            labels = self._labels(
                event.node,
                event.gpu_uuid,
                event.gpu_index,
                event.kind,
                event.condition,
                event.condition_severity or event.severity,
                event.xid,
            )
            previous = self.active.get(key)
            if previous is not None:
                labels = previous["labels"]
            alert = self._alert(
                labels,
                summary=event.reason,
                description=self._describe(event),
                action=event.action,
                event_id=event.event_id,
                starts_at=event.condition_since or event.observed_at,
                ends_at=ahead,
            )
            self.active[key] = alert
            out.append(alert)
        else:
            labels = self._labels(
                event.node,
                event.gpu_uuid,
                event.gpu_index,
                event.kind,
                "",
                event.severity,
                event.xid,
            )
            out.append(
                self._alert(
                    labels,
                    summary=event.reason,
                    description=self._describe(event),
                    action=event.action,
                    event_id=event.event_id,
                    starts_at=event.observed_at,
                    ends_at=event.observed_at + self._transient_s,
                )
            )
        if event.gpu_uuid:
            out += self._unhealthy(event, ahead)
        return out

    def _describe(self, event: HealthEvent) -> str:
        parts = [event.message] if event.message else []
        if event.observed_value is not None:
            observed = f"observed {event.observed_value:g}"
            if event.threshold is not None:
                observed += f", threshold {event.threshold:g}"
            parts.append(observed)
        if event.repeat_count > 1:
            parts.append(f"{event.repeat_count} occurrences")
        return "; ".join(parts)

    def _unhealthy(self, event: HealthEvent, ahead: float) -> list[dict[str, Any]]:
        key: AlertKey = (event.node, event.gpu_uuid, "")
        previous = self.active.get(key)
        if not event.healthy:
            labels = (
                previous["labels"]
                if previous is not None
                else {
                    "alertname": UNHEALTHY_ALERT,
                    "node": event.node,
                    "gpu": str(event.gpu_index) if event.gpu_index is not None else "",
                    "uuid": event.gpu_uuid,
                    "severity": "critical",
                }
            )
            labels = {k: v for k, v in labels.items() if v}
            since = event.condition_since or event.observed_at
            if previous is not None:
                alert = dict(previous)
                alert["endsAt"] = rfc3339(ahead)
                if event.kind not in END_KINDS:
                    alert["annotations"] = dict(
                        previous["annotations"], latest=event.reason, event_id=event.event_id
                    )
            else:
                alert = self._alert(
                    labels,
                    summary=f"GPU {event.gpu_index} on {event.node} is unhealthy: {event.reason}",
                    description="",
                    action=event.action,
                    event_id=event.event_id,
                    starts_at=since,
                    ends_at=ahead,
                )
            self.active[key] = alert
            return [alert]
        if previous is None:
            return []
        del self.active[key]
        resolved = dict(previous)
        resolved["endsAt"] = rfc3339(event.observed_at)
        resolved["annotations"] = dict(previous["annotations"], resolved_by=event.reason)
        return [resolved]

    def reconcile(
        self, healths: Sequence[tuple[str, GpuHealth]], now: float
    ) -> list[dict[str, Any]]:
        """Alerts for the current state read from the KV bucket: (node, GPU health)."""
        ahead = now + 4 * self._resend_s
        out: list[dict[str, Any]] = []
        for node, health in healths:
            for c in health.conditions:
                xid = (
                    int(c.condition.split(":", 1)[1])
                    if c.kind == "xid" and ":" in c.condition
                    else None
                )
                labels = self._labels(
                    node, health.gpu_uuid, health.gpu_index, c.kind, c.condition, c.severity, xid
                )
                alert = self._alert(
                    labels,
                    summary=c.reason,
                    description=c.message,
                    action=c.action,
                    event_id="",
                    starts_at=c.since or now,
                    ends_at=ahead,
                )
                self.active[(node, health.gpu_uuid, c.condition)] = alert
                out.append(alert)
            if not health.healthy:
                labels = {
                    "alertname": UNHEALTHY_ALERT,
                    "node": node,
                    "gpu": str(health.gpu_index) if health.gpu_index is not None else "",
                    "uuid": health.gpu_uuid,
                    "severity": "critical",
                }
                since = min((c.since for c in health.conditions if c.since), default=now)
                first = health.conditions[0].reason if health.conditions else "not present"
                alert = self._alert(
                    {k: v for k, v in labels.items() if v},
                    summary=f"GPU {health.gpu_index} on {node} is unhealthy: {first}",
                    description="",
                    action=health.conditions[0].action if health.conditions else "operator_check",
                    event_id="",
                    starts_at=since,
                    ends_at=ahead,
                )
                self.active[(node, health.gpu_uuid, "")] = alert
                out.append(alert)
        return out

    # --- sending ---------------------------------------------------------------------

    async def post(self, alerts: list[dict[str, Any]]) -> None:
        if not alerts:
            return
        body = json.dumps(alerts).encode()
        await anyio.to_thread.run_sync(
            post_json, self._url, body, self._timeout_s, abandon_on_cancel=True
        )

    async def deliver(self, event: HealthEvent) -> None:
        pending = self._pending
        key = (event.node, event.event_id)  # per node: the consumer proved the node
        if pending is None or pending[0] != key:
            pending = self._pending = (key, self.alerts_for(event, time.time()))
        await self.post(pending[1])
        self._pending = None

    async def resend(self, now: float) -> None:
        if not self.active:
            return
        ahead = rfc3339(now + 4 * self._resend_s)
        alerts = []
        for alert in self.active.values():
            alert["endsAt"] = ahead
            alerts.append(alert)
        await self.post(alerts)


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
        # --hub` (gpulet_health.fleet_alerts), with bounded redelivery.
        self._stream = stream
        self._max_deliver = max_deliver
        self._max_ack_pending = max_ack_pending
        meter = meter or metrics.get_meter("gpulet.alerts")
        self._delivered = meter.create_counter(
            "gpulet.alerts.delivered", description="Health events delivered to a sink"
        )
        self._failures = meter.create_counter(
            "gpulet.alerts.delivery_failures",
            description="Failed deliveries (retried unless permanent)",
        )
        self._malformed = meter.create_counter(
            "gpulet.alerts.malformed", description="Stream messages that were not health events"
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
                try:
                    keys = await kv.keys()
                except nats.js.errors.NoKeysError:
                    return out
                for key in keys:
                    node_token = key.split(".", 1)[0]
                    if wanted not in ("*", ">") and node_token != wanted:
                        continue
                    entry = await kv.get(key)
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
