"""The :class:`Bus`: a connected client, its publish and subscribe, and its parts.

:class:`Bus` puts together the parts of the bus, each in its own module: the shared
state and total decoding (:mod:`.decoding`), request/reply (:mod:`.rpc`) and the
JetStream helpers (:mod:`.jetstream`); :meth:`Bus.connect` opens and closes the
connection with :mod:`.connection`. What it adds itself:

* :meth:`Bus.publish` encodes with a :class:`~gpulet_common.codec.Codec` and puts the
  current OpenTelemetry trace context into the NATS headers (W3C ``traceparent``), so
  a consumer's span joins the producer's trace.
* :meth:`Bus.subscribe` yields typed :class:`~gpulet_common.bus.decoding.Delivery`
  objects, each decoded totally (what fails is counted, logged and dropped).
* The connection's state: :attr:`Bus.is_connected`, :meth:`Bus.wait_reconnected` and
  :meth:`Bus.wait_disconnected`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import TypeVar

import nats.errors
from nats.aio.subscription import Subscription
from opentelemetry import metrics, propagate
from opentelemetry.trace import SpanKind

from gpulet_common.bus.connection import (
    ConnectionWatch,
    close_client,
    describe_servers,
    log,
    open_client,
)
from gpulet_common.bus.decoding import Delivery, tracer
from gpulet_common.bus.jetstream import JetStreamHelpers
from gpulet_common.bus.rpc import RequestReply
from gpulet_common.codec import Codec
from gpulet_common.settings.limits import LimitsSettings
from gpulet_common.settings.nats import NatsSettings

T = TypeVar("T")


class Bus(RequestReply, JetStreamHelpers):
    """A connected NATS client with typed helpers. Create with :meth:`connect`."""

    # -- connection --------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        settings: NatsSettings,
        *,
        name: str | None = None,
        meter: metrics.Meter | None = None,
        max_initial_attempts: int | None = None,
        drain_timeout_s: float = 1.0,
        limits: LimitsSettings | None = None,
        quiet_connect: bool = False,
        unreachable_hint: str | None = None,
    ) -> AsyncIterator[Bus]:
        """Connect, retrying with back-off; drain and close on exit.

        ``max_initial_attempts=None`` keeps trying until cancelled: a sidecar may
        start before its NATS sidecar is listening (``unreachable_hint`` is logged with
        the first failed attempt). ``quiet_connect``: failed attempts are not logged,
        only the :class:`~gpulet_common.refusal.NatsUnreachable` they end in.
        """
        watch = ConnectionWatch(settings.url, quiet=quiet_connect)
        nc = await open_client(
            settings,
            watch,
            name=name,
            max_initial_attempts=max_initial_attempts,
            drain_timeout_s=drain_timeout_s,
            hint=unreachable_hint,
        )
        bus = cls(nc, settings, meter or metrics.get_meter("gpulet.bus"), limits, watch=watch)
        log.info(
            "nats: connected to %s",
            describe_servers(nc.connected_url.geturl() if nc.connected_url else ""),
        )
        try:
            yield bus
        finally:
            watch.closing = True
            await close_client(nc, drain_timeout_s)

    @property
    def is_connected(self) -> bool:
        return bool(self._nc.is_connected)

    @property
    def reconnects(self) -> int:
        """How many times the connection came back since it was opened."""
        return self._watch.reconnects

    async def wait_reconnected(self) -> None:
        """Return at the next reconnection to NATS (its subscriptions are back then)."""
        await self._watch.wait_reconnected()

    async def wait_disconnected(self) -> None:
        """Return at the next loss of the connection (nats-py is reconnecting then)."""
        await self._watch.wait_disconnected()

    async def flush(self, timeout_s: float = 2.0) -> None:
        await self._nc.flush(timeout=timeout_s)  # type: ignore[arg-type]

    # -- publish / subscribe -----------------------------------------------------

    async def publish(
        self,
        subject: str,
        value: T,
        codec: Codec[T],
        *,
        headers: dict[str, str] | None = None,
        reply: str = "",
    ) -> None:
        data = codec.encode(value)
        with tracer.start_as_current_span(f"publish {subject}", kind=SpanKind.PRODUCER):
            carrier: dict[str, str] = dict(headers) if headers else {}
            propagate.inject(carrier)
            await self._nc.publish(subject, data, reply=reply, headers=carrier or None)
        self._metrics.published.add(1, {"type": codec.type.__name__})

    @asynccontextmanager
    async def subscribe(
        self, subject: str, codec: Codec[T], *, queue: str = "", node: str | None = None
    ) -> AsyncIterator[AsyncIterator[Delivery[T]]]:
        """Subscribe for the duration of the ``async with`` block.

        The subscription is flushed (a PING/PONG round trip) before the block starts,
        so the server has it: a publish made afterwards on this connection is never
        missed, and one from another connection is not either once that connection
        has made a round trip of its own after this one (without it, 4 to 7 in 100
        were lost on this machine, see tests/deploy/test_deploy_nats.py). While
        disconnected the flush is skipped: nats-py sends the subscription again when
        it reconnects. ``node``: the
        consumer's node; a message about another node is rejected (so is one whose node
        differs from its subject's, always).
        """
        async with self._raw_subscription(subject, queue=queue) as sub:
            if self._nc.is_connected:
                with suppress(nats.errors.Error, TimeoutError, OSError):
                    await self._nc.flush(timeout=self._settings.request_timeout_s)  # type: ignore[arg-type]
            yield self._iterate(sub, codec, node)

    async def _iterate(
        self, sub: Subscription, codec: Codec[T], node: str | None
    ) -> AsyncIterator[Delivery[T]]:
        async for msg in sub.messages:
            delivery = self.decode(msg, codec, node=node)
            if delivery is not None:
                yield delivery
