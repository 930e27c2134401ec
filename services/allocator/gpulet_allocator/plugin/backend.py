"""The allocation decisions the device plugin delegates, and how they can fail.

Why
---
The plugin only speaks kubelet's protocol; *which* GPU a container gets is decided by
the allocator service (topology-aware, with a checkpoint), reached over NATS
request-reply. That forwarding is an :class:`AllocationBackend`; the plugin never
knows about NATS. The structs here are msgspec so the NATS forwarder can send them
as they are.

Failures are typed so the plugin can give kubelet a precise gRPC status instead of
an opaque ``UNKNOWN``:

- :class:`AllocationRejected`: the allocator answered "no" (bad request, not enough
  capacity, unhealthy GPU ...); its :class:`RejectCode` names the gRPC status.
- :class:`AllocatorUnavailable`: no answer (timeout, no responders, connection
  lost); the plugin also raises it itself when the backend exceeds its deadline.
"""

from __future__ import annotations

import enum
from typing import Protocol

from gpulet_allocator.protocol import ContainerAllocation, PreferredRequest


class RejectCode(enum.StrEnum):
    """Why the allocator said no; the value names the gRPC status kubelet sees."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"


class AllocationRejected(Exception):
    """The allocator refused the request; not worth retrying as it is."""

    def __init__(self, code: RejectCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class AllocatorUnavailable(Exception):
    """The allocator could not be asked or did not answer in time."""


class AllocationBackend(Protocol):
    """Makes the allocation decisions for the plugin's resources.

    Both calls get one entry per container, in order, and must answer one entry per
    container, in the same order. They may raise :class:`AllocationRejected` or
    :class:`AllocatorUnavailable`; the plugin bounds them with its own deadline.
    """

    async def allocate(
        self, resource: str, container_requests: list[list[str]]
    ) -> list[ContainerAllocation]: ...

    async def preferred(
        self, resource: str, requests: list[PreferredRequest]
    ) -> list[list[str]]: ...
