"""A forged, future-dated health event misleads no consumer.

The hardening issue's finding: the allocator's feed and the reporter's health view
kept "the newest ``observed_at``", so one event dated ``1e18`` saying "healthy" made
the allocator hand out a GPU the health service reported with XID 79 (and froze the
reporter on ``rfc3339(1e18)``). Consumers now read the health service's KV state
through a :class:`~gpulet_common.nodeview.NodeView`, ordered by KV revision; events
are for alerting only.

Everything real but NVML (mock dgx-h100) and the cluster (the Kubernetes API
emulator, a fake kubelet): a nats-server, the collector and the health service, the
allocator, the device plugin and the reporter, each on its own connection. GPU 3
gets XID 79; then a forged event on ``gpu.health.<node>`` says it recovered, dated
``1e18`` (and another says healthy GPU 5 failed). A real fault on GPU 6 afterwards
is the marker: once every consumer shows it, the forged events (published before
it) have been delivered to anyone listening.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import grpc
import grpc.aio
import msgspec
import pytest

from gpulet_allocator.kubelet.deviceplugin.service import DevicePluginService
from gpulet_allocator.service import AllocatorService
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import HealthEvent
from gpulet_common.mock_nvml import SCENARIO_DIR
from gpulet_common.settings.nats import NatsSettings
from gpulet_common.settings.reporter import ReporterSettings
from support.agent import runtime_for
from support.allocator_stack import GPU, dev_root_with, make_settings, rpc_error
from support.fake_kubelet import FakeKubelet, running_fake_kubelet
from support.faults import device_view
from support.health_harness import NODE, HealthNode, health_node
from support.kube_emulator import KubeEmulator
from support.reporter_harness import RunningReporter, running_reporter
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

DGX = SCENARIO_DIR / "dgx-h100.toml"
SICK, FINE, MARKER = 3, 5, 6


@dataclass
class Node:
    health: HealthNode
    allocator: AllocatorService
    plugin: DevicePluginService
    reporter: RunningReporter
    kubelet: FakeKubelet
    emulator: KubeEmulator

    def uuid(self, gpu: int) -> str:
        return self.health.uuid(gpu)

    def beliefs(self, gpu: int) -> dict[str, bool | None]:
        """Whether each consumer believes ``gpu`` healthy (None: it does not know it)."""
        uuid = self.uuid(gpu)
        listed = {d.ID: d.health == "Healthy" for d in self.kubelet.devices(GPU)}
        device = device_view(self.emulator, NODE).get(uuid)
        ledger = {d.uuid: d.healthy for d in self.allocator.core.ledger.devices()}
        return {
            "allocator": ledger.get(uuid),
            "device plugin": listed.get(uuid),
            "reporter": None if device is None else device.health,
        }


@asynccontextmanager
async def whole_node(nats_url: str, tmp_path: Path) -> AsyncIterator[Node]:
    short = Path(tempfile.mkdtemp(prefix="gpl-"))  # unix sockets: 107 bytes at most
    settings = make_settings(
        nats_url, tmp_path / "alloc", short / "dp", dev_root_with(tmp_path / "dev", 8)
    )
    settings = msgspec.structs.replace(settings, node_name=NODE)
    (short / "dp").mkdir()
    try:
        async with (
            KubeEmulator.running() as emulator,
            health_node(nats_url, tmp_path, scenario=DGX) as health,
            running_fake_kubelet(short / "dp") as kubelet,
            AsyncExitStack() as exits,
        ):
            emulator.add_node(NODE)
            kubeconfig = emulator.write_kubeconfig(tmp_path / "kubeconfig")
            reporter = await exits.enter_async_context(
                running_reporter(
                    nats_url,
                    tmp_path / "reporter",
                    NODE,
                    ReporterSettings(mode="cluster", kubeconfig=str(kubeconfig)),
                )
            )
            allocator = AllocatorService(
                await exits.enter_async_context(runtime_for(settings, name="allocator"))
            )
            plugin = DevicePluginService(
                await exits.enter_async_context(runtime_for(settings, name="plugin"))
            )
            tg = await exits.enter_async_context(anyio.create_task_group())
            await tg.start(allocator.run)
            await tg.start(plugin.run)
            node = Node(health, allocator, plugin, reporter, kubelet, emulator)
            await kubelet.wait_registered(GPU, timeout_s=10)
            await wait_until(
                lambda: all(set(node.beliefs(i).values()) == {True} for i in range(8)),
                timeout_s=15,
                what="every consumer to list 8 healthy GPUs",
            )
            yield node
            tg.cancel_scope.cancel()
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _forged(uuid: str, *, healthy: bool) -> HealthEvent:
    return HealthEvent(
        event_id=f"forged-{uuid}",
        node=NODE,
        gpu_uuid=uuid,
        kind="recovered" if healthy else "xid",
        severity="info" if healthy else "fatal",
        healthy=healthy,
        reason="forged",
        xid=None if healthy else 79,
        condition="xid:79",
        observed_at=1e18,
        published_at=1e18,
        condition_since=1e18,
    )


async def test_a_forged_future_dated_event_changes_no_consumers_belief(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with whole_node(nats_server.url, tmp_path) as node:
        everyone = {"allocator": False, "device plugin": False, "reporter": False}
        node.health.inject("xid", gpu=SICK, value=79)
        await wait_until(
            lambda: node.beliefs(SICK) == everyone, timeout_s=10, what="XID 79 seen by all"
        )
        assert not node.health.service.engine.gpus[node.uuid(SICK)].healthy

        async with Bus.connect(NatsSettings(url=nats_server.url), name="forger") as forger:
            for event in (
                _forged(node.uuid(SICK), healthy=True),
                _forged(node.uuid(FINE), healthy=False),
            ):
                await forger.publish(subjects.health(NODE), event, codec.HEALTH_EVENT)
            await forger.flush()

        node.health.inject("xid", gpu=MARKER, value=79)
        await wait_until(
            lambda: node.beliefs(MARKER) == everyone, timeout_s=10, what="the marker fault"
        )
        assert node.beliefs(SICK) == everyone
        assert node.beliefs(FINE) == dict.fromkeys(everyone, True)

        # The allocator does not hand the GPU out, asked for it by name.
        refusal = await rpc_error(node.kubelet.allocate(GPU, [[node.uuid(SICK)]]))
        assert refusal.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "unhealthy_device" in (refusal.details() or "")
        # Nor when it chooses: every whole GPU that is free and healthy, and no more.
        healthy = [node.uuid(i) for i in range(8) if i not in (SICK, MARKER)]
        [preferred] = await node.kubelet.preferred(GPU, [([node.uuid(i) for i in range(8)], [], 6)])
        assert sorted(preferred) == sorted(healthy)
        # The reporter kept writing (the marker reached the Device), without a failure.
        assert node.reporter.probe.value("gpulet.reporter.write_failures") == 0
