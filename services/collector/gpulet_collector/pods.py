"""Which pods hold which GPUs, from the allocator's ``pods`` endpoint, for metric labels.

Why
---
"Which pod is using this GPU" is the question operators ask first. dcgm-exporter
answers it by asking kubelet's PodResources API which container holds which device
IDs, and labelling each GPU's metrics with ``pod``, ``namespace`` and ``container``.
gpulet's allocator already asks PodResources (to release the grants of pods that are
gone), so it is the node's one reader of it ("one source of each fact"): its ``pods``
endpoint (:class:`~gpulet_common.messages.PodsReply`) answers, per GPU or MIG device
UUID, the containers holding it or a part of it (a share, a time-slicing replica). The
collector follows that endpoint as a long poll (asked with a
:class:`~gpulet_common.messages.HeldRequest`, answered when the holders change) and
hands the holders to the DCGM exporter. Labels therefore follow allocations within one
PodResources pass of the allocator (``allocator.pods_poll_s``), with no restart, and
the collector needs neither gRPC nor kubelet's socket.

Hostile input: the reply is decoded totally and bounded by its schema
(:mod:`gpulet_common.codec`); what it claims is checked against what the collector
knows: a UUID that is not in the inventory (a GPU or one of its MIG devices) is
ignored, a container listed twice is kept once. An unreadable reply keeps the last
holders and is said once in the status, never ends the collector.

No allocator (not deployed, not started yet, gone): nobody can tell who holds a GPU,
so the metrics carry no pod labels; the component ``collector.pod-labels`` of the
status says why (it stays ``ready``: the metrics are right, only unlabelled), and the
endpoint is asked again after 0.5 s, doubling up to ``collector.pod_resources_poll_s``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Final

import anyio
import anyio.abc

from gpulet_collector.dcgm import PodLabels
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.messages import HeldRequest, PodsReply
from gpulet_common.refusal import NoResponders
from gpulet_common.telemetry import StatusBoard

log = logging.getLogger("gpulet.collector.pods")

#: The component of the status board that says where the pod labels come from.
STATUS_NAME: Final = "collector.pod-labels"
# How long the allocator may hold one long poll (it holds at most 30 s).
WAIT_S: Final = 15.0
# No answer: asked again after this, doubling up to collector.pod_resources_poll_s
# (the allocator of `gpulet run` or of the pod usually starts a moment later).
FIRST_RETRY_S: Final = 0.5


def holders_of(reply: PodsReply, devices: Collection[str]) -> dict[str, list[PodLabels]]:
    """Device UUID -> the containers holding it, for the devices in ``devices``."""
    holders: dict[str, list[PodLabels]] = {}
    for uuid, held in reply.holders.items():
        if uuid not in devices:
            continue
        unique = {PodLabels(pod=h.pod, namespace=h.namespace, container=h.container) for h in held}
        if unique:
            holders[uuid] = sorted(unique, key=lambda p: (p.namespace, p.pod, p.container))
    return holders


class PodAttribution:
    """Follows the allocator's ``pods`` endpoint and publishes the holders through
    ``update`` (see the module docstring)."""

    def __init__(
        self,
        bus: Bus,
        node: str,
        retry_s: float,
        devices: Callable[[], Collection[str]],
        update: Callable[[dict[str, list[PodLabels]]], None],
        status: StatusBoard,
    ) -> None:
        self._bus = bus
        self._subject = subjects.allocator_endpoint(node, subjects.ALLOCATOR_PODS_ENDPOINT)
        self._node = node
        self._retry_s = retry_s
        self._devices = devices
        self._update = update
        self._status = status
        self._epoch, self._version = "", 0
        self._holders: dict[str, list[PodLabels]] = {}

    def _publish(self, holders: dict[str, list[PodLabels]]) -> None:
        if holders != self._holders:
            self._holders = holders
            self._update(holders)

    def _say(self, detail: str) -> None:
        self._status.set(STATUS_NAME, "ready", detail)

    async def ask(self) -> bool:
        """One request (a long poll once current); True when the holders are current
        (never raises for the allocator's failures)."""
        request = HeldRequest(epoch=self._epoch, version=self._version, wait_s=WAIT_S)
        try:
            reply = await self._bus.request(
                self._subject,
                request,
                codec.HELD_REQUEST,
                codec.PODS_REPLY,
                timeout_s=WAIT_S + 5.0,
                node=self._node,
            )
            holders = holders_of(reply, frozenset(self._devices()))
        except NoResponders:
            self._epoch, self._version = "", 0
            self._publish({})
            self._say("no pod labels: the allocator does not answer (not deployed or not up)")
            return False
        except Exception as exc:  # whatever came back, the collector lives on
            self._epoch, self._version = "", 0
            self._say(f"no new pod labels: asking the allocator failed: {exc}"[:300])
            return False
        current = (reply.epoch, reply.version) == (self._epoch, self._version)
        self._epoch, self._version = reply.epoch, reply.version
        # Filtered again at every answer: the inventory may have changed meanwhile.
        self._publish(holders)
        if reply.source == "ok":
            self._say("pod labels from the allocator (kubelet's PodResources)")
        else:
            self._say(f"pod labels from the allocator, which cannot read kubelet: {reply.source}")
        if current:
            await anyio.sleep(0.05)  # the poll's time ran out: a breath, never a hot loop
        return True

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        self._say("asking the allocator")
        task_status.started()
        first = min(FIRST_RETRY_S, self._retry_s)
        delay = first
        while True:
            if await self.ask():
                delay = first
            else:
                await anyio.sleep(delay)
                delay = min(delay * 2, self._retry_s)
