"""A thin, typed layer over nats-py that fits anyio task groups.

Layers
------
* :meth:`Bus.connect` owns the connection: initial connect and reconnect with
  exponential, jittered back-off; user/password, token, NKey seed, creds file and TLS;
  the reply inbox prefix (``nats.inbox_prefix``), so that a server can confine each
  user to its own replies.
* :meth:`Bus.publish` encodes with a :class:`~gpulet_common.codec.Codec` and puts the
  current OpenTelemetry trace context into the NATS headers (W3C ``traceparent``), so a
  consumer's span joins the producer's trace.
* :meth:`Bus.subscribe` yields typed :class:`Delivery` objects. Every payload goes
  through :meth:`~gpulet_common.codec.Codec.decode` with the bus's ``[limits]``, the
  subject it came on, the consumer's node (when given) and this clock: one that is too
  large, too deep or not the type is counted in
  ``gpulet_bus_malformed_messages_total{type,reason}``, one whose claims do not hold
  (another node, duplicate GPUs, a far-future timestamp) in
  ``gpulet_bus_rejected_messages_total{type,reason}``; either is logged (rate-limited)
  and dropped: bad input is never fatal and changes no state. Backpressure comes from
  nats-py's bounded pending queue; a consumer that falls behind is reported by the
  server as a slow consumer and counted, rather than growing memory without bound.
* :meth:`Bus.request` / :meth:`Bus.serve` give typed request/reply. A request carries
  the trace context too, and its reply is decoded like a subscribed message (counted
  when malformed or rejected). Refusals follow the one convention of
  :mod:`gpulet_common.refusal` (nats.micro's error headers and an
  :class:`~gpulet_common.messages.ErrorReply` body), so a caller always gets a
  :class:`~gpulet_common.refusal.BusError` with a code instead of a timeout or a crash.
* JetStream helpers: streams with age/size limits and de-duplication, acknowledged
  publishes with a message id, and key-value buckets.
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue
from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import SpanKind

from gpulet_common import codec as codecs
from gpulet_common.codec import Codec
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.refusal import (
    MAX_ERROR_MESSAGE_CHARS,
    MICRO_ERROR_CODE_HEADER,
    MICRO_ERROR_HEADER,
    refusal,
)
from gpulet_common.refusal import BusError as BusError
from gpulet_common.refusal import NoResponders as NoResponders
from gpulet_common.refusal import Refused as Refused
from gpulet_common.refusal import RequestTimeout as RequestTimeout
from gpulet_common.settings.limits import LimitsSettings
from gpulet_common.settings.nats import NatsSettings

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger("gpulet.bus")

_tracer = trace.get_tracer("gpulet.bus")


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


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Exponential back-off with full jitter, never below ``base_s / 2``."""
    ceiling = min(max_s, base_s * (2 ** min(attempt, 30)))
    return max(base_s / 2, random.uniform(0, ceiling))


def tls_context(settings: NatsSettings) -> ssl.SSLContext | None:
    if not (settings.tls_ca_file or settings.tls_cert_file):
        return None
    ctx = ssl.create_default_context(cafile=settings.tls_ca_file or None)
    if settings.tls_cert_file:
        ctx.load_cert_chain(settings.tls_cert_file, settings.tls_key_file or None)
    return ctx


def _auth_options(settings: NatsSettings) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if settings.user:
        options["user"] = settings.user
        options["password"] = settings.password
    if settings.token:
        options["token"] = settings.token
    if settings.creds_file:
        options["user_credentials"] = settings.creds_file
    elif settings.nkey_seed_file:
        options["nkeys_seed"] = settings.nkey_seed_file
    tls = tls_context(settings)
    if tls is not None:
        options["tls"] = tls
    return options


def describe_servers(url: str) -> str:
    """Server URLs with any embedded credentials masked, for logs."""
    masked = []
    for server in url.split(","):
        scheme, sep, rest = server.strip().rpartition("://")
        if "@" in rest:
            rest = "***@" + rest.split("@", 1)[1]
        masked.append(f"{scheme}{sep}{rest}")
    return ",".join(masked)


