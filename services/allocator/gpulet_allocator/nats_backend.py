"""The device plugin's :class:`~.plugin.backend.AllocationBackend` over NATS.

Why
---
The plugin speaks kubelet's gRPC; the allocator decides. This forwards each call as
one NATS request to ``gpulet.allocator.<node>.<endpoint>`` (contract:
:mod:`.protocol`) and turns every outcome into what the plugin understands:

- no allocator listening (NATS answers "no responders" at once), no reply within
  ``timeout_s``, a lost connection, or an allocator that is up but has no inventory
  yet (``not_ready``): :class:`AllocatorUnavailable`, which the plugin reports as
  gRPC ``UNAVAILABLE`` -- kubelet gets a clear error, bounded in time, never a hang;
- a refusal: :class:`AllocationRejected` with the gRPC status its code belongs to and
  a message that starts with the code (``invalid_core_units: ...``), so the reason
  reaches ``kubectl describe pod`` verbatim;
- anything else (a 500, a reply that does not decode): :class:`AllocatorFailure`,
  which the plugin reports as ``INTERNAL``.
"""

from __future__ import annotations

from typing import Final, TypeVar

from nats.aio.client import Client as NatsClient

from gpulet_allocator import protocol as p
from gpulet_allocator.plugin.backend import (
    AllocationRejected,
    AllocatorUnavailable,
    ContainerAllocation,
    PreferredRequest,
    RejectCode,
)
from gpulet_common import subjects
from gpulet_common.bus import BusError, RemoteError
from gpulet_common.codec import Codec

Q = TypeVar("Q")
R = TypeVar("R")

REJECT_CODES: Final[dict[str, RejectCode]] = {
    "unknown_device": RejectCode.INVALID_ARGUMENT,
    "invalid_core_units": RejectCode.INVALID_ARGUMENT,
    "memory_exceeds_card": RejectCode.INVALID_ARGUMENT,
    "invalid_request": RejectCode.INVALID_ARGUMENT,
    "unknown_resource": RejectCode.INVALID_ARGUMENT,
    "malformed_request": RejectCode.INVALID_ARGUMENT,
    "too_many_units": RejectCode.RESOURCE_EXHAUSTED,
    "insufficient_capacity": RejectCode.RESOURCE_EXHAUSTED,
    "unhealthy_device": RejectCode.FAILED_PRECONDITION,
}
UNAVAILABLE_CODES: Final = frozenset({"not_ready"})


class AllocatorFailure(Exception):
    """The allocator failed in a way that is neither a refusal nor an absence."""


class NatsAllocationBackend:
    def __init__(self, nc: NatsClient, node: str, *, timeout_s: float) -> None:
        self._nc = nc
        self._node = node
        self._timeout_s = timeout_s

    async def allocate(
        self, resource: str, container_requests: list[list[str]]
    ) -> list[ContainerAllocation]:
        reply = await self._call(
            p.ENDPOINT_ALLOCATE,
            p.AllocateRequest(resource=resource, containers=container_requests),
            p.ALLOCATE_REQUEST,
            p.ALLOCATE_REPLY,
        )
        return reply.containers

    async def preferred(self, resource: str, requests: list[PreferredRequest]) -> list[list[str]]:
        reply = await self._call(
            p.ENDPOINT_PREFERRED,
            p.PreferredAllocationRequest(resource=resource, containers=requests),
            p.PREFERRED_REQUEST,
            p.PREFERRED_REPLY,
        )
        return reply.containers

    async def _call(self, endpoint: str, value: Q, request: Codec[Q], reply: Codec[R]) -> R:
        subject = subjects.allocator_endpoint(self._node, endpoint)
        try:
            return await p.request(
                self._nc, subject, value, request, reply, timeout_s=self._timeout_s
            )
        except RemoteError as exc:
            detail = f"{exc.code}: {exc.message}"
            if exc.code in UNAVAILABLE_CODES:
                raise AllocatorUnavailable(detail) from exc
            code = REJECT_CODES.get(exc.code)
            if code is None:
                raise AllocatorFailure(detail) from exc
            raise AllocationRejected(code, detail) from exc
        except BusError as exc:
            raise AllocatorUnavailable(str(exc)) from exc
