"""dcgm-exporter's DCGM_FI_* metrics: exact names, types, units and labels.

The collector runs against the mock NVML (8 H100s) and a real nats-server; the text is
read from the same function that serves ``/metrics``.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from gpulet_collector.dcgm import FIELDS, NAMES, XID_FIELD
from gpulet_collector.service import CollectorService
from gpulet_common import codec, subjects
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import HealthEvent
from gpulet_common.telemetry import render_metrics
from support.agent import agent_settings, mock_adapter, runtime_for
from support.exposition import parse
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

DCGM_LABELS = {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"}
DCGM_LABELS |= {"DCGM_FI_DRIVER_VERSION"}


def values(samples: list[tuple[str, dict[str, str], float]], name: str) -> dict[str, float]:
    return {labels["gpu"]: value for n, labels, value in samples if n == name}


async def test_every_dcgm_field_with_its_name_type_unit_and_labels(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    settings = agent_settings(
        nats_server.url,
        tmp_path,
        node="gpu-node-7",
        overrides=["collector.sample_period_s=3600"],
    )
    adapter, _mock = mock_adapter("dgx-h100", jitter=False)
    async with runtime_for(settings, adapter=adapter) as rt, anyio.create_task_group() as tg:
        collector = CollectorService(rt)
        await tg.start(collector.run)
        # Two slow reads: GPM activity needs two samples of the counters.
        await collector.sample_once(slow=True)
        await collector.sample_once(slow=True)
        text = render_metrics().decode()
        tg.cancel_scope.cancel()
    types, samples = parse(text)
    # Hopper retires no pages (it remaps rows): NVML answers NOT_SUPPORTED, and a
    # field NVML does not have is left out, as dcgm-exporter leaves it blank.
    assert set(types) == set(NAMES) - {"DCGM_FI_DEV_RETIRED_PENDING"}
    for field in (*FIELDS, XID_FIELD):
        if field.name not in types:
            continue
        assert types[field.name] == field.kind
        assert len(values(samples, field.name)) == 8, field.name
    inventory = collector.inventory
    for name, labels, _ in samples:
        assert set(labels) == DCGM_LABELS, (name, labels)
        gpu = inventory.gpus[int(labels["gpu"])]
        assert labels["UUID"] == gpu.uuid
        assert labels["pci_bus_id"] == gpu.pci_bus_id
        assert labels["device"] == f"nvidia{gpu.minor}"
        assert labels["modelName"] == "NVIDIA H100 80GB HBM3"
        assert labels["Hostname"] == "gpu-node-7"
        assert labels["DCGM_FI_DRIVER_VERSION"] == "550.54.15"
    # Units as dcgm-exporter's: MiB, W, mJ, MHz, %, ratios.
    assert set(values(samples, "DCGM_FI_DEV_FB_USED").values()) == {4096}
    assert set(values(samples, "DCGM_FI_DEV_FB_FREE").values()) == {81559 - 4096}
    assert set(values(samples, "DCGM_FI_DEV_POWER_USAGE").values()) == {118.0}
    assert all(v >= 3.6e9 for v in values(samples, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION").values())
    assert set(values(samples, "DCGM_FI_DEV_SM_CLOCK").values()) == {1980}
    assert set(values(samples, "DCGM_FI_DEV_MEM_CLOCK").values()) == {2619}
    assert set(values(samples, "DCGM_FI_DEV_GPU_UTIL").values()) == {20}
    assert set(values(samples, "DCGM_FI_DEV_GPU_TEMP").values()) == {34}
    assert set(values(samples, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE").values()) == {0.12}
    assert set(values(samples, "DCGM_FI_PROF_GR_ENGINE_ACTIVE").values()) == {0.2}
    assert set(values(samples, "DCGM_FI_DEV_XID_ERRORS").values()) == {0}
    assert set(values(samples, "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL").values()) == {0}


async def test_last_xid_comes_from_the_health_events(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    settings = agent_settings(
        nats_server.url, tmp_path, overrides=["collector.sample_period_s=0.05"]
    )
    adapter, _mock = mock_adapter("dgx-h100")
    async with runtime_for(settings, adapter=adapter) as rt, anyio.create_task_group() as tg:
        collector = CollectorService(rt)
        await tg.start(collector.run)
        uuid3 = collector.inventory.gpus[3].uuid

        def event(gpu_uuid: str, xid: int) -> HealthEvent:
            return HealthEvent(
                event_id=f"e-{gpu_uuid}-{xid}",
                node=settings.node_name,
                gpu_uuid=gpu_uuid,
                kind="xid",
                severity="warning",
                healthy=True,
                reason="test",
                xid=xid,
                observed_at=time.time(),
            )

        subject = subjects.health(settings.node_name)
        # A GPU the node does not have is not believed.
        await rt.bus.publish(subject, event("GPU-not-here", 48), codec.HEALTH_EVENT)
        await rt.bus.publish(subject, event(uuid3, 31), codec.HEALTH_EVENT)

        def xids() -> dict[str, float]:
            return values(parse(render_metrics().decode())[1], "DCGM_FI_DEV_XID_ERRORS")

        await wait_until(lambda: xids().get("3") == 31, what="XID 31 on GPU 3")
        assert {gpu: v for gpu, v in xids().items() if gpu != "3"} == {
            str(i): 0 for i in range(8) if i != 3
        }
        assert "GPU-not-here" not in render_metrics().decode()
        tg.cancel_scope.cancel()
    # Stopped: the collector's metrics leave /metrics with it.
    assert "DCGM_FI_DEV_GPU_TEMP" not in render_metrics().decode()


async def test_dcgm_metrics_can_be_turned_off(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    settings = agent_settings(
        nats_server.url,
        tmp_path,
        overrides=["collector.sample_period_s=0.05", "collector.dcgm_metrics=false"],
    )
    adapter, _mock = mock_adapter("dgx-h100")
    async with runtime_for(settings, adapter=adapter) as rt, anyio.create_task_group() as tg:
        collector = CollectorService(rt)
        await tg.start(collector.run)
        await collector.sample_once()
        assert "DCGM_FI_" not in render_metrics().decode()
        tg.cancel_scope.cancel()


async def test_fields_a_gpu_lacks_are_left_out(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    settings = agent_settings(
        nats_server.url, tmp_path, overrides=["collector.sample_period_s=3600"]
    )
    adapter, _mock = mock_adapter("t4")
    async with runtime_for(settings, adapter=adapter) as rt, anyio.create_task_group() as tg:
        collector = CollectorService(rt)
        await tg.start(collector.run)
        await collector.sample_once(slow=True)
        await collector.sample_once(slow=True)
        types, _ = parse(render_metrics().decode())
        tg.cancel_scope.cancel()
    # A T4: no NVLink, no row remapping, no GPM (Turing); pages retire instead.
    assert "DCGM_FI_DEV_RETIRED_PENDING" in types
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" in types
    assert not {n for n in types if "NVLINK" in n or "REMAP" in n or "_PROF_" in n}


def test_docs_map_every_exported_name_to_its_type() -> None:
    """docs/metrics.md lists every DCGM_FI_* name gpulet exports, with its type."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    rows = {
        cells[1].strip("` "): cells[2].strip()
        for line in docs.splitlines()
        if line.startswith(("| `DCGM_FI_DEV_", "| `DCGM_FI_PROF_"))
        for cells in [line.split("|")]
    }
    assert rows == {f.name: f.kind for f in (*FIELDS, XID_FIELD)}
