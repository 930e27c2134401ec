"""The device plugin's :class:`~.backend.AllocationBackend` over NATS.

Why
---
The plugin speaks kubelet's gRPC; the allocator decides. This forwards each call as
one request on the :class:`~gpulet_common.bus.Bus` to
``gpulet.allocator.<node>.<endpoint>`` (contract: :mod:`gpulet_allocator.protocol`),
so it carries the trace context and its reply is decoded totally and counted when
malformed. Every outcome is already in the one exception tree (:mod:`gpulet_common.refusal`), and
passes through untouched:

- no allocator listening (NATS answers "no responders" at once), no reply within
  ``timeout_s``, a lost connection: :class:`~gpulet_common.refusal.RequestTimeout`,
  which the plugin reports as gRPC ``UNAVAILABLE`` -- kubelet gets a clear error,
  bounded in time, never a hang;
- a refusal, or an answer that does not decode:
  :class:`~gpulet_common.refusal.Refused` with the allocator's code, whose gRPC status
  the plugin looks up in :data:`~gpulet_common.refusal.STATUS` (``not_ready``:
  ``UNAVAILABLE``, ``invalid_core_units``: ``INVALID_ARGUMENT``, a 500: ``INTERNAL``),
  with a message that starts with the code, so the reason reaches
  ``kubectl describe pod`` verbatim;
- a request too large for one NATS message (a 3 MB device ID): the bus refuses it,
  ``invalid_request`` ("request too large"), which kubelet gets as
  ``INVALID_ARGUMENT``. A caller's error never reads as an outage.

Coalescing
----------
Kubelet admits pods one at a time, but calls can still come in bursts (several
kubelet clients, tools, the 50-call waves of ``bench/allocate_roundtrip.py``). Sent one
by one, each costs a NATS message both ways, a nats.micro dispatch and a durability
wait in the allocator: under 50 concurrent calls that overhead, not the decision, was
most of the allocator's time. So while :meth:`NatsAllocationBackend.run` is running,
calls go through a bounded queue to one sender, which keeps one request out at a
time: when it is answered, the sender takes every call waiting (at most
:data:`MAX_BATCH`) and sends them as one ``allocate-batch``, or alone when only one
waits. A lone call therefore waits for nothing, and a burst forms batches by itself,
as large as the allocator is slow, but never larger than half a NATS message
(:meth:`~NatsAllocationBackend._batch_bytes`): a call that is larger goes alone, so
one oversized call is refused for itself, never for the calls beside it. (Measured
with 50 concurrent calls on 2 cores, allowing 4 requests out made smaller batches and
cost the plugin and the allocator 50-90 % more CPU per call.) The allocator decides
each call
on its own, so batching changes neither the answers nor the refusals. A batch
endpoint that nobody serves (an older allocator) makes the sender fall back to one
request per call. Without :meth:`~NatsAllocationBackend.run` (tests, tools), every
call is sent alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Final, TypeVar

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from gpulet_allocator import protocol as p
from gpulet_allocator.protocol import ContainerAllocation, PreferredRequest
from gpulet_common import subjects
from gpulet_common.bus import Bus, BusError, NoResponders, Refused, RequestTimeout
from gpulet_common.codec import Codec
from gpulet_common.logutil import RateLimitedLog

log = logging.getLogger("gpulet.device-plugin")
# Once per failed request (a bug, but one per request): rate-limited.
_unexpected_log = RateLimitedLog(log, per_minute=10)

Q = TypeVar("Q")
R = TypeVar("R")

# Calls per allocate-batch: a batch's answer (about 1 KB per container) must stay
# well under NATS's 1 MiB max_payload.
MAX_BATCH: Final = 32
# Calls with more containers than this go alone, for the same reason.
MAX_BATCH_CONTAINERS: Final = 8
# Calls waiting for the sender; more wait in their own send (backpressure).
QUEUE_SIZE: Final = 256
# After "no responders" on allocate-batch, how long calls go alone before it is tried again.
BATCH_RECHECK_S: Final = 30.0


@dataclass(eq=False, slots=True)
class _Queued:
    """One Allocate call waiting for the sender, and then for its outcome."""

    request: p.AllocateRequest
    # Its encoded size: a batch never grows past what one NATS message carries.
    size: int = 0
    done: anyio.Event = field(default_factory=anyio.Event)
    containers: list[ContainerAllocation] | None = None
    failure: BusError | None = None
    # Set when the caller gave up (its deadline) before the call was sent.
    abandoned: bool = False

    def resolve(self, containers: list[ContainerAllocation]) -> None:
        self.containers = containers
        self.done.set()

    def fail(self, failure: BusError) -> None:
        self.failure = failure
        self.done.set()


class NatsAllocationBackend:
    def __init__(self, bus: Bus, node: str, *, timeout_s: float) -> None:
        self._bus = bus
        self._node = node
        self._timeout_s = timeout_s
        self._queue: MemoryObjectSendStream[_Queued] | None = None
        # Until when allocate-batch is known to have no responder (then calls go alone).
        self._batch_unserved_until = float("-inf")

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Send queued Allocate calls, coalesced (see the module docstring), until cancelled."""
        send, receive = anyio.create_memory_object_stream[_Queued](QUEUE_SIZE)
        async with send, receive:
            self._queue = send
            try:
                task_status.started()
                await self._send_queued(receive)
            finally:
                self._queue = None
                # Nobody will send these any more: tell their callers now rather than
                # at their deadline.
                while True:
                    try:
                        receive.receive_nowait().fail(_stopping())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break

    async def allocate(
        self, resource: str, container_requests: list[list[str]]
    ) -> list[ContainerAllocation]:
        request = p.AllocateRequest(resource=resource, containers=container_requests)
        size = len(p.ALLOCATE_REQUEST.encode(request))
        if (
            self._queue is None
            or len(container_requests) > MAX_BATCH_CONTAINERS
            or size > self._batch_bytes()
        ):
            # Alone: a request too large for NATS is then refused for itself (the bus
            # says invalid_request), never for the calls it would have been sent with.
            return await self._allocate_alone(request)
        queued = _Queued(request, size)
        try:
            await self._queue.send(queued)
            await queued.done.wait()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise _stopping() from exc
        except BaseException:
            queued.abandoned = True
            raise
        if queued.failure is not None:
            raise queued.failure
        assert queued.containers is not None
        return queued.containers

    async def _send_queued(self, receive: MemoryObjectReceiveStream[_Queued]) -> None:
        async for first in receive:
            # The calls that came while the previous request was out go together.
            batch, size, limit = [first], first.size, self._batch_bytes()
            while len(batch) < MAX_BATCH:
                try:
                    queued = receive.receive_nowait()
                except anyio.WouldBlock:
                    break
                if size + queued.size > limit:
                    # Full: this one opens the next batch (sent after this one).
                    await self._send(batch)
                    batch, size = [], 0
                batch.append(queued)
                size += queued.size
            await self._send(batch)

    async def _send(self, batch: list[_Queued]) -> None:
        try:
            live = [q for q in batch if not q.abandoned]
            if len(live) > 1 and anyio.current_time() >= self._batch_unserved_until:
                await self._send_batch(live)
            else:
                await self._send_each(live)
        finally:
            # Only a cancellation (the plugin stopping) leaves a call unanswered here.
            for queued in batch:
                if not queued.done.is_set():
                    queued.fail(_stopping())

    def _batch_bytes(self) -> int:
        """What the calls of one allocate-batch may take: half a NATS message, the
        rest is room for the batch's own framing."""
        return self._bus.client.max_payload // 2

    async def _send_each(self, calls: list[_Queued]) -> None:
        async with anyio.create_task_group() as tg:
            for queued in calls:
                tg.start_soon(self._send_alone, queued)

    async def _send_alone(self, queued: _Queued) -> None:
        try:
            queued.resolve(await self._allocate_alone(queued.request))
        except Exception as exc:  # handed to the caller, never lost
            queued.fail(_as_bus_error(exc))

    async def _allocate_alone(self, request: p.AllocateRequest) -> list[ContainerAllocation]:
        reply = await self._call(p.ENDPOINT_ALLOCATE, request, p.ALLOCATE_REQUEST, p.ALLOCATE_REPLY)
        return reply.containers

    async def _send_batch(self, batch: list[_Queued]) -> None:
        try:
            reply = await self._call(
                p.ENDPOINT_ALLOCATE_BATCH,
                p.AllocateBatchRequest(calls=[q.request for q in batch]),
                p.ALLOCATE_BATCH_REQUEST,
                p.ALLOCATE_BATCH_REPLY,
            )
        except NoResponders:
            # Nobody serves allocate-batch (an older allocator), or no allocator at
            # all; the calls alone then say which.
            self._batch_unserved_until = anyio.current_time() + BATCH_RECHECK_S
            await self._send_each(batch)
            return
        except Exception as exc:  # handed to the callers, never lost
            failure = _as_bus_error(exc)
            for queued in batch:
                queued.fail(failure)
            return
        if len(reply.outcomes) != len(batch):
            failure = Refused(
                "malformed_reply",
                f"allocator answered {len(reply.outcomes)} outcomes for {len(batch)} calls",
            )
            for queued in batch:
                queued.fail(failure)
            return
        for queued, outcome in zip(batch, reply.outcomes, strict=True):
            if outcome.error is None:
                queued.resolve(outcome.containers)
            else:
                queued.fail(Refused(outcome.error.code, outcome.error.message))

    async def preferred(self, resource: str, requests: list[PreferredRequest]) -> list[list[str]]:
        reply = await self._call(
            p.ENDPOINT_PREFERRED,
            p.PreferredAllocationRequest(resource=resource, containers=requests),
            p.PREFERRED_REQUEST,
            p.PREFERRED_REPLY,
        )
        return reply.containers

    async def withheld(self, epoch: str, version: int, wait_s: float) -> p.WithheldReply:
        """The cards kubelet must not count as whole GPUs: a long poll of ``wait_s``."""
        return await self._call(
            p.ENDPOINT_WITHHELD,
            p.WithheldRequest(epoch=epoch, version=version, wait_s=wait_s),
            p.WITHHELD_REQUEST,
            p.WITHHELD_REPLY,
            timeout_s=wait_s + self._timeout_s,
        )

    async def _call(
        self,
        endpoint: str,
        value: Q,
        request: Codec[Q],
        reply: Codec[R],
        *,
        timeout_s: float | None = None,
    ) -> R:
        subject = subjects.allocator_endpoint(self._node, endpoint)
        return await self._bus.request(
            subject, value, request, reply, timeout_s=timeout_s or self._timeout_s
        )


def _stopping() -> RequestTimeout:
    # A new one each time: one raised by several callers would share a traceback.
    return RequestTimeout("the device plugin is stopping")


def _as_bus_error(exc: Exception) -> BusError:
    """``exc`` if it is one of the tree, else an ``internal`` refusal naming it (a bug)."""
    if isinstance(exc, BusError):
        return exc
    _unexpected_log.error("allocate over NATS failed unexpectedly: %s: %s", type(exc).__name__, exc)
    return Refused("internal", f"{type(exc).__name__}: {exc}")
