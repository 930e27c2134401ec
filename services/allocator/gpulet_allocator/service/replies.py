"""How the allocator's endpoints answer: decoded totally, counted, timed, bounded.

One :class:`Replies` per service: an endpoint's handler is a method made one by
:func:`handler_for`, which decodes the body totally; a malformed one is answered
``malformed_request`` and counted; every answer and refusal is counted by endpoint
(the ``data`` of each endpoint in nats.micro's ``$SRV.STATS``: ok, rejected,
malformed, codes) and in ``gpulet.allocator.requests{endpoint,outcome}`` with its
latency. A refusal is sent the one way (:func:`gpulet_common.refusal.refusal`:
bounded, one line in the header); the refusals of endpoints that fail a pod's
admission are logged as warnings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec
import nats.errors
from nats.micro.request import Request
from nats.micro.service import EndpointStats
from opentelemetry.metrics import Meter

from gpulet_allocator import protocol as p
from gpulet_common.codec import Codec
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.refusal import bounded, one_line, refusal
from gpulet_common.telemetry import REQUEST_LATENCY_BUCKETS_S

log = logging.getLogger("gpulet.allocator")
# Once per request: what a caller sends must not be able to flood the log.
_answer_log = RateLimitedLog(log, per_minute=10)
_refusal_log = RateLimitedLog(log, per_minute=60)

T = TypeVar("T")
S = TypeVar("S", bound="Answering")

# Endpoints whose refusals fail a pod's admission: logged as warnings.
_ALLOCATING = frozenset({p.ENDPOINT_ALLOCATE, p.ENDPOINT_ALLOCATE_BATCH})


@dataclass(slots=True)
class _Counts:
    ok: int = 0
    rejected: int = 0
    malformed: int = 0
    codes: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "rejected": self.rejected,
            "malformed": self.malformed,
            "codes": dict(self.codes),
        }


class Replies:
    def __init__(self, meter: Meter, max_payload: Callable[[], int]) -> None:
        # The server's max_payload, read when an answer is checked (it may change on
        # reconnection).
        self._max_payload = max_payload
        self._counts = {e: _Counts() for e in p.ENDPOINTS}
        self._requests = meter.create_counter(
            "gpulet.allocator.requests", description="Allocator requests by endpoint and outcome"
        )
        self._latency = meter.create_histogram(
            "gpulet.allocator.request_duration",
            unit="s",
            description="From receiving a request to sending its (durable) answer",
            explicit_bucket_boundaries_advisory=REQUEST_LATENCY_BUCKETS_S,
        )

    def stats_data(self, stats: EndpointStats) -> dict[str, Any]:
        counts = self._counts.get(stats.name)
        return counts.as_dict() if counts else {}

    async def decode(
        self, req: Request, endpoint: str, codec: Codec[T], started: float
    ) -> T | None:
        """The request body, or None once a malformed one has been answered."""
        try:
            return codec.decode(req.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            problem = f"{codec.type.__name__}: {exc}"
        await self.reject(req, endpoint, "malformed_request", problem, started)
        return None

    async def _send(self, req: Request, data: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            await req.respond(data, headers=headers)
        except ValueError:
            pass  # a publish, not a request: nobody to answer
        except (nats.errors.Error, OSError) as exc:
            _answer_log.warning("cannot answer on %s: %s", req.subject[:200], exc)

    async def ok(self, req: Request, endpoint: str, data: bytes, started: float) -> None:
        await self._send(req, data)
        self._counts[endpoint].ok += 1
        self._record(endpoint, "ok", started)

    def count_refusal(self, endpoint: str, code: str, message: str) -> None:
        """Count and log one refusal that is being sent."""
        counts = self._counts[endpoint]
        if code == "malformed_request":
            counts.malformed += 1
        else:
            counts.rejected += 1
        counts.codes[code] = counts.codes.get(code, 0) + 1
        (_refusal_log.warning if endpoint in _ALLOCATING else _refusal_log.info)(
            "%s refused: %s: %s",
            endpoint,
            code,
            one_line(bounded(message)),
        )

    async def reject(
        self, req: Request, endpoint: str, code: str, message: str, started: float
    ) -> None:
        self.count_refusal(endpoint, code, message)
        body, headers = refusal(code, message)
        await self._send(req, body, headers)
        self._record(endpoint, code, started)

    def _record(self, endpoint: str, outcome: str, started: float) -> None:
        attributes = {"endpoint": endpoint, "outcome": outcome}
        self._requests.add(1, attributes)
        self._latency.record(time.perf_counter() - started, {"endpoint": endpoint})

    def too_large(self, data: bytes, containers: int) -> str | None:
        """Why ``data`` cannot be sent as an answer, if it cannot.

        A request for thousands of containers (never kubelet's: 5,000 of one GPU do)
        got an answer larger than the server's max_payload: nats-py refused to send
        it, the caller timed out, and the allocation stayed. Refused instead (and, for
        allocate, undone).
        """
        limit = self._max_payload()
        if len(data) <= limit:
            return None
        return (
            f"the answer for {containers} containers would take {len(data)} bytes, more "
            f"than the {limit} NATS carries in one message: ask for fewer containers"
        )


class Answering(Protocol):
    """What serves endpoints: it answers through its :class:`Replies`."""

    @property
    def replies(self) -> Replies: ...


def handler_for(
    name: str, codec: Codec[T]
) -> Callable[
    [Callable[[S, Request, T, float], Awaitable[None]]], Callable[[S, Request], Awaitable[None]]
]:
    """Make a method ``(self, req, value, started)`` the nats.micro handler of the
    endpoint ``name``: it gets the body decoded totally by ``codec`` (a malformed one has
    been refused and counted) and the time the request came, which latency counts from."""

    def handler_of(
        method: Callable[[S, Request, T, float], Awaitable[None]],
    ) -> Callable[[S, Request], Awaitable[None]]:
        async def handler(self: S, req: Request) -> None:
            started = time.perf_counter()
            value = await self.replies.decode(req, name, codec, started)
            if value is not None:
                await method(self, req, value, started)

        return handler

    return handler_of