class Bus:
    """A connected NATS client with typed helpers. Create with :meth:`connect`."""

    def __init__(
        self,
        nc: NatsClient,
        settings: NatsSettings,
        meter: metrics.Meter,
        limits: LimitsSettings | None = None,
    ) -> None:
        self._nc = nc
        self._settings = settings
        self.limits = limits or LimitsSettings()
        self._metrics = BusMetrics.create(meter)
        self._malformed_log = RateLimitedLog(log, per_minute=20)
        self._handler_log = RateLimitedLog(log, per_minute=10)
        self._js: JetStreamContext | None = None
        self._closing = False
        # Core NATS delivers at most once: what was published while this connection
        # was down (or before its subscriptions were back) is gone for it. Consumers
        # that keep state from a subject re-ask its owner after a reconnection
        # (see wait_reconnected); found by tests/faults/test_nats_outage.py.
        self.reconnects = 0
        self._reconnect_event = anyio.Event()
        self._disconnect_event = anyio.Event()

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
    ) -> AsyncIterator[Bus]:
        """Connect, retrying with back-off; drain and close on exit.

        ``max_initial_attempts=None`` keeps trying until cancelled: a sidecar may
        start before its NATS sidecar is listening.
        """
        meter = meter or metrics.get_meter("gpulet.bus")
        holder: list[Bus] = []

        # nats-py reports each message it drops for a slow consumer as its own error:
        # counted exactly (gpulet.bus.errors), logged at most once per 10 s per kind.
        error_logs: dict[str, RateLimitedLog] = {}

        async def on_error(exc: Exception) -> None:
            kind = type(exc).__name__
            if holder:
                holder[0]._metrics.errors.add(1, {"error": kind})
            limiter = error_logs.get(kind)
            if limiter is None:
                limiter = error_logs[kind] = RateLimitedLog(log, per_interval=1, interval_s=10.0)
            limiter.warning("nats: %s: %s", kind, exc)

        async def on_disconnect() -> None:
            if holder and holder[0]._closing:
                return
            if holder:
                holder[0]._disconnected()
            log.warning("nats: disconnected from %s", describe_servers(settings.url))

        async def on_reconnect() -> None:
            if holder:
                holder[0]._metrics.reconnects.add(1)
                holder[0]._reconnected()
            log.info("nats: reconnected")

        def choose_server(servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
            attempt = min((s.reconnects for s in servers), default=0)
            delay = backoff_delay(attempt, settings.reconnect_wait_s, settings.reconnect_max_wait_s)
            return None, delay

        servers = [s.strip() for s in settings.url.split(",") if s.strip()]
        if not servers:
            raise BusError("no NATS server URL configured (settings nats.url)")
        options = _auth_options(settings)
        attempt = 0
        while True:
            nc = NatsClient()
            try:
                await nc.connect(
                    servers=servers,
                    name=name or settings.name,
                    connect_timeout=settings.connect_timeout_s,  # type: ignore[arg-type]
                    # nats-py retries a failed *initial* connect forever when reconnects
                    # are unlimited; we want our own bounded, jittered loop there, so
                    # unlimited reconnects are switched on only once connected (below).
                    allow_reconnect=False,
                    max_reconnect_attempts=1,
                    reconnect_time_wait=settings.reconnect_wait_s,  # type: ignore[arg-type]
                    reconnect_to_server_handler=choose_server,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    drain_timeout=max(1, int(drain_timeout_s)),
                    # Every inbox of this client (request replies, JetStream API replies,
                    # pull and KV watch deliveries) starts with it: nats-py derives them
                    # all from the connection's prefix.
                    inbox_prefix=settings.inbox_prefix,
                    **options,
                )
                nc.options["allow_reconnect"] = True
                nc.options["max_reconnect_attempts"] = -1
                break
            except (OSError, nats.errors.Error, TimeoutError) as exc:
                attempt += 1
                if max_initial_attempts is not None and attempt >= max_initial_attempts:
                    raise BusError(
                        f"cannot connect to NATS at {describe_servers(settings.url)}: {exc}"
                    ) from exc
                delay = backoff_delay(
                    attempt, settings.reconnect_wait_s, settings.reconnect_max_wait_s
                )
                log.warning(
                    "nats: cannot connect to %s (%s); retrying in %.2fs",
                    describe_servers(settings.url),
                    exc or type(exc).__name__,
                    delay,
                )
                await anyio.sleep(delay)
        bus = cls(nc, settings, meter, limits)
        holder.append(bus)
        log.info(
            "nats: connected to %s",
            describe_servers(nc.connected_url.geturl() if nc.connected_url else ""),
        )
        try:
            yield bus
        finally:
            bus._closing = True
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(drain_timeout_s + 0.5),
                suppress(nats.errors.Error, OSError, TimeoutError),
            ):
                await nc.drain()
            if not nc.is_closed:
                # close() writes out what nats-py buffered while reconnecting: on a
                # connection the server dropped (the pod's NATS stopped first) that
                # raises ConnectionResetError. The client is closed all the same.
                with (
                    anyio.CancelScope(shield=True),
                    anyio.move_on_after(0.5),
                    suppress(nats.errors.Error, OSError, TimeoutError),
                ):
                    await nc.close()

    @property
    def client(self) -> NatsClient:
        """The underlying nats-py client, for APIs this layer does not wrap (nats.micro)."""
        return self._nc

    @property
    def is_connected(self) -> bool:
        return bool(self._nc.is_connected)

    def _reconnected(self) -> None:
        self.reconnects += 1
        event, self._reconnect_event = self._reconnect_event, anyio.Event()
        event.set()

    async def wait_reconnected(self) -> None:
        """Return at the next reconnection to NATS (its subscriptions are back then)."""
        await self._reconnect_event.wait()

    def _disconnected(self) -> None:
        event, self._disconnect_event = self._disconnect_event, anyio.Event()
        event.set()

    async def wait_disconnected(self) -> None:
        """Return at the next loss of the connection (nats-py is reconnecting then)."""
        await self._disconnect_event.wait()

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
        with _tracer.start_as_current_span(f"publish {subject}", kind=SpanKind.PRODUCER):
            carrier: dict[str, str] = dict(headers) if headers else {}
            propagate.inject(carrier)
            await self._nc.publish(subject, data, reply=reply, headers=carrier or None)
        self._metrics.published.add(1, {"type": codec.type.__name__})

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

    def decode_value(
        self, data: bytes, codec: Codec[T], *, subject: str, node: str | None = None
    ) -> T | None:
        """Decode and check one payload with this bus's limits and clock; count, log
        and drop it (return None) if it fails."""
        try:
            return codec.decode(
                data, limits=self.limits, subject=subject, node=node, now=time.time()
            )
        except Exception as exc:
            self.count_bad(subject, codec, exc, data)
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
        sub = await self._nc.subscribe(
            subject, queue=queue, pending_msgs_limit=self._settings.pending_msgs_limit
        )
        if self._nc.is_connected:
            with suppress(nats.errors.Error, TimeoutError, OSError):
                await self._nc.flush(timeout=self._settings.request_timeout_s)  # type: ignore[arg-type]
        try:
            yield self._iterate(sub, codec, node)
        finally:
            with anyio.CancelScope(shield=True):
                with suppress(nats.errors.Error, OSError):
                    await sub.unsubscribe()

    async def _iterate(
        self, sub: Subscription, codec: Codec[T], node: str | None
    ) -> AsyncIterator[Delivery[T]]:
        async for msg in sub.messages:
            delivery = self.decode(msg, codec, node=node)
            if delivery is not None:
                yield delivery

    # -- request / reply ---------------------------------------------------------

    async def request(
        self,
        subject: str,
        value: T,
        request_codec: Codec[T],
        reply_codec: Codec[R],
        *,
        timeout_s: float | None = None,
        node: str | None = None,
    ) -> R:
        """Send a request and decode the reply.

        Raises :class:`Refused` with the responder's code when it refuses,
        :class:`NoResponders` when nobody listens, :class:`RequestTimeout` when nobody
        answers in time or the connection cannot carry the request. The reply is
        checked like a subscribed message, against the request's subject (and
        ``node``): one that fails is counted and raises ``Refused("malformed_reply")``.
        """
        data = request_codec.encode(value)
        carrier: dict[str, str] = {}
        with _tracer.start_as_current_span(f"request {subject}", kind=SpanKind.CLIENT):
            propagate.inject(carrier)
            try:
                msg = await self._nc.request(
                    subject,
                    data,
                    timeout=timeout_s or self._settings.request_timeout_s,
                    headers=carrier or None,
                )
            except nats.errors.NoRespondersError as exc:
                raise NoResponders(f"no responder on {subject}") from exc
            except nats.errors.MaxPayloadError as exc:
                # The caller's error, never an outage (issue 23): refused as too large.
                raise Refused(
                    "invalid_request",
                    f"request too large: {len(data)} bytes for {subject}, more than the "
                    f"{self._nc.max_payload} one NATS message carries",
                ) from exc
            except nats.errors.TimeoutError as exc:
                raise RequestTimeout(f"no reply on {subject} in time") from exc
            except (
                nats.errors.ConnectionClosedError,
                nats.errors.ConnectionDrainingError,
                nats.errors.ConnectionReconnectingError,
                nats.errors.StaleConnectionError,
                nats.errors.OutboundBufferLimitError,
            ) as exc:
                # The connection is the bus's problem, not the caller's: every caller
                # already handles RequestTimeout (ask again later), so a lost connection
                # must not escape as an exception that would end its service.
                raise RequestTimeout(f"no reply on {subject}: {type(exc).__name__}") from exc
            except (nats.errors.Error, OSError) as exc:
                # Anything else the client refuses to send (a payload over the limit...).
                raise RequestTimeout(f"cannot ask {subject}: {type(exc).__name__}: {exc}") from exc
        headers = msg.headers or {}
        if MICRO_ERROR_CODE_HEADER in headers:
            error = self.decode_value(msg.data, codecs.ERROR_REPLY, subject=subject)
            if error is None:
                # nats.micro's own answer for a handler that raised, or a broken body.
                detail = headers.get(MICRO_ERROR_HEADER, "")[:MAX_ERROR_MESSAGE_CHARS]
                raise Refused("internal", detail or "the error reply did not decode")
            raise Refused(error.code, error.message)
        try:
            return reply_codec.decode(
                msg.data, limits=self.limits, subject=subject, node=node, now=time.time()
            )
        except Exception as exc:
            self.count_bad(subject, reply_codec, exc, msg.data)
            problem = f"{reply_codec.name}: {exc}"[:MAX_ERROR_MESSAGE_CHARS]
            raise Refused("malformed_reply", problem) from exc

    async def respond(self, delivery: Delivery[Any], value: R, codec: Codec[R]) -> None:
        if delivery.reply:
            await self._nc.publish(delivery.reply, codec.encode(value))

    async def respond_error(self, reply: str, code: str, message: str) -> None:
        if reply:
            body, headers = refusal(code, message)
            await self._nc.publish(reply, body, headers=headers)

    async def serve(
        self,
        subject: str,
        handler: Callable[[Delivery[T]], Awaitable[R]],
        request_codec: Codec[T],
        reply_codec: Codec[R],
        *,
        queue: str = "",
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Answer requests on ``subject`` until cancelled, one at a time.

        A malformed request is answered with ``malformed_request``; a handler raising
        :class:`Refused` is answered with its code. Any other handler failure
        is logged and answered with ``internal`` so the caller never waits in vain.
        """
        sub = await self._nc.subscribe(
            subject, queue=queue, pending_msgs_limit=self._settings.pending_msgs_limit
        )
        task_status.started()
        try:
            async for msg in sub.messages:
                await self._answer(msg, handler, request_codec, reply_codec)
        finally:
            with anyio.CancelScope(shield=True):
                with suppress(nats.errors.Error, OSError):
                    await sub.unsubscribe()

    async def _answer(
        self,
        msg: Msg,
        handler: Callable[[Delivery[T]], Awaitable[R]],
        request_codec: Codec[T],
        reply_codec: Codec[R],
    ) -> None:
        try:
            value = request_codec.decode(
                msg.data, limits=self.limits, subject=msg.subject, now=time.time()
            )
        except Exception as exc:
            self.count_bad(msg.subject, request_codec, exc, msg.data)
            await self.respond_error(msg.reply, "malformed_request", str(exc))
            return
        delivery = Delivery(msg.subject, value, dict(msg.headers or {}), msg.reply, msg)
        token = otel_context.attach(delivery.trace_context())
        try:
            with _tracer.start_as_current_span(f"serve {msg.subject}", kind=SpanKind.SERVER):
                result = await handler(delivery)
        except Refused as exc:
            await self.respond_error(msg.reply, exc.code, exc.message)
            return
        except Exception as exc:
            self._handler_log.exception("handler for %s failed", msg.subject[:200])
            await self.respond_error(msg.reply, "internal", f"{type(exc).__name__}: {exc}")
            return
        finally:
            otel_context.detach(token)
        if msg.reply:
            await self._nc.publish(msg.reply, reply_codec.encode(result))

    # -- JetStream ---------------------------------------------------------------

    @property
    def jetstream(self) -> JetStreamContext:
        if self._js is None:
            self._js = self._nc.jetstream()
        return self._js

    async def ensure_stream(
        self,
        name: str,
        subjects: list[str],
        *,
        max_age_s: float,
        max_bytes: int,
        duplicate_window_s: float = 120.0,
        storage: StorageType = StorageType.FILE,
    ) -> None:
        """Create the stream, or update its limits if it exists."""
        config = StreamConfig(
            name=name,
            subjects=subjects,
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            max_age=max_age_s,
            max_bytes=max_bytes,
            duplicate_window=min(duplicate_window_s, max_age_s)
            if max_age_s
            else duplicate_window_s,
            storage=storage,
        )
        try:
            await self.jetstream.add_stream(config)
        except nats.js.errors.BadRequestError:
            await self.jetstream.update_stream(config)

    async def js_publish(
        self,
        subject: str,
        value: T,
        codec: Codec[T],
        *,
        msg_id: str | None = None,
        timeout_s: float = 2.0,
    ) -> int:
        """Publish to JetStream and wait for the ack; returns the stream sequence.

        ``msg_id`` enables the server's de-duplication (``Nats-Msg-Id``).
        """
        carrier: dict[str, str] = {}
        with _tracer.start_as_current_span(f"publish {subject}", kind=SpanKind.PRODUCER):
            propagate.inject(carrier)
            if msg_id:
                carrier["Nats-Msg-Id"] = msg_id
            ack = await self.jetstream.publish(
                subject, codec.encode(value), timeout=timeout_s, headers=carrier or None
            )
        self._metrics.published.add(1, {"type": codec.type.__name__})
        return int(ack.seq)

    async def key_value(
        self, bucket: str, *, history: int = 1, ttl_s: float | None = None
    ) -> KeyValue:
        """The KV bucket, created if missing."""
        try:
            return await self.jetstream.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            return await self.jetstream.create_key_value(
                KeyValueConfig(bucket=bucket, history=history, ttl=ttl_s)
            )


def now() -> float:
    return time.time()


async def fetch_ready(
    subscription: JetStreamContext.PullSubscription, batch: int, wait_s: float
) -> list[Msg]:
    """Up to ``batch`` messages of a pull consumer, without holding any back.

    nats-py's ``fetch(n)`` keeps the first message until ``n`` arrived or its timeout
    passed, which adds up to the whole timeout to every message's latency when traffic
    is light. So: wait up to ``wait_s`` for one message, then take what else is already
    there (a short, no-wait fetch). Raises what ``fetch`` raises when nothing came.
    """
    first: list[Msg] = await subscription.fetch(1, timeout=wait_s)
    if batch <= 1:
        return first
    try:
        more: list[Msg] = await subscription.fetch(batch - 1, timeout=_READY_WAIT_S)
    except (nats.errors.TimeoutError, TimeoutError):
        more = []
    return first + more


# How long the second, "what is already there" fetch of fetch_ready may take; what
# arrives later stays queued in the subscription and is taken by the next fetch.
_READY_WAIT_S = 0.01
