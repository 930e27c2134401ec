"""The hub side of the fleet: its stream, its bucket and the fleet view (what
``gpulet fleet setup`` and ``gpulet fleet status`` run, cluster-side).

Design
------
* :func:`ensure_fleet_stream`: ``GPU_FLEET`` on the hub's JetStream, ``gpu.events.*``
  of every leaf node (each node's fleet relay, gpulet_health.fleet_relay, hands over
  its node's ``GPU_HEALTH`` events there and acks them locally only once this stream
  acked them; not the live ``gpu.health.*``, which a leaf carries at most once: an
  event published while the leaf link is down would never arrive), replicated
  (``fleet.replicas``, R3 on a 3-server cluster), with the limits of
  :class:`~gpulet_common.settings.fleet.FleetSettings`. Each event comes with
  ``Nats-Msg-Id = <node>:<event_id>`` (per node: subjects.event_msg_id), so the
  server drops a repeat within ``duplicate_window_s``: a re-send after a lost ack, a
  relay that restarted before acking its node's copy.
* :func:`ensure_fleet_bucket`: ``gpulet_fleet``, one key per node (its
  :class:`~gpulet_common.messages.NodeStatus`), written through the account's subject
  mapping ``gpu.fleet.* -> $KV.gpulet_fleet.*`` (gpulet_common.fleet.identity.fleet_mappings).
* :func:`read_fleet`: the latest status of every node with the time the *hub* stored
  it ("last heard": the server's clock, not the node's), newest status per key by
  stream sequence. A value that does not decode is reported as such, never fatal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.messages import NodeStatus
from gpulet_common.settings.fleet import FleetSettings


def fleet_stream_config(settings: FleetSettings) -> StreamConfig:
    return StreamConfig(
        name=subjects.FLEET_STREAM,
        description="gpulet: every node's health events (docs/fleet.md)",
        subjects=list(subjects.FLEET_STREAM_SUBJECTS),
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        storage=StorageType.FILE,
        num_replicas=settings.replicas,
        max_age=settings.stream_max_age_s,
        max_bytes=settings.stream_max_bytes,
        max_msgs=settings.stream_max_msgs,
        max_msg_size=settings.stream_max_msg_size,
        duplicate_window=min(settings.duplicate_window_s, settings.stream_max_age_s),
    )


async def ensure_fleet_stream(bus: Bus, settings: FleetSettings) -> None:
    """Create the fleet stream, or update its limits (replicas included)."""
    config = fleet_stream_config(settings)
    try:
        await bus.jetstream.add_stream(config)
    except nats.js.errors.BadRequestError:
        await bus.jetstream.update_stream(config)


async def ensure_fleet_bucket(bus: Bus, settings: FleetSettings) -> None:
    try:
        await bus.jetstream.key_value(subjects.FLEET_KV_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        await bus.jetstream.create_key_value(
            KeyValueConfig(
                bucket=subjects.FLEET_KV_BUCKET,
                description="gpulet: each node's status (docs/fleet.md)",
                history=1,
                replicas=settings.replicas,
                max_value_size=settings.stream_max_msg_size,
                storage=StorageType.FILE,
            )
        )


@dataclass(frozen=True)
class FleetNodeStatus:
    key: str
    node: str
    last_heard: float  # the hub's clock
    revision: int
    status: NodeStatus | None
    problem: str = ""

    def age(self, now: float) -> float:
        return max(0.0, now - self.last_heard)


async def read_fleet(bus: Bus, *, timeout_s: float = 5.0) -> list[FleetNodeStatus]:
    """The latest status of every node in the fleet bucket, sorted by node."""
    kv = await bus.jetstream.key_value(subjects.FLEET_KV_BUCKET)
    views: dict[str, FleetNodeStatus] = {}
    watcher = await kv.watchall(ignore_deletes=True)
    try:
        with anyio.fail_after(timeout_s):
            while True:
                try:
                    entry = await watcher.updates(timeout=timeout_s)  # type: ignore[no-untyped-call]
                except nats.errors.TimeoutError:
                    break
                if entry is None:
                    break
                heard = entry.created.timestamp() if entry.created is not None else 0.0
                node = subjects.untoken(entry.key)
                status: NodeStatus | None = None
                problem = ""
                try:
                    status = codec.NODE_STATUS.decode(entry.value or b"")
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    problem = f"undecodable status: {exc}"
                if status is not None and subjects.token(status.node) != entry.key:
                    # The mapping puts a node's status under its own key only; a value
                    # that names another node is not trusted.
                    problem = f"status names node {status.node!r}, stored under {entry.key!r}"
                    status = None
                previous = views.get(entry.key)
                if previous is None or (entry.revision or 0) > previous.revision:
                    views[entry.key] = FleetNodeStatus(
                        key=entry.key,
                        node=node,
                        last_heard=heard,
                        revision=entry.revision or 0,
                        status=status,
                        problem=problem,
                    )
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            await watcher.stop()  # type: ignore[no-untyped-call]
    return sorted(views.values(), key=lambda v: v.node)


def format_fleet(
    views: list[FleetNodeStatus], *, now: float | None = None, stale_after_s: float
) -> str:
    """The table ``gpulet fleet status`` prints."""
    now = time.time() if now is None else now
    lines = [f"{'NODE':<32} {'LAST HEARD':>10} {'GPUS':>4} {'UNHEALTHY':>9}  DETAILS"]
    for view in views:
        age = view.age(now)
        heard = f"{age:.0f}s ago"
        if age > stale_after_s:
            heard += "!"
        status = view.status
        if status is None:
            lines.append(f"{view.node:<32} {heard:>10} {'?':>4} {'?':>9}  {view.problem}")
            continue
        details = "; ".join(
            f"GPU {g.gpu_index if g.gpu_index is not None else '?'} {g.gpu_uuid}: "
            + ", ".join(c.condition for c in g.conditions)
            for g in status.unhealthy
        )
        lines.append(
            f"{view.node:<32} {heard:>10} {status.gpus:>4} {len(status.unhealthy):>9}  {details}"
        )
    stale = sum(1 for v in views if v.age(now) > stale_after_s)
    unhealthy = sum(len(v.status.unhealthy) for v in views if v.status is not None)
    lines.append(
        f"{len(views)} nodes, {unhealthy} unhealthy GPUs, "
        f"{stale} stale (not heard for {stale_after_s:g}s, marked !)"
    )
    return "\n".join(lines)
