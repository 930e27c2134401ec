"""The remediation loop: follow the node's health, find the holders of a failed GPU,
and (``remediation.mode = "evict"``) evict them, or (``"report"``) say so.

Flow
----
1. The allocator's ``NodeView`` listener calls :meth:`Remediator.poke` on every health
   change; the loop wakes (and again at the next retry's deadline).
2. :func:`~.policy.faults_of` reads each GPU's active conditions; none: nothing to do,
   and what was tracked for GPUs that recovered is forgotten.
3. The holders of each failed device (:func:`~.policy.holders_of`): the ledger and its
   DRA claims (in memory), kubelet's PodResources (one ``List``), the node's pods (one
   API list: UIDs, claims, pods already terminating). A source that fails is named in
   the plan's problems; the others still count.
4. The circuit breaker (:mod:`.breaker`) admits the GPU or holds it back.
5. Each holder of an admitted device is evicted once (mode ``evict``), with an Event
   on the pod and on the Node naming the fault and its catalogue entry. A 429 (a
   PodDisruptionBudget) or a failure is retried with exponential backoff
   (``retry_initial_s`` to ``retry_max_s``) for as long as the fault stands, counted,
   and said once per pod in an Event. In mode ``report`` the same Events say what
   would be done, once per pod and fault.

:meth:`Remediator.plan` is the same computation without acting or admitting:
``gpulet health remediate --dry-run``. Nothing here raises into the allocator: a
failing API or PodResources is a problem in the plan and a rate-limited log line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

import anyio
import msgspec
from opentelemetry.metrics import Counter, Meter, UpDownCounter

from gpulet_allocator.protocol import AllocationView
from gpulet_allocator.service.remediate.breaker import Breaker, BreakerState
from gpulet_allocator.service.remediate.fleet import FleetGate
from gpulet_allocator.service.remediate.heal import Healer
from gpulet_allocator.service.remediate.kube import EventTarget, KubeActions, KubeError
from gpulet_allocator.service.remediate.policy import (
    Holder,
    Records,
    devices_in_scope,
    faults_of,
    holders_of,
)
from gpulet_allocator.state.records import ClaimRecord
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import GpuHealth
from gpulet_common.podresources import PodResourcesUnavailable
from gpulet_common.remediation import (
    BreakerView,
    Fault,
    PlannedGpu,
    PlannedPod,
    PodState,
    RemediationPlan,
)
from gpulet_common.settings.remediation import RemediationSettings
from gpulet_common.telemetry import create_counters

log = logging.getLogger("gpulet.allocator.remediation")

REASON_EVICTED: Final = "GpuletEvictedForGpuFault"
REASON_WOULD_EVICT: Final = "GpuletWouldEvictForGpuFault"
REASON_BLOCKED: Final = "GpuletEvictionBlockedByPDB"
REASON_BREAKER: Final = "GpuletRemediationBreakerOpen"
REASON_BREAKER_CLOSED: Final = "GpuletRemediationBreakerClosed"


class BreakerStore(Protocol):
    async def load(self) -> BreakerState | None: ...
    async def save(self, state: BreakerState) -> None: ...


@dataclass(slots=True)
class Sources:
    """Where the loop reads the node's health and the records of holders."""

    healths: Callable[[], Mapping[str, GpuHealth]]
    node_gpus: Callable[[], int]
    mig_devices: Callable[[str], Iterable[str]]
    ledger: Callable[[], tuple[Sequence[AllocationView], Sequence[ClaimRecord]]]
    # One PodResources List; raises PodResourcesUnavailable.
    pod_resources: Callable[[], Awaitable[pr.ListPodResourcesResponse]]


@dataclass(slots=True)
class Track:
    """One pod of one failed device, followed until it is evicted or the fault ends."""

    holder: Holder
    state: PodState = "planned"
    attempts: int = 0
    next_at: float = 0.0
    detail: str = ""
    reported: set[str] = field(default_factory=set)


