"""Connection set-up and reconnection: options, credentials, TLS, back-off.

* :func:`open_client` connects, retrying with exponential, jittered back-off
  (:func:`backoff_delay`) until it succeeds, is cancelled, or has tried
  ``max_initial_attempts`` times (then :class:`NatsUnreachable`); a one-shot tool
  connects quietly (its failed attempts are not logged, only the one error it ends
  with), and a service that waits for its pod's NATS logs a ``hint`` (where the server
  should come from) with the first failed attempt. User/password, token, NKey seed,
  creds file and TLS (:func:`tls_context`) come from ``[nats]``, and so does the reply inbox prefix
  (``nats.inbox_prefix``), so that a server can confine each user to its own replies.
  Once connected, nats-py reconnects without limit, with the same back-off.
* :class:`ConnectionWatch` takes what nats-py reports about the connection: errors are
  counted exactly and logged at most once per 10 s per kind; disconnections and
  reconnections become events a consumer can wait on.
* :func:`close_client` drains and closes, bounded in time and shielded from
  cancellation, so a service's stop never hangs on a dead server.

Server URLs are logged through :func:`describe_servers`, which masks credentials.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Awaitable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import anyio
import nats.errors
from nats.aio.client import Client as NatsClient

from gpulet_common.logutil import RateLimitedLog
from gpulet_common.refusal import BusError, NatsUnreachable
from gpulet_common.settings.nats import NatsSettings

if TYPE_CHECKING:
    from gpulet_common.bus.decoding import BusMetrics

# The one logger of every part of the bus.
log = logging.getLogger("gpulet.bus")


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Exponential back-off with full jitter, never below ``base_s / 2``."""
    ceiling = min(max_s, base_s * (2 ** min(attempt, 30)))
    return max(base_s / 2, random.uniform(0, ceiling))


def reconnect_choice(servers: list[Any], settings: NatsSettings) -> tuple[Any, float]:
    """nats-py's reconnect handler: the server to try next, and the wait before.

    The least-tried server of the pool (``reconnects``: failed tries since it last
    connected), so a dead server is tried once and then passed over for the others.
    Naming none, as this did, makes nats-py take the first server of its pool on every
    try, and it shuffles the pool only once per disconnection: a client whose first
    server was the one that died tried only it until it came back (a cluster with one
    server down lost that server's clients for as long). The wait backs off only while
    every server fails.
    """
    if not servers:
        return None, settings.reconnect_wait_s
    attempt = min(s.reconnects for s in servers)
    chosen = next(s for s in servers if s.reconnects == attempt)
    delay = backoff_delay(attempt, settings.reconnect_wait_s, settings.reconnect_max_wait_s)
    return chosen, delay


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


class ConnectionWatch:
    """nats-py's connection callbacks: counted, logged (rate-limited), and turned into
    events to wait on.

    Core NATS delivers at most once: what was published while the connection was down
    (or before its subscriptions were back) is gone for it. Consumers that keep state
    from a subject re-ask its owner after a reconnection (:meth:`wait_reconnected`);
    found by tests/faults/test_nats_outage.py.
    """

    def __init__(self, url: str, *, quiet: bool = False) -> None:
        self._url = url
        # Until the first connection: errors are not logged (a tool says why it could
        # not connect once, with its own words).
        self.quiet = quiet
        # Set once the bus exists; errors before that (failed first attempts) are
        # logged only.
        self.metrics: BusMetrics | None = None
        self.closing = False
        self.reconnects = 0
        self._reconnect_event = anyio.Event()
        self._disconnect_event = anyio.Event()
        # nats-py reports each message it drops for a slow consumer as its own error:
        # counted exactly (gpulet.bus.errors), logged at most once per 10 s per kind.
        self._error_logs: dict[str, RateLimitedLog] = {}

    async def on_error(self, exc: Exception) -> None:
        kind = type(exc).__name__
        if self.metrics is not None:
            self.metrics.errors.add(1, {"error": kind})
        if self.quiet:
            log.debug("nats: %s: %s", kind, exc)
            return
        limiter = self._error_logs.get(kind)
        if limiter is None:
            limiter = self._error_logs[kind] = RateLimitedLog(log, per_interval=1, interval_s=10.0)
        limiter.warning("nats: %s: %s", kind, exc)

    async def on_disconnect(self) -> None:
        if self.closing:
            return
        event, self._disconnect_event = self._disconnect_event, anyio.Event()
        event.set()
        log.warning("nats: disconnected from %s", describe_servers(self._url))

    async def on_reconnect(self) -> None:
        if self.metrics is not None:
            self.metrics.reconnects.add(1)
        self.reconnects += 1
        event, self._reconnect_event = self._reconnect_event, anyio.Event()
        event.set()
        log.info("nats: reconnected")

    async def wait_reconnected(self) -> None:
        await self._reconnect_event.wait()

    async def wait_disconnected(self) -> None:
        await self._disconnect_event.wait()


