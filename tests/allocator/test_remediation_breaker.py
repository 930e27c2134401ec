"""The node breaker that holds: it counts a flapping GPU's fault episodes and the pods
evicted, not only GPUs, and its window survives a restart (kept in the node's KV on a
real nats-server). The loop runs against a fake API (as test_remediation_policy.py)."""

from __future__ import annotations

import pytest

from gpulet_allocator.service.remediate.breaker import Breaker, BreakerState
from gpulet_allocator.service.remediate.heal_store import KvBreakerStore
from gpulet_allocator.service.remediate.runner import Remediator, Sources
from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.heal import HEAL_KV_BUCKET
from gpulet_common.settings.nats import NatsSettings
from gpulet_common.settings.remediation import RemediationSettings
from support.remediation_fakes import Clock, FakeKube, Node, health, no_podresources

pytestmark = pytest.mark.anyio


async def test_a_flapping_gpu_does_not_evict_a_pod_each_time() -> None:
    clock, kube, node = Clock(), FakeKube(), Node()
    settings = RemediationSettings(mode="evict", window_s=600, max_faults_per_gpu=2)
    r = node.remediator(settings, kube, clock)
    for flap in range(10):  # fails, its pod is evicted and replaced, recovers, fails again
        node.healths["GPU-1"] = health(1, True)
        await r.step()
        node.pod_of[1] = f"p1-{flap + 1}"
        node.healths["GPU-1"] = health(1, False)
        await r.step()
        clock.now += 50  # ten flaps in 500 s
    assert kube.evictions == ["p1-0", "p1-1"]
    assert "GpuletRemediationBreakerOpen" in kube.reasons
    # The window passes: the next fault is remediated again.
    clock.now += 600
    node.healths["GPU-1"] = health(1, True)
    await r.step()
    assert kube.evictions[-1] == "p1-10"


async def test_evictions_are_counted_as_well_as_gpus() -> None:
    clock, kube, node = Clock(), FakeKube(), Node()
    settings = RemediationSettings(mode="evict", max_fraction=1.0, max_evictions=3)
    r = node.remediator(settings, kube, clock)
    for n in range(4):
        node.healths[f"GPU-{n}"] = health(n, True)
    await r.step()
    assert len(kube.evictions) == 3
    plan = await r.plan()
    assert (plan.breaker.evictions, plan.breaker.max_evictions) == (3, 3)
    held = [p for g in plan.gpus for p in g.pods if p.state == "held_by_breaker"]
    assert [p.name for p in held] == ["p3-0"]


async def test_a_restart_inside_the_window_admits_no_fresh_batch(
    nats_server: EmbeddedNats,
) -> None:
    settings = RemediationSettings(mode="evict", max_fraction=0.25, window_s=600)
    async with Bus.connect(NatsSettings(url=nats_server.url), name="breaker") as bus:
        kv = await bus.key_value(HEAL_KV_BUCKET)
        clock, kube, node = Clock(), FakeKube(), Node()
        first = node.remediator(settings, kube, clock, KvBreakerStore(kv, "node-a"))
        await first.restore_breaker()
        node.healths["GPU-0"] = health(0, True)
        await first.step()
        await first.save_breaker()
        assert kube.evictions == ["p0-0"]
        # GPU 0 recovers; the agent restarts 100 s later; GPU 2 fails: a quarter of 4
        # GPUs is 1, taken within the window.
        node.healths["GPU-0"] = health(0, False)
        clock.now += 100
        second = node.remediator(settings, kube, clock, KvBreakerStore(kv, "node-a"))
        await second.restore_breaker()
        node.healths["GPU-2"] = health(2, True)
        await second.step()
        assert kube.evictions == ["p0-0"]
        assert second.breaker.open
        # After the window, it goes on.
        clock.now += 600
        await second.step()
        assert kube.evictions == ["p0-0", "p2-0"]
        # Without the kept window the restart would have evicted at once.
        fresh = node.remediator(settings, FakeKube(), Clock())
        await fresh.step()
        assert not fresh.breaker.open


async def test_an_unreadable_breaker_state_fails_closed(nats_server: EmbeddedNats) -> None:
    async with Bus.connect(NatsSettings(url=nats_server.url), name="breaker") as bus:
        kv = await bus.key_value(HEAL_KV_BUCKET)
        await kv.put("node-a.breaker", b"[1, 2")
        clock, kube, node = Clock(), FakeKube(), Node()
        settings = RemediationSettings(mode="evict", max_fraction=1.0)
        r = node.remediator(settings, kube, clock, KvBreakerStore(kv, "node-a"))
        await r.restore_breaker()
        node.healths["GPU-0"] = health(0, True)
        await r.step()
        assert kube.evictions == []


def test_restore_clamps_times_from_the_future() -> None:
    clock = Clock()
    breaker = Breaker(0.5, 600, clock, max_evictions=1)
    breaker.restore(BreakerState(evictions=[clock.now + 1e9], admitted={"GPU-9": float("nan")}))
    assert not breaker.may_evict()
    assert breaker.in_window() == ["GPU-9"]
    clock.now += 600
    assert breaker.may_evict()
    assert breaker.in_window() == []


async def test_a_machine_wake_up_is_translated_to_the_loop_clock() -> None:
    """The machines keep wall-clock deadlines (the settle window's end); the loop sleeps
    on its monotonic clock: the next look comes when the machine asked, not an hour on."""
    wall, mono, kube, node = Clock(), Clock(), FakeKube(), Node()
    mono.now = 1000.0
    settings = RemediationSettings(mode="reset")
    sources = Sources(
        healths=lambda: node.healths,
        node_gpus=lambda: 4,
        mig_devices=lambda _: [],
        ledger=lambda: ([], []),
        pod_resources=lambda: no_podresources(),
    )
    r = Remediator(settings, "node-a", sources, kube, clock=mono, wall=wall)

    class Settling:
        async def run_pass(self, _faults: object) -> float:
            return wall.now + 5.0  # the settle window ends in 5 s

    r.healer = Settling()  # type: ignore[assignment]
    assert await r.step() == 1005.0
    node.healths["GPU-0"] = health(0, True)
    assert await r.step() == 1005.0
