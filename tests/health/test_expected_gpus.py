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

import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import msgspec
import nats.js.errors
import pytest

from gpulet_collector import service as collector_service
from gpulet_collector.service import CollectorService
from gpulet_common import codec, subjects
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import (
    ActiveCondition,
    GpuHealth,
    GpuInfo,
    HealthClearRequest,
    HealthEvent,
    HealthStateRequest,
    Inventory,
    MockInjectRequest,
    PeerLink,
)
from gpulet_common.mock_nvml import SCENARIO_DIR, MockNvml
from gpulet_common.settings.health import HealthSettings
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_health.known import KnownGpus
from gpulet_health.rules import NotPresent, RuleEngine
from gpulet_reporter.core import ReporterCore
from support.agent import agent_settings, mock_adapter, runtime_for
from support.faults import DEVICES, GpuOnDevice, device_view
from support.health_harness import NODE, HealthNode, health_node
from support.kube_emulator import KubeEmulator, cluster_with_node
from support.reporter_harness import fast_settings, running_reporter, wait_until

DGX = SCENARIO_DIR / "dgx-h100.toml"
LOST = 2


def lose(slot: int) -> Callable[[MockNvml], None]:
    def prepare(mock: MockNvml) -> None:
        reply = mock.inject(MockInjectRequest(gpu=slot, fault="lost"))
        assert reply.applied, reply.detail

    return prepare


@pytest.fixture
async def emulator(tmp_path: Path) -> AsyncIterator[KubeEmulator]:
    async with cluster_with_node(NODE, tmp_path / "kubeconfig") as emu:
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


@pytest.mark.anyio
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
        EmbeddedNats(state_dir=tmp_path / "nats-after", port=0) as fresh,
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


