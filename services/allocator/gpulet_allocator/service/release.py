"""Releasing the allocations of pods that are gone, and rebuilding a lost record.

Every ``release_interval_s``, :class:`PodResourcesFollower` asks kubelet's PodResources
API which containers are alive and hands the answer to the core
(:meth:`~gpulet_allocator.decide.core.AllocatorCore.reconcile`), which releases the
allocations none of whose grants has been listed for ``release_grace_s``.

Lost record: while the record is lost, PodResources is asked every
``min(release_interval_s, 5 s)``; each answer's whole-GPU containers are adopted
(:meth:`~gpulet_allocator.decide.core.AllocatorCore.adopt`). The record counts as
rebuilt once PodResources has answered for ``release_grace_s`` (a kubelet that just
restarted may list no pods for a moment) and the latest answer held nothing that cannot
be placed (a share: kubelet does not know its card).

Pods: every answer also says which container holds which device
(:func:`~.podresources.pod_holders`, :attr:`PodResourcesFollower.pods`), which the
``pods`` endpoint tells the collector for its metric labels. So the pass runs every
``min(release_interval_s, pods_poll_s)``. A failed call keeps the last holders (kubelet
said nothing new); a missing socket drops them (no kubelet, no holder), and either way
``pods``' ``source`` says why.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import anyio
from opentelemetry.metrics import Counter

from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.decide.record import HeldDevices
from gpulet_allocator.service.podresources import (
    PodResourcesUnavailable,
    held_devices,
    list_pod_resources,
    live_grants,
    pod_holders,
)
from gpulet_allocator.service.withheld import PodsSnapshot
from gpulet_allocator.state.checkpoint import CheckpointError, Committer
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.settings.allocator import AllocatorSettings

log = logging.getLogger("gpulet.allocator")

# While the record is lost, PodResources is asked at least this often.
LOST_RETRY_S = 5.0


class PodResourcesFollower:
    """The release loop (see the module docstring)."""

    def __init__(
        self,
        core: AllocatorCore,
        settings: AllocatorSettings,
        *,
        released: Counter,
        on_change: Callable[[], None],
        committer: Callable[[], Committer | None],
    ) -> None:
        self._core = core
        self._settings = settings
        self._released = released
        # Called when allocations or the record's state changed (counts and status).
        self._on_change = on_change
        self._committer = committer
        self._log = RateLimitedLog(log, per_minute=2)
        self._state = ""
        # Since when (monotonic) PodResources has answered without a failure.
        self._since: float | None = None
        #: Device UUID -> its holders, and "ok" or why PodResources does not answer.
        self.pods: PodsSnapshot = ({}, "")
        #: Called after each pass (the ``pods`` feed follows :attr:`pods`).
        self.on_pods: Callable[[], None] = lambda: None

    async def run(self, before_pass: Callable[[], None]) -> None:
        socket = Path(self._settings.pod_resources_socket)
        while True:
            before_pass()
            await self.reconcile_once(socket)
            interval = min(self._settings.release_interval_s, self._settings.pods_poll_s)
            if self._core.lost is not None:
                interval = min(interval, LOST_RETRY_S)
            await anyio.sleep(interval)

    async def reconcile_once(self, socket: Path | None = None) -> int:
        """One PodResources pass; returns how many allocations it released."""
        core = self._core
        socket = socket or Path(self._settings.pod_resources_socket)
        try:
            response = await list_pod_resources(socket, self._settings.pod_resources_timeout_s)
        except PodResourcesUnavailable as exc:
            await self._unavailable(socket, exc)
            self.on_pods()
            return 0
        self.pods = (pod_holders(response), "ok")
        self.on_pods()
        if self._state != "ok":
            log.info("following PodResources at %s", socket)
            self._state = "ok"
        now = anyio.current_time()
        if self._since is None:
            self._since = now
        if core.lost is not None:
            self._rebuild(held_devices(response, core.kind_of, core.pod_uid), now - self._since)
        released = core.reconcile(live_grants(response, core.kind_of, core.pod_uid))
        if released:
            self._released.add(len(released), {"reason": "pod_gone"})
            self._on_change()
        committer = self._committer()
        if committer is not None and committer.durable < core.version:
            # A failure is logged by the committer, which keeps retrying.
            with contextlib.suppress(CheckpointError):
                await committer.wait(core.version)
        return len(released)

    async def _unavailable(self, socket: Path, exc: PodResourcesUnavailable) -> None:
        self._since = None
        state = "failing" if await anyio.Path(socket).exists() else "absent"
        holders = self.pods[0] if state == "failing" else {}
        self.pods = (holders, f"kubelet's PodResources at {socket}: {exc}"[:1000])
        if state != self._state:
            if state == "absent":
                log.info(
                    "no PodResources API at %s: allocations are released only by "
                    "explicit release requests",
                    socket,
                )
            else:
                self._log.warning("PodResources List failed: %s", exc)
        self._state = state
        if self._core.lost is not None:
            self._core.record.rebuild_blocker = (
                f"kubelet's PodResources API at {socket} cannot rebuild it ({exc})"
            )
            self._on_change()

    def _rebuild(self, held: list[HeldDevices], answering_s: float) -> None:
        """One step of rebuilding a lost record from a PodResources answer."""
        core = self._core
        adoption = core.adopt(held)
        if adoption.adopted:
            log.warning(
                "rebuilding the lost allocation record: adopted %d whole-GPU allocation(s) "
                "kubelet's PodResources lists",
                adoption.adopted,
            )
        grace = self._settings.release_grace_s
        if not adoption.complete:
            core.record.rebuild_blocker = (
                f"kubelet's PodResources cannot rebuild it: {adoption.blocker()}"
            )
        elif answering_s < grace:
            core.record.rebuild_blocker = (
                f"rebuilding it from kubelet's PodResources ({core.ledger.count()} allocation(s) "
                f"so far): PodResources must answer for {grace:g} s (release_grace_s) before "
                "its pod list is trusted"
            )
        else:
            reason = core.end_loss()
            log.warning(
                "the lost allocation record (%s) was rebuilt from kubelet's PodResources: "
                "%d allocation(s); allocating again",
                reason,
                core.ledger.count(),
            )
        self._on_change()
