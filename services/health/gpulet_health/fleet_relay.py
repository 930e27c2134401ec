"""The node's relay of its health events to the hub's fleet stream, at least once.

Why a relay
-----------
A leaf connection carries plain NATS messages, at most once: a ``gpu.health.<node>``
published while the node's leaf connection is down (its hub server just died, the
network blinked) reaches the node's own ``GPU_HEALTH`` stream and nobody on the hub.
So the fleet stream is not fed by the live subject but by this relay, which reads the
node's stream and hands each event to the hub's stream with an acknowledgement:

* a durable pull consumer ``gpulet-fleet-relay`` on the node's ``GPU_HEALTH`` (this
  node's subject), on the node's own JetStream: it survives restarts of the health
  service and resumes where it stopped;
* each event is published, in stream order, on ``gpu.events.<node>`` (which the node's
  hub user may publish; the hub's ``GPU_FLEET`` stream captures it) with
  ``Nats-Msg-Id = <node>:<event_id>`` (de-duplicated per node: one node's ids never
  collide with another's), as a request: the hub's JetStream answers with a publish
  ack once the event is stored on a quorum of its replicas;
* only then is the node's message acked. No ack from the hub (timeout, no responders
  while the leaf reconnects, a 503 during a leader election) -> back off
  (``fleet.relay_retry_initial_s`` doubling up to ``relay_retry_max_s``) and send the
  same event again: the hub drops the repeat by its id. Order is kept (one at a time).

The ack reaches the node through the leaf connection on this relay's own inbox
prefix, ``_INBOX.fleet.<node>``: the only inbox the node's hub user may receive on, so
no node sees another's acks. The relay therefore has its own connection to the node's
server (as the health user, whose auth.conf rights include it).

Bounded: one event in flight, ``_FETCH_BATCH`` fetched at a time; a message that is
not a health event is terminated (counted, logged), never relayed.
"""

from __future__ import annotations

import contextlib
import logging

import anyio
import anyio.abc
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import metrics

from gpulet_common import subjects
from gpulet_common.bus import Bus, fetch_ready
from gpulet_common.codec import HEALTH_EVENT
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.settings.fleet import FleetSettings
from gpulet_common.settings.nats import NatsSettings
from gpulet_common.telemetry import create_counters
from gpulet_common.untrusted import json_document

log = logging.getLogger("gpulet.health.fleet_relay")

DURABLE = "gpulet-fleet-relay"
_FETCH_BATCH = 64
_FETCH_TIMEOUT_S = 1.0


class HubRefused(Exception):
    pass


def relay_nats(settings: NatsSettings, node: str) -> NatsSettings:
    """The relay's connection: the service's, with the node's fleet inbox prefix."""
    return msgspec.structs.replace(
        settings, inbox_prefix=subjects.fleet_relay_inbox(node), name="gpulet-fleet-relay"
    )


