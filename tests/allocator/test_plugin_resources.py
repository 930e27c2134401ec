"""Resource model, device-file specs and the device state source of the plugin."""

from __future__ import annotations

from pathlib import Path

import anyio
import grpc
import msgspec
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader

from gpulet_allocator.kubelet.deviceplugin import (
    DeviceList,
    DeviceNodes,
    PluginGpu,
    build_inventory,
    plugin_gpus_from_inventory,
    socket_name,
)
from gpulet_allocator.kubelet.deviceplugin.metrics import PluginMetrics
from gpulet_allocator.kubelet.deviceplugin.server import fallback_preference
from gpulet_allocator.protocol import (
    CORES_PER_GPU,
    MEMORY_UNIT_BYTES,
    DeviceSpec,
    PreferredRequest,
    ResourceKind,
    parse_device_id,
    resource_specs,
)
from gpulet_common.messages import GpuInfo
from gpulet_common.settings.allocator import ResourceNames
from gpulet_common.telemetry import REQUEST_LATENCY_BUCKETS_S

UUID = "GPU-fef8089b-4820-abfc-e83e-94318197576e"


def gpu(uuid: str = UUID, *, index: int = 0, healthy: bool = True) -> PluginGpu:
    return PluginGpu(
        uuid=uuid,
        index=index,
        minor=index,
        memory_total_bytes=3 * MEMORY_UNIT_BYTES + 1,
        numa_node=None,
        healthy=healthy,
    )


def test_resource_specs_and_names() -> None:
    specs = resource_specs(ResourceNames())
    assert [(s.name, s.kind, s.preferred_allocation) for s in specs] == [
        ("nvidia.com/gpu", ResourceKind.WHOLE, True),
        ("gpulet.io/gpu-core", ResourceKind.CORE, False),
        ("gpulet.io/gpu-memory", ResourceKind.MEMORY, False),
    ]
    assert [s.name for s in resource_specs(ResourceNames(gpu="example.com/gpu"), shares=False)] == [
        "example.com/gpu"
    ]
    with pytest.raises(ValueError, match="distinct"):
        resource_specs(ResourceNames(core="nvidia.com/gpu"))
    assert socket_name("gpulet", "nvidia.com/gpu") == "gpulet-nvidia.com-gpu.sock"


def test_devices_per_resource_follow_gpu_health() -> None:
    inventory = build_inventory(
        resource_specs(ResourceNames()), [gpu("GPU-b", index=1, healthy=False), gpu()]
    )
    whole = inventory["nvidia.com/gpu"]
    assert [(d.id, d.health) for d in whole] == [(UUID, "Healthy"), ("GPU-b", "Unhealthy")]
    core = inventory["gpulet.io/gpu-core"]
    assert len(core) == 2 * CORES_PER_GPU
    assert core[0].id == f"{UUID}::core-0"
    assert {d.health for d in core if d.gpu_uuid == "GPU-b"} == {"Unhealthy"}
    memory = inventory["gpulet.io/gpu-memory"]
    assert [d.id for d in memory if d.gpu_uuid == UUID] == [f"{UUID}::mem-{n}" for n in range(3)]
    assert max(len(d.id) for d in [*core, *memory]) <= 63


def test_parse_device_id_round_trips() -> None:
    assert parse_device_id(UUID).kind is ResourceKind.WHOLE
    parsed = parse_device_id(f"{UUID}::core-42")
    assert (parsed.gpu_uuid, parsed.kind, parsed.unit) == (UUID, ResourceKind.CORE, 42)
    parsed = parse_device_id(f"{UUID}::mem-7")
    assert (parsed.kind, parsed.unit) == (ResourceKind.MEMORY, 7)
    for bad in ("", "::core-1", f"{UUID}::core-x", f"{UUID}::disk-1", f"{UUID}::core"):
        with pytest.raises(ValueError, match="malformed"):
            parse_device_id(bad)


def test_plugin_gpus_from_inventory() -> None:
    infos = [
        GpuInfo(uuid="GPU-a", index=0, minor=0, memory_total_bytes=10, numa_node=-1),
        GpuInfo(uuid="GPU-b", index=1, memory_total_bytes=20, numa_node=1),
    ]
    a, b = plugin_gpus_from_inventory(infos, unhealthy={"GPU-b"})
    assert (a.numa_node, a.healthy, a.minor) == (None, True, 0)
    assert (b.numa_node, b.healthy, b.minor) == (1, False, None)


