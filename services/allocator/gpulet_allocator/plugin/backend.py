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

import msgspec


class Mount(msgspec.Struct, frozen=True, kw_only=True):
    container_path: str
    host_path: str
    read_only: bool = False


class DeviceSpec(msgspec.Struct, frozen=True, kw_only=True):
    container_path: str
    host_path: str
    permissions: str = "rw"


class ContainerAllocation(msgspec.Struct, frozen=True, kw_only=True):
    """What one container gets; maps onto kubelet's ContainerAllocateResponse.

    ``gpus`` lists the UUIDs of the physical GPUs the allocator chose: the plugin turns
    them into ``/dev/nvidiaN`` plus control device specs itself, because only the node
    knows which device files exist. ``devices`` are extra specs; any of them under
    ``/dev`` that does not exist is dropped too.
    """

    gpus: list[str] = []
    envs: dict[str, str] = {}
    mounts: list[Mount] = []
    devices: list[DeviceSpec] = []
    annotations: dict[str, str] = {}
    # Fully qualified CDI names, e.g. "nvidia.com/gpu=GPU-...".
    cdi_devices: list[str] = []


class PreferredRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One container of a GetPreferredAllocation call."""

    available: list[str]
    must_include: list[str] = []
    size: int


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
