"""GPUs the node is expected to have are remembered (issue 12).

* A GPU lost before the agent starts raises ``gpu_missing`` and stays in the Device
  with ``health: false``, even when JetStream (the KV bucket) is gone too: the health
  service's own file of expected GPUs is enough.
* A GPU lost while the agent runs stays in the Device, unhealthy, also after the
  agent restarts (and NVML still shows it lost).
* With a lost GPU the collector does not republish the inventory every period.

The collector and health service run in one process on a mock NVML (as in
``gpulet run``), the reporter writes to the Kubernetes API emulator through a
kubeconfig, against a real nats-server.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest

from gpulet_collector import service as collector_service
from gpulet_collector.service import CollectorService
from gpulet_common import codec, subjects
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import HealthEvent, HealthStateRequest, Inventory, MockInjectRequest
from gpulet_common.mock_nvml import SCENARIO_DIR, MockNvml
from gpulet_common.settings.reporter import ReporterSettings
from support.agent import agent_settings, mock_adapter, runtime_for
from support.faults import DEVICES, GpuOnDevice, device_view
from support.health_harness import NODE, HealthNode, health_node
from support.kube_emulator import KubeEmulator
from support.reporter_harness import fast_settings, running_reporter, wait_until

pytestmark = pytest.mark.anyio

DGX = SCENARIO_DIR / "dgx-h100.toml"
LOST = 2


def lose(slot: int) -> Callable[[MockNvml], None]:
    def prepare(mock: MockNvml) -> None:
        reply = mock.controller.inject(MockInjectRequest(gpu=slot, fault="lost"))
        assert reply.applied, reply.detail

    return prepare


@pytest.fixture
async def emulator(tmp_path: Path) -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator.running() as emu:
        emu.add_node(NODE)
        emu.write_kubeconfig(tmp_path / "kubeconfig")
        yield emu


def reporter_settings(tmp_path: Path) -> ReporterSettings:
    return fast_settings(kubeconfig=str(tmp_path / "kubeconfig"))


async def until_device(
    emu: KubeEmulator, check: Callable[[dict[str, GpuOnDevice]], bool], *, within: float = 15.0
) -> None:
    await wait_until(lambda: bool(check(device_view(emu, NODE))), within=within)


async def first_run(url: str, tmp_path: Path, emu: KubeEmulator) -> list[str]:
    """The agent once with every GPU fine: it learns the node's GPUs. Returns the UUIDs."""
    async with (
        health_node(url, tmp_path, scenario=DGX, subscriber=False) as h,
        running_reporter(url, tmp_path / "reporter", NODE, reporter_settings(tmp_path)),
    ):
        uuids = [h.uuid(i) for i in range(8)]
        await until_device(
            emu, lambda seen: len(seen) == 8 and all(g.health for g in seen.values())
        )
        await wait_until(lambda: h.service.known.writes >= 1)
    return uuids


def missing_event(h: HealthNode, uuid: str) -> list[HealthEvent]:
    return h.log.where(lambda e: e.kind == "gpu_missing" and e.gpu_uuid == uuid)


async def test_a_gpu_lost_before_start_is_missing_and_stays_in_the_device(
    nats_server: EmbeddedNats, emulator: KubeEmulator, tmp_path: Path
) -> None:
    uuids = await first_run(nats_server.url, tmp_path, emulator)
    known = json.loads((tmp_path / "state" / "health" / "gpus.json").read_bytes())
    assert [g["uuid"] for g in known["gpus"]] == uuids

    # The node reboots with GPU 2 lost, and JetStream is gone too (a fresh server): the
    # file of expected GPUs in the state dir is all the health service has.
    emulator.delete_object(DEVICES, NODE)
    async with (
        EmbeddedNats.running(state_dir=tmp_path / "nats-after", port=0) as fresh,
        health_node(fresh.url, tmp_path, scenario=DGX, prepare=lose(LOST)) as h,
        running_reporter(fresh.url, tmp_path / "reporter", NODE, reporter_settings(tmp_path)) as r,
    ):
        [event] = await h.log.wait_for(
            lambda e: e.kind == "gpu_missing" and e.gpu_uuid == uuids[LOST], within=10
        )
        assert not event.healthy
        assert event.severity == "critical"
        assert "missing at start" in event.reason
        assert event.gpu_index == LOST
        # The collector's inventory leaves it out; the Device keeps it, unhealthy.
        await wait_until(lambda: r.service.inventory is not None, within=10)
        assert r.service.inventory is not None
        assert uuids[LOST] not in {g.uuid for g in r.service.inventory.gpus}
        await until_device(
            emulator,
            lambda seen: (
                set(seen) == set(uuids)
                and not seen[uuids[LOST]].health
                and all(g.health for u, g in seen.items() if u != uuids[LOST])
            ),
        )
        assert device_view(emulator, NODE)[uuids[LOST]].reason == "GpuMissing"
        # The health state says so too, and names the GPU.
        state = await h.runtime.bus.request(
            subjects.health_state(NODE),
            HealthStateRequest(gpu=uuids[LOST]),
            codec.HEALTH_STATE_REQUEST,
            codec.HEALTH_STATE,
            timeout_s=2.0,
        )
        [gpu] = state.gpus
        assert (gpu.present, gpu.healthy) == (False, False)
        assert gpu.info is not None
        assert gpu.info.uuid == uuids[LOST]
        assert [c.condition for c in gpu.conditions] == ["missing"]

        # Once it answers again, it recovers by itself.
        h.inject("reset", gpu=LOST)
        await h.log.wait_for(
            lambda e: e.kind == "recovered" and e.condition == "missing", within=15
        )
        await until_device(emulator, lambda seen: seen[uuids[LOST]].health)


