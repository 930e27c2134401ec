"""JetStream helpers: streams with limits, acknowledged publishes, KV buckets, pulls.

* :meth:`JetStreamHelpers.ensure_stream` creates a stream with age and size limits and
  a de-duplication window, or updates the limits of one that exists.
* :meth:`JetStreamHelpers.js_publish` publishes with the trace context and, when given,
  a message id (the server drops a repeat within the window), and waits for the ack.
* :meth:`JetStreamHelpers.key_value` opens a key-value bucket, creating it if missing.
* :func:`fetch_ready` takes what a pull consumer has without holding the first message
  back for a full batch.
"""

from __future__ import annotations

from functools import cached_property
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from gpulet_common.bus.decoding import BusBase, tracer
from gpulet_common.codec import Codec

T = TypeVar("T")

# How long the second, "what is already there" fetch of fetch_ready may take; what
# arrives later stays queued in the subscription and is taken by the next fetch.
_READY_WAIT_S = 0.01


class JetStreamHelpers(BusBase):
    """The JetStream context of the bus's connection, and typed helpers over it."""

    @cached_property
    def jetstream(self) -> JetStreamContext:
        return self._nc.jetstream()

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
        with tracer.start_as_current_span(f"publish {subject}", kind=SpanKind.PRODUCER):
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


async def kv_keys(js: JetStreamContext, bucket: str, prefix: str = "") -> list[str]:
    """The keys of KV ``bucket`` that start with ``prefix`` (a whole token or more,
    ending in "." or empty), from the stream's own subject list.

    Not nats-py's ``KeyValue.keys()``: that opens an ordered consumer and ends its
    listing when the consumer's info shows nothing pending and its callback has not run
    yet, which, when the server has already pushed the entries but the client has not
    handled them (a loaded machine), reads as an empty bucket (``NoKeysError``). The
    health service read its previous state that way and, once in a CI run, would have
    started without it. The stream's info names every subject it holds, with no
    consumer and no race. A key whose last entry is a delete is still named: the
    caller's ``get`` raises ``KeyNotFoundError`` for it (nats-py maps a delete to it).
    """
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.{prefix}>")
    head = f"$KV.{bucket}."
    held = info.state.subjects or {}
    return sorted(s[len(head) :] for s in held if s.startswith(head))


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
