"""Remediation by reset with the real health service (on the mock NVML, a real
nats-server): a fault the health service cannot see a reset end (an XID alone, no
counter to go back) is ended by the verified reset's clear, so the GPU is healthy
again in the node view once its machine returns it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from gpulet_allocator.service.remediate.heal import Healer
from gpulet_allocator.service.remediate.heal_events import NodeEvents
from gpulet_allocator.service.remediate.heal_store import KvHealStore
from gpulet_allocator.service.remediate.heal_view import faults_since, known_identity
from gpulet_allocator.service.remediate.nvml_port import NvmlGpu
from gpulet_allocator.service.remediate.policy import faults_of
from gpulet_allocator.service.remediate.reset_exec import MockExecutor
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.heal import HEAL_KV_BUCKET
from gpulet_common.nodeview import NodeView
from gpulet_common.settings.remediation import RemediationSettings, ResetSettings
from support.health_harness import health_node
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

SETTINGS = RemediationSettings(mode="reset", reset=ResetSettings(executor="mock", settle_s=0.2))


@dataclass
class NoPods:
    async def holders_left(self, gpu_uuid: str) -> int:
        return 0


@pytest.mark.parametrize("tell_health", [True, False])
async def test_a_verified_reset_ends_the_xid_the_health_service_holds(
    nats_server: EmbeddedNats, tmp_path: Path, tell_health: bool
) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        bus = h.runtime.bus
        view = NodeView(bus, h.node, retry_s=0.05, who="test")
        async with anyio.create_task_group() as tg:
            await tg.start(view.run)
            uuid = h.uuid(0)
            await wait_until(lambda: view.inventory is not None, timeout_s=20)
            h.inject("xid", 0, value=119)  # GSP_RPC_TIMEOUT: fatal, reset_gpu, sticky
            await wait_until(lambda: not view.healthy(uuid), timeout_s=20, what="xid 119")
            health = view.health(uuid)
            assert health is not None
            faults = faults_of(health, SETTINGS)
            assert [f.condition for f in faults] == ["xid:119"]
            kv = await bus.key_value(HEAL_KV_BUCKET)
            store = KvHealStore(kv, bus.jetstream, h.node)
            healer = Healer(
                SETTINGS.reset,
                store,
                NvmlGpu(h.mock),
                MockExecutor(h.mock, 5.0),
                NoPods(),
                NodeEvents(h.node, None, bus if tell_health else None),
                known=known_identity(view),
                faults_since=faults_since(view),
            )

            async def returned() -> bool:
                await healer.run_pass(faults)
                record, _ = await store.get(uuid)
                return record is not None and record.state == "returned"

            for _ in range(400):
                if await returned():
                    break
                await anyio.sleep(0.02)
            record, _ = await store.get(uuid)
            assert record is not None
            assert record.state == "returned", record.steps
            assert h.mock.resets_of(0) == 1
            if tell_health:
                await wait_until(lambda: view.healthy(uuid), timeout_s=20, what="healthy")
                cleared = [e for e in h.log.events if e.kind == "cleared"]
                assert any("gpulet-remediation" in e.reason for e in cleared)
            else:
                # Without the clear the health service still holds the XID: the reset
                # alone left no evidence it can see.
                await h.log.wait_for(lambda e: e.kind == "xid")
                assert not view.healthy(uuid)
            tg.cancel_scope.cancel()