def test_device_nodes_only_existing_files(tmp_path: Path) -> None:
    for name in ("nvidia0", "nvidia3", "nvidiactl", "nvidia-modeset"):
        (tmp_path / name).touch()
    nodes = DeviceNodes(tmp_path)
    assert [s.host_path for s in nodes.specs_for_gpus([3, 1, 3])] == [
        "/dev/nvidia3",
        "/dev/nvidiactl",
        "/dev/nvidia-modeset",
    ]
    assert nodes.specs_for_gpus([]) == []
    kept = nodes.existing(
        [
            DeviceSpec(container_path="/dev/nvidia0", host_path="/dev/nvidia0"),
            DeviceSpec(container_path="/dev/nvidia-uvm", host_path="/dev/nvidia-uvm"),
            DeviceSpec(container_path="/x", host_path="/opt/not-a-dev-file"),
        ]
    )
    assert [s.host_path for s in kept] == ["/dev/nvidia0", "/opt/not-a-dev-file"]


def test_device_nodes_of_a_mock_dev_root_appear_at_dev_in_the_container(tmp_path: Path) -> None:
    for name in ("nvidia3", "nvidiactl"):
        (tmp_path / name).touch()
    nodes = DeviceNodes(tmp_path, str(tmp_path), container_dev="/dev")
    assert [(s.host_path, s.container_path) for s in nodes.specs_for_gpus([3])] == [
        (f"{tmp_path}/nvidia3", "/dev/nvidia3"),
        (f"{tmp_path}/nvidiactl", "/dev/nvidiactl"),
    ]
    # Without container_dev the container path is the host path, as on a real node.
    plain = DeviceNodes(tmp_path, str(tmp_path))
    assert plain.specs_for_gpus([3])[0].container_path == f"{tmp_path}/nvidia3"


def test_device_nodes_notice_new_and_removed_files_after_recheck(tmp_path: Path) -> None:
    now = [100.0]
    (tmp_path / "nvidia0").touch()
    nodes = DeviceNodes(tmp_path, recheck_s=1.0, clock=lambda: now[0])
    assert [s.host_path for s in nodes.specs_for_gpus([0])] == ["/dev/nvidia0"]
    # nvidia-modprobe creates the uvm file on first CUDA use; the driver goes away.
    (tmp_path / "nvidia-uvm").touch()
    (tmp_path / "nvidia0").unlink()
    now[0] += 0.5
    assert [s.host_path for s in nodes.specs_for_gpus([0])] == ["/dev/nvidia0"]
    now[0] += 0.6
    assert nodes.specs_for_gpus([0]) == []
    assert [s.host_path for s in nodes.control_specs()] == ["/dev/nvidia-uvm"]
    assert nodes.control_names() == ["nvidia-uvm"]  # the DRA plugin's CDI specs
    (tmp_path / "nvidiactl").touch()
    assert nodes.control_names() == ["nvidia-uvm"]  # looked at once a second
    now[0] += 1.1
    assert nodes.control_names() == ["nvidiactl", "nvidia-uvm"]


def test_fallback_preference_keeps_one_numa_node() -> None:
    numa: dict[str, int | None] = {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}
    req = PreferredRequest(available=["a", "b", "c", "d", "e"], size=2)
    assert fallback_preference(req, numa) == ["a", "d"]
    req = PreferredRequest(available=["a", "b", "c", "d", "e"], must_include=["b"], size=2)
    assert fallback_preference(req, numa) == ["b", "c"]
    req = PreferredRequest(available=["a", "b", "c", "d", "e"], size=4)
    assert fallback_preference(req, numa) == ["a", "d", "e", "b"]


@pytest.mark.anyio
async def test_device_state_is_level_triggered() -> None:
    state = DeviceList([gpu()])
    first = state.snapshot()
    assert not state.publish([gpu()])  # the same list: no change
    seen: list[int] = []

    async def watcher() -> None:
        snap = await state.wait_for_change(first.version)
        seen.append(snap.version)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watcher)
        await anyio.sleep(0.01)
        assert state.publish([msgspec.structs.replace(gpu(), healthy=False)])
        assert state.publish([gpu()])
    # The watcher sees the latest state, not a queue of every intermediate one.
    assert seen == [2]
    with anyio.fail_after(1):
        assert (await state.wait_for_change(0)).version == 2


def test_plugin_call_latency_buckets_fit_milliseconds() -> None:
    reader = InMemoryMetricReader()
    plugin_metrics = PluginMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"))
    plugin_metrics.call("Allocate", "nvidia.com/gpu", grpc.StatusCode.OK, 0.003)
    data = reader.get_metrics_data()
    assert data is not None
    [histogram] = [
        m
        for r in data.resource_metrics
        for s in r.scope_metrics
        for m in s.metrics
        if m.name == "gpulet.device_plugin.call_duration"
    ]
    [point] = histogram.data.data_points
    assert isinstance(point, HistogramDataPoint)
    assert tuple(point.explicit_bounds) == REQUEST_LATENCY_BUCKETS_S
    # 3 ms lands between 2.5 and 5 ms, not in a first bucket of "up to 5 s".
    assert point.bucket_counts[REQUEST_LATENCY_BUCKETS_S.index(0.005)] == 1
