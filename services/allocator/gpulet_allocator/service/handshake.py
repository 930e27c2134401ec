"""The scheduler handshake's I/O: this node's pods into the core's book, refusals out
as Events.

With ``allocator.handshake.enabled``, :class:`HandshakeRunner` watches this node's pods
(:mod:`.pod_watch`) into the core's :class:`~gpulet_allocator.decide.koordinator.PodBook`,
so calls that belong to a pod koord-scheduler decided for follow that decision, and
posts the core's refused decisions as Kubernetes Events on the pod
(docs/koordinator.md). Failures degrade, never end, the service: until the watch has
listed, and while the API server is away, the book holds what it last knew and calls
it cannot match are decided by gpulet as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from gpulet_allocator.decide.koordinator import (
    RES_GPU_CORE,
    RES_GPU_MEMORY_RATIO,
    PodBook,
    PodKey,
)
from gpulet_allocator.service.pod_watch import EventWriter, PodWatch, kube_configuration
from gpulet_common.kube import KubeConfigError
from gpulet_common.kubeapi import KubeClient
from gpulet_common.settings.allocator import AllocatorSettings

log = logging.getLogger("gpulet.allocator")

RETRY_MIN_S = 1.0
RETRY_MAX_S = 30.0


def pod_book(node: str, settings: AllocatorSettings) -> PodBook | None:
    """The core's book of this node's pods; None without the handshake."""
    if not settings.handshake.enabled:
        return None
    plugin = settings.plugin
    koordinator = plugin.profile == "koordinator"
    return PodBook(
        node,
        whole_resource=plugin.resources.gpu,
        core_resource=RES_GPU_CORE if koordinator else plugin.resources.core,
        share_resources=(RES_GPU_CORE, RES_GPU_MEMORY_RATIO)
        if koordinator
        else (plugin.resources.core, plugin.resources.memory),
    )


@dataclass(slots=True)
class RefusalEvents:
    """Refused scheduler decisions to the Event writer, once there is one."""

    writer: EventWriter | None = None

    def __call__(self, pod: PodKey, message: str) -> None:
        if self.writer is not None:
            self.writer.post(pod, message)


class HandshakeRunner:
    """The pod watch and the Event writer (see the module docstring)."""

    def __init__(
        self, node: str, settings: AllocatorSettings, on_problem: Callable[[], None]
    ) -> None:
        self._node = node
        self._settings = settings.handshake
        self._on_problem = on_problem
        #: What the core calls on a refusal: holds only the writer, not the service.
        self.refusals = RefusalEvents()
        #: Refused decisions become Events on their pod (set up in :meth:`run`).
        self.events: EventWriter | None = None
        self.pod_watch: PodWatch | None = None
        #: Why the handshake does not work now ("" when it does).
        self.problem = ""

    def _on_state(self, problem: str) -> None:
        if problem != self.problem:
            self.problem = problem
            self._on_problem()

    async def run(self, book: PodBook) -> None:
        delay = RETRY_MIN_S
        while True:
            try:
                configuration = await kube_configuration(self._settings)
            except KubeConfigError as exc:
                self._on_state(f"no pod watch: {exc}")
                log.warning("koord-scheduler handshake: %s; again in %.0fs", exc, delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            break
        async with KubeClient(configuration) as api:
            self.events = EventWriter(api, self._node, self._settings)
            self.refusals.writer = self.events
            self.pod_watch = PodWatch(api, book, self._settings, on_state=self._on_state)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.events.run)
                await tg.start(self.pod_watch.run)
                log.info("following koord-scheduler's decisions on the pods of %s", self._node)