async def open_client(
    settings: NatsSettings,
    watch: ConnectionWatch,
    *,
    name: str | None,
    max_initial_attempts: int | None,
    drain_timeout_s: float,
    hint: str | None = None,
) -> NatsClient:
    """A connected client, retrying with back-off (``max_initial_attempts=None``:
    until cancelled); raises :class:`NatsUnreachable` when the attempts are spent.
    ``watch.quiet``: failed attempts are logged at debug level only. ``hint`` ends the
    first failed attempt's warning."""

    def choose_server(servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
        return reconnect_choice(servers, settings)

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
                error_cb=watch.on_error,
                disconnected_cb=watch.on_disconnect,
                reconnected_cb=watch.on_reconnect,
                drain_timeout=max(1, int(drain_timeout_s)),
                # Every inbox of this client (request replies, JetStream API replies,
                # pull and KV watch deliveries) starts with it: nats-py derives them
                # all from the connection's prefix.
                inbox_prefix=settings.inbox_prefix,
                **options,
            )
            nc.options["allow_reconnect"] = True
            nc.options["max_reconnect_attempts"] = -1
            watch.quiet = False
            return nc
        except (OSError, nats.errors.Error, TimeoutError) as exc:
            attempt += 1
            if max_initial_attempts is not None and attempt >= max_initial_attempts:
                raise NatsUnreachable(
                    f"cannot connect to NATS at {describe_servers(settings.url)} "
                    f"({exc or type(exc).__name__})"
                ) from exc
            delay = backoff_delay(attempt, settings.reconnect_wait_s, settings.reconnect_max_wait_s)
            (log.debug if watch.quiet else log.warning)(
                "nats: cannot connect to %s (%s); retrying in %.2fs%s",
                describe_servers(settings.url),
                exc or type(exc).__name__,
                delay,
                f": {hint}" if hint and attempt == 1 else "",
            )
            await anyio.sleep(delay)


async def close_client(nc: NatsClient, drain_timeout_s: float) -> None:
    """Drain, then close if draining did not; bounded, shielded, never raises."""
    with (
        anyio.CancelScope(shield=True),
        anyio.move_on_after(drain_timeout_s + 0.5),
        suppress(nats.errors.Error, OSError, TimeoutError),
    ):
        await _foreign_cancel_ignored(nc.drain())
    if not nc.is_closed:
        # close() writes out what nats-py buffered while reconnecting: on a
        # connection the server dropped (the pod's NATS stopped first) that
        # raises ConnectionResetError. The client is closed all the same.
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(0.5),
            suppress(nats.errors.Error, OSError, TimeoutError),
        ):
            await _foreign_cancel_ignored(nc.close())


async def _foreign_cancel_ignored(step: Awaitable[None]) -> None:
    """Await one nats-py shutdown step; a CancelledError that nobody asked this task
    for is swallowed.

    nats-py cancels its own reader and flusher tasks while it closes, and when the
    server went away first (a pod's NATS sidecar stopping before the service) that
    cancellation can surface in the caller from ``StreamWriter.wait_closed``: it ended
    a sidecar's SIGTERM with exit status 1. Ours (the deadline above) is told apart by
    the task's pending cancel requests and goes on to end the step as before.
    """
    try:
        await step
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        log.debug("nats: a cancellation from inside nats-py while closing, ignored")
