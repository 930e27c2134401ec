"""The fleet breaker: remediation slots in a KV bucket on the hub's NATS, taken by
compare-and-set, so that at most N GPUs, or X % of the fleet's GPUs, are in
remediation at once across every node.

Why
---
Each node's breaker (:mod:`.breaker`) bounds what one node does. A driver bug, a bad
firmware push or a fabric event that trips every node at once would still let each node
evict and reset its share, and take the fleet down together. So a node takes a *slot*
before it evicts or resets a GPU, and gives it back when the GPU is back in service,
escalated, or its fault is gone.

How
---
One key, :data:`SLOTS_KEY`, in the bucket ``remediation.fleet.bucket`` (created if
missing): a JSON :class:`Slots` mapping ``<node>/<gpu>`` to the time it was taken
(the taker's clock; informative, and for the expiry). :meth:`FleetSlots.take` reads it
with its revision, drops slots older than ``slot_ttl_s`` (a node that died holding
one), and when the GPU fits under the limit writes it back with ``update(last=
revision)``; another node's write in between makes the server refuse, and it reads
again (bounded tries). The limit is ``min(max_gpus, max_percent % of the fleet's
GPUs)``, at least 1; the fleet's GPUs are the sum over the nodes' statuses in the
hub's ``gpulet_fleet`` bucket (docs/fleet.md), or ``max_gpus`` alone when none is
known. A value that does not decode is not trusted: it reads as full (fail closed)
until its slots expire or an operator deletes the key.

Without a hub (``remediation.fleet.enabled = false``, the default) the node breaker
alone applies.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Final

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, kv_keys
from gpulet_common.codec import Codec, MalformedMessage
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.runtime import Runtime
from gpulet_common.settings.nats import NatsSettings
from gpulet_common.settings.remediation import FleetBreakerSettings
from gpulet_common.validate import RejectedMessage

log = logging.getLogger("gpulet.allocator.remediation.fleet")
_bad_log = RateLimitedLog(log, per_minute=6)

SLOTS_KEY: Final = "slots"
_TRIES: Final = 8
_SHOWN: Final = 8


class Slots(msgspec.Struct, kw_only=True, omit_defaults=True):
    taken: dict[str, float] = {}


SLOTS = Codec(Slots)


class FleetSlots:
    def __init__(
        self,
        kv: KeyValue,
        node: str,
        *,
        max_gpus: int,
        max_percent: float,
        ttl_s: float,
        fleet_gpus: Callable[[], Awaitable[int]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._kv = kv
        self._node = subjects.token(node)
        self.max_gpus = max_gpus
        self.max_percent = max_percent
        self._ttl = ttl_s
        self._fleet_gpus = fleet_gpus
        self._clock = clock

    def key(self, gpu: str) -> str:
        return f"{self._node}/{gpu}"

    async def limit(self) -> int:
        try:
            fleet = await self._fleet_gpus()
        except (nats.errors.Error, OSError, TimeoutError):
            fleet = 0
        if fleet <= 0:
            return max(1, self.max_gpus)
        share = math.floor(self.max_percent / 100.0 * fleet + 1e-9)
        return max(1, min(self.max_gpus, share))

    async def _read(self) -> tuple[Slots | None, int]:
        """The slots and their revision (0: no key); None: a value not trusted."""
        try:
            entry = await self._kv.get(SLOTS_KEY)
        except nats.js.errors.KeyNotFoundError:
            return Slots(), 0
        revision = int(entry.revision or 0)
        if entry.value is None or entry.operation in ("DEL", "PURGE"):
            return Slots(), revision
        try:
            return SLOTS.decode(entry.value), revision
        except (MalformedMessage, RejectedMessage) as exc:
            _bad_log.error("fleet remediation slots unreadable (%s): counted as full", exc)
            return None, revision

    async def _write(self, slots: Slots, revision: int) -> bool:
        try:
            if revision == 0:
                await self._kv.create(SLOTS_KEY, SLOTS.encode(slots))
            else:
                await self._kv.update(SLOTS_KEY, SLOTS.encode(slots), last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            return False
        return True

    def _fresh(self, slots: Slots) -> dict[str, float]:
        now = self._clock()
        return {k: t for k, t in slots.taken.items() if now - t < self._ttl}

    async def take(self, gpu: str) -> str | None:
        """Take the GPU's slot: None when it is held (now or already), else why not."""
        key = self.key(gpu)
        for _ in range(_TRIES):
            slots, revision = await self._read()
            if slots is None:
                return "the fleet's remediation slots are unreadable: held back"
            taken = self._fresh(slots)
            if key in taken:
                return None
            limit = await self.limit()
            if len(taken) >= limit:
                shown = ", ".join(sorted(taken)[:_SHOWN])
                return (
                    f"fleet breaker full: {len(taken)} of at most {limit} GPU(s) of the "
                    f"fleet in remediation ({shown})"
                )
            taken[key] = self._clock()
            if await self._write(Slots(taken=taken), revision):
                log.info("fleet remediation slot taken for %s (%d/%d)", key, len(taken), limit)
                return None
        return "fleet breaker busy: another node wrote the slots each time; again later"

    async def give(self, gpu: str) -> bool:
        """Give the GPU's slot back; True when it is gone (or was never held)."""
        key = self.key(gpu)
        for _ in range(_TRIES):
            slots, revision = await self._read()
            if slots is None or key not in slots.taken:
                return True
            taken = {k: t for k, t in self._fresh(slots).items() if k != key}
            if await self._write(Slots(taken=taken), revision):
                log.info("fleet remediation slot given back for %s", key)
                return True
        return False

    async def held(self) -> list[str]:
        slots, _ = await self._read()
        return sorted(self._fresh(slots)) if slots is not None else []


