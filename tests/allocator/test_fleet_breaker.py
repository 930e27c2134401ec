"""The fleet breaker: remediation slots in a KV bucket on a real nats-server (standing
for the hub), taken by compare-and-set from several nodes; and a node's remediation
loop held back while the fleet is full (against a fake API, as
test_remediation_breaker.py)."""

from __future__ import annotations

import anyio
import pytest

from gpulet_allocator.service.remediate.fleet import SLOTS_KEY, FleetSlots, fleet_slots
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import NodeStatus
from gpulet_common.settings.nats import NatsSettings
from gpulet_common.settings.remediation import FleetBreakerSettings, RemediationSettings
from support.remediation_fakes import Clock, FakeKube, Node, health

pytestmark = pytest.mark.anyio

BUCKET = "gpulet_remediation_slots"


def slots(kv: object, node: str, clock: Clock, *, max_gpus: int = 2, fleet: int = 0) -> FleetSlots:
    async def fleet_gpus() -> int:
        return fleet

    return FleetSlots(
        kv,  # type: ignore[arg-type]
        node,
        max_gpus=max_gpus,
        max_percent=5.0,
        ttl_s=600.0,
        fleet_gpus=fleet_gpus,
        clock=clock,
    )


async def test_at_most_n_gpus_of_the_fleet_at_once(nats_server: EmbeddedNats) -> None:
    clock = Clock()
    async with Bus.connect(NatsSettings(url=nats_server.url), name="hub") as bus:
        kv = await bus.key_value(BUCKET)
        a, b = slots(kv, "node-a", clock), slots(kv, "node-b", clock)
        assert await a.take("GPU-1") is None
        assert await a.take("GPU-1") is None  # already held: idempotent
        assert await b.take("GPU-7") is None
        full = await b.take("GPU-8")
        assert full is not None
        assert "fleet breaker full: 2 of at most 2" in full
        assert "node-a/GPU-1" in full
        assert await a.give("GPU-1")
        assert await b.take("GPU-8") is None
        assert await a.held() == ["node-b/GPU-7", "node-b/GPU-8"]
        # A node that died holding slots: they expire.
        clock.now += 601
        assert await a.take("GPU-2") is None
        assert await a.held() == ["node-a/GPU-2"]


async def test_compare_and_set_under_contention_admits_exactly_the_limit(
    nats_server: EmbeddedNats,
) -> None:
    clock = Clock()
    async with Bus.connect(NatsSettings(url=nats_server.url), name="hub") as bus:
        kv = await bus.key_value(BUCKET)
        takers = [slots(kv, f"node-{n}", clock, max_gpus=3) for n in range(8)]
        results: list[str | None] = [None] * 8

        async def take(n: int) -> None:
            results[n] = await takers[n].take("GPU-0")

        async with anyio.create_task_group() as tg:
            for n in range(8):
                tg.start_soon(take, n)
        assert sum(1 for r in results if r is None) == 3
        assert len(await takers[0].held()) == 3


async def test_percent_of_the_fleet_from_the_hubs_statuses(nats_server: EmbeddedNats) -> None:
    async with Bus.connect(NatsSettings(url=nats_server.url), name="hub") as bus:
        fleet = await bus.key_value(subjects.FLEET_KV_BUCKET)
        for n in range(5):  # 5 nodes of 8 GPUs: 40 GPUs; 5 % is 2
            status = NodeStatus(node=f"node-{n}", boot_id="b", seq=1, gpus=8)
            await fleet.put(subjects.fleet_kv_key(f"node-{n}"), codec.NODE_STATUS.encode(status))
        await fleet.put("node-bad", b"{broken")
        gate = await fleet_slots(bus, FleetBreakerSettings(enabled=True, max_gpus=8), "node-0")
        assert await gate.limit() == 2
        assert await gate.take("GPU-0") is None
        assert await gate.take("GPU-1") is None
        assert await gate.take("GPU-2") is not None


async def test_unreadable_slots_hold_everything_back(nats_server: EmbeddedNats) -> None:
    async with Bus.connect(NatsSettings(url=nats_server.url), name="hub") as bus:
        kv = await bus.key_value(BUCKET)
        await kv.put(SLOTS_KEY, b"not json")
        why = await slots(kv, "node-a", Clock()).take("GPU-0")
        assert why is not None
        assert "unreadable" in why


async def test_a_full_fleet_breaker_holds_the_node_back_until_a_slot_frees(
    nats_server: EmbeddedNats,
) -> None:
    clock, kube, node = Clock(), FakeKube(), Node()
    async with Bus.connect(NatsSettings(url=nats_server.url), name="hub") as bus:
        kv = await bus.key_value(BUCKET)
        other = slots(kv, "node-b", clock, max_gpus=1)
        assert await other.take("GPU-5") is None  # another node holds the only slot
        r = node.remediator(RemediationSettings(mode="evict"), kube, clock)
        r.fleet.slots_kv = slots(kv, "node-a", clock, max_gpus=1)
        node.healths["GPU-1"] = health(1, True)
        await r.step()
        assert kube.evictions == []
        assert "GPU-1" in r.fleet.held
        assert await r.holders_left("GPU-1") >= 1
        assert "GpuletRemediationBreakerOpen" in kube.reasons
        plan = await r.plan()
        assert "fleet breaker full" in plan.breaker.fleet
        await r.step()
        assert kube.reasons.count("GpuletRemediationBreakerOpen") == 1  # said once
        assert await other.give("GPU-5")
        await r.step()
        assert kube.evictions == ["p1-0"]
        assert await other.held() == ["node-a/GPU-1"]
        # The fault ends: the slot goes back.
        node.healths["GPU-1"] = health(1, False)
        await r.step()
        assert await other.held() == []
