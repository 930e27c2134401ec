"""Remediation inside the allocator service: its sources, its API connection and its
``remediation`` endpoint (the dry run).

:class:`RemediationService` builds the :class:`~.runner.Remediator` over the
allocator's own records (the core's ledger and claims, kubelet's PodResources, the
``NodeView``'s health), connects to the API server the way the handshake does
(``allocator.handshake.kubeconfig``, in-cluster otherwise; retried with backoff while
it cannot), and answers ``gpulet.allocator.<node>.remediation`` with the plan. With
``remediation.mode = "off"`` it does nothing but answer that the mode is off.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import anyio
from nats.micro.request import Request

from gpulet_allocator import protocol as p
from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.service.pod_watch import kube_configuration
from gpulet_allocator.service.remediate.fleet import fleet_bus, fleet_slots
from gpulet_allocator.service.remediate.heal import Healer
from gpulet_allocator.service.remediate.heal_events import NodeEvents, register_gauge
from gpulet_allocator.service.remediate.heal_store import KvBreakerStore, KvHealStore
from gpulet_allocator.service.remediate.heal_view import faults_since, known_identity
from gpulet_allocator.service.remediate.kube import KubeClient
from gpulet_allocator.service.remediate.reset_exec import (
    MockExecutor,
    NvidiaSmiExecutor,
    ResetExecutor,
)
from gpulet_allocator.service.remediate.runner import Remediator, Sources
from gpulet_allocator.service.replies import Replies
from gpulet_common import kubeapi
from gpulet_common.heal import HEAL_KV_BUCKET
from gpulet_common.kube import KubeConfigError
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.nodeview import NodeView
from gpulet_common.podresources import list_pod_resources
from gpulet_common.remediation import REMEDIATION_PLAN, REMEDIATION_REQUEST
from gpulet_common.runtime import Runtime
from gpulet_common.settings import Settings

log = logging.getLogger("gpulet.allocator.remediation")

RETRY_MIN_S = 1.0
RETRY_MAX_S = 30.0


class RemediationService:
    def __init__(
        self,
        settings: Settings,
        node: str,
        core: AllocatorCore,
        view: NodeView,
        meter: Any,
        runtime: Runtime | None = None,
    ) -> None:
        self._allocator = settings.allocator
        self._node = node
        self._runtime = runtime
        self._view = view
        self._meter = meter
        socket = Path(self._allocator.pod_resources_socket)
        timeout = self._allocator.pod_resources_timeout_s

        async def pod_resources() -> pr.ListPodResourcesResponse:
            return await list_pod_resources(socket, timeout)

        def node_gpus() -> int:
            inventory = view.inventory
            known = {g.uuid for g in inventory.gpus} if inventory is not None else set()
            return len(known | set(view.healths()))

        sources = Sources(
            healths=view.healths,
            node_gpus=node_gpus,
            mig_devices=core.mig_devices_of,
            ledger=lambda: (core.allocation_views(), list(core.books.claims.values())),
            pod_resources=pod_resources,
        )
        self.remediator = Remediator(settings.remediation, node, sources, None, meter=meter)

    @property
    def enabled(self) -> bool:
        return self.remediator.settings.mode != "off"

    def on_view(self) -> None:
        if self.enabled:
            self.remediator.poke()

    async def run(self) -> None:
        if not self.enabled:
            return
        handshake = self._allocator.handshake
        delay = RETRY_MIN_S
        while True:
            try:
                configuration = await kube_configuration(handshake)
                break
            except KubeConfigError as exc:
                log.warning("remediation: no API server: %s; again in %.0fs", exc, delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
        async with kubeapi.KubeClient(configuration) as api:
            settings = self.remediator.settings
            self.remediator.kube = KubeClient(
                api, self._node, settings.node_event_namespace, handshake.api_timeout_s
            )
            if self._runtime is not None:
                kv = await self._runtime.bus.key_value(HEAL_KV_BUCKET)
                self.remediator.breaker_store = KvBreakerStore(kv, self._node)
            if settings.mode == "reset":
                self.remediator.healer = await self._healer()
            async with fleet_bus(settings.fleet, self._runtime) as hub:
                if hub is not None:
                    self.remediator.fleet.slots_kv = await fleet_slots(
                        hub, settings.fleet, self._node
                    )
                await self.remediator.run()

    async def _healer(self) -> Healer | None:
        """Remediation by reset's machine on this process's NVML and the node's KV; None
        (evictions only, said) where either is missing."""
        runtime = self._runtime
        if runtime is None:
            log.error("remediation mode reset: no runtime (NVML, NATS); evicting only")
            return None
        handle = await runtime.nvml.get()
        module = handle.adapter.module if handle.adapter is not None else None
        if module is None:
            log.error("remediation mode reset needs NVML (%s); evicting only", handle.reason)
            return None
        # NVML's bindings and the mock only here, in mode reset: the allocator sidecar
        # never loads them otherwise (tests/cli/test_sidecar_imports.py).
        from gpulet_allocator.service.remediate.nvml_port import NvmlGpu
        from gpulet_common.mock_nvml import MockNvml

        reset = self.remediator.settings.reset
        executor: ResetExecutor
        if reset.executor == "mock":
            if not isinstance(module, MockNvml):
                log.error("remediation.reset.executor = mock needs --nvml mock; evicting only")
                return None
            executor = MockExecutor(module, reset.timeout_s)
        else:
            executor = NvidiaSmiExecutor(reset.nvidia_smi, reset.timeout_s)
        kv = await runtime.bus.key_value(HEAL_KV_BUCKET)
        healer = Healer(
            reset,
            KvHealStore(kv, runtime.bus.jetstream, self._node),
            NvmlGpu(module),
            executor,
            self.remediator,
            NodeEvents(self._node, self.remediator.kube, runtime.bus),
            known=known_identity(self._view),
            faults_since=faults_since(self._view),
        )
        if self._meter is not None:
            register_gauge(self._meter, self._node, lambda: healer.out_of_service)
        return healer

    async def on_request(self, req: Request, replies: Replies) -> None:
        endpoint = p.ENDPOINT_REMEDIATION
        started = time.perf_counter()
        if await replies.decode(req, endpoint, REMEDIATION_REQUEST, started) is None:
            return
        plan = await self.remediator.plan()
        await replies.ok(req, endpoint, REMEDIATION_PLAN.encode(plan), started)
