"""Typed request/reply over the bus, with the one refusal convention.

A request carries the OpenTelemetry trace context in its headers, and its reply is
decoded like a subscribed message (counted when malformed or rejected). Refusals follow
the one convention of :mod:`gpulet_common.refusal` (nats.micro's error headers and an
:class:`~gpulet_common.messages.ErrorReply` body), so a caller always gets a
:class:`~gpulet_common.refusal.BusError` with a code instead of a timeout or a crash:
:meth:`RequestReply.request` turns what the server or the responder said into
:class:`~gpulet_common.refusal.Refused`, :class:`~gpulet_common.refusal.NoResponders`
or :class:`~gpulet_common.refusal.RequestTimeout`, and :meth:`RequestReply.serve`
answers a malformed request, a refusal and a handler's crash each with its code.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.abc
import nats.errors
from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from gpulet_common import codec as codecs
from gpulet_common.bus.decoding import BusBase, Delivery, tracer
from gpulet_common.codec import Codec
from gpulet_common.refusal import (
    MAX_ERROR_MESSAGE_CHARS,
    MICRO_ERROR_CODE_HEADER,
    MICRO_ERROR_HEADER,
    NoResponders,
    Refused,
    RequestTimeout,
    refusal,
)

T = TypeVar("T")
R = TypeVar("R")


class RequestReply(BusBase):
    """Request/reply: :meth:`request` asks, :meth:`serve` answers."""

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
        with tracer.start_as_current_span(f"request {subject}", kind=SpanKind.CLIENT):
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
            return self.decode_checked(msg.data, reply_codec, subject=subject, node=node)
        except Exception as exc:
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
        async with self._raw_subscription(subject, queue=queue) as sub:
            task_status.started()
            async for msg in sub.messages:
                await self._answer(msg, handler, request_codec, reply_codec)

    async def _answer(
        self,
        msg: Msg,
        handler: Callable[[Delivery[T]], Awaitable[R]],
        request_codec: Codec[T],
        reply_codec: Codec[R],
    ) -> None:
        try:
            value = self.decode_checked(msg.data, request_codec, subject=msg.subject)
        except Exception as exc:
            await self.respond_error(msg.reply, "malformed_request", str(exc))
            return
        delivery = Delivery(msg.subject, value, dict(msg.headers or {}), msg.reply, msg)
        token = otel_context.attach(delivery.trace_context())
        try:
            with tracer.start_as_current_span(f"serve {msg.subject}", kind=SpanKind.SERVER):
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
