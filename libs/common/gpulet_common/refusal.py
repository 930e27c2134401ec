"""One exception tree for a request that fails, one table for what each refusal means.

Design
------
Like httpx's exceptions: one base, :class:`BusError`, for every request that got no
answer the caller can use, and a ``code`` on every instance, so each boundary maps it
once, by that code, through :data:`STATUS`:

* :class:`Refused` -- the responder said no (``code`` for programs, ``message`` for
  people). The deciding code raises it (the allocator's engine and core, a
  :meth:`~gpulet_common.bus.Bus.serve` handler); the serving side sends it
  (:func:`refusal`); :meth:`~gpulet_common.bus.Bus.request` raises it again on the
  caller's side; the device plugin turns it into kubelet's gRPC status. It never
  changes form in between.
* :class:`RequestTimeout` -- nobody answered in time, or the connection could not
  carry the request (code ``unavailable``); :class:`NoResponders` when NATS said at
  once that nobody listens.

The wire
--------
nats.micro's convention, for every gpulet service: a refusal is an
:class:`~gpulet_common.messages.ErrorReply` body (the code and the message) with the
``Nats-Service-Error: <code>: <message>`` and ``Nats-Service-Error-Code: <status>``
headers, the status HTTP-like (400 the request, 409 the state, 503 not now, 500 a
bug), so the ``nats micro`` tooling understands gpulet's refusals too.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from gpulet_common import codec
from gpulet_common.messages import ErrorReply

MICRO_ERROR_HEADER: Final = "Nats-Service-Error"
MICRO_ERROR_CODE_HEADER: Final = "Nats-Service-Error-Code"
# A refusal may quote the request; bounded so a huge request cannot make a reply
# larger than the server's max payload (which closes the connection).
MAX_ERROR_MESSAGE_CHARS: Final = 1000


class BusError(Exception):
    """Base of every failed request; ``code`` says how it failed (see :data:`STATUS`)."""

    code: str = "unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NatsUnreachable(BusError):
    """No NATS server answered the first connection within its attempts."""


class Refused(BusError):
    """The responder refused the request: ``code`` for programs, ``message`` for people."""

    def __init__(self, code: str, message: str) -> None:
        Exception.__init__(self, f"{code}: {message}")
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"Refused({self.code!r}, {self.message!r})"


class RequestTimeout(BusError):
    """Nobody answered in time, or the connection could not carry the request."""


class NoResponders(RequestTimeout):
    """Nobody serves the subject (NATS answered "no responders" at once)."""


class Status(NamedTuple):
    """What a refusal code means on the wire (nats.micro) and to kubelet (gRPC)."""

    wire: int
    grpc: str


_REQUEST: Final = Status(400, "INVALID_ARGUMENT")
_FULL: Final = Status(409, "RESOURCE_EXHAUSTED")
_STATE: Final = Status(409, "FAILED_PRECONDITION")
_BUG: Final = Status(500, "INTERNAL")

# The one table of refusal codes. A code not listed (a newer responder's) is
# :data:`UNKNOWN`: the caller can say no more than that it failed.
STATUS: Final[dict[str, Status]] = {
    # -- the request is wrong (the allocator's engine, then its service) --
    # An ID the node does not know (never seen in the inventory).
    "unknown_device": _REQUEST,
    # Core units that are neither a share (1..99) nor whole cards (multiples of 100).
    "invalid_core_units": _REQUEST,
    # A share asking for more memory than the largest card has.
    "memory_exceeds_card": _REQUEST,
    # Anything else malformed: empty owner, zero sizes, a conflicting re-request.
    "invalid_request": _REQUEST,
    # The body did not decode or validate.
    "malformed_request": _REQUEST,
    # The resource name is not one this node serves.
    "unknown_resource": _REQUEST,
    # A GPU the health service does not know.
    "unknown_gpu": _REQUEST,
    # -- the node cannot take it now --
    # More units than the node has free or than one card holds.
    "too_many_units": _FULL,
    # A valid request that does not fit in what is free right now.
    "insufficient_capacity": _FULL,
    # A named device is unhealthy or lost.
    "unhealthy_device": _STATE,
    # A GPU with MIG enabled (only its MIG devices run containers), or with a pending
    # MIG mode change: never given whole nor shared (issue 27).
    "mig_enabled": _STATE,
    "mig_pending": _STATE,
    # A GPU given as time-slicing replicas is not given whole nor shared, and a GPU held
    # whole or shared gives no replica; a replica above the count in force is not
    # given (gpulet_allocator.timeslicing).
    "time_sliced": _STATE,
    # koord-scheduler's decision for the pod cannot be honoured (unhealthy, held or
    # unknown GPU, kubelet's IDs differ, the annotation is malformed); never answered
    # with another card instead.
    "scheduler_decision": _STATE,
    # The allocator chose a GPU this node's device plugin does not list.
    "inventory_mismatch": _STATE,
    # The record of allocations is lost (a corrupt checkpoint) and not rebuilt yet:
    # nothing is allocated until an operator accepts the loss (`allocator reset`).
    "checkpoint_lost": Status(503, "FAILED_PRECONDITION"),
    # No inventory yet (collector not heard from): nothing can be decided.
    "not_ready": Status(503, "UNAVAILABLE"),
    # -- no usable answer --
    # No answer in time, nobody listening, no connection (raised by the caller's side).
    "unavailable": Status(503, "UNAVAILABLE"),
    # The allocation could not be made durable; nothing was allocated.
    "checkpoint_failed": _BUG,
    # A bug: the responder failed unexpectedly.
    "internal": _BUG,
    # The answer did not decode, or does not answer the question (the caller's side).
    "malformed_reply": _BUG,
}
UNKNOWN: Final = Status(400, "INTERNAL")


def status_of(code: str) -> Status:
    return STATUS.get(code, UNKNOWN)


def bounded(message: str) -> str:
    """``message``, cut to :data:`MAX_ERROR_MESSAGE_CHARS` (saying how much was cut)."""
    if len(message) <= MAX_ERROR_MESSAGE_CHARS:
        return message
    more = len(message) - MAX_ERROR_MESSAGE_CHARS
    return f"{message[:MAX_ERROR_MESSAGE_CHARS]}... ({more} more characters)"


def one_line(text: str) -> str:
    """``text`` with every unprintable character (a newline...) a space: for a header or a log."""
    return text if text.isprintable() else "".join(c if c.isprintable() else " " for c in text)


def refusal(code: str, message: str) -> tuple[bytes, dict[str, str]]:
    """The body and headers that send the refusal ``code`` (see "The wire")."""
    message = bounded(message)
    headers = {
        MICRO_ERROR_HEADER: f"{code}: {one_line(message)}",
        MICRO_ERROR_CODE_HEADER: str(status_of(code).wire),
    }
    return codec.ERROR_REPLY.encode(ErrorReply(code=code, message=message)), headers
