"""OpenTelemetry set-up and the HTTP endpoints ``/metrics``, ``/healthz`` and ``/readyz``.

Metrics are recorded through the OpenTelemetry API, except those that must keep a
foreign exact name (dcgm-exporter's ``DCGM_FI_*``): their text is appended through
:func:`add_exposition`. The process-wide
:class:`Telemetry` installs a MeterProvider whose Prometheus reader feeds the
``prometheus_client`` registry that ``/metrics`` renders, and an OTLP/HTTP exporter
when an endpoint is configured. Components receive a ``Meter`` rather than reaching for
a global, so tests can hand them one backed by an in-memory reader; they declare their
counters as one table each (:func:`create_counters`).

``/healthz`` answers 200 while the event loop serves requests and no component has
*failed* (liveness; a failed component is one that will not come back, such as an
embedded nats-server whose restarts were used up, and the process exits right after).
``/readyz`` answers 200 once every component reported ready (a *degraded* component,
e.g. NVML missing, counts as ready: it is running and saying why), and 503 otherwise,
e.g. while the embedded nats-server is being restarted or the NATS connection is
re-established; both bodies are JSON with each component's state and detail, so an
operator sees *why*. A
*blocked* component runs but refuses its work until something (often an operator)
acts, e.g. the allocator after a corrupt checkpoint: not ready.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import anyio
import anyio.abc
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from gpulet_common.errors import UsageError
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.settings.telemetry import TelemetrySettings

log = logging.getLogger("gpulet.telemetry")
# Once per scrape while a renderer is broken: rate-limited.
_exposition_log = RateLimitedLog(log, per_minute=2)

ComponentState = Literal[
    "starting", "ready", "degraded", "blocked", "stopping", "stopped", "failed"
]

# Bucket boundaries (seconds) for request latencies of a millisecond to seconds: OTel's
# default buckets are made for milliseconds and would put every such request in the first.
REQUEST_LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


def create_counters(meter: metrics.Meter, *table: tuple[str, str]) -> list[metrics.Counter]:
    """A component's counters from one table of ``(name, description)`` rows, in order.

    The one way a component declares its counters: each name beside what it counts,
    instead of a ``create_counter`` call (and its keyword) per counter.
    """
    return [meter.create_counter(name, description=description) for name, description in table]


# Log records a minute for changes of one component's detail alone (see StatusBoard).
DETAIL_LOGS_PER_MINUTE = 6


@dataclass(slots=True)
class ComponentStatus:
    state: ComponentState
    detail: str = ""


class StatusBoard:
    """What each component of the process is doing, for ``/readyz`` and the logs.

    Every change of a component's state is logged. A change of its detail alone (the
    allocator's line counts its allocations, so it changes with every Allocate) is
    logged at most :data:`DETAIL_LOGS_PER_MINUTE` times a minute per component: the
    log follows the state without repeating every request; ``/readyz`` always has the
    latest detail.
    """

    def __init__(self) -> None:
        self._components: dict[str, ComponentStatus] = {}
        self._lock = threading.Lock()
        self._detail_logs: dict[str, RateLimitedLog] = {}

    def set(self, name: str, state: ComponentState, detail: str = "") -> None:
        with self._lock:
            previous = self._components.get(name)
            self._components[name] = ComponentStatus(state, detail)
            if previous is not None and previous.state == state:
                if previous.detail == detail:
                    return
                limited = self._detail_logs.get(name)
                if limited is None:
                    limited = RateLimitedLog(log, DETAIL_LOGS_PER_MINUTE)
                    self._detail_logs[name] = limited
            else:
                limited = None
        args = (name, state, f" ({detail})" if detail else "")
        if state in ("degraded", "blocked", "failed"):
            (limited or log).warning("%s: %s%s", *args)
        else:
            (limited or log).info("%s: %s%s", *args)

    def get(self, name: str) -> ComponentStatus | None:
        with self._lock:
            return self._components.get(name)

    def snapshot(self) -> dict[str, dict[str, str]]:
        with self._lock:
            return {n: {"state": s.state, "detail": s.detail} for n, s in self._components.items()}

    @property
    def live(self) -> bool:
        with self._lock:
            return all(s.state != "failed" for s in self._components.values())

    @property
    def ready(self) -> bool:
        with self._lock:
            return bool(self._components) and all(
                s.state in ("ready", "degraded") for s in self._components.values()
            )


class Telemetry:
    """Process-wide providers. Create once per process with :meth:`install`."""

    _installed: Telemetry | None = None

    def __init__(self, meter_provider: MeterProvider, tracer_provider: TracerProvider) -> None:
        self.meter_provider = meter_provider
        self.tracer_provider = tracer_provider

    @classmethod
    def install(cls, settings: TelemetrySettings, service_name: str) -> Telemetry:
        if cls._installed is not None:
            return cls._installed
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        resource = Resource.create({"service.name": service_name, "service.namespace": "gpulet"})
        readers: list[MetricReader] = [PrometheusMetricReader()]
        tracer_provider = TracerProvider(resource=resource)
        if settings.otlp_endpoint:
            try:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                    OTLPMetricExporter,
                )
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError:
                log.warning("OTLP endpoint set but gpulet[otlp] is not installed; skipping")
            else:
                base = settings.otlp_endpoint.rstrip("/")
                readers.append(
                    PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{base}/v1/metrics"))
                )
                tracer_provider.add_span_processor(
                    BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{base}/v1/traces"))
                )
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        metrics.set_meter_provider(meter_provider)
        trace.set_tracer_provider(tracer_provider)
        cls._installed = cls(meter_provider, tracer_provider)
        return cls._installed

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


# Extra exposition text appended to /metrics by components that must name their
# metrics exactly (the collector's dcgm-exporter names, which neither OpenTelemetry's
# exporter nor prometheus_client's counters would leave unchanged).
_expositions: list[Callable[[], bytes]] = []
_expositions_lock = threading.Lock()


def add_exposition(render: Callable[[], bytes]) -> None:
    """Append ``render()``'s Prometheus text to every /metrics answer."""
    with _expositions_lock:
        _expositions.append(render)


