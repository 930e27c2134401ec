"""A GPU that disappears and comes back is read again, without any restart (issue 28).

One process runs the real collector and health service over one mock NVML, and the
real allocator and device plugin in front of the fake kubelet. GPU 1 of four is
removed, then comes back as a new device: a new handle (the old one answers
INVALID_ARGUMENT, as a handle of a previous enumeration does) at a new NVML index
(enumerated after the others). The collector's inventory and samples, the health
state (healthy again on the scan's evidence, its events watched again through the
new handle) and the device list kubelet gets from ListAndWatch all follow; the
service objects are the ones started at the beginning.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import pytest

from gpulet_collector.service import CollectorService
from gpulet_common import codec, subjects
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import HealthEvent, MockInjectRequest, SampleBatch
from gpulet_common.mock_nvml import MockNvml, scenario_from_toml
from gpulet_common.mock_nvml.faultspec import FaultSpec
from gpulet_common.nvml.adapter import NvmlAdapter
from gpulet_common.settings.collector import CollectorSettings
from gpulet_health.service import HealthService
from support.agent import runtime_for
from support.allocator_stack import GPU, Stack, allocator_stack, dev_root_with, make_settings
from support.health_harness import until

pytestmark = pytest.mark.anyio

# Four GPUs, their identities drawn from the seed; no NVLink.
FOUR_GPUS = 'base = "t4"\njitter = false\n' + "[[gpus]]\n" * 4


@dataclass
class Seen:
    """What a plain subscriber of the node's health events and samples received."""

    events: list[HealthEvent]
    batches: list[SampleBatch]

    def health(self, uuid: str, kind: str, condition: str | None = None) -> list[HealthEvent]:
        return [
            e
            for e in self.events
            if e.gpu_uuid == uuid and e.kind == kind and condition in (None, e.condition)
        ]

    def sampled(self, uuid: str, index: int) -> bool:
        """A batch read the GPU, without error, at that index."""
        return any(
            s.uuid == uuid and s.index == index and s.error is None
            for b in self.batches[-3:]
            for s in b.samples
        )


@dataclass
class Node:
    stack: Stack
    mock: MockNvml
    collector: CollectorService
    health: HealthService
    seen: Seen

    def inject(self, fault: str, gpu: int, value: float | None = None) -> None:
        reply = self.mock.inject(MockInjectRequest(fault=fault, gpu=gpu, value=value))
        assert reply.applied, reply.detail

    def plugin_health(self) -> dict[str, str]:
        """kubelet's last device list for nvidia.com/gpu: device ID -> health."""
        return {d.ID: d.health for d in self.stack.kubelet.devices(GPU)}

    async def until(self, check: Callable[[], object], what: str) -> None:
        try:
            await until(lambda: bool(check()), within=10.0)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}") from None


