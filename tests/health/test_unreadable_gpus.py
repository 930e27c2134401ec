"""A GPU already lost when the agent starts is not invisible (issue 23, finding 9).

Real NVML keeps a lost GPU in ``nvmlDeviceGetCount`` and fails its handle (or every
call on it) with GPU_IS_LOST; the mock does the same (a ``lost`` fault, or the
scenario's ``lost_at_start``). A node with no memory of its GPUs (a first start, no
JetStream state, an empty state dir) still says it has one GPU fewer than NVML counts,
and which one: in a health event, the KV state, the Device CR and the node condition.
The collector's inventory carries NVML's count and the GPU it could not list.

The collector, health service and reporter run on a mock NVML against a real
nats-server and the Kubernetes API emulator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpulet_common import codec, subjects
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import GpuInfo, HealthStateRequest, MockInjectRequest, UnreadableGpu
from gpulet_common.mock_nvml import SCENARIO_DIR, MockNvml
from gpulet_common.mock_nvml.scenario import scenario_from_toml
from gpulet_common.nvml.adapter import NvmlAdapter
from gpulet_common.settings.health import HealthSettings
from gpulet_health.rules import RuleEngine
from gpulet_health.rules.unreadable import placeholder
from support.faults import device_view
from support.health_harness import NODE, health_node
from support.kube_emulator import NODES, KubeEmulator, cluster_with_node
from support.reporter_harness import fast_settings, running_reporter, wait_until

DGX = SCENARIO_DIR / "dgx-h100.toml"
LOST = 2
BUSES = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]


def lost_before_start(mock: MockNvml) -> None:
    reply = mock.inject(MockInjectRequest(gpu=LOST, fault="lost"))
    assert reply.applied, reply.detail


def dgx_with(lost: str) -> str:
    """The DGX H100 scenario with GPU 2 lost before the start (``lost_at_start``)."""
    gpus = "".join(
        f'[[gpus]]\nbus_id = "00000000:{bus}:00.0"\n'
        + (f'lost_at_start = "{lost}"\n' if slot == LOST else "")
        for slot, bus in enumerate(BUSES)
    )
    return f'base = "dgx-h100"\n{gpus}'


@pytest.fixture
async def emulator(tmp_path: Path) -> AsyncIterator[KubeEmulator]:
    async with cluster_with_node(NODE, tmp_path / "kubeconfig") as emu:
        yield emu


def node_condition(emu: KubeEmulator) -> dict[str, str]:
    node = emu.get_object(NODES, NODE) or {}
    for condition in node.get("status", {}).get("conditions", []):
        if condition.get("type") == "GpuletGPUHealthy":
            return {str(k): str(v) for k, v in condition.items()}
    return {}


@pytest.mark.anyio
async def test_a_gpu_lost_before_the_first_start_is_raised_by_index(
    nats_server: EmbeddedNats, emulator: KubeEmulator, tmp_path: Path
) -> None:
    url = nats_server.url
    settings = fast_settings(kubeconfig=str(tmp_path / "kubeconfig"), node_condition=True)
    async with (
        health_node(url, tmp_path, scenario=DGX, prepare=lost_before_start) as h,
        running_reporter(url, tmp_path / "reporter", NODE, settings) as r,
    ):
        uuids = [h.uuid(i) for i in range(8)]
        key = placeholder(LOST)
        [event] = await h.log.wait_for(
            lambda e: e.kind == "gpu_missing" and e.gpu_index == LOST, within=10
        )
        assert event.gpu_uuid == key
        assert not event.healthy
        assert event.severity == "critical"
        assert "NVML counts 8 GPU(s), 7 answer" in event.reason
        assert "GPU_IS_LOST" in event.reason

        # The collector's inventory says what NVML counts and which GPU it left out.
        await wait_until(lambda: r.service.inventory is not None, within=10)
        inventory = r.service.inventory
        assert inventory is not None
        assert inventory.nvml_count == 8
        assert len(inventory.gpus) == 7
        assert [(g.index, g.lost) for g in inventory.unreadable] == [(LOST, True)]

        # The health state (and so the KV bucket) lists it, not present and unhealthy.
        state = await h.runtime.bus.request(
            subjects.health_state(NODE),
            HealthStateRequest(gpu=key),
            codec.HEALTH_STATE_REQUEST,
            codec.HEALTH_STATE,
            timeout_s=2.0,
        )
        [gpu] = state.gpus
        assert (gpu.gpu_index, gpu.present, gpu.healthy) == (LOST, False, False)
        assert [c.condition for c in gpu.conditions] == ["missing"]

        # The Device CR has 8 entries, the unreadable one unhealthy; the node says so.
        others = set(uuids) - {uuids[LOST]}
        await wait_until(
            lambda: (
                set(device_view(emulator, NODE)) == others | {key}
                and not device_view(emulator, NODE)[key].health
            ),
            within=15,
        )
        assert device_view(emulator, NODE)[key].reason == "GpuMissing"
        await wait_until(lambda: node_condition(emulator).get("status") == "False", within=15)
        assert f"GPU {LOST}" in node_condition(emulator).get("message", "")

        # It answers again: the placeholder ends and is forgotten, the GPU is listed
        # under its UUID, and every GPU is healthy.
        h.inject("reset", gpu=LOST)
        await h.log.wait_for(
            lambda e: e.kind == "recovered" and e.gpu_uuid == key and e.condition == "missing",
            within=15,
        )
        await wait_until(
            lambda: (
                set(device_view(emulator, NODE)) == set(uuids)
                and all(g.health for g in device_view(emulator, NODE).values())
            ),
            within=15,
        )
        assert key not in h.service.engine.gpus


@pytest.mark.anyio
async def test_a_gpu_lost_at_start_whose_pci_info_answers_is_named_by_its_bus(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    scenario = tmp_path / "dgx-lost.toml"
    scenario.write_text(dgx_with("calls"))
    async with health_node(nats_server.url, tmp_path, scenario=scenario) as h:
        [event] = await h.log.wait_for(
            lambda e: e.kind == "gpu_missing" and e.gpu_index == LOST, within=10
        )
        assert "bus 00000000:3A:00.0" in event.reason
        gpu = h.service.engine.gpus[placeholder(LOST)]
        assert gpu.info is not None
        assert gpu.info.pci_bus_id == "00000000:3A:00.0"


# --- the parts on their own -------------------------------------------------------------


@pytest.mark.parametrize("lost", ["handle", "calls"])
def test_the_mock_counts_a_gpu_lost_at_start_and_the_adapter_reports_it(lost: str) -> None:
    mock = MockNvml(scenario_from_toml(dgx_with(lost)))
    adapter = NvmlAdapter(mock, backend="mock")
    adapter.init()
    assert adapter.device_count() == 8
    inventory, skipped = adapter.inventory_report(NODE, 1)
    assert sorted(skipped) == [LOST]
    assert inventory.nvml_count == 8
    assert len(inventory.gpus) == 7
    [gpu] = inventory.unreadable
    assert (gpu.index, gpu.lost, gpu.uuid) == (LOST, True, None)
    assert gpu.pci_bus_id == ("00000000:3A:00.0" if lost == "calls" else None)
    # A reset brings it back, as a GPU that answers.
    assert mock.inject(MockInjectRequest(gpu=LOST, fault="reset")).applied
    inventory, skipped = adapter.inventory_report(NODE, 2)
    assert (len(inventory.gpus), inventory.unreadable, skipped) == (8, [], {})


def info(index: int) -> GpuInfo:
    return GpuInfo(uuid=f"GPU-{index}", index=index, pci_bus_id=f"00000000:{index:02X}:00.0")


def test_the_engine_matches_an_unreadable_gpu_with_the_node_memory_first() -> None:
    engine = RuleEngine("n1", HealthSettings())
    engine.expect([info(0), info(1), info(2)])
    found = [info(0), info(2)]
    missing = engine.observe_inventory(found, 1.0)
    assert [(e.kind, e.gpu_uuid) for e in missing] == [("gpu_missing", "GPU-1")]
    # NVML counts a fourth GPU nobody knew, and GPU 1 (known) does not answer.
    unreadable = [UnreadableGpu(index=1, lost=True), UnreadableGpu(index=3, lost=True)]
    events = engine.observe_unreadable(unreadable, 4, found, 1.0)
    assert [(e.kind, e.gpu_uuid, e.gpu_index) for e in events] == [
        ("gpu_missing", placeholder(3), 3)
    ]
    # Placeholders are not remembered as expected GPUs: they name an index.
    assert [g.uuid for g in engine.expected()] == ["GPU-0", "GPU-1", "GPU-2"]
    # By PCI bus id, whatever the index says; a readable UUID is used as it is.
    by_bus = UnreadableGpu(index=7, pci_bus_id="0000:01:00.0", lost=True)
    with_uuid = UnreadableGpu(index=3, uuid="GPU-new", lost=True)
    events = engine.observe_unreadable([by_bus, with_uuid], 4, found, 2.0)
    assert [(e.kind, e.gpu_uuid) for e in events] == [
        ("gpu_missing", "GPU-new"),
        ("recovered", placeholder(3)),
    ]
    assert placeholder(3) not in engine.gpus
