"""NodeView's quarantine overlay: a remediation machine in the ``gpulet_heal`` KV holds
its GPU out of service in every read (the device plugin, the DRA slice and the node
condition all read the view), against a real nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from gpulet_common.bus import Bus
from gpulet_common.dra import taints
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.heal import HEAL_KV_BUCKET, HEAL_RECORD, HealRecord, heal_key
from gpulet_common.nodeview import NodeView
from gpulet_common.settings.nats import NatsSettings
from support.health_kv import gpu_health, put_health
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

NODE = "node-q"
A, B = "GPU-aaaa", "GPU-bbbb"


@asynccontextmanager
async def view_on(server: EmbeddedNats) -> AsyncIterator[tuple[Bus, NodeView]]:
    async with Bus.connect(NatsSettings(url=server.url), name="q") as bus:
        await put_health(bus, NODE, gpu_health(A, healthy=True, xid=None))
        view = NodeView(bus, NODE, retry_s=0.05, who="test")
        async with anyio.create_task_group() as tg:
            await tg.start(view.run)
            with anyio.fail_after(5):
                await view.health_seen.wait()
            yield bus, view
            tg.cancel_scope.cancel()


async def test_a_machine_holds_its_gpu_out_of_service_until_returned(
    nats_server: EmbeddedNats,
) -> None:
    async with view_on(nats_server) as (bus, view):
        kv = await bus.key_value(HEAL_KV_BUCKET)
        assert view.healthy(A)
        record = HealRecord(gpu_uuid=A, state="evicting", cause="xid:79", started_at=5.0)
        revision = await kv.put(heal_key(NODE, A), HEAL_RECORD.encode(record))
        await wait_until(lambda: not view.healthy(A), what="A quarantined")
        assert A in view.unhealthy()
        assert B not in view.unhealthy()
        health = view.health(A)
        assert health is not None
        assert [c.condition for c in health.conditions] == ["remediation:quarantined"]
        # The DRA slice's taint, from the same read.
        wanted = taints.health_taints(health, driver="gpu.gpulet.io")
        assert wanted[0][0][2] == "NoSchedule"
        assert wanted[0][0][0] == "gpu.gpulet.io/unhealthy"
        # Escalated: still out, saying so.
        record.state, record.detail = "escalated", "the reset failed"
        revision = await kv.update(heal_key(NODE, A), HEAL_RECORD.encode(record), last=revision)
        await wait_until(
            lambda: (
                [c.condition for c in (view.health(A) or health).conditions]
                == ["remediation:needs_reboot"]
            )
        )
        # A machine for a GPU the health service never named still holds it.
        await kv.put(heal_key(NODE, B), HEAL_RECORD.encode(HealRecord(gpu_uuid=B, state="retired")))
        await wait_until(lambda: not view.healthy(B))
        assert view.healths()[B].conditions[0].action == "hardware_inspection"
        # Returned: in service again, its last reset known.
        record.state, record.last_reset = "returned", "2026-12-06T03:10:42Z xid:79"
        await kv.update(heal_key(NODE, A), HEAL_RECORD.encode(record), last=revision)
        await wait_until(lambda: view.healthy(A), what="A back")
        assert A not in view.unhealthy()
        assert view.last_reset(A) == "2026-12-06T03:10:42Z xid:79"
        assert view.last_reset(B) == ""


async def test_an_unreadable_machine_record_fails_closed(nats_server: EmbeddedNats) -> None:
    async with view_on(nats_server) as (bus, view):
        kv = await bus.key_value(HEAL_KV_BUCKET)
        await kv.put(heal_key(NODE, A), b"\xff not json")
        await wait_until(lambda: not view.healthy(A), what="A held")
        # A record under A's key that names B holds A, not B.
        await kv.put(
            heal_key(NODE, B), HEAL_RECORD.encode(HealRecord(gpu_uuid=A, state="returned"))
        )
        await wait_until(lambda: not view.healthy(B), what="B held")
