"""The allocation decisions the device plugin delegates, and how they can fail.

Why
---
The plugin only speaks kubelet's protocol; *which* GPU a container gets is decided by
the allocator service (topology-aware, with a checkpoint). The plugin asks through an
:class:`AllocationBackend` and never knows how it is reached: in production it is
:class:`~.nats_backend.NatsAllocationBackend`, a NATS request on the
:class:`~gpulet_common.bus.Bus` in the types of the allocator contract
(:mod:`gpulet_allocator.protocol`).

Failures are gpulet's one exception tree (:mod:`gpulet_common.refusal`), so the plugin
gives kubelet a precise gRPC status, looked up by code in the one table, instead of
an opaque ``UNKNOWN``:

- :class:`~gpulet_common.refusal.Refused`: the allocator answered "no" (bad request,
  not enough capacity, unhealthy GPU ...) or its answer was unusable;
- :class:`~gpulet_common.refusal.RequestTimeout`: no answer (timeout, no responders,
  connection lost); the plugin also raises it itself when the backend exceeds its
  deadline.
"""

from __future__ import annotations

from typing import Protocol

from gpulet_allocator.protocol import ContainerAllocation, PreferredRequest


class AllocationBackend(Protocol):
    """Makes the allocation decisions for the plugin's resources.

    Both calls get one entry per container, in order, and must answer one entry per
    container, in the same order. They may raise any
    :class:`~gpulet_common.refusal.BusError`; the plugin bounds them with its own
    deadline.
    """

    async def allocate(
        self, resource: str, container_requests: list[list[str]]
    ) -> list[ContainerAllocation]: ...

    async def preferred(
        self, resource: str, requests: list[PreferredRequest]
    ) -> list[list[str]]: ...