async def _follow(stack: Stack, seen: Seen, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    async with (
        stack.bus.subscribe(subjects.health(stack.node), codec.HEALTH_EVENT) as events,
        stack.bus.subscribe(subjects.samples(stack.node), codec.SAMPLES) as samples,
        anyio.create_task_group() as tg,
    ):
        await stack.bus.flush()

        async def take_samples() -> None:
            async for delivery in samples:
                seen.batches.append(delivery.value)
                del seen.batches[:-50]

        tg.start_soon(take_samples)
        task_status.started()
        async for delivery in events:
            seen.events.append(delivery.value)


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    # Short: a unix socket path must fit in 108 bytes, pytest's tmp_path may not.
    with tempfile.TemporaryDirectory(prefix="gpl-") as d:
        yield Path(d)


@pytest.fixture
async def node(nats_server: EmbeddedNats, tmp_path: Path, plugin_dir: Path) -> AsyncIterator[Node]:
    settings = make_settings(
        nats_server.url, tmp_path / "state", plugin_dir, dev_root_with(tmp_path / "dev", 8)
    )
    settings = msgspec.structs.replace(
        settings,
        collector=CollectorSettings(sample_period_s=0.05, dcgm_metrics=False),
        health=msgspec.structs.replace(
            settings.health, tick_s=0.1, device_poll_s=0.1, event_wait_timeout_ms=50
        ),
    )
    mock = MockNvml(scenario_from_toml(FOUR_GPUS), jitter=False)
    adapter = NvmlAdapter(mock, backend="mock")
    adapter.init()
    seen = Seen([], [])
    try:
        async with (
            allocator_stack(
                settings,
                inventory=None,
                start_allocator=False,
                start_plugin=False,
                stand_in_collector=False,
            ) as stack,
            runtime_for(settings, adapter=adapter, name="test-health") as health_rt,
            anyio.create_task_group() as tg,
        ):
            await tg.start(_follow, stack, seen)
            collector = await stack.start_collector(adapter)
            health = HealthService(health_rt)
            await tg.start(health.run)
            await stack.start_allocator()
            await stack.wait_allocator_ready()
            await stack.start_plugin()
            await stack.kubelet.wait_registered(GPU, timeout_s=5)
            await stack.kubelet.wait_devices(GPU, lambda d: len(d) == 4, timeout_s=5)
            yield Node(stack, mock, collector, health, seen)
            tg.cancel_scope.cancel()
    finally:
        mock.close()
        adapter.shutdown()


async def test_a_gpu_removed_and_returned_at_a_new_index_comes_back_without_a_restart(
    node: Node,
) -> None:
    uuid = node.mock.slot_uuid(1)
    collector, health = node.collector, node.health
    first = collector.inventory
    assert [g.uuid for g in first.gpus] == [node.mock.slot_uuid(i) for i in range(4)]
    assert set(node.plugin_health().values()) == {"Healthy"}

    # Gone: out of the inventory and the device list, unhealthy in the health state.
    node.inject("remove", gpu=1)
    await node.until(lambda: node.seen.health(uuid, "gpu_removed"), "gpu_removed")
    await node.until(lambda: uuid not in {g.uuid for g in collector.inventory.gpus}, "inventory")
    await node.until(lambda: node.plugin_health().get(uuid, "Unhealthy") == "Unhealthy", "plugin")
    assert not health.engine.gpus[uuid].present

    # Back, as a new device at a new index (3; the GPUs after it moved up and back).
    node.inject("hot_add", gpu=1, value=1)
    await node.until(
        lambda: (
            [(g.index, g.uuid) for g in collector.inventory.gpus]
            == [
                (0, node.mock.slot_uuid(0)),
                (1, node.mock.slot_uuid(2)),
                (2, node.mock.slot_uuid(3)),
                (3, uuid),
            ]
        ),
        "the inventory to list the GPU again at index 3",
    )
    assert collector.inventory.generation > first.generation
    [added] = await _wait(node, lambda: node.seen.health(uuid, "gpu_added"))
    assert added.healthy
    assert added.gpu_index == 3
    await _wait(node, lambda: node.seen.health(uuid, "recovered", "removed"))
    gpu = health.engine.gpus[uuid]
    assert (gpu.present, gpu.index, gpu.conditions) == (True, 3, {})
    await node.until(lambda: node.seen.sampled(uuid, 3), "a sample of the GPU at index 3")
    await node.until(lambda: node.plugin_health().get(uuid) == "Healthy", "kubelet told Healthy")
    assert set(node.plugin_health().values()) == {"Healthy"}
    assert len(node.plugin_health()) == 4

    # Its events are watched through the new handle: a fatal XID reaches everyone.
    node.inject("xid", gpu=1, value=79)
    [xid] = await _wait(node, lambda: node.seen.health(uuid, "xid"))
    assert (xid.xid, xid.healthy, xid.gpu_index) == (79, False, 3)
    await node.until(lambda: node.plugin_health().get(uuid) == "Unhealthy", "kubelet told")
    assert node.plugin_health()[node.mock.slot_uuid(2)] == "Healthy"

    # Same services throughout: nothing was restarted.
    assert (node.collector, node.health) == (collector, health)
    assert node.stack.kubelet.registration_count(GPU) == 1
    assert not [e for e in node.seen.events if e.kind == "nvml_unavailable"]


async def _wait(node: Node, found: Callable[[], list[HealthEvent]]) -> list[HealthEvent]:
    await node.until(found, "health events")
    return found()


async def test_a_gpu_that_went_and_came_back_between_two_counts_is_followed(
    node: Node,
) -> None:
    """The count never changes: the old handle answers INVALID_ARGUMENT, the sample at
    index 1 names another GPU, the collector rebuilds the inventory, the health scan
    registers the events again (through the new handle)."""
    uuid = node.mock.slot_uuid(1)
    first = node.collector.inventory
    registrations = node.health.scanner.registrations
    applied = node.mock.apply_together(
        FaultSpec(fault="remove", gpu=1), FaultSpec(fault="hot_add", gpu=1, value=1)
    )
    assert all(ok for ok, _ in applied), applied
    await node.until(
        lambda: {g.uuid: g.index for g in node.collector.inventory.gpus}.get(uuid) == 3,
        "the inventory to list the GPU at index 3",
    )
    assert node.collector.inventory.generation > first.generation
    await node.until(lambda: node.seen.sampled(uuid, 3), "a sample of the GPU at index 3")
    await node.until(lambda: node.health.engine.gpus[uuid].index == 3, "health to follow")
    # The scan saw the GPUs at other indices and had their events registered again.
    await node.until(
        lambda: node.health.scanner.registrations > registrations, "events registered again"
    )
    # Its events are watched through the new handle, and the others' still are.
    node.inject("xid", gpu=1, value=79)
    [xid] = await _wait(node, lambda: node.seen.health(uuid, "xid"))
    assert (xid.xid, xid.gpu_index, xid.healthy) == (79, 3, False)
    other = node.mock.slot_uuid(2)
    node.inject("xid", gpu=2, value=13)
    [app] = await _wait(node, lambda: node.seen.health(other, "xid"))
    assert app.gpu_index == 1
    await node.until(lambda: node.plugin_health().get(uuid) == "Unhealthy", "kubelet told")
    assert not [e for e in node.seen.events if e.kind in ("gpu_lost", "nvml_unavailable")]