class FleetGate:
    """The node's side of the fleet breaker: the slots it holds, the GPUs held back and
    why. ``needs(gpu)`` says whether a GPU being remediated needs a slot now (in mode
    reset, while its machine runs); without :attr:`slots_kv` every GPU passes."""

    def __init__(self, needs: Callable[[str], Awaitable[bool]]) -> None:
        self.slots_kv: FleetSlots | None = None
        self._needs = needs
        self._taken: set[str] = set()
        #: GPUs held back by the fleet breaker, and why.
        self.held: dict[str, str] = {}

    async def take(self, gpu: str) -> str | None:
        """None: the GPU may go on (slot held, or none needed); else why not, said
        once per holding back by the caller (the GPU is then in :attr:`held`)."""
        if self.slots_kv is None or gpu in self._taken or not await self._needs(gpu):
            return None
        why = await self.slots_kv.take(gpu)
        if why is None:
            self._taken.add(gpu)
            self.held.pop(gpu, None)
        return why

    async def give(self, faulty: set[str]) -> None:
        """Give back the slots of GPUs no longer remediated."""
        for gpu in list(self.held):
            if gpu not in faulty:
                del self.held[gpu]
        if self.slots_kv is None:
            return
        for gpu in sorted(self._taken):
            release = gpu not in faulty or not await self._needs(gpu)
            if release and await self.slots_kv.give(gpu):
                self._taken.discard(gpu)


@asynccontextmanager
async def fleet_bus(
    settings: FleetBreakerSettings, runtime: Runtime | None
) -> AsyncIterator[Bus | None]:
    """The NATS the slots live on: a connection of its own to ``nats_url``, or this
    node's; None when the fleet breaker is off (or there is no runtime)."""
    if not settings.enabled or runtime is None:
        yield None
        return
    if not settings.nats_url:
        yield runtime.bus
        return
    async with Bus.connect(NatsSettings(url=settings.nats_url), name="gpulet-fleet-breaker") as bus:
        yield bus


async def fleet_slots(bus: Bus, settings: FleetBreakerSettings, node: str) -> FleetSlots:
    kv = await bus.key_value(settings.bucket)

    async def fleet_gpus() -> int:
        """The fleet's GPUs: the sum over the nodes' statuses in gpulet_fleet (0 when
        the bucket is not there: not a hub)."""
        try:
            fleet = await bus.jetstream.key_value(subjects.FLEET_KV_BUCKET)
            keys = await kv_keys(bus.jetstream, subjects.FLEET_KV_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            return 0
        total = 0
        for key in keys:
            try:
                entry = await fleet.get(key)
                total += codec.NODE_STATUS.decode(entry.value or b"").gpus
            except (nats.js.errors.KeyNotFoundError, MalformedMessage, RejectedMessage):
                continue
        return total

    return FleetSlots(
        kv,
        node,
        max_gpus=settings.max_gpus,
        max_percent=settings.max_percent,
        ttl_s=settings.slot_ttl_s,
        fleet_gpus=fleet_gpus,
    )