class FleetRelay:
    def __init__(
        self,
        bus: Bus,
        node: str,
        settings: FleetSettings,
        *,
        meter: metrics.Meter | None = None,
    ) -> None:
        self._bus = bus
        self._node = node
        self._settings = settings
        self._subject = subjects.fleet_events(node)
        meter = meter or metrics.get_meter("gpulet.health.fleet_relay")
        self._relayed, self._retries = create_counters(
            meter,
            ("gpulet.fleet.events_relayed", "Health events stored by the hub"),
            ("gpulet.fleet.relay_retries", "Relays to the hub that were retried"),
        )
        self._fail_log = RateLimitedLog(log, per_minute=6)
        self._malformed_log = RateLimitedLog(log, per_minute=10)
        self.relayed = 0
        self.duplicates = 0

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        subscription = await self._subscribe()
        task_status.started()
        while True:
            try:
                messages = await fetch_ready(subscription, _FETCH_BATCH, _FETCH_TIMEOUT_S)
            except (nats.errors.TimeoutError, TimeoutError):
                # nats-py raises either, depending on where the wait ended.
                continue
            except (nats.errors.Error, OSError) as exc:
                self._fail_log.warning("reading the node's health stream failed: %s", exc)
                await anyio.sleep(self._settings.relay_retry_initial_s)
                continue
            for msg in messages:
                await self._relay(msg)

    async def _subscribe(self) -> JetStreamContext.PullSubscription:
        config = ConsumerConfig(
            durable_name=DURABLE,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            # Longer than the relay's slowest retry, so a message is never handed to a
            # second fetch while this one still works on it (it also sends progress).
            ack_wait=max(60.0, 4 * self._settings.relay_retry_max_s),
            max_deliver=-1,
            filter_subject=subjects.health(self._node),
        )
        delay = self._settings.relay_retry_initial_s
        while True:
            try:
                return await self._bus.jetstream.pull_subscribe(
                    subjects.health(self._node),
                    durable=DURABLE,
                    stream=subjects.HEALTH_STREAM,
                    config=config,
                )
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                self._fail_log.warning("cannot read %s yet: %s", subjects.HEALTH_STREAM, exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, self._settings.relay_retry_max_s)

    async def _relay(self, msg: Msg) -> None:
        try:
            event = HEALTH_EVENT.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._malformed_log.warning(
                "not relaying a malformed message on %s: %s", msg.subject[:200], exc
            )
            await msg.term()
            return
        delay = self._settings.relay_retry_initial_s
        attempts = 0
        while True:
            attempts += 1
            try:
                duplicate = await self._send(msg.data, event.event_id)
                break
            except (HubRefused, nats.errors.Error, OSError, TimeoutError) as exc:
                self._retries.add(1)
                self._fail_log.warning(
                    "the hub did not store %s (attempt %d: %s); retrying in %.2fs",
                    event.event_id,
                    attempts,
                    exc or type(exc).__name__,
                    delay,
                )
                with contextlib.suppress(nats.errors.Error, OSError):
                    await msg.in_progress()
                await anyio.sleep(delay)
                delay = min(delay * 2, self._settings.relay_retry_max_s)
        self.relayed += 1
        self.duplicates += int(duplicate)
        self._relayed.add(1)
        try:
            await msg.ack()
        except (nats.errors.Error, OSError) as exc:
            # Stored on the hub, not acked here: relayed again later, dropped there.
            self._fail_log.warning("acking %s locally failed: %s", event.event_id, exc)

    async def _send(self, data: bytes, event_id: str) -> bool:
        """Publish to the hub and wait for its stream's ack; True if a duplicate."""
        reply = await self._bus.client.request(
            self._subject,
            data,
            timeout=self._settings.relay_timeout_s,
            # Scoped to this node (the subject's): subjects.event_msg_id.
            headers={"Nats-Msg-Id": subjects.event_msg_id(self._node, event_id)},
        )
        try:
            ack = json_document(reply.data, max_bytes=1 << 16, what="ack")
        except ValueError as exc:  # UntrustedDocumentError
            raise HubRefused(f"unreadable ack {reply.data[:100]!r}") from exc
        if not isinstance(ack, dict):
            raise HubRefused(f"unexpected ack {ack!r}")
        if ack.get("error"):
            raise HubRefused(str(ack["error"]))
        if ack.get("stream") != subjects.FLEET_STREAM:
            raise HubRefused(f"acked by {ack.get('stream')!r}, not {subjects.FLEET_STREAM}")
        return bool(ack.get("duplicate"))


async def run_relay(
    nats_settings: NatsSettings,
    node: str,
    settings: FleetSettings,
    meter: metrics.Meter | None = None,
    *,
    task_status: anyio.abc.TaskStatus[FleetRelay] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Connect with the relay's own inbox prefix and relay until cancelled."""
    async with Bus.connect(relay_nats(nats_settings, node), meter=meter) as bus:
        relay = FleetRelay(bus, node, settings, meter=meter)
        async with anyio.create_task_group() as tg:
            await tg.start(relay.run)
            task_status.started(relay)
