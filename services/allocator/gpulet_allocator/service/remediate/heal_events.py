"""What the cluster and the health service are told as a GPU's remediation by reset
moves: Events on the Node, and after a verified reset the health service's clear.

The quarantine itself is the machine's record in the ``gpulet_heal`` KV: every node
view overlays it (:func:`gpulet_common.heal.overlay`), so the device plugin, the DRA
slice and the node condition take the GPU out of service from the one record, written
before this is called. :class:`NodeEvents` is the :class:`~.heal.Quarantine` port on the
remediation loop's :class:`~.kube.KubeActions`: an Event on the Node for each step that
matters (reasons below), and a log line; with no API server, the log line alone.

A reset that passed its verify is the evidence the fault's own sticky condition waits
for, but the health service sees a reset only where a counter went back or a lost GPU
came back; an XID alone (a GSP timeout, say) would keep the GPU unhealthy after its
reset. So the verified reset is said to the health service too: its clear request
(``gpulet.health.clear.<node>``, what ``gpulet health clear`` sends), by
``gpulet-remediation``, which ends the GPU's sticky conditions with an event naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Final

from opentelemetry.metrics import CallbackOptions, Observation

from gpulet_allocator.service.remediate.kube import EventTarget, KubeActions
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, BusError
from gpulet_common.heal import FaultHistory, HealRecord
from gpulet_common.messages import HealthClearRequest

log = logging.getLogger("gpulet.allocator.remediation.heal")

REASON_QUARANTINED: Final = "GpuletGpuQuarantined"
REASON_RETURNED: Final = "GpuletGpuReturnedToService"
REASON_NEEDS_REBOOT: Final = "GpuletGpuNeedsReboot"
REASON_RETIRED: Final = "GpuletGpuRetired"
CLEAR_TIMEOUT_S: Final = 5.0


GAUGE: Final = "gpulet.allocator.remediation.gpu_state"


def register_gauge(meter: Any, node: str, records: Any) -> None:
    """``gpulet_allocator_remediation_gpu_state``: 1 for each GPU a machine holds out
    of service, labelled with its state (quarantined ... retired) and, escalated or
    retired, why (the alerts GpuletGpuNeedsReboot and GpuletGpuRetired read it).
    ``records()`` gives the machines as of the last pass."""

    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        out: list[HealRecord] = list(records().values())
        for record in out:
            attributes = {
                "gpu": str(record.gpu_index) if record.gpu_index is not None else "",
                "UUID": record.gpu_uuid,
                "Hostname": node,
                "state": record.state,
                "reason": record.detail[:200] if record.state in ("escalated", "retired") else "",
            }
            yield Observation(1, attributes)

    meter.create_observable_gauge(
        GAUGE,
        [observe],
        description="1 for each GPU remediation by reset holds out of service, by state",
    )


class NodeEvents:
    def __init__(
        self, node: str, kube: KubeActions | None, bus: Bus | None = None, *, nats_node: str = ""
    ) -> None:
        self.node = node
        self.kube = kube
        self._bus = bus
        # The node's name on NATS, where it differs from the Node's (tests).
        self._nats_node = nats_node or node

    async def _event(self, reason: str, message: str, *, warning: bool = True) -> None:
        if self.kube is None:
            return
        # Kubelet's own Node Events carry the node's name as the UID.
        target = EventTarget("Node", self.node, uid=self.node)
        await self.kube.post_event(target, reason, message[:1000], warning=warning)

    async def hold(self, gpu_uuid: str, reason: str) -> None:
        await self._event(REASON_QUARANTINED, f"GPU {gpu_uuid} quarantined for a reset: {reason}")

    async def release(self, gpu_uuid: str, last_reset: str, *, verified: bool = False) -> None:
        if verified and self._bus is not None:
            request = HealthClearRequest(
                gpu=gpu_uuid, requested_by=f"gpulet-remediation (verified reset: {last_reset})"
            )
            try:
                await self._bus.request(
                    subjects.health_clear(self._nats_node),
                    request,
                    codec.HEALTH_CLEAR_REQUEST,
                    codec.HEALTH_STATE,
                    timeout_s=CLEAR_TIMEOUT_S,
                )
            except BusError as exc:  # no health service: its own evidence, later
                log.warning("GPU %s: the health service's clear failed: %s", gpu_uuid, exc)
        await self._event(
            REASON_RETURNED,
            f"GPU {gpu_uuid} back in service (last reset {last_reset})",
            warning=False,
        )

    async def escalate(self, gpu_uuid: str, reason: str) -> None:
        await self._event(
            REASON_NEEDS_REBOOT,
            f"GPU {gpu_uuid} stays quarantined and needs the node rebooted or inspected "
            f"(gpulet never reboots a node): {reason}",
        )

    async def retire(self, gpu_uuid: str, reason: str, history: FaultHistory) -> None:
        await self._event(
            REASON_RETIRED,
            f"GPU {gpu_uuid} retired, {reason}: {history.summary()}; out of service until "
            "`gpulet health clear --retired`",
        )
