"""The NVML event loop: waits for XID, ECC and GPU-unavailable events on a worker thread.

Design
------
``nvmlEventSetWait`` blocks its thread, so it runs on a dedicated worker thread (its
own capacity limiter, so it never takes a slot the collector's NVML calls need) with
a short timeout (``event_wait_timeout_ms``, default 200 ms). Between two waits the
thread checks a stop flag, which makes shutdown take at most one timeout; the async
side sets that flag from a ``finally`` when its task is cancelled, and awaits the
thread -- nothing is left running (no fire-and-forget).

The thread registers, per GPU, only the event types that GPU supports
(:meth:`NvmlAdapter.register_events` drops unsupported types, and the ECC types when
ECC is off); a GPU without event support registers nothing and is *not* unhealthy for
that. The set of GPUs to watch comes from the async side (:meth:`watch`); a change
makes the thread build a fresh event set.

Right after an XID event the thread reads the GPU's recovery action (NVML field 230,
R570+; :mod:`gpulet_health.recovery`) and posts it with the event
(``EventReceived.recovery``), once per GPU and batch; for a GPU whose last reading asked
for an action it reads the field again every ``device_poll_s`` (posted as an event of
no type), since the return to NONE comes with no event. The async side asks for those
readings too (:meth:`NvmlEventSource.ask_recovery`): for the GPUs a hold read back from
the KV bucket keeps out of service (the last reading is not kept across a restart, and
the XID that raised the hold will not come again).

Everything the thread learns is posted as a :data:`SourceItem` into a bounded memory
object stream; when the stream is full the thread waits (checking the stop flag), so
no event is dropped and memory stays bounded. Besides events it posts:

* :class:`LostSignal` -- the wait itself failed with GPU_IS_LOST (drivers without the
  GpuUnavailable event report a loss this way, without naming the GPU);
* :class:`CountChanged` -- the GPU count changed (checked every ``device_poll_s``):
  a removal or a hot-add, seen without waiting for the collector;
* :class:`NvmlChanged` -- NVML as a whole went away (a reason) / came back. While
  it is away the thread re-initialises it with back-off (NVML must be initialised
  again after the driver or library returns).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
from anyio.streams.memory import MemoryObjectSendStream

from gpulet_common.nvml.adapter import HEALTH_EVENT_MASK, NvmlAdapter, NvmlEvent
from gpulet_common.nvml.errors import GpuLostError, NvmlCallError, NvmlError, NvmlUnavailable
from gpulet_health import recovery

log = logging.getLogger("gpulet.health.events")

# Most events taken from NVML and handed to the event loop at once (see _drain).
DRAIN_BATCH = 256


# EventReceived.recovery when the field was not read with the event.
NOT_READ = -1


@dataclass(frozen=True, slots=True)
class EventReceived:
    event: NvmlEvent
    # The GPU's recovery action (NVML field 230) read right after an XID event: None
    # where the driver does not report it, NOT_READ when it was not read.
    recovery: int | None = NOT_READ


@dataclass(frozen=True, slots=True)
class LostSignal:
    index: int | None
    uuid: str | None
    detail: str
    timestamp: float


@dataclass(frozen=True, slots=True)
class CountChanged:
    count: int
    timestamp: float


@dataclass(frozen=True, slots=True)
class Registered:
    """Which event types each watched GPU (by index) was registered for."""

    masks: dict[int, int]
    # The watch generation (see NvmlEventSource.watch) this registration is for.
    generation: int


@dataclass(frozen=True, slots=True)
class NvmlChanged:
    # Why NVML went away; None: it came back.
    down_reason: str | None
    timestamp: float


SourceItem = EventReceived | LostSignal | CountChanged | Registered | NvmlChanged

_BACKOFF_MIN_S = 0.05
_LOST_PAUSE_S = 0.01
_BACKOFF_MAX_S = 5.0


class NvmlEventSource:
    def __init__(
        self,
        adapter: NvmlAdapter,
        *,
        timeout_ms: int,
        device_poll_s: float,
        wanted_mask: int = HEALTH_EVENT_MASK,
    ) -> None:
        self._adapter = adapter
        self._timeout_ms = timeout_ms
        self._poll_s = device_poll_s
        self._wanted = wanted_mask
        self._lock = threading.Lock()
        self._indexes: tuple[int, ...] = ()
        self._count: int | None = None
        self._generation = 0
        self._limiter = anyio.CapacityLimiter(1)
        # GPUs whose driver does not report the recovery action (field 230), and those
        # whose last reading asked for an action (read again every device_poll_s).
        self._no_recovery: set[int] = set()
        self._asking: dict[int, int] = {}
        # GPUs the async side asked to read again (under the lock).
        self._asked: set[int] = set()

    def watch(
        self, indexes: Sequence[int], count: int | None = None, *, force: bool = False
    ) -> int:
        """Watch these GPU indices from now on (thread-safe; re-registers if changed).

        Returns the watch generation; a :class:`Registered` item with that generation
        (or a later one) says the thread registered them. ``force`` registers again
        even if nothing changed: a GPU that was lost while being registered is back.

        ``count`` is the GPU count the caller's scan saw: the thread reports any other
        count it finds, even one that changed and changed back between two polls.
        """
        wanted = tuple(sorted(set(indexes)))
        with self._lock:
            if force or wanted != self._indexes or count != self._count:
                self._indexes = wanted
                self._count = count
                self._generation += 1
            return self._generation

    def ask_recovery(self, indexes: Iterable[int]) -> None:
        """Read the recovery action (field 230) of these GPUs on the next poll, and go on
        as for a reading from an XID (thread-safe): the GPUs a recovery hold keeps out of
        service, whose reading may end it with no event to prompt one."""
        with self._lock:
            self._asked.update(indexes)

    def _watched(self) -> tuple[int, tuple[int, ...], int | None]:
        with self._lock:
            return self._generation, self._indexes, self._count

    async def run(
        self,
        send: MemoryObjectSendStream[SourceItem],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the waiting thread until cancelled; returns once the thread has ended."""
        stop = threading.Event()
        # Set (from the thread) once the first registration was tried: whoever starts
        # the source knows that events from then on are seen.
        ready = anyio.Event()
        async with send, anyio.create_task_group() as tg:

            async def waiting_thread() -> None:
                try:
                    await anyio.to_thread.run_sync(
                        self._loop, stop, send, ready.set, limiter=self._limiter
                    )
                finally:
                    stop.set()
                    tg.cancel_scope.cancel()

            tg.start_soon(waiting_thread)
            await ready.wait()
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                # Cancelled: the thread sees this within one wait timeout and returns;
                # the task group then waits for it.
                stop.set()

    # --- the thread --------------------------------------------------------------------

    def _post(
        self, stop: threading.Event, send: MemoryObjectSendStream[SourceItem], item: SourceItem
    ) -> None:
        while not stop.is_set():
            try:
                anyio.from_thread.run_sync(send.send_nowait, item)
                return
            except anyio.WouldBlock:
                stop.wait(0.005)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.RunFinishedError):
                stop.set()
                return

    def _drain(
        self,
        stop: threading.Event,
        send: MemoryObjectSendStream[SourceItem],
        adapter: NvmlAdapter,
        event_set: Any,
        first: EventReceived,
    ) -> None:
        """Post ``first`` with the events already waiting behind it (no wait, at most
        :data:`DRAIN_BATCH`), in as few hand-overs to the event loop as the stream takes:
        in a storm one hand-over per event would cap the rate well below the driver's
        (the queue then overflows and drops a different, newer fault). A failing wait
        posts what it took first, then raises as before."""
        batch: list[SourceItem] = [first]
        try:
            while len(batch) < DRAIN_BATCH:
                more = adapter.wait_event(event_set, 0)
                if more is None:
                    break
                batch.append(EventReceived(more))
            batch = self._with_recovery(adapter, batch)
        finally:
            while batch and not stop.is_set():
                try:
                    sent = anyio.from_thread.run_sync(_send_some, send, batch)
                except (
                    anyio.BrokenResourceError,
                    anyio.ClosedResourceError,
                    anyio.RunFinishedError,
                ):
                    stop.set()
                    return
                del batch[:sent]
                if batch:
                    stop.wait(0.005)

    def _with_recovery(self, adapter: NvmlAdapter, batch: list[SourceItem]) -> list[SourceItem]:
        """The first XID event of each GPU in a batch carries the GPU's recovery action
        (field 230), read now: the driver changes it with a fault (and logs XID 154).
        Once per GPU and batch, so a storm costs one read a batch; not again for a GPU
        whose driver answered NOT_SUPPORTED (until NVML is initialised again)."""
        read: set[int] = set()
        out: list[SourceItem] = []
        for item in batch:
            index = item.event.gpu_index if isinstance(item, EventReceived) else None
            if (
                isinstance(item, EventReceived)
                and item.event.xid is not None
                and index is not None
                and index not in read
                and index not in self._no_recovery
            ):
                read.add(index)
                try:
                    value = recovery.read(adapter.module, index)
                except Exception as exc:  # a lost GPU, NVML going away: not read
                    log.debug("recovery action of GPU %s not read: %s", index, exc)
                else:
                    self._note_recovery(index, value)
                    item = EventReceived(item.event, value)
            out.append(item)
        return out

    def _note_recovery(self, index: int, value: int | None) -> None:
        if value is None:
            self._no_recovery.add(index)
        if value:
            self._asking[index] = value
        else:
            self._asking.pop(index, None)

    def _poll_recovery(self, adapter: NvmlAdapter, post: Callable[[SourceItem], None]) -> None:
        """Read field 230 again for GPUs whose driver asked for an action: the value going
        back to NONE (after the reset) comes with no event. A reading is posted as an
        EventReceived whose NVML event has no type (no family but the recovery rule
        looks at it). GPUs the async side asked for are read too."""
        with self._lock:
            asked, self._asked = self._asked, set()
        for index in asked - self._no_recovery:
            self._asking.setdefault(index, NOT_READ)
        for index in list(self._asking):
            try:
                value = recovery.read(adapter.module, index)
                uuid = adapter.uuid_of(index)
            except Exception as exc:  # lost, or NVML away: read on the next poll
                log.debug("recovery action of GPU %s not read: %s", index, exc)
                continue
            self._note_recovery(index, value)
            reading = NvmlEvent(
                gpu_index=index, gpu_uuid=uuid, event_type=0, event_data=0, timestamp=time.time()
            )
            post(EventReceived(reading, value))

    def _loop(
        self,
        stop: threading.Event,
        send: MemoryObjectSendStream[SourceItem],
        ready: Callable[[], None],
    ) -> None:
        adapter = self._adapter
        announced = False

        def announce() -> None:
            nonlocal announced
            if not announced:
                announced = True
                try:
                    anyio.from_thread.run_sync(ready)
                except anyio.RunFinishedError:
                    stop.set()

        post: Callable[[SourceItem], None] = lambda item: self._post(stop, send, item)  # noqa: E731
        event_set: Any = None
        registered_generation = -1
        last_count: int | None = None
        next_poll = 0.0
        down = False
        backoff = _BACKOFF_MIN_S
        try:
            while not stop.is_set():
                try:
                    if down:
                        adapter.init()
                    generation, indexes, expected = self._watched()
                    if event_set is None or generation != registered_generation:
                        if event_set is not None:
                            adapter.free_event_set(event_set)
                            event_set = None
                        event_set = adapter.create_event_set()
                        masks = self._register(adapter, event_set, indexes, post)
                        post(Registered(masks, generation))
                        registered_generation = generation
                        if expected is not None:
                            last_count = expected
                        announce()
                    now = time.monotonic()
                    if now >= next_poll:
                        next_poll = now + self._poll_s
                        count = adapter.device_count()
                        if count != last_count:
                            if last_count is not None:
                                post(CountChanged(count, time.time()))
                            last_count = count
                        self._poll_recovery(adapter, post)
                    if down:
                        down = False
                        self._no_recovery.clear()  # the driver may be another one now
                        log.info("NVML is back")
                        post(NvmlChanged(None, time.time()))
                    event = adapter.wait_event(event_set, self._timeout_ms)
                    backoff = _BACKOFF_MIN_S
                    if event is not None:
                        self._drain(stop, send, adapter, event_set, EventReceived(event))
                except GpuLostError as exc:
                    announce()
                    now_s = time.time()
                    attributed = True
                    if exc.index is None and exc.uuid is None:
                        # The wait failed without naming the GPU (drivers without the
                        # GpuUnavailable event): find it now, two NVML calls a GPU,
                        # rather than leave it to a full scan.
                        _, watched, expected = self._watched()
                        found = self._probe(adapter, watched, expected)
                        for index in found:
                            post(LostSignal(index, None, "nvmlEventSetWait: GPU_IS_LOST", now_s))
                        if not found:
                            attributed = False
                            post(LostSignal(None, None, str(exc), now_s))
                    else:
                        post(LostSignal(exc.index, exc.uuid, str(exc), now_s))
                    # The set may keep failing for the lost GPU: build a new one once
                    # the async side has taken the GPU off the watch list. A loss we
                    # could attribute is handled: only a moment for that, no back-off
                    # (events of the other GPUs must keep flowing). One we could not
                    # attribute backs off, so a set that keeps failing cannot spin.
                    registered_generation = -1
                    if attributed:
                        backoff = _BACKOFF_MIN_S
                        stop.wait(_LOST_PAUSE_S)
                    else:
                        stop.wait(backoff)
                        backoff = min(backoff * 2, _BACKOFF_MAX_S)
                except NvmlUnavailable as exc:
                    announce()
                    if not down:
                        log.warning("NVML unavailable: %s", exc.reason)
                        post(NvmlChanged(exc.reason, time.time()))
                    down = True
                    # Handles of a previous initialisation are void: never free them.
                    event_set = None
                    last_count = None
                    stop.wait(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                except NvmlError as exc:
                    announce()
                    log.warning("NVML event wait failed: %s", exc)
                    registered_generation = -1
                    stop.wait(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
        finally:
            if event_set is not None and not down:
                adapter.free_event_set(event_set)

    def _probe(
        self, adapter: NvmlAdapter, indexes: Sequence[int], expected: int | None
    ) -> list[int]:
        """The watched GPUs that are lost (by index); [] when that cannot be told."""
        try:
            if expected is None or adapter.device_count() != expected:
                return []  # indices may have shifted: leave it to a scan
        except NvmlError:
            return []
        lost: list[int] = []
        for index in indexes:
            adapter.invalidate(index)
            try:
                adapter.uuid_of(index)
            except GpuLostError:
                lost.append(index)
            except NvmlError:
                continue
        return lost

    def _register(
        self,
        adapter: NvmlAdapter,
        event_set: Any,
        indexes: Sequence[int],
        post: Callable[[SourceItem], None],
    ) -> dict[int, int]:
        masks: dict[int, int] = {}
        for index in indexes:
            try:
                masks[index] = adapter.register_events(event_set, index, self._wanted)
            except GpuLostError as exc:
                masks[index] = 0
                post(LostSignal(index, exc.uuid, str(exc), time.time()))
            except NvmlCallError as exc:
                masks[index] = 0
                log.warning("cannot register NVML events for GPU %d: %s", index, exc)
        return masks


def _send_some(send: MemoryObjectSendStream[SourceItem], items: Sequence[SourceItem]) -> int:
    """On the event loop: send what the stream takes now; how many were sent."""
    for n, item in enumerate(items):
        try:
            send.send_nowait(item)
        except anyio.WouldBlock:
            return n
    return len(items)
