"""What every part of the bus shares, and total decoding of what comes off it.

:class:`BusBase` holds the connection and its
:class:`~gpulet_common.bus.connection.ConnectionWatch`, the settings, the ``[limits]`` and the bus's
counters, and opens subscriptions with nats-py's bounded pending queue (a consumer that
falls behind is reported by the server as a slow consumer and counted, rather than
growing memory without bound); the other parts of :class:`~gpulet_common.bus.Bus`
build on it.

Every payload from the bus (a subscribed message, a reply, a request) goes through
:meth:`~gpulet_common.codec.Codec.decode` with the bus's ``[limits]``, the subject it
came on, the consumer's node (when given) and this clock (:meth:`BusBase.decode_checked`):
one that is too large, too deep or not the type is counted in
``gpulet_bus_malformed_messages_total{type,reason}``, one whose claims do not hold
(another node, duplicate GPUs, a far-future timestamp) in
``gpulet_bus_rejected_messages_total{type,reason}``; either is logged (rate-limited)
and dropped: bad input is never fatal and changes no state.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace

from gpulet_common import codec as codecs
from gpulet_common.bus.connection import ConnectionWatch, log
from gpulet_common.codec import Codec
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.settings.limits import LimitsSettings
from gpulet_common.settings.nats import NatsSettings

T = TypeVar("T")

# The most an unsubscribe may take when a subscription ends (it is shielded).
UNSUBSCRIBE_S = 1.0

tracer = trace.get_tracer("gpulet.bus")


@dataclass(frozen=True, slots=True)
class Delivery(Generic[T]):
    subject: str
    value: T
    headers: dict[str, str]
    reply: str
    raw: Msg = field(repr=False)

    def trace_context(self) -> otel_context.Context:
        return propagate.extract(self.headers)


@dataclass(slots=True)
class BusMetrics:
    published: metrics.Counter
    received: metrics.Counter
    malformed: metrics.Counter
    rejected: metrics.Counter
    errors: metrics.Counter
    reconnects: metrics.Counter

    @classmethod
    def create(cls, meter: metrics.Meter) -> BusMetrics:
        return cls(
            published=meter.create_counter(
                "gpulet.bus.messages_published", description="Messages published"
            ),
            received=meter.create_counter(
                "gpulet.bus.messages_received", description="Messages received and decoded"
            ),
            malformed=meter.create_counter(
                "gpulet.bus.malformed_messages",
                description="Messages dropped because they failed to decode or validate "
                "(too large, too deep, not JSON, not the type or out of range), by type and reason",
            ),
            rejected=meter.create_counter(
                "gpulet.bus.rejected_messages",
                description="Messages dropped because what they claim does not hold (another "
                "node, duplicate or too many GPUs, a timestamp out of bounds), by type and reason",
            ),
            errors=meter.create_counter(
                "gpulet.bus.errors", description="Asynchronous errors reported by the client"
            ),
            reconnects=meter.create_counter(
                "gpulet.bus.reconnects", description="Reconnections to NATS"
            ),
        )


class BusBase:
    """The connection and its watch, settings, limits and counters; bounded
    subscriptions; decoding that never raises for what a sender controls unless asked
    to (:meth:`decode_checked`)."""

    def __init__(
        self,
        nc: NatsClient,
        settings: NatsSettings,
        meter: metrics.Meter,
        limits: LimitsSettings | None = None,
        *,
        watch: ConnectionWatch | None = None,
    ) -> None:
        self._nc = nc
        self._settings = settings
        self.limits = limits or LimitsSettings()
        self._metrics = BusMetrics.create(meter)
        self._malformed_log = RateLimitedLog(log, per_minute=20)
        self._handler_log = RateLimitedLog(log, per_minute=10)
        self._watch = watch or ConnectionWatch(settings.url)
        self._watch.metrics = self._metrics

    @property
    def client(self) -> NatsClient:
        """The underlying nats-py client, for APIs this layer does not wrap (nats.micro)."""
        return self._nc

    @asynccontextmanager
    async def _raw_subscription(
        self, subject: str, *, queue: str = ""
    ) -> AsyncIterator[Subscription]:
        """A raw subscription with the bounded pending queue, unsubscribed on exit
        (shielded, so cancellation cannot leak it)."""
        sub = await self._nc.subscribe(
            subject, queue=queue, pending_msgs_limit=self._settings.pending_msgs_limit
        )
        try:
            yield sub
        finally:
            # Bounded: nats-py's unsubscribe queues a flush, which can wait on a
            # connection that is going away; a stop must end all the same.
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(UNSUBSCRIBE_S),
                suppress(nats.errors.Error, OSError),
            ):
                await sub.unsubscribe()

    def count_bad(self, subject: str, codec: Codec[Any], exc: Exception, data: bytes) -> None:
        """Count and log (rate-limited) one payload that failed to decode or check."""
        family, reason = codecs.failure_reason(exc)
        counter = self._metrics.rejected if family == "rejected" else self._metrics.malformed
        counter.add(1, {"type": codec.name, "reason": reason})
        preview = bytes(data[:120])
        self._malformed_log.warning(
            "dropped %s %s on %s: %s: %s (payload %d bytes: %r)",
            family,
            codec.name,
            subject[:200],
            reason,
            str(exc)[:300],
            len(data),
            preview,
        )

    def decode_checked(
        self, data: bytes, codec: Codec[T], *, subject: str, node: str | None = None
    ) -> T:
        """Decode and check one payload with this bus's limits and clock; count and log
        one that fails, then raise what the codec raised."""
        try:
            return codec.decode(
                data, limits=self.limits, subject=subject, node=node, now=time.time()
            )
        except Exception as exc:
            self.count_bad(subject, codec, exc, data)
            raise

    def decode_value(
        self, data: bytes, codec: Codec[T], *, subject: str, node: str | None = None
    ) -> T | None:
        """Decode and check one payload with this bus's limits and clock; count, log
        and drop it (return None) if it fails."""
        try:
            return self.decode_checked(data, codec, subject=subject, node=node)
        except Exception:
            return None

    def decode(self, msg: Msg, codec: Codec[T], *, node: str | None = None) -> Delivery[T] | None:
        """Decode one message; count, log and drop it (return None) if malformed or
        if what it claims does not hold (see :mod:`gpulet_common.validate`)."""
        value = self.decode_value(msg.data, codec, subject=msg.subject, node=node)
        if value is None:
            return None
        self._metrics.received.add(1, {"type": codec.type.__name__})
        return Delivery(
            subject=msg.subject,
            value=value,
            headers=dict(msg.headers or {}),
            reply=msg.reply,
            raw=msg,
        )