class Remediator:
    def __init__(
        self,
        settings: RemediationSettings,
        node: str,
        sources: Sources,
        kube: KubeActions | None,
        *,
        meter: Meter | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        breaker_store: BreakerStore | None = None,
    ) -> None:
        self.settings = settings
        self.node = node
        self._sources = sources
        self.kube = kube
        self._clock = clock
        # On the wall clock: its window is kept across restarts (breaker_store).
        self.breaker = Breaker(
            settings.max_fraction,
            settings.window_s,
            wall,
            max_faults_per_gpu=settings.max_faults_per_gpu,
            max_evictions=settings.max_evictions,
        )
        self.breaker_store = breaker_store
        self._wall = wall
        self._saved: BreakerState | None = None
        self._tracks: dict[tuple[str, str], Track] = {}
        self._wake = anyio.Event()
        self._log = RateLimitedLog(log, per_minute=6)
        self.evictions_requested = 0
        #: Passes of :meth:`step` (tests wait on it).
        self.passes = 0
        #: Remediation by reset (mode "reset"; set by the service once it has NVML).
        self.healer: Healer | None = None
        #: The fleet breaker (its slots_kv set by the service with a hub).
        self.fleet = FleetGate(self._needs_slot)
        self._evictions: Counter | None = None
        self._trips: Counter | None = None
        self._breaker_open: UpDownCounter | None = None
        if meter is not None:
            self._evictions, self._trips = create_counters(
                meter,
                ("gpulet.allocator.remediation.evictions", "Evictions asked for, by result"),
                (
                    "gpulet.allocator.remediation.breaker_trips",
                    "Times the remediation circuit breaker opened",
                ),
            )
            self._breaker_open = meter.create_up_down_counter(
                "gpulet.allocator.remediation.breaker_open",
                description="1 while the remediation circuit breaker holds GPUs back",
            )

    def poke(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        if self.settings.mode == "off":
            return
        log.info("remediation on node %s: mode %s", self.node, self.settings.mode)
        await self.restore_breaker()
        while True:
            self._wake = anyio.Event()
            try:
                next_at = await self.step()
                await self.save_breaker()
            except Exception:  # a bug here must not end the allocator: say it, go on
                self._log.exception("remediation pass failed")
                next_at = self._clock() + self.settings.retry_max_s
            delay = None if next_at is None else max(0.0, next_at - self._clock())
            with anyio.move_on_after(delay if delay is not None else 3600.0):
                await self._wake.wait()

    async def restore_breaker(self) -> None:
        """The breaker's window as the previous run left it (none: a fresh one)."""
        if self.breaker_store is None:
            return
        state = await self.breaker_store.load()
        if state is not None:
            self.breaker.restore(state)
            self._saved = self.breaker.state()
            log.info(
                "remediation breaker restored: %d GPU(s), %d eviction(s) in the window",
                len(self._saved.admitted),
                len(self._saved.evictions),
            )

    async def save_breaker(self) -> None:
        if self.breaker_store is None:
            return
        state = self.breaker.state()
        if state != self._saved:
            await self.breaker_store.save(state)
            self._saved = state

    # --- one pass ----------------------------------------------------------------------

    async def _records(self, problems: list[str]) -> Records:
        allocations, claims = self._sources.ledger()
        response: pr.ListPodResourcesResponse | None = None
        try:
            response = await self._sources.pod_resources()
        except PodResourcesUnavailable as exc:
            problems.append(f"kubelet's PodResources: {exc}")
        pods = None
        if self.kube is not None:
            try:
                pods = await self.kube.list_pods()
            except KubeError as exc:
                problems.append(f"the node's pods cannot be listed: {exc}")
        else:
            problems.append("no API server: pods found only by the ledger and PodResources")
        return Records(allocations=allocations, claims=claims, pod_resources=response, pods=pods)

    def _faults(self) -> list[Fault]:
        found = [f for h in self._sources.healths().values() for f in faults_of(h, self.settings)]
        return sorted(found, key=lambda f: (f.gpu_index is None, f.gpu_index or 0, f.device))

    async def plan(self) -> RemediationPlan:
        """What would be done now; changes nothing (the dry run)."""
        problems: list[str] = []
        faults = self._faults()
        records = await self._records(problems) if faults else Records()
        gpus = []
        total = self._sources.node_gpus()
        window = set(self.breaker.in_window())
        fits = self.breaker.limit(total) - len(window)
        for fault in faults:
            holders = holders_of(devices_in_scope(fault, self._sources.mig_devices), records)
            admitted = fault.gpu_uuid in window or not holders or fits > 0
            if holders and fault.gpu_uuid not in window and fits > 0:
                fits -= 1
                window.add(fault.gpu_uuid)
            pods = [self._planned(fault, h, admitted) for h in holders]
            step = await self.healer.step_of(fault) if self.healer is not None else ("", "")
            gpus.append(_planned_gpu(fault, admitted, pods, step))
        return RemediationPlan(
            node=self.node,
            mode=self.settings.mode,
            gpus=gpus,
            breaker=self._breaker_view(total),
            problems=problems,
        )

    def _planned(self, fault: Fault, holder: Holder, admitted: bool) -> PlannedPod:
        track = self._tracks.get((fault.device, holder.key))
        state: PodState = "held_by_breaker" if not admitted else "planned"
        if holder.terminating:
            state = "evicted"
        attempts, detail = 0, ""
        if track is not None:
            state, attempts, detail = track.state, track.attempts, track.detail
        return PlannedPod(
            namespace=holder.namespace,
            name=holder.name,
            uid=holder.uid,
            via=sorted(holder.via),
            state=state,
            attempts=attempts,
            detail=detail,
        )

    def _breaker_view(self, total: int) -> BreakerView:
        b = self.breaker
        held = sorted(b.held)
        return BreakerView(
            open=b.open,
            max_fraction=b.max_fraction,
            window_s=b.window_s,
            node_gpus=total,
            limit=b.limit(total),
            in_window=b.in_window(),
            trips=b.trips,
            detail=f"holding back {', '.join(held)}" if held else "",
            evictions=b.evictions_in_window(),
            max_evictions=b.max_evictions,
            max_faults_per_gpu=b.max_faults_per_gpu,
            fleet="; ".join(f"{gpu}: {why}" for gpu, why in sorted(self.fleet.held.items())),
        )

    async def step(self) -> float | None:
        """One pass; returns when the next retry is due (None: nothing pending)."""
        self.passes += 1
        now = self._clock()
        faults = self._faults()
        devices = {f.device for f in faults}
        self._tracks = {k: t for k, t in self._tracks.items() if k[0] in devices}
        if self.breaker.settle({f.gpu_uuid for f in faults}) is False:
            await self._breaker_closed()
        heal_at = await self._heal(faults)
        await self.fleet.give({f.gpu_uuid for f in faults})
        if not faults:
            return heal_at
        problems: list[str] = []
        records = await self._records(problems)
        for problem in problems:
            self._log.warning("remediation: %s", problem)
        pending: list[float] = []
        for fault in faults:
            holders = holders_of(devices_in_scope(fault, self._sources.mig_devices), records)
            holders = [h for h in holders if not h.terminating]
            # Mode reset: a GPU no pod holds is still admitted before it is reset.
            if not holders and self.healer is None:
                continue
            verdict = self.breaker.admit(fault.gpu_uuid, self._sources.node_gpus())
            if verdict.changed is True:
                await self._breaker_tripped(fault)
            elif verdict.changed is False:
                await self._breaker_closed()
            if not verdict.admitted or not await self._take_slot(fault):
                continue
            for holder in holders:
                track = self._tracks.setdefault((fault.device, holder.key), Track(holder))
                track.holder = holder
                if self._evicted_for_another(fault.device, holder.key):
                    # One pod holding two failed devices is evicted once.
                    track.state, track.detail = "evicted", "with another failed device"
                    continue
                await self._act(fault, track)
                if track.state in ("blocked_by_pdb", "failed"):
                    pending.append(track.next_at)
        # While a fault stands, look again now and then: a holder may show up late.
        if heal_at is not None:
            pending.append(heal_at)
        return min(pending) if pending else now + self.settings.retry_max_s

    async def _heal(self, faults: list[Fault]) -> float | None:
        """Remediation by reset's pass; when it next needs to look, on this loop's clock
        (the machines keep wall-clock times, which survive a restart)."""
        if self.healer is None:
            return None
        wake = await self.healer.run_pass(faults)
        if wake is None:
            return None
        return self._clock() + max(0.0, wake - self._wall())

    async def holders_left(self, gpu_uuid: str) -> int:
        """How many pods still hold the GPU or one of its MIG devices, terminating ones
        included, and at least 1 while a breaker holds the GPU back (remediation by
        reset waits for none: :class:`~.heal.Evictions`)."""
        records = await self._records([])
        scope = devices_in_scope(
            Fault(gpu_uuid=gpu_uuid, device=gpu_uuid), self._sources.mig_devices
        )
        held = gpu_uuid in self.breaker.held or gpu_uuid in self.fleet.held
        return max(len(holders_of(scope, records)), 1 if held else 0)

    async def _needs_slot(self, gpu_uuid: str) -> bool:
        """A fleet slot is held while the GPU is remediated: in mode evict while its
        fault stands, in mode reset while its machine runs."""
        return self.healer is None or await self.healer.active(gpu_uuid)

    async def _take_slot(self, fault: Fault) -> bool:
        gpu, was_held = fault.gpu_uuid, fault.gpu_uuid in self.fleet.held
        why = await self.fleet.take(gpu)
        if why is None:
            return True
        if not was_held:
            self._log.warning("remediation of GPU %s held back: %s", gpu, why)
            if self.kube is not None:
                await self.kube.post_event(
                    self._node_target(), REASON_BREAKER, f"GPU {gpu} held back: {why}"
                )
        self.fleet.held[gpu] = why
        return False

    def _evicted_for_another(self, device: str, pod: str) -> bool:
        return any(
            d != device and k == pod and t.state == "evicted" and not t.detail
            for (d, k), t in self._tracks.items()
        )

    async def _act(self, fault: Fault, track: Track) -> None:
        holder = track.holder
        if track.state in ("evicted", "gone") or self._clock() < track.next_at:
            return
        why = _why(fault)
        if self.settings.mode == "report":
            if "report" not in track.reported:
                track.reported.add("report")
                message = f"would evict pod {holder.key}: {why}"
                log.warning("remediation (report only): %s", message)
                await self._events(fault, holder, REASON_WOULD_EVICT, message)
            return
        if self.kube is None:
            return
        if not self.breaker.may_evict():
            track.state = "held_by_breaker"
            track.detail = (
                f"{self.breaker.max_evictions} pods evicted within {self.breaker.window_s:g} s"
            )
            if "evictions" not in track.reported:
                track.reported.add("evictions")
                await self._events(
                    fault, holder, REASON_BREAKER, f"not evicting pod {holder.key}: " + track.detail
                )
            return
        track.attempts += 1
        self.evictions_requested += 1
        outcome = await self.kube.evict(holder.namespace, holder.name, holder.uid)
        if self._evictions is not None:
            self._evictions.add(1, {"result": outcome.result})
        track.state, track.detail = outcome.result, outcome.detail
        if outcome.result == "evicted":
            self.breaker.evicted()
            log.warning("remediation: evicted pod %s: %s", holder.key, why)
            await self._events(fault, holder, REASON_EVICTED, f"evicted pod {holder.key}: {why}")
            return
        if outcome.result == "gone":
            return
        delay = min(
            self.settings.retry_max_s, self.settings.retry_initial_s * 2 ** (track.attempts - 1)
        )
        if outcome.retry_after_s is not None:
            delay = max(delay, min(outcome.retry_after_s, self.settings.retry_max_s))
        track.next_at = self._clock() + delay
        self._log.warning(
            "remediation: evicting pod %s %s (HTTP %d %s); again in %.1fs",
            holder.key,
            "is blocked by a PodDisruptionBudget"
            if outcome.result == "blocked_by_pdb"
            else "failed",
            outcome.status,
            outcome.detail,
            delay,
        )
        if outcome.result == "blocked_by_pdb" and "blocked" not in track.reported:
            track.reported.add("blocked")
            message = (
                f"eviction of pod {holder.key} is blocked by a PodDisruptionBudget "
                f"({outcome.detail or 'HTTP 429'}); retrying: {why}"
            )
            await self._events(fault, holder, REASON_BLOCKED, message, node=False)

    async def _events(
        self, fault: Fault, holder: Holder, reason: str, message: str, *, node: bool = True
    ) -> None:
        if self.kube is None:
            return
        pod = EventTarget("Pod", holder.name, holder.namespace, holder.uid)
        await self.kube.post_event(pod, reason, message)
        if node:
            await self.kube.post_event(self._node_target(), reason, message)

    def _node_target(self) -> EventTarget:
        # Kubelet's own Node Events carry the node's name as the UID.
        return EventTarget("Node", self.node, uid=self.node)

    async def _breaker_tripped(self, fault: Fault) -> None:
        total = self._sources.node_gpus()
        message = (
            f"remediation circuit breaker open: GPU {fault.gpu_uuid} would make more than "
            f"{self.settings.max_fraction:g} of the node's {total} GPUs remediated within "
            f"{self.settings.window_s:g} s (already {len(self.breaker.in_window())}); "
            "no further pod is evicted (a storm: check the driver, power and fabric)"
        )
        log.error("%s", message)
        if self._trips is not None and self._breaker_open is not None:
            self._trips.add(1)
            self._breaker_open.add(1)
        if self.kube is not None:
            await self.kube.post_event(self._node_target(), REASON_BREAKER, message)

    async def _breaker_closed(self) -> None:
        message = "remediation circuit breaker closed: held-back GPUs recovered or fit again"
        log.warning("%s", message)
        if self._breaker_open is not None:
            self._breaker_open.add(-1)
        if self.kube is not None:
            await self.kube.post_event(
                self._node_target(),
                REASON_BREAKER_CLOSED,
                message,
                warning=False,
            )


def _why(fault: Fault) -> str:
    where = (
        f"GPU {fault.gpu_index} {fault.gpu_uuid}" if fault.gpu_index is not None else fault.gpu_uuid
    )
    if fault.device != fault.gpu_uuid:
        where += f" MIG device {fault.device}"
    return (
        f"{where} failed: {fault.condition} ({fault.kind}, {fault.severity}, action "
        f"{fault.action}; {fault.entry}): {fault.reason}"
    )


def _planned_gpu(
    fault: Fault, admitted: bool, pods: list[PlannedPod], step: tuple[str, str]
) -> PlannedGpu:
    # A PlannedGpu is a Fault with the breaker's verdict, the pods and the reset's step.
    return PlannedGpu(
        **msgspec.structs.asdict(fault),
        admitted=admitted,
        pods=pods,
        step=step[0],
        step_detail=step[1],
    )
