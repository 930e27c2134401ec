"""Per-GPU-instance (MIG) memory metrics with dcgm-exporter's GPU_I_ID / GPU_I_PROFILE.

* The collector on the mock's ``a100-mig-mixed`` node (real nats-server) serves
  ``DCGM_FI_DEV_FB_FREE`` / ``DCGM_FI_DEV_FB_USED`` once per GPU instance of GPUs 0 and
  1 (GPU 1's GPU instance 1 holds two compute instances: one series, profile
  ``3g.20gb``), beside the GPU-wide series, which carry no GPU_I labels.
* The exporter gives a GPU instance's series the pods of its MIG devices, and the
  values of its first MIG device.
* The adapter reads each MIG device's memory with each sample; a MIG device destroyed
  since the layout was read is left out, with no error, until the layout is read again.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest

from gpulet_collector.dcgm import DcgmExporter, PodLabels
from gpulet_collector.service import CollectorService
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import MigSample, SampleBatch
from gpulet_common.mock_nvml.faultspec import FaultSpec
from gpulet_common.telemetry import render_metrics
from support.agent import agent_settings, mock_adapter, runtime_for
from support.exposition import parse

MIB = 1024 * 1024

# (gpu, GPU_I_ID) -> GPU_I_PROFILE, from the scenario file.
INSTANCES = {
    ("0", "1"): "3g.20gb",
    ("0", "2"): "2g.10gb",
    ("0", "3"): "1g.5gb",
    ("0", "4"): "1g.5gb",
    ("1", "1"): "3g.20gb",
    ("1", "2"): "3g.20gb",
}


@pytest.mark.anyio
async def test_the_collector_serves_memory_per_gpu_instance(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    settings = agent_settings(
        nats_server.url, tmp_path, node="a100-node", overrides=["collector.sample_period_s=3600"]
    )
    adapter, _mock = mock_adapter("a100-mig-mixed", jitter=False)
    async with runtime_for(settings, adapter=adapter) as rt, anyio.create_task_group() as tg:
        collector = CollectorService(rt)
        await tg.start(collector.run)
        await collector.sample_once()
        text = render_metrics().decode()
        inventory = adapter.inventory("a100-node", 1)
        tg.cancel_scope.cancel()
    totals = {
        (str(g.index), str(d.gpu_instance_id)): d.memory_total_bytes // MIB
        for g in inventory.gpus
        for d in g.mig_devices
    }
    _types, samples = parse(text)
    for name in ("DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED"):
        series = [labels for n, labels, _ in samples if n == name]
        # The GPU-wide series, as before: one per GPU, no GPU_I labels.
        assert sorted(s["gpu"] for s in series if "GPU_I_ID" not in s) == ["0", "1", "2", "3"]
        per_instance = {
            (s["gpu"], s["GPU_I_ID"]): s["GPU_I_PROFILE"] for s in series if "GPU_I_ID" in s
        }
        assert per_instance == INSTANCES
        for s in series:
            # A GPU instance's series names its GPU (UUID, device) as dcgm-exporter does.
            gpu = inventory.gpus[int(s["gpu"])]
            assert (s["UUID"], s["device"]) == (gpu.uuid, f"nvidia{gpu.minor}")
            assert s["Hostname"] == "a100-node"
    free = {
        (labels["gpu"], labels["GPU_I_ID"]): value
        for n, labels, value in samples
        if n == "DCGM_FI_DEV_FB_FREE" and "GPU_I_ID" in labels
    }
    used = {
        (labels["gpu"], labels["GPU_I_ID"]): value
        for n, labels, value in samples
        if n == "DCGM_FI_DEV_FB_USED" and "GPU_I_ID" in labels
    }
    for key in INSTANCES:
        assert free[key] + used[key] == totals[key]


def test_a_gpu_instance_carries_its_mig_devices_pods_and_first_reading() -> None:
    adapter, _mock = mock_adapter("a100-mig-mixed", jitter=False)
    inventory = adapter.inventory("n", 1)
    gpu1 = inventory.gpus[1]
    ci0, ci1, other = gpu1.mig_devices
    sample = msgspec.structs.replace(
        adapter.sample(1),
        mig=[
            MigSample(
                uuid=u.uuid,
                gpu_instance_id=u.gpu_instance_id,
                compute_instance_id=u.compute_instance_id,
                memory_used_bytes=used * MIB,
                memory_free_bytes=100 * MIB,
            )
            for u, used in ((ci1, 7), (ci0, 5), (other, 3))
        ],
    )
    exporter = DcgmExporter("n")
    exporter.update_inventory(inventory)
    exporter.update_samples(SampleBatch(node="n", timestamp=1.0, samples=[sample]))
    a = PodLabels(pod="a", namespace="ns", container="c")
    b = PodLabels(pod="b", namespace="ns", container="c")
    exporter.update_holders({ci0.uuid: [a], ci1.uuid: [b], gpu1.uuid: [a]})
    _types, samples = parse(exporter.render().decode())
    found = {
        (labels["GPU_I_ID"], labels.get("pod", "")): value
        for n, labels, value in samples
        if n == "DCGM_FI_DEV_FB_USED" and "GPU_I_ID" in labels
    }
    # GPU instance 1: its compute instance 0's reading, a series per holder of either.
    assert found == {("1", "a"): 5, ("1", "b"): 5, ("2", ""): 3}


def test_a_destroyed_mig_device_is_left_out_until_the_layout_is_read_again() -> None:
    adapter, mock = mock_adapter("a100-mig-mixed", jitter=False)
    before = adapter.inventory("n", 1).gpus[0]
    first = adapter.sample(0)
    assert [m.uuid for m in first.mig] == [d.uuid for d in before.mig_devices]
    for m, d in zip(first.mig, before.mig_devices, strict=True):
        assert (m.memory_used_bytes or 0) + (m.memory_free_bytes or 0) == d.memory_total_bytes
    layout = {"mode": "enabled", "devices": [{"gi": 1, "profile": "7g.40gb"}]}
    assert mock.apply(FaultSpec(fault="mig", gpu=0, spec=layout))[0]
    stale = adapter.sample(0)
    assert (stale.error, stale.mig) == (None, [])
    assert adapter.mig_changed(before)
    again = adapter.sample(0)
    assert [(m.gpu_instance_id, m.compute_instance_id) for m in again.mig] == [(1, 0)]
    assert again.mig[0].memory_free_bytes == adapter.gpu_info(0).mig_devices[0].memory_total_bytes
