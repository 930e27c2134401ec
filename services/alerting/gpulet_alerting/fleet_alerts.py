"""``gpulet alerts --hub``: alerting for the whole fleet, from the hub's stream.

Design
------
The same :class:`~gpulet_alerting.consumer.AlertsConsumer` as on a node, pointed at the
hub's replicated ``GPU_FLEET`` stream (:mod:`.fleet_hub`) through one durable
pull consumer, ``fleet.alerts_durable``, that every replica of ``gpulet alerts --hub``
shares. A pull consumer hands each message to one fetch, so each event goes to one
replica; it is acked only after every sink took it. An event a replica took and did
not ack (the replica died, the hub server it talked to died) is redelivered after
``fleet.alerts_ack_wait_s`` to whichever replica fetches next, at most
``fleet.alerts_max_deliver`` times. ``fleet.alerts_max_ack_pending`` bounds what is
in flight across replicas.

That is at-least-once. "Exactly once to the sink" is the sink's part: every event
carries its ``event_id``, the same on every redelivery, and Alertmanager (same labels,
same alert) and a webhook receiver that keys on ``event_id`` absorb a repeat. Each
replica also remembers the last ``DEDUP_CAPACITY`` event ids it delivered (per
node: ``<node>:<event_id>``, the node being the one the subject ``gpu.events.<node>``
proves, as the node user may publish there only) and acks a
redelivery of one of them without calling the sinks again (:class:`DedupSink`), which
removes the repeats a lost ack would cause; the repeats a replica's death causes reach
the other replica, and the sink's own de-duplication.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TextIO

import msgspec
from opentelemetry import metrics

from gpulet_alerting.consumer import AlertsConsumer
from gpulet_alerting.sinks import AlertSink
from gpulet_common import subjects
from gpulet_common.bus import Bus
from gpulet_common.messages import HealthEvent
from gpulet_common.settings import Settings
from gpulet_common.settings.health import AlertSettings

DEDUP_CAPACITY = 65536


class DedupSink:
    """A sink that skips an event id it already delivered (bounded memory)."""

    def __init__(self, inner: AlertSink, capacity: int = DEDUP_CAPACITY) -> None:
        self.name = inner.name
        self._inner = inner
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity
        self.skipped = 0

    async def deliver(self, event: HealthEvent) -> None:
        # Per node: another node's event with the same id is another event. The node
        # is the one the subject proved (the consumer rejects an event that names
        # another node than its subject's gpu.events.<node>).
        key = subjects.event_msg_id(event.node, event.event_id)
        if key in self._seen:
            self._seen.move_to_end(key)
            self.skipped += 1
            return
        await self._inner.deliver(event)
        self._seen[key] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)

    async def resend(self, now: float) -> None:
        await self._inner.resend(now)


def hub_alert_settings(settings: Settings) -> AlertSettings:
    """The alerts settings with the fleet consumer's durable name and ack wait; no
    reconciliation from a node's KV bucket (the hub has none: it has the stream)."""
    fleet = settings.fleet
    return msgspec.structs.replace(
        settings.health.alerts,
        durable=fleet.alerts_durable,
        subject=subjects.FLEET_STREAM_SUBJECTS[0],
        ack_wait_s=fleet.alerts_ack_wait_s,
        reconcile_from_kv=False,
    )


def hub_consumer(
    bus: Bus,
    settings: Settings,
    *,
    out: TextIO | None = None,
    meter: metrics.Meter | None = None,
) -> AlertsConsumer:
    alert_settings = hub_alert_settings(settings)
    plain = AlertsConsumer.from_settings(bus, alert_settings, out=out, meter=meter)
    return AlertsConsumer(
        bus,
        alert_settings,
        [DedupSink(sink) for sink in plain.sinks],
        meter=meter,
        stream=subjects.FLEET_STREAM,
        max_deliver=settings.fleet.alerts_max_deliver,
        max_ack_pending=settings.fleet.alerts_max_ack_pending,
    )
