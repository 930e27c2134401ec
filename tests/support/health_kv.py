"""Standing in for the health service's state: each GPU's ``GpuHealth`` in the
``gpu_health`` KV bucket, where :class:`~gpulet_common.nodeview.NodeView` reads it.

Consumers no longer read health events, so a test that wants the reporter, the
allocator or the device plugin to see a GPU fail writes the state the health service
would write, with the same key (``<node>.<gpu-uuid>``) and codec.
"""

from __future__ import annotations

import time
from typing import Any

from nats.js.kv import KeyValue

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.messages import ActiveCondition, GpuHealth


async def health_bucket(bus: Bus) -> KeyValue:
    """The bucket, created as the health service creates it."""
    return await bus.key_value(subjects.HEALTH_KV_BUCKET)


async def put_health(bus: Bus, node: str, health: GpuHealth) -> int:
    """Write one GPU's state; returns its KV revision."""
    kv = await health_bucket(bus)
    return await kv.put(
        subjects.health_kv_key(node, health.gpu_uuid), codec.GPU_HEALTH.encode(health)
    )


def gpu_health(
    uuid: str,
    *,
    healthy: bool,
    xid: int | None = 79,
    reason: str = "Xid79",
    message: str = "GPU has fallen off the bus",
    kind: Any = None,
    severity: Any = None,
    condition: str | None = None,
    since: float | None = None,
    present: bool = True,
    action: Any = "none",
    index: int | None = None,
) -> GpuHealth:
    """A GPU's state after one fault (``healthy`` False) or with none active.

    A warning (``severity="warning"``) on a healthy GPU is kept as an active
    condition, as the health service keeps it, and leaves the GPU healthy."""
    now = time.time()
    if healthy and severity != "warning":
        return GpuHealth(gpu_uuid=uuid, healthy=True, present=present, updated_at=now)
    active = ActiveCondition(
        condition=condition if condition is not None else (f"xid:{xid}" if xid else "fault"),
        kind=kind or "xid",
        severity=severity or "critical",
        reason=reason,
        message=message,
        action=action,
        since=since if since is not None else now,
    )
    return GpuHealth(
        gpu_uuid=uuid,
        gpu_index=index,
        healthy=healthy,
        present=present,
        conditions=[active],
        updated_at=now,
    )