async def test_a_gpu_lost_while_running_stays_in_the_device_across_a_restart(
    nats_server: EmbeddedNats, emulator: KubeEmulator, tmp_path: Path
) -> None:
    url = nats_server.url
    async with (
        health_node(url, tmp_path, scenario=DGX) as h,
        running_reporter(url, tmp_path / "reporter", NODE, reporter_settings(tmp_path)),
    ):
        uuids = [h.uuid(i) for i in range(8)]
        await until_device(emulator, lambda seen: len(seen) == 8)
        h.inject("lost", gpu=LOST)
        await h.log.wait_for(lambda e: e.kind == "gpu_lost" and e.gpu_uuid == uuids[LOST])
        # Still listed (the inventory no longer is), unhealthy.
        await until_device(
            emulator, lambda seen: set(seen) == set(uuids) and not seen[uuids[LOST]].health
        )

    # The agent restarts (a new process: new mock, still showing the GPU lost; a new
    # reporter). The Device is deleted so that what it says next is the new agent's.
    emulator.delete_object(DEVICES, NODE)
    async with (
        health_node(url, tmp_path, scenario=DGX, prepare=lose(LOST)) as h,
        running_reporter(url, tmp_path / "reporter", NODE, reporter_settings(tmp_path)) as r,
    ):
        await until_device(
            emulator,
            lambda seen: (
                set(seen) == set(uuids)
                and not seen[uuids[LOST]].health
                and all(g.health for u, g in seen.items() if u != uuids[LOST])
            ),
        )
        assert device_view(emulator, NODE)[uuids[LOST]].reason == "GpuLost"
        assert [g.uuid for g in r.service.core.absent_gpus()] == [uuids[LOST]]


async def test_a_lost_gpu_does_not_make_the_collector_republish_the_inventory(
    nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    period, retry = 0.05, 0.3
    monkeypatch.setattr(collector_service, "SKIPPED_RETRY_S", retry)
    settings = agent_settings(
        nats_server.url,
        tmp_path,
        overrides=[f"collector.sample_period_s={period}", "collector.inventory_republish_s=0"],
    )
    adapter, mock = mock_adapter("dgx-h100")
    builds = 0
    build = adapter.inventory_report

    def counted(node: str, generation: int) -> tuple[Inventory, dict[int, str]]:
        nonlocal builds
        builds += 1
        return build(node, generation)

    monkeypatch.setattr(adapter, "inventory_report", counted)
    # Lost before the collector starts: NVML still counts it, it cannot be listed.
    assert mock.controller.inject(MockInjectRequest(gpu=5, fault="lost")).applied
    try:
        async with (
            runtime_for(settings, adapter=adapter) as rt,
            rt.bus.subscribe(subjects.inventory(settings.node_name), codec.INVENTORY) as stream,
            rt.bus.subscribe(subjects.samples(settings.node_name), codec.SAMPLES) as samples,
            anyio.create_task_group() as tg,
        ):
            received: list[int] = []
            batches = 0

            async def count_inventories() -> None:
                async for delivery in stream:
                    received.append(len(delivery.value.gpus))  # noqa: PERF401 - as they come

            async def count_batches() -> None:
                nonlocal batches
                async for _ in samples:
                    batches += 1

            await rt.bus.flush()
            tg.start_soon(count_inventories)
            tg.start_soon(count_batches)
            collector = CollectorService(rt)
            await tg.start(collector.run)
            await wait_until(lambda: received == [7])
            # Many periods, and several looks for the left-out GPU (inventory builds).
            await wait_until(lambda: batches >= 40 and builds >= 4, within=20)
            assert collector.inventory_publishes == 1
            assert received == [7]
            # It answers again: published once more, with it.
            assert mock.controller.inject(MockInjectRequest(gpu=5, fault="reset")).applied
            await wait_until(lambda: received == [7, 8], within=10)
            seen = batches
            await wait_until(lambda: batches >= seen + 20, within=20)
            assert received == [7, 8]
            tg.cancel_scope.cancel()
    finally:
        mock.close()
