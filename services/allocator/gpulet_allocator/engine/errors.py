"""The one exception type of the allocation engine.

Design
------
Every refusal of the engine is an :class:`AllocationError` with a stable machine code
and a message meant for the person reading ``kubectl describe pod``. The code is what
callers branch on (the device plugin maps it to a gRPC status, the NATS API to an
``ErrorReply``); the message names the request and the numbers that made it fail, so
nobody has to reproduce the allocator's state to understand a refusal.

The codes are a closed set (:data:`ErrorCode`): adding one is an API change.
"""

from __future__ import annotations

from typing import Literal, get_args

ErrorCode = Literal[
    # An ID the node does not know (never seen in the inventory).
    "unknown_device",
    # More units than the node has free or than one card holds.
    "too_many_units",
    # Core units that are neither a share (1..99) nor whole cards (multiples of 100).
    "invalid_core_units",
    # A share asking for more memory than the largest card has.
    "memory_exceeds_card",
    # A named device is unhealthy or lost.
    "unhealthy_device",
    # A valid request that does not fit in what is free right now.
    "insufficient_capacity",
    # Anything else malformed: empty owner, zero sizes, a conflicting re-request.
    "invalid_request",
]

ERROR_CODES: frozenset[str] = frozenset(get_args(ErrorCode))


class AllocationError(Exception):
    """A refused allocation: ``code`` for programs, ``message`` for people."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code: ErrorCode = code
        self.message = message

    def __repr__(self) -> str:
        return f"AllocationError({self.code!r}, {self.message!r})"
