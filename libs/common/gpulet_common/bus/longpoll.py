"""The client side of a versioned long poll (the allocator's ``withheld`` and ``held``).

The server answers a request naming the ``(epoch, version)`` the client holds when its
set changes, or with the same pair when the poll's time runs out. :func:`follow_versions`
is the one loop around that: ask with the pair last seen, hand every *new* reply to
``on_reply``, take a breath after an unchanged one (never a hot loop), and back off,
doubling from ``retry_s`` to ``retry_max_s``, while the bus fails. Without an answer
the caller's last known state stays; the loop runs until cancelled.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import anyio

from gpulet_common.refusal import BusError

# The pause after an unchanged reply (the poll's time ran out).
UNCHANGED_PAUSE_S = 0.05


class Versioned(Protocol):
    @property
    def epoch(self) -> str: ...

    @property
    def version(self) -> int: ...


R = TypeVar("R", bound=Versioned)


async def follow_versions(
    ask: Callable[[str, int], Awaitable[R]],
    on_reply: Callable[[R], None],
    *,
    retry_s: float,
    retry_max_s: float,
    what: str,
    log: logging.Logger,
) -> None:
    """Ask ``ask(epoch, version)`` again and again; ``on_reply`` gets each new reply."""
    epoch, version, delay = "", 0, retry_s
    while True:
        try:
            reply = await ask(epoch, version)
        except BusError as exc:
            log.debug("%s unknown (%s); asking again in %.1f s", what, exc, delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, retry_max_s)
            continue
        delay = retry_s
        if (reply.epoch, reply.version) == (epoch, version):
            await anyio.sleep(UNCHANGED_PAUSE_S)
            continue
        epoch, version = reply.epoch, reply.version
        on_reply(reply)
