"""A thin, typed layer over nats-py that fits anyio task groups.

This package is the one entry point: ``from gpulet_common.bus import Bus, ...``. The
:class:`Bus` is put together from one part per concern, each a module here:

* :mod:`.connection` -- initial connect and reconnect with exponential, jittered
  back-off; user/password, token, NKey seed, creds file and TLS; the reply inbox prefix
  (``nats.inbox_prefix``), so that a server can confine each user to its own replies;
  errors, disconnections and reconnections counted, logged (rate-limited) and turned
  into events; drain and close, bounded.
* :mod:`.decoding` -- the state every part shares and total decoding: every payload
  goes through :meth:`~gpulet_common.codec.Codec.decode` with the bus's ``[limits]``,
  the subject it came on, the consumer's node (when given) and this clock; one that is
  too large, too deep or not the type is counted in
  ``gpulet_bus_malformed_messages_total{type,reason}``, one whose claims do not hold
  (another node, duplicate GPUs, a far-future timestamp) in
  ``gpulet_bus_rejected_messages_total{type,reason}``; either is logged (rate-limited)
  and dropped: bad input is never fatal and changes no state. Backpressure comes from
  nats-py's bounded pending queue; a consumer that falls behind is reported by the
  server as a slow consumer and counted, rather than growing memory without bound.
* :mod:`.client` -- :class:`Bus` itself: connect, publish with the OpenTelemetry trace
  context in the NATS headers (W3C ``traceparent``), typed subscriptions.
* :mod:`.rpc` -- typed request/reply. Refusals follow the one convention of
  :mod:`gpulet_common.refusal` (nats.micro's error headers and an
  :class:`~gpulet_common.messages.ErrorReply` body), so a caller always gets a
  :class:`~gpulet_common.refusal.BusError` with a code instead of a timeout or a crash.
  The errors are :mod:`gpulet_common.refusal`'s, re-exported here for the bus's callers.
* :mod:`.jetstream` -- streams with age/size limits and de-duplication, acknowledged
  publishes with a message id, key-value buckets, and :func:`fetch_ready` for pull
  consumers.
"""

from gpulet_common.bus.client import Bus
from gpulet_common.bus.connection import backoff_delay, describe_servers
from gpulet_common.bus.decoding import Delivery
from gpulet_common.bus.jetstream import fetch_ready, kv_keys
from gpulet_common.refusal import BusError, NatsUnreachable, NoResponders, Refused, RequestTimeout

__all__ = [
    "Bus",
    "BusError",
    "Delivery",
    "NatsUnreachable",
    "NoResponders",
    "Refused",
    "RequestTimeout",
    "backoff_delay",
    "describe_servers",
    "fetch_ready",
    "kv_keys",
]
