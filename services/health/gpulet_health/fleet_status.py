"""The node's status for the hub's fleet view (``gpu.fleet.<node>``).

Design
------
One task, started by the health service, looks at the rule engine's state every
``fleet.status_min_interval_s`` and publishes a
:class:`~gpulet_common.messages.NodeStatus` (the GPU count and the unhealthy GPUs with
their conditions) when the unhealthy set changed, or when ``fleet.status_heartbeat_s``
passed without one. So a node sends at most one status per interval however many
faults a storm brings, and the hub hears from a quiet node at the heartbeat. The
subject crosses the node's leaf connection; on the hub, the account maps it onto the
node's own key of the ``gpulet_fleet`` bucket (docs/fleet.md).

A plain publish, not a JetStream one: the node has no JetStream API on the hub (its
leaf user may publish ``gpu.*.<node>`` only). A status lost on the way is replaced by
the next one; ``seq`` (per ``boot_id``) lets a reader tell newer from older.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import anyio
import anyio.abc
import nats.errors

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.lifecycle import repeat_every
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import HealthState, NodeStatus
from gpulet_common.settings.fleet import FleetSettings

log = logging.getLogger("gpulet.health.fleet")


def summarise(node: str, state: HealthState, *, boot_id: str, seq: int, now: float) -> NodeStatus:
    return NodeStatus(
        node=node,
        boot_id=boot_id,
        seq=seq,
        gpus=sum(1 for g in state.gpus if g.present),
        unhealthy=[g for g in state.gpus if not g.healthy],
        published_at=now,
    )


def _fingerprint(status: NodeStatus) -> tuple[int, tuple[tuple[str, tuple[str, ...]], ...]]:
    return (
        status.gpus,
        tuple(
            sorted(
                (g.gpu_uuid, tuple(sorted(c.condition for c in g.conditions)))
                for g in status.unhealthy
            )
        ),
    )


class FleetStatusPublisher:
    def __init__(
        self,
        bus: Bus,
        node: str,
        state: Callable[[], HealthState],
        settings: FleetSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bus = bus
        self._node = node
        self._subject = subjects.fleet_status(node)
        self._state = state
        self._settings = settings
        self._clock = clock
        self.boot_id = uuid.uuid4().hex
        self.seq = 0
        self._last_fingerprint: object = None
        self._last_sent = -float("inf")
        self._fail_log = RateLimitedLog(log, per_minute=2)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        interval_s = self._settings.status_min_interval_s
        await repeat_every(interval_s, self.tick, task_status=task_status)

    async def tick(self) -> bool:
        """Publish if the status changed or the heartbeat is due; True if it did."""
        now = self._clock()
        status = summarise(
            self._node, self._state(), boot_id=self.boot_id, seq=self.seq + 1, now=time.time()
        )
        fingerprint = _fingerprint(status)
        due = now - self._last_sent >= self._settings.status_heartbeat_s
        if fingerprint == self._last_fingerprint and not due:
            return False
        try:
            await self._bus.publish(self._subject, status, codec.NODE_STATUS)
        except (nats.errors.Error, OSError) as exc:
            self._fail_log.warning("publishing the fleet status failed: %s", exc)
            return False
        self.seq += 1
        self._last_fingerprint = fingerprint
        self._last_sent = now
        return True
