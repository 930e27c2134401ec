"""The collector publishing through a real nats-server against the mock NVML."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from gpulet_collector.service import CollectorService
from gpulet_common import codec, subjects
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import Inventory, InventoryRequest, MockInjectRequest
from gpulet_common.mock_nvml.faultspec import FaultSpec
from gpulet_common.runtime import Runtime
from gpulet_common.settings.nvml import NvmlSettings
from support.agent import agent_settings, mock_adapter, runtime_for
from support.host import HIDDEN_DRIVER, without_driver
from support.metrics import MetricsProbe

pytestmark = pytest.mark.anyio


async def test_publishes_inventory_then_samples_of_every_gpu(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    settings = agent_settings(
        nats_server.url,
        tmp_path,
        node="gpu-node.example.com",
        overrides=["collector.sample_period_s=0.05"],
    )
    adapter, _mock = mock_adapter("dgx-h100")
    async with runtime_for(settings, adapter=adapter) as rt:
        node = settings.node_name
        async with (
            rt.bus.subscribe(subjects.inventory(node), codec.INVENTORY) as inventories,
            rt.bus.subscribe(subjects.samples(node), codec.SAMPLES) as batches,
            anyio.create_task_group() as tg,
        ):
            await tg.start(CollectorService(rt).run)
            with anyio.fail_after(5):
                inventory = (await anext(aiter(inventories))).value
                first = (await anext(aiter(batches))).value
                second = (await anext(aiter(batches))).value
            tg.cancel_scope.cancel()
    assert inventory.node == node
    assert len(inventory.gpus) == 8
    assert inventory.nvml_backend == "mock"
    assert {g.name for g in inventory.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert all(len(g.topology) == 7 for g in inventory.gpus)
    assert all(link.nvlinks == 18 for g in inventory.gpus for link in g.topology)
    assert [s.index for s in first.samples] == list(range(8))
    assert all(s.error is None and s.temperature_c is not None for s in first.samples)
    assert {s.uuid for s in first.samples} == {g.uuid for g in inventory.gpus}
    assert 0.02 < second.timestamp - first.timestamp < 1.0
    # The collector's own order (gpulet_common.ordering): one process, rising seq.
    assert inventory.boot_id == first.boot_id == second.boot_id != ""
    assert 0 < inventory.seq < first.seq < second.seq


async def test_inventory_on_request_and_after_hot_add(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    settings = agent_settings(
        nats_server.url, tmp_path, overrides=["collector.sample_period_s=0.05"]
    )
    adapter, mock = mock_adapter("dgx-h100")
    async with runtime_for(settings, adapter=adapter) as rt, anyio.create_task_group() as tg:
        node = settings.node_name
        async with rt.bus.subscribe(subjects.inventory(node), codec.INVENTORY) as inventories:
            await tg.start(CollectorService(rt).run)
            with anyio.fail_after(5):
                assert len((await anext(aiter(inventories))).value.gpus) == 8
            answer = await rt.bus.request(
                subjects.inventory_request(node),
                InventoryRequest(),
                codec.INVENTORY_REQUEST,
                codec.INVENTORY,
            )
            assert len(answer.gpus) == 8
            with anyio.fail_after(2):
                assert (await anext(aiter(inventories))).value.generation == answer.generation
            reply = mock.inject(MockInjectRequest(fault="hot_add"))
            assert reply.applied, reply.detail
            with anyio.fail_after(5):
                grown = (await anext(aiter(inventories))).value
        tg.cancel_scope.cancel()
    assert len(grown.gpus) == 9
    assert grown.generation > answer.generation


async def test_a_hung_gpu_does_not_delay_the_others(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    settings = agent_settings(
        nats_server.url,
        tmp_path,
        overrides=["collector.sample_period_s=0.1", "nvml.call_timeout_s=0.2"],
    )
    adapter, mock = mock_adapter("dgx-h100")
    async with runtime_for(settings, adapter=adapter) as rt, anyio.create_task_group() as tg:
        async with rt.bus.subscribe(subjects.samples(settings.node_name), codec.SAMPLES) as batches:
            await tg.start(CollectorService(rt).run)
            assert mock.inject(MockInjectRequest(gpu=3, fault="hang", duration_s=2.0)).applied
            seen = []
            started = time.monotonic()
            with anyio.fail_after(5):
                async for delivery in batches:
                    seen.append((time.monotonic(), delivery.value))
                    if len(seen) == 6:
                        break
        tg.cancel_scope.cancel()
    hung = [b for _, b in seen if b.samples[3].error == "timeout"]
    assert len(hung) >= 4, "GPU 3 should be reported as hung while it hangs"
    for _, batch in seen:
        healthy = [s for s in batch.samples if s.index != 3]
        assert all(s.error is None and s.temperature_c is not None for s in healthy)
    # Six batches of a 0.1 s period with one GPU stuck for 2 s: the others kept their pace.
    assert seen[-1][0] - started < 1.6


async def test_lost_gpu_is_reported_in_samples(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    settings = agent_settings(
        nats_server.url, tmp_path, overrides=["collector.sample_period_s=0.05"]
    )
    adapter, mock = mock_adapter("dgx-h100")
    probe = MetricsProbe()
    async with (
        runtime_for(settings, adapter=adapter, meter=probe.meter) as rt,
        anyio.create_task_group() as tg,
    ):
        async with rt.bus.subscribe(subjects.samples(settings.node_name), codec.SAMPLES) as batches:
            await tg.start(CollectorService(rt).run)
            assert mock.inject(MockInjectRequest(gpu=5, fault="lost")).applied
            with anyio.fail_after(5):
                async for delivery in batches:
                    if delivery.value.samples[5].error == "lost":
                        break
        tg.cancel_scope.cancel()
    assert probe.value("gpulet.collector.sample_errors") >= 1


async def test_without_nvml_the_collector_runs_degraded_and_says_why(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # The real pynvml on a machine made driverless: the library path does not exist.
    settings = agent_settings(
        nats_server.url, tmp_path, overrides=["nvml.backend=auto", *without_driver()]
    )
    assert settings.nvml == NvmlSettings(backend="auto", library=HIDDEN_DRIVER)
    async with runtime_for(settings) as rt, anyio.create_task_group() as tg:
        async with rt.bus.subscribe(
            subjects.inventory(settings.node_name), codec.INVENTORY
        ) as inventories:
            await tg.start(CollectorService(rt).run)
            with anyio.fail_after(5):
                inventory = (await anext(aiter(inventories))).value
        status = rt.status.get("collector")
        tg.cancel_scope.cancel()
    assert inventory.gpus == []
    assert inventory.degraded_reason is not None
    assert "--nvml mock" in inventory.degraded_reason
    assert HIDDEN_DRIVER in inventory.degraded_reason
    assert status is not None
    assert status.state == "degraded"


async def test_recovers_when_nvml_vanishes_and_returns(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    settings = agent_settings(
        nats_server.url, tmp_path, overrides=["collector.sample_period_s=0.05"]
    )
    adapter, mock = mock_adapter("dgx-h100")
    async with runtime_for(settings, adapter=adapter) as rt, anyio.create_task_group() as tg:
        async with rt.bus.subscribe(subjects.samples(settings.node_name), codec.SAMPLES) as batches:
            await tg.start(CollectorService(rt).run)
            assert mock.inject(MockInjectRequest(fault="nvml_vanish")).applied
            with anyio.fail_after(5):
                async for delivery in batches:
                    if all(
                        (s.error or "").startswith("nvml_unavailable")
                        for s in delivery.value.samples
                    ):
                        break
            status = rt.status.get("collector")
            assert status is not None
            assert status.state == "degraded"
            assert mock.inject(MockInjectRequest(fault="nvml_return")).applied
            with anyio.fail_after(10):
                async for delivery in batches:
                    if all(s.error is None for s in delivery.value.samples):
                        break
            status = rt.status.get("collector")
        tg.cancel_scope.cancel()
    assert status is not None
    assert status.state == "ready"


async def test_an_nvlink_going_down_and_up_republishes_the_inventory(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    settings = agent_settings(
        nats_server.url,
        tmp_path,
        # A link going down moves the recovery counter (read at once); one coming back
        # does not: it is seen on the next nvlink_state_period_s.
        overrides=[
            "collector.sample_period_s=0.05",
            "collector.slow_period_s=0.1",
            "collector.nvlink_state_period_s=0.3",
        ],
    )
    adapter, mock = mock_adapter("nvlink-pairs-8gpu")
    probe = MetricsProbe()
    collector: CollectorService
    async with (
        runtime_for(settings, adapter=adapter, meter=probe.meter) as rt,
        anyio.create_task_group() as tg,
    ):
        node = settings.node_name
        async with rt.bus.subscribe(subjects.inventory(node), codec.INVENTORY) as inventories:
            collector = CollectorService(rt)
            await tg.start(collector.run)
            with anyio.fail_after(5):
                first = (await anext(aiter(inventories))).value
            publishes = collector.inventory_publishes
            # Two of the four links between GPU 0 and GPU 1 go down (both ends).
            for link in (0, 1):
                reply = mock.inject(MockInjectRequest(fault="nvlink_down", gpu=0, value=link))
                assert reply.applied, reply.detail
            with anyio.fail_after(5):
                async for delivery in inventories:
                    down = delivery.value
                    if down.gpus[0].nvlinks_down == [0, 1]:
                        break
            gpu0 = down.gpus[0].uuid
            assert probe.value("gpulet.gpu.nvlinks.down", UUID=gpu0) == 2
            assert probe.value("gpulet.gpu.nvlinks.up", UUID=gpu0) == 4  # of 6
            reply = mock.inject(MockInjectRequest(fault="nvlink_up", gpu=0))
            assert reply.applied, reply.detail
            with anyio.fail_after(5):
                async for delivery in inventories:
                    up = delivery.value
                    if not up.gpus[0].nvlinks_down:
                        break
            # Steady links: no more inventories than the changes (the slow period
            # ran many times meanwhile).
            await anyio.sleep(0.5)
            changes = collector.inventory_publishes - publishes
        tg.cancel_scope.cancel()

    def pair(inventory: Inventory, a: int, b: int) -> tuple[int, int]:
        link = next(p for p in inventory.gpus[a].topology if p.peer_index == b)
        return link.nvlinks, link.nvlinks_down

    assert pair(first, 0, 1) == pair(first, 1, 0) == (4, 0)
    assert pair(down, 0, 1) == pair(down, 1, 0) == (2, 2)
    assert len(down.gpus[1].nvlinks_down) == 2
    assert pair(down, 0, 2) == (1, 0)
    assert down.generation > first.generation
    assert pair(up, 0, 1) == (4, 0)
    assert up.gpus[0].nvlinks_up == first.gpus[0].nvlinks_up
    assert up.generation > down.generation
    assert changes <= 3  # at most: one down (or two, a link at a time), one up


async def test_a_mig_layout_change_republishes_the_inventory(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    settings = agent_settings(
        nats_server.url,
        tmp_path,
        overrides=["collector.sample_period_s=0.05", "collector.slow_period_s=0.1"],
    )
    adapter, mock = mock_adapter("a100-mig-mixed")
    async with (
        runtime_for(settings, adapter=adapter) as rt,
        anyio.create_task_group() as tg,
    ):
        node = settings.node_name
        async with rt.bus.subscribe(subjects.inventory(node), codec.INVENTORY) as inventories:
            collector = CollectorService(rt)
            await tg.start(collector.run)
            with anyio.fail_after(5):
                first = (await anext(aiter(inventories))).value
            assert (first.gpus[2].mig_mode, first.gpus[2].mig_devices) == ("enabled", [])
            # Many slow periods with the layout as it is: nothing new is published.
            seen = collector.inventory_publishes
            await wait_batches(rt, node, 20)
            assert collector.inventory_publishes == seen
            # Two GPU instances are created on GPU 2 (MIG enabled, empty until now).
            layout = {
                "mode": "enabled",
                "devices": [
                    {"gi": 1, "ci": 0, "profile": "4g.20gb"},
                    {"gi": 2, "ci": 0, "profile": "3g.20gb"},
                ],
            }
            applied, detail = mock.apply(FaultSpec(fault="mig", gpu=2, spec=layout))
            assert applied, detail
            with anyio.fail_after(5):
                async for delivery in inventories:
                    changed = delivery.value
                    if changed.gpus[2].mig_devices:
                        break
        tg.cancel_scope.cancel()
    assert [d.profile for d in changed.gpus[2].mig_devices] == ["4g.20gb", "3g.20gb"]
    assert changed.generation > first.generation
    assert changed.gpus[0].mig_devices == first.gpus[0].mig_devices


async def wait_batches(rt: Runtime, node: str, count: int) -> None:
    """Wait until ``count`` more sample batches were published (a condition, no pause)."""
    async with rt.bus.subscribe(subjects.samples(node), codec.SAMPLES) as batches:
        with anyio.fail_after(10):
            seen = 0
            async for _ in batches:
                seen += 1
                if seen >= count:
                    return