def remove_exposition(render: Callable[[], bytes]) -> None:
    with _expositions_lock:
        if render in _expositions:
            _expositions.remove(render)


def render_metrics() -> bytes:
    from prometheus_client import REGISTRY, generate_latest

    with _expositions_lock:
        extra = list(_expositions)
    body = generate_latest(REGISTRY)
    for render in extra:
        try:
            body += render()
        except Exception:  # one broken renderer must not take /metrics down
            _exposition_log.exception("a metrics exposition failed")
    return body


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


def _http_response(status: int, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


async def _handle(stream: anyio.abc.SocketStream, status: StatusBoard) -> None:
    async with stream:
        request = b""
        with anyio.move_on_after(5):
            while b"\r\n\r\n" not in request and len(request) < 8192:
                try:
                    chunk = await stream.receive(4096)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
                request += chunk
        line = request.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) < 2:
            return
        method, path = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            reply = _http_response(405, b"method not allowed\n", "text/plain")
        elif path == "/metrics":
            body = await anyio.to_thread.run_sync(render_metrics)
            reply = _http_response(200, body, "text/plain; version=0.0.4; charset=utf-8")
        elif path in ("/healthz", "/livez"):
            live = status.live
            body = json.dumps(
                {"status": "ok" if live else "failing", "components": status.snapshot()}
            ).encode()
            reply = _http_response(200 if live else 503, body, "application/json")
        elif path == "/readyz":
            ready = status.ready
            body = json.dumps({"ready": ready, "components": status.snapshot()}).encode()
            reply = _http_response(200 if ready else 503, body, "application/json")
        else:
            reply = _http_response(404, b"not found\n", "text/plain")
        if method == "HEAD":
            reply = reply.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await stream.send(reply)


async def serve_http(
    host: str,
    port: int,
    status: StatusBoard,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the endpoints until cancelled; reports the bound port to ``task_status``."""
    try:
        listener = await anyio.create_tcp_listener(
            local_host=host, local_port=port, reuse_port=False
        )
    except OSError as exc:
        raise UsageError(
            f"cannot serve /metrics, /healthz and /readyz on {host}:{port} "
            f"(telemetry.http_port): {exc.strerror or exc}"
        ) from None
    async with listener:
        bound = int(listener.extra(anyio.abc.SocketAttribute.local_port))
        log.info("metrics and health endpoints on http://%s:%d", host, bound)
        task_status.started(bound)

        async def handle(stream: anyio.abc.SocketStream) -> None:
            await _handle(stream, status)

        await listener.serve(handle)