@pytest.mark.anyio
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

        # The GPU was taken out for good: the operator clears it, it is forgotten.
        cleared = await h.runtime.bus.request(
            subjects.health_clear(NODE),
            HealthClearRequest(gpu=uuids[LOST], condition="lost", requested_by="test"),
            codec.HEALTH_CLEAR_REQUEST,
            codec.HEALTH_STATE,
            timeout_s=2.0,
        )
        assert cleared.gpus[0].gpu_uuid == uuids[LOST]
        await until_device(emulator, lambda seen: set(seen) == set(uuids) - {uuids[LOST]})
        assert uuids[LOST] not in h.service.engine.gpus
        await wait_until(
            lambda: uuids[LOST] not in (tmp_path / "state" / "health" / "gpus.json").read_text()
        )
        state = await h.runtime.bus.request(
            subjects.health_state(NODE),
            HealthStateRequest(),
            codec.HEALTH_STATE_REQUEST,
            codec.HEALTH_STATE,
            timeout_s=2.0,
        )
        assert uuids[LOST] not in {g.gpu_uuid for g in state.gpus}
        kv = await h.runtime.bus.key_value(subjects.HEALTH_KV_BUCKET)
        key = subjects.health_kv_key(NODE, uuids[LOST])

        async def deleted() -> bool:
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return True
            return entry.value in (None, b"")

        with anyio.fail_after(5):
            while not await deleted():  # noqa: ASYNC110 - state in another service
                await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_a_lost_gpu_does_not_make_the_collector_republish_the_inventory(
    nats_server: EmbeddedNats,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The GPU left out is looked for with a growing wait (not every retry period
    forever, each a full inventory build) and logged once, not at every look."""
    period, retry = 0.05, 0.3
    monkeypatch.setattr(collector_service, "SKIPPED_RETRY_S", retry)
    monkeypatch.setattr(collector_service, "SKIPPED_RETRY_MAX_S", 4 * retry)
    caplog.set_level(logging.DEBUG, logger="gpulet.nvml")
    settings = agent_settings(
        nats_server.url,
        tmp_path,
        overrides=[f"collector.sample_period_s={period}", "collector.inventory_republish_s=0"],
    )
    adapter, mock = mock_adapter("dgx-h100")
    builds = 0
    build = adapter.inventory_report
    built_at: list[float] = []

    def counted(node: str, generation: int) -> tuple[Inventory, dict[int, str]]:
        nonlocal builds
        builds += 1
        built_at.append(time.monotonic())
        return build(node, generation)

    monkeypatch.setattr(adapter, "inventory_report", counted)
    # Lost before the collector starts: NVML still counts it, it cannot be listed.
    assert mock.inject(MockInjectRequest(gpu=5, fault="lost")).applied
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
            await wait_until(lambda: batches >= 40 and builds >= 6, within=30)
            assert collector.inventory_publishes == 1
            assert received == [7]
            # The waits between looks: at least 0.3, 0.6, 1.2, then the cap (1.2) s.
            gaps = [b - a for a, b in itertools.pairwise(built_at[:6])]
            least = [retry, 2 * retry, 4 * retry, 4 * retry, 4 * retry]
            assert all(g >= 0.9 * m for g, m in zip(gaps, least, strict=True)), gaps
            left_out = [
                r for r in caplog.records if "GPU 5 left out of the inventory" in r.getMessage()
            ]
            assert [r.levelno for r in left_out][:1] == [logging.WARNING]
            assert all(r.levelno == logging.DEBUG for r in left_out[1:])
            assert len(left_out) >= 4  # looked for again and again, logged once
            # It answers again: published once more, with it.
            assert mock.inject(MockInjectRequest(gpu=5, fault="reset")).applied
            await wait_until(lambda: received == [7, 8], within=10)
            seen = batches
            await wait_until(lambda: batches >= seen + 20, within=20)
            assert received == [7, 8]
            tg.cancel_scope.cancel()
    finally:
        mock.close()


# --- the parts on their own -------------------------------------------------------------

T0 = 1_700_000_000.0


def info(index: int) -> GpuInfo:
    return GpuInfo(
        uuid=f"GPU-{index}", index=index, name="H100", pci_bus_id=f"0000:{index:02x}:00.0"
    )


def test_the_engine_raises_missing_for_an_expected_gpu_the_first_scan_lacks() -> None:
    engine = RuleEngine("n1", HealthSettings())
    assert engine.expect([info(0), info(1), info(2)]) == 3
    assert engine.expect([info(0), GpuInfo(uuid="", index=9)]) == 0
    events = engine.observe_inventory([info(0), info(2)], T0)
    assert [(e.kind, e.condition, e.gpu_uuid, e.healthy) for e in events] == [
        ("gpu_missing", "missing", "GPU-1", False)
    ]
    assert "GPU 1 (H100, bus 0000:01:00.0) was on this node before" in events[0].reason
    snapshot = engine.snapshot("GPU-1")
    assert (snapshot.present, snapshot.healthy) == (False, False)
    assert snapshot.info == info(1)
    assert [g.uuid for g in engine.expected()] == ["GPU-0", "GPU-1", "GPU-2"]
    # A later scan that still lacks it says nothing new; one that finds it ends it.
    assert engine.observe_inventory([info(0), info(2)], T0 + 1) == []
    back = engine.observe_inventory([info(0), info(1), info(2)], T0 + 2)
    assert ("recovered", "missing") in [(e.kind, e.condition) for e in back]
    assert back[-1].kind == "gpu_added"
    assert back[-1].healthy


def test_a_restored_gpu_that_names_another_gpu_loses_that_identity() -> None:
    forged = GpuHealth(gpu_uuid="GPU-1", gpu_index=1, info=info(7))
    engine = RuleEngine("n1", HealthSettings())
    engine.restore([forged, GpuHealth(gpu_uuid="GPU-2", gpu_index=2, info=info(2))])
    assert engine.snapshot("GPU-1").info is None
    assert engine.snapshot("GPU-2").info == info(2)


def test_the_file_of_expected_gpus(tmp_path: Path) -> None:
    path = tmp_path / "health" / "gpus.json"
    known = KnownGpus(path, "n1")
    assert known.load().gpus == []
    with_topology = msgspec.structs.replace(
        info(0), topology=[PeerLink(peer_uuid="GPU-1", peer_index=1)]
    )
    known.save([with_topology, info(1)])
    known.save([with_topology, info(1)])  # unchanged: not written again
    assert known.writes == 1
    again = KnownGpus(path, "n1").load()
    assert again.gpus == [info(0), info(1)]
    # Another node's file, or a corrupt one, is kept aside and not used.
    assert KnownGpus(path, "n2").load().gpus == []
    path.write_bytes(b'{"version": 1, "gpus": [{"uuid": 1}]}')
    broken = KnownGpus(path, "n1").load()
    assert broken.gpus == []
    assert "kept as gpus.json.corrupt-" in broken.detail
    assert len(list(path.parent.glob("gpus.json.corrupt-*"))) == 2


def test_the_reporter_keeps_a_gpu_the_health_service_says_is_not_present() -> None:
    node = "n1"
    core = ReporterCore(node, fast_settings())
    inventory = Inventory(node=node, generation=1, gpus=[info(0), info(1), info(2)])
    core.on_inventory(inventory)
    assert core.desired is not None
    assert len(core.desired.gpus) == 3
    lost = GpuHealth(
        gpu_uuid="GPU-1",
        gpu_index=1,
        healthy=False,
        present=False,
        info=info(1),
        conditions=[
            ActiveCondition(
                condition="lost", kind="gpu_lost", severity="critical", reason="GPU 1 is lost"
            )
        ],
    )
    fine = [GpuHealth(gpu_uuid=f"GPU-{i}", gpu_index=i, info=info(i)) for i in (0, 2)]
    for health in (fine[0], lost, fine[1]):  # the KV entries, as NodeView hands them on
        core.on_health(health.gpu_uuid, health)
    # The collector's next inventory leaves it out: the Device does not.
    core.on_inventory(msgspec.structs.replace(inventory, generation=2, gpus=[info(0), info(2)]))
    gpus = {g.uuid: g for g in core.desired.gpus}
    assert sorted(gpus) == ["GPU-0", "GPU-1", "GPU-2"]
    condition = gpus["GPU-1"].condition
    assert condition is not None
    assert not condition.healthy
    assert condition.reason == "GpuLost"
    assert [g.uuid for g in core.absent_gpus()] == ["GPU-1"]
    # Kubelet's capacity counts it (the device plugin lists it, unhealthy): so does GFD's.
    assert core.desired.node_labels["nvidia.com/gpu.count"] == "3"
    # The health service forgets it (its KV entry is deleted): so does the Device.
    core.on_health("GPU-1", None)
    assert sorted(g.uuid for g in core.desired.gpus) == ["GPU-0", "GPU-2"]
    assert core.desired.node_labels["nvidia.com/gpu.count"] == "2"


def test_clearing_a_gpu_that_is_not_present_forgets_it() -> None:
    engine = RuleEngine("n1", HealthSettings())
    engine.expect([info(0), info(1)])
    engine.observe_inventory([info(0)], T0)
    engine.take_dirty()
    gpu, events = engine.clear("GPU-1", "missing", T0 + 1, "alice")
    assert gpu.uuid == "GPU-1"
    assert [(e.kind, e.condition) for e in events] == [("cleared", "missing")]
    assert "forgotten" in events[0].reason
    assert "GPU-1" not in engine.gpus
    assert engine.take_dirty() == {"GPU-1"}
    assert [g.uuid for g in engine.expected()] == ["GPU-0"]
    # A present GPU's condition is cleared as before, and the GPU stays.
    engine.observe_xid("GPU-0", 79, T0 + 2)
    _, events = engine.clear("GPU-0", "xid:79", T0 + 3)
    assert [(e.kind, e.condition) for e in events] == [("cleared", "xid:79")]
    assert "GPU-0" in engine.gpus


def test_clearing_the_sticky_conditions_of_a_gpu_that_is_not_present_is_refused() -> None:
    """``gpulet health clear --gpu X`` on a missing GPU would change nothing: refused,
    naming the condition whose clearing forgets it."""
    engine = RuleEngine("n1", HealthSettings())
    engine.expect([info(0), info(1)])
    engine.observe_inventory([info(0)], T0)
    with pytest.raises(NotPresent) as refused:
        engine.clear("GPU-1", None, T0 + 1)
    assert refused.value.args == ("missing",)
    assert "GPU-1" in engine.gpus  # nothing changed
    # A present GPU's sticky conditions are cleared as before.
    engine.observe_xid("GPU-0", 79, T0 + 2)
    _, events = engine.clear("GPU-0", None, T0 + 3)
    assert [(e.kind, e.condition) for e in events] == [("cleared", "xid:79")]


@pytest.mark.anyio
async def test_reporter_preview_shows_what_the_reporter_writes_with_a_gpu_missing(
    nats_server: EmbeddedNats, emulator: KubeEmulator, tmp_path: Path
) -> None:
    """``gpulet reporter-preview`` runs the reporter's code on the reporter's inputs:
    with GPU 2 missing at start, both have 8 devices (GPU 2 unhealthy), the same node
    labels (``nvidia.com/gpu.count`` 8, as kubelet's capacity), and the condition's
    boot ID."""
    from gpulet_common.bootid import read_boot_id
    from gpulet_common.settings import Settings
    from gpulet_common.settings.nats import NatsSettings
    from gpulet_reporter.cli import preview

    uuids = await first_run(nats_server.url, tmp_path, emulator)
    emulator.delete_object(DEVICES, NODE)
    settings = reporter_settings(tmp_path)
    async with (
        EmbeddedNats(state_dir=tmp_path / "nats-after", port=0) as fresh,
        health_node(fresh.url, tmp_path, scenario=DGX, prepare=lose(LOST)),
        running_reporter(fresh.url, tmp_path / "reporter", NODE, settings),
    ):
        await until_device(
            emulator, lambda seen: set(seen) == set(uuids) and not seen[uuids[LOST]].health
        )
        await wait_until(
            lambda: (
                (emulator.get_object("nodes", NODE) or {})["metadata"]
                .get("labels", {})
                .get("nvidia.com/gpu.count")
                == "8"
            )
        )
        shown = await preview(
            Settings(node_name=NODE, nats=NatsSettings(url=fresh.url), reporter=settings),
            timeout_s=5,
        )
        written = emulator.get_object(DEVICES, NODE)
        assert written is not None
        assert shown["device"]["spec"] == written["spec"]
        assert shown["device"]["metadata"]["labels"] == written["metadata"]["labels"]
        node_labels = (emulator.get_object("nodes", NODE) or {})["metadata"]["labels"]
        assert shown["nodeLabels"]["nvidia.com/gpu.count"] == "8"
        assert {k: node_labels.get(k) for k in shown["nodeLabels"]} == shown["nodeLabels"]
        # The condition the reporter would write (it is off in this harness): with the
        # node's boot ID at the end of its message, as the reporter writes it.
        with_condition = msgspec.structs.replace(settings, node_condition=True)
        shown = await preview(
            Settings(node_name=NODE, nats=NatsSettings(url=fresh.url), reporter=with_condition),
            timeout_s=5,
        )
        assert shown["nodeCondition"]["message"].endswith(f"; boot ID {read_boot_id()}")
