"""One read model of a node: its GPU inventory and every GPU's health state.

Why
---
The reporter, the allocator and the device plugin all need the same two facts: which
GPUs the node has, and whether each is healthy. They used to fold health *events*
each in its own way, each ordered by the sender's ``observed_at``, so one event dated
``1e18`` pinned a GPU's health in two consumers in two different ways. The health
service already keeps exactly the state they want, in the ``gpu_health`` KV bucket;
:class:`NodeView` reads it, and nothing else. Health events on ``gpu.health.*`` are
for alerting and history only: no consumer of this view reads them.

Sources and their order (never a sender's clock)
------------------------------------------------
* **Health**: a watch on the KV keys ``<node>.<gpu-uuid>`` (value a JSON
  :class:`~gpulet_common.messages.GpuHealth`). The watch first delivers every key's
  current value, then each change, in the order of the bucket's stream; an entry is
  applied only if its *revision*, assigned by the server, is newer than the one held
  for its GPU. Only the health service may write the bucket. A delete removes the GPU.
* **Inventory**: ``gpu.inventory.<node>``, and the collector's answer to
  ``gpulet.inventory.request.<node>``, ordered by the collector's own ``seq`` and
  ``boot_id`` (:mod:`gpulet_common.ordering`), never by ``published_at``.

One loop
--------
:meth:`NodeView.run` subscribes to the inventory first, then runs *sessions*. A
session asks the collector for its inventory (with back-off, until one arrives) and
opens the KV watch (with back-off, until the bucket exists). Every reconnection to
NATS ends the session and starts a new one: core NATS delivers at most once, and a
fresh watch re-reads every key, so a view that missed changes while it was cut off
converges on the health service's state as soon as it is back. So does every
``resync_s`` (5 minutes), whatever else may have gone wrong with a watch. The first
snapshot of a session replaces the health map whole (a GPU whose key vanished
meanwhile goes).

Reads are in memory and never wait (an Allocate never waits on NATS for health).
Listeners (:meth:`NodeView.listen`) are called synchronously, on the event loop,
after each change, with what changed; they read the view for the values.

A GPU the health service has not spoken of counts as healthy: without the health
service (disabled, not started yet), GPUs are still usable, as before.

Quarantine
----------
Remediation by reset (``remediation.mode = "reset"``) keeps each GPU's state machine
in the ``gpulet_heal`` KV bucket (:mod:`gpulet_common.heal`), keys
``<node>.machine.<gpu-uuid>``. The view watches them too (same sessions, same revision
rule) and, while a machine holds its GPU out of service, shows the GPU unhealthy with
the quarantine's condition (:func:`gpulet_common.heal.overlay`) in every read: the
device plugin says Unhealthy, the DRA slice taints it ``NoSchedule``, the node
condition names it, from the one record, at once. A machine record that does not
decode fails closed: the GPU reads quarantined ("not trusted").
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass

import anyio
import anyio.abc
import nats.errors
import nats.js.errors
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, BusError, Delivery
from gpulet_common.heal import HEAL_KV_BUCKET, HEAL_RECORD, HealRecord, machine_prefix, overlay
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import GpuHealth, Inventory, InventoryRequest
from gpulet_common.ordering import SenderOrder

log = logging.getLogger("gpulet.nodeview")

ASK_TIMEOUT_S = 1.0
ASK_MAX_DELAY_S = 30.0
# Opening the KV watch (bucket lookup and consumer creation) is given this long.
WATCH_OPEN_TIMEOUT_S = 5.0
# A fresh session (inventory asked, every key re-read) at least this often.
RESYNC_S = 300.0


@dataclass(frozen=True, slots=True)
class NodeChange:
    """What one update changed: the inventory, and/or the health of these GPUs."""

    inventory: bool = False
    gpus: frozenset[str] = frozenset()


Listener = Callable[[NodeChange], None]


class NodeView:
    def __init__(
        self,
        bus: Bus,
        node: str,
        *,
        retry_s: float = 2.0,
        who: str = "",
        resync_s: float = RESYNC_S,
    ) -> None:
        self._bus = bus
        self._resync_s = resync_s
        self._node = node
        self._retry_s = retry_s
        self._who = who or "node view"
        self._prefix = subjects.token(node) + "."
        self._listeners: list[Listener] = []
        self._order = SenderOrder()
        self._health: dict[str, GpuHealth] = {}
        self._revision: dict[str, int] = {}
        # Remediation machines (gpulet_heal), by GPU, and their KV revisions.
        self._heal: dict[str, HealRecord] = {}
        self._heal_revision: dict[str, int] = {}
        self._heal_prefix = machine_prefix(node)
        self._arrived = anyio.Event()
        self._bad = RateLimitedLog(log, per_minute=10)
        self._listener_log = RateLimitedLog(log, per_minute=10)
        #: The last inventory accepted (degraded ones included: consumers decide).
        self.inventory: Inventory | None = None
        self.inventory_seen = anyio.Event()
        #: Set once a KV snapshot was read: the health map is the service's state.
        self.health_seen = anyio.Event()
        #: Set once the gpulet_heal bucket was read (or found not to exist): the
        #: quarantines in every read are remediation's state, not "none known yet".
        self.heal_seen = anyio.Event()
        #: Sessions started (1 + reconnections and resyncs), for tests and status.
        self.sessions = 0

    # --- reads (in memory, never blocking) ------------------------------------------------

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def health(self, uuid: str) -> GpuHealth | None:
        return self._seen(uuid, self._health.get(uuid))

    def _seen(self, uuid: str, health: GpuHealth | None) -> GpuHealth | None:
        record = self._heal.get(uuid)
        return health if record is None else overlay(health, record)

    def last_reset(self, uuid: str) -> str:
        """The GPU's last verified reset by remediation ("<time> <cause>"), or ""."""
        record = self._heal.get(uuid)
        return record.last_reset if record is not None else ""

    def healths(self) -> Mapping[str, GpuHealth]:
        out = {u: self._seen(u, h) or h for u, h in self._health.items()}
        for uuid, record in self._heal.items():
            if uuid not in out:
                held = overlay(None, record)
                if held is not None:
                    out[uuid] = held
        return out

    def healthy(self, uuid: str) -> bool:
        """Healthy and present; a GPU the health service never named counts as healthy
        (unless a remediation machine holds it).

        A MIG device's UUID is unhealthy while its GPU lists it among its
        ``unhealthy_mig_devices`` (its GPU's own health is its GPU's)."""
        health = self.health(uuid)
        if health is None:
            return not any(uuid in h.unhealthy_mig_devices for h in self._health.values())
        return health.healthy and health.present

    def unhealthy(self) -> set[str]:
        """The unhealthy or absent GPUs, and the MIG devices marked on their own."""
        healths = self.healths()
        out = {u for u, h in healths.items() if not (h.healthy and h.present)}
        for h in healths.values():
            out.update(h.unhealthy_mig_devices)
        return out

    # --- the loop --------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with (
            self._bus.subscribe(
                subjects.inventory(self._node), codec.INVENTORY, node=self._node
            ) as inventories,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(self._follow_inventory, inventories)
            tg.start_soon(self._sessions)
            task_status.started()

    async def _sessions(self) -> None:
        while True:
            self.sessions += 1
            self._arrived = anyio.Event()
            async with anyio.create_task_group() as session:
                session.start_soon(self._ask_inventory)
                session.start_soon(self._watch_health)
                session.start_soon(self._watch_heal)
                # Core NATS delivered nothing while we were cut off: start afresh.
                with anyio.move_on_after(self._resync_s):
                    await self._bus.wait_reconnected()
                session.cancel_scope.cancel()
            log.debug("%s: reading the node's state again", self._who)

    # --- inventory -------------------------------------------------------------------------

    async def _follow_inventory(self, stream: AsyncIterator[Delivery[Inventory]]) -> None:
        async for delivery in stream:
            self._on_inventory(delivery.value)

    def _on_inventory(self, inventory: Inventory) -> None:
        self._arrived.set()
        if inventory.node != self._node:
            self._bad.warning(
                "%s: ignored an inventory of node %r (we are %r)",
                self._who,
                inventory.node,
                self._node,
            )
            return
        if not self._order.accept(inventory.boot_id, inventory.seq):
            return  # older than one already applied (or the same one again)
        self.inventory = inventory
        self.inventory_seen.set()
        self._notify(NodeChange(inventory=True))

    async def _ask_inventory(self) -> None:
        delay = self._retry_s
        while not self._arrived.is_set():
            try:
                inventory = await self._bus.request(
                    subjects.inventory_request(self._node),
                    InventoryRequest(reason=f"{self._who} start"),
                    codec.INVENTORY_REQUEST,
                    codec.INVENTORY,
                    timeout_s=ASK_TIMEOUT_S,
                )
            except BusError as exc:
                log.debug(
                    "%s: no inventory yet (%s); asking again in %.1f s", self._who, exc, delay
                )
            else:
                self._on_inventory(inventory)
                return
            with anyio.move_on_after(delay):
                await self._arrived.wait()
            delay = min(delay * 2, ASK_MAX_DELAY_S)

    # --- health ----------------------------------------------------------------------------

    async def _watch_health(self) -> None:
        delay = self._retry_s
        while True:
            try:
                with anyio.fail_after(WATCH_OPEN_TIMEOUT_S):
                    kv = await self._bus.jetstream.key_value(subjects.HEALTH_KV_BUCKET)
                    watcher = await kv.watch(f"{self._prefix}>")
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                log.debug(
                    "%s: cannot watch KV %s yet (%s); trying again in %.1f s",
                    self._who,
                    subjects.HEALTH_KV_BUCKET,
                    exc or type(exc).__name__,
                    delay,
                )
                await anyio.sleep(delay)
                delay = min(delay * 2, ASK_MAX_DELAY_S)
                continue
            delay = self._retry_s
            try:
                await self._follow_watch(watcher)
            finally:
                with (
                    anyio.CancelScope(shield=True),
                    anyio.move_on_after(1.0),
                    suppress(nats.errors.Error, OSError),
                ):
                    await watcher.stop()  # type: ignore[no-untyped-call]

    async def _follow_watch(self, watcher: KeyValue.KeyWatcher) -> None:
        snapshot: dict[str, tuple[int, GpuHealth]] | None = {}
        async for entry in watcher:
            if entry is None:  # the end of the current values
                if snapshot is not None:
                    self._replace(snapshot)
                    snapshot = None
                continue
            uuid = self._uuid_of(entry.key)
            if uuid is None:
                continue
            health = None
            if entry.operation not in (KV_DEL, KV_PURGE):
                health = self._decode(entry.key, uuid, entry.value or b"")
                if health is None:
                    continue
            revision = entry.revision or 0
            if snapshot is None:
                self._apply(uuid, revision, health)
            elif health is None:
                snapshot.pop(uuid, None)
            else:
                snapshot[uuid] = (revision, health)

    # --- remediation machines ----------------------------------------------------------------

    async def _watch_heal(self) -> None:
        """Like :meth:`_watch_health`, on ``gpulet_heal`` (absent until remediation by
        reset first runs on the node). Looked for again every ``retry_s``, without
        back-off: once the bucket exists a quarantine must show within that, not after
        a back-off grown while nobody used it (one bucket lookup per ``retry_s``)."""
        while True:
            try:
                with anyio.fail_after(WATCH_OPEN_TIMEOUT_S):
                    kv = await self._bus.jetstream.key_value(HEAL_KV_BUCKET)
                    watcher = await kv.watch(f"{self._heal_prefix}>")
            except nats.js.errors.BucketNotFoundError:
                self.heal_seen.set()  # no remediation machine has run on this node
                await anyio.sleep(self._retry_s)
                continue
            except (nats.errors.Error, OSError, TimeoutError):
                await anyio.sleep(self._retry_s)
                continue
            try:
                await self._follow_heal(watcher)
            finally:
                with (
                    anyio.CancelScope(shield=True),
                    anyio.move_on_after(1.0),
                    suppress(nats.errors.Error, OSError),
                ):
                    await watcher.stop()  # type: ignore[no-untyped-call]

    async def _follow_heal(self, watcher: KeyValue.KeyWatcher) -> None:
        snapshot: dict[str, tuple[int, HealRecord]] | None = {}
        async for entry in watcher:
            if entry is None:
                if snapshot is not None:
                    old = self._heal
                    self._heal = {u: r for u, (_, r) in snapshot.items()}
                    self._heal_revision = {u: rev for u, (rev, _) in snapshot.items()}
                    changed = {
                        u for u in old.keys() | self._heal.keys() if old.get(u) != self._heal.get(u)
                    }
                    snapshot = None
                    self.heal_seen.set()
                    if changed:
                        self._notify(NodeChange(gpus=frozenset(changed)))
                continue
            key = entry.key
            if not key.startswith(self._heal_prefix):
                continue
            try:
                uuid = subjects.untoken(key[len(self._heal_prefix) :])
            except (ValueError, UnicodeDecodeError):
                continue
            record = None
            if entry.operation not in (KV_DEL, KV_PURGE):
                record = self._decode_heal(key, uuid, entry.value or b"")
            revision = entry.revision or 0
            if snapshot is not None:
                if record is None:
                    snapshot.pop(uuid, None)
                else:
                    snapshot[uuid] = (revision, record)
            elif revision > self._heal_revision.get(uuid, 0):
                self._heal_revision[uuid] = revision
                if self._heal.get(uuid) != record:
                    if record is None:
                        self._heal.pop(uuid, None)
                    else:
                        self._heal[uuid] = record
                    self._notify(NodeChange(gpus=frozenset({uuid})))

    def _decode_heal(self, key: str, uuid: str, data: bytes) -> HealRecord:
        try:
            record = HEAL_RECORD.decode(data)
        except Exception as exc:  # total: fail closed, the GPU stays out
            self._bad.warning("%s: malformed remediation record %s: %s", self._who, key, exc)
            return HealRecord(gpu_uuid=uuid, state="escalated", detail="record not trusted")
        if record.gpu_uuid != uuid:
            self._bad.warning("%s: remediation record %s names another GPU", self._who, key)
            return HealRecord(gpu_uuid=uuid, state="escalated", detail="record not trusted")
        return record

    def _uuid_of(self, key: str) -> str | None:
        if not key.startswith(self._prefix):
            return None
        try:
            return subjects.untoken(key[len(self._prefix) :])
        except (ValueError, UnicodeDecodeError):
            self._bad.warning("%s: ignored KV key %r: not <node>.<gpu-uuid>", self._who, key)
            return None

    def _decode(self, key: str, uuid: str, data: bytes) -> GpuHealth | None:
        try:
            health = codec.GPU_HEALTH.decode(data)
        except Exception as exc:  # total: no value, however hostile, ends a consumer
            self._bad.warning("%s: ignored malformed KV value of %s: %s", self._who, key, exc)
            return None
        if health.gpu_uuid != uuid:
            self._bad.warning(
                "%s: ignored KV value of %s: it names GPU %r", self._who, key, health.gpu_uuid
            )
            return None
        return health

    def _replace(self, snapshot: Mapping[str, tuple[int, GpuHealth]]) -> None:
        new = {uuid: health for uuid, (_, health) in snapshot.items()}
        changed = {u for u in self._health.keys() | new.keys() if self._health.get(u) != new.get(u)}
        self._health = new
        self._revision = {uuid: revision for uuid, (revision, _) in snapshot.items()}
        self.health_seen.set()
        if changed:
            self._notify(NodeChange(gpus=frozenset(changed)))

    def _apply(self, uuid: str, revision: int, health: GpuHealth | None) -> None:
        """One live change (None: the key was deleted), if newer than what we hold."""
        if revision <= self._revision.get(uuid, 0):
            return
        self._revision[uuid] = revision
        if self._health.get(uuid) == health:
            return
        if health is None:
            del self._health[uuid]
        else:
            self._health[uuid] = health
        self._notify(NodeChange(gpus=frozenset({uuid})))

    def _notify(self, change: NodeChange) -> None:
        for listener in self._listeners:
            try:
                listener(change)
            except Exception:
                # A consumer's bug must not stop the view for the others.
                self._listener_log.exception("%s: a node view listener failed", self._who)
