"""The kubelet device plugin against a fake kubelet speaking the real gRPC API.

The allocation backend is a small in-test class: the real allocator (over NATS) is
tested elsewhere; here only the plugin's delegation, error mapping and deadlines are.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import grpc
import grpc.aio
import msgspec
import pytest

from gpulet_allocator.kubelet.deviceplugin import (
    DeviceList,
    DevicePluginManager,
    PluginConfig,
    PluginGpu,
    manager,
)
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as dp
from gpulet_allocator.protocol import ContainerAllocation, DeviceSpec, Mount, PreferredRequest
from gpulet_common.refusal import NoResponders, Refused
from support.fake_kubelet import FakeContainer, FakeKubelet, FakePod, running_fake_kubelet

GIB = 1024**3
UUID0 = "GPU-00000000-1111-2222-3333-444444444444"
UUID1 = "GPU-11111111-1111-2222-3333-444444444444"
GPU = "nvidia.com/gpu"
CORE = "gpulet.io/gpu-core"
MEM = "gpulet.io/gpu-memory"
ALL = (GPU, CORE, MEM)


def gpus() -> list[PluginGpu]:
    # 1 GiB + 100 MiB: the partial fifth 256 MiB unit must not be offered.
    mem = GIB + 100 * 1024**2
    return [
        PluginGpu(uuid=UUID0, index=0, minor=0, memory_total_bytes=mem, numa_node=0),
        PluginGpu(uuid=UUID1, index=1, minor=1, memory_total_bytes=mem, numa_node=1),
    ]


class FakeBackend:
    """Answers like the allocator would, or fails the way a test asks it to."""

    def __init__(self) -> None:
        self.allocate_calls: list[tuple[str, list[list[str]]]] = []
        self.preferred_calls: list[tuple[str, list[PreferredRequest]]] = []
        self.reject: Refused | None = None
        self.unavailable = False
        self.hang = False
        self.preferred_answer: list[list[str]] | None = None

    async def _fail_if_asked(self) -> None:
        if self.hang:
            await anyio.sleep_forever()
        if self.unavailable:
            raise NoResponders("no responders on gpulet.allocator.allocate")
        if self.reject is not None:
            raise self.reject

    async def allocate(
        self, resource: str, container_requests: list[list[str]]
    ) -> list[ContainerAllocation]:
        self.allocate_calls.append((resource, container_requests))
        await self._fail_if_asked()
        return [
            ContainerAllocation(
                gpus=sorted({i.split("::")[0] for i in ids}),
                envs={"NVIDIA_VISIBLE_DEVICES": ",".join(ids)},
                mounts=[Mount(container_path="/run/gpulet", host_path="/run/gpulet/x")],
                # Absent in the fake dev root, so the plugin must drop it.
                devices=[
                    DeviceSpec(
                        container_path="/dev/nvidia-uvm-tools", host_path="/dev/nvidia-uvm-tools"
                    )
                ],
                annotations={"gpulet.io/allocated": "yes"},
                cdi_devices=[f"nvidia.com/gpu={i}" for i in ids],
            )
            for ids in container_requests
        ]

    async def preferred(self, resource: str, requests: list[PreferredRequest]) -> list[list[str]]:
        self.preferred_calls.append((resource, requests))
        await self._fail_if_asked()
        if self.preferred_answer is not None:
            return self.preferred_answer
        return [[*r.must_include, *r.available][: r.size] for r in requests]


@pytest.fixture
def dev_root(tmp_path: Path) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    return dev


def make_config(plugin_dir: Path, dev_root: Path, **overrides: object) -> PluginConfig:
    base = PluginConfig(
        plugin_dir=str(plugin_dir),
        dev_root=str(dev_root),
        backend_timeout_s=0.3,
        watch_interval_s=0.05,
        register_backoff_initial_s=0.05,
        register_backoff_max_s=0.2,
        register_timeout_s=1.0,
        stop_grace_s=0.2,
    )
    return msgspec.structs.replace(base, **overrides)


@contextlib.asynccontextmanager
async def running_plugin(
    config: PluginConfig, state: DeviceList, backend: FakeBackend
) -> AsyncIterator[DevicePluginManager]:
    manager = DevicePluginManager(config, state, backend)
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(5):
            await tg.start(manager.run)
        yield manager
        manager.stop()


class Env:
    def __init__(
        self,
        kubelet: FakeKubelet,
        manager: DevicePluginManager,
        state: DeviceList,
        backend: FakeBackend,
    ) -> None:
        self.kubelet = kubelet
        self.manager = manager
        self.state = state
        self.backend = backend


@contextlib.asynccontextmanager
async def environment(plugin_dir: Path, dev_root: Path, **overrides: object) -> AsyncIterator[Env]:
    state = DeviceList(gpus())
    backend = FakeBackend()
    async with (
        running_fake_kubelet(plugin_dir) as kubelet,
        running_plugin(make_config(plugin_dir, dev_root, **overrides), state, backend) as manager,
    ):
        for resource in ALL:
            await kubelet.wait_devices(resource)
        yield Env(kubelet, manager, state, backend)


def health(devices: list[dp.Device]) -> dict[str, str]:
    return {d.ID: d.health for d in devices}


def socket_mode(path: Path) -> int:
    st = path.stat()
    assert stat.S_ISSOCK(st.st_mode)
    return stat.S_IMODE(st.st_mode)


# --- registration ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_registers_every_resource_on_a_private_socket(
    plugin_dir: Path, dev_root: Path
) -> None:
    async with environment(plugin_dir, dev_root) as env:
        regs = {r.resource_name: r for r in env.kubelet.registrations}
        assert set(regs) == set(ALL)
        assert regs[GPU].endpoint == "gpulet-nvidia.com-gpu.sock"
        assert regs[CORE].endpoint == "gpulet-gpulet.io-gpu-core.sock"
        assert regs[MEM].endpoint == "gpulet-gpulet.io-gpu-memory.sock"
        for reg in regs.values():
            assert reg.version == "v1beta1"
            assert not reg.pre_start_required
            assert socket_mode(plugin_dir / reg.endpoint) == 0o600
        assert regs[GPU].get_preferred_allocation_available
        assert not regs[CORE].get_preferred_allocation_available

        options = await env.kubelet.options(GPU)
        assert options.get_preferred_allocation_available
        assert not options.pre_start_required
        assert await env.kubelet.pre_start(GPU, [UUID0]) == dp.PreStartContainerResponse()

        # The method path on the wire is kubelet's, not derived from our package.
        async with grpc.aio.insecure_channel(f"unix://{plugin_dir / regs[GPU].endpoint}") as ch:
            raw = ch.unary_unary(
                "/v1beta1.DevicePlugin/GetDevicePluginOptions",
                request_serializer=dp.Empty.SerializeToString,
                response_deserializer=dp.DevicePluginOptions.FromString,
            )
            assert (await raw(dp.Empty(), timeout=2)).get_preferred_allocation_available


@pytest.mark.anyio
async def test_start_waits_until_kubelet_appears(plugin_dir: Path, dev_root: Path) -> None:
    manager = DevicePluginManager(
        make_config(plugin_dir, dev_root), DeviceList(gpus()), FakeBackend()
    )
    async with anyio.create_task_group() as tg:
        registered = anyio.Event()

        async def start() -> None:
            await tg.start(manager.run)
            registered.set()

        tg.start_soon(start)
        await anyio.sleep(0.3)
        assert not registered.is_set()
        assert all(p.exists() for p in manager.socket_paths)
        async with running_fake_kubelet(plugin_dir) as kubelet:
            with anyio.fail_after(5):
                await registered.wait()
            assert {r.resource_name for r in kubelet.registrations} == set(ALL)
            manager.stop()


# --- ListAndWatch ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_list_and_watch_initial_lists(plugin_dir: Path, dev_root: Path) -> None:
    async with environment(plugin_dir, dev_root) as env:
        whole = env.kubelet.devices(GPU)
        assert [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in whole] == [
            (UUID0, "Healthy", [0]),
            (UUID1, "Healthy", [1]),
        ]
        core = env.kubelet.devices(CORE)
        assert len(core) == 200
        assert f"{UUID0}::core-0" == core[0].ID
        assert f"{UUID1}::core-99" == core[-1].ID
        assert all(len(d.ID) <= 63 for d in core)
        mem = env.kubelet.devices(MEM)
        assert [d.ID for d in mem[:4]] == [f"{UUID0}::mem-{n}" for n in range(4)]
        assert len(mem) == 8
        assert {d.topology.nodes[0].ID for d in mem if d.ID.startswith(UUID1)} == {1}


@pytest.mark.anyio
async def test_list_and_watch_follows_health_both_ways(plugin_dir: Path, dev_root: Path) -> None:
    async with environment(plugin_dir, dev_root) as env:
        sick = [msgspec.structs.replace(gpus()[0], healthy=False), gpus()[1]]
        env.state.publish(sick)
        whole = await env.kubelet.wait_devices(GPU, lambda ds: health(ds)[UUID0] == "Unhealthy")
        assert health(whole)[UUID1] == "Healthy"
        core = await env.kubelet.wait_devices(
            CORE, lambda ds: health(ds)[f"{UUID0}::core-0"] == "Unhealthy"
        )
        assert {h for i, h in health(core).items() if i.startswith(UUID0)} == {"Unhealthy"}
        assert {h for i, h in health(core).items() if i.startswith(UUID1)} == {"Healthy"}
        await env.kubelet.wait_devices(MEM, lambda ds: health(ds)[f"{UUID0}::mem-3"] == "Unhealthy")

        # Recovery is advertised too; the reference plugins never do that.
        updates = env.kubelet.endpoint(GPU).updates
        env.state.publish(gpus())
        whole = await env.kubelet.wait_devices(GPU, lambda ds: health(ds)[UUID0] == "Healthy")
        assert env.kubelet.endpoint(GPU).updates == updates + 1

        # A GPU that disappears from the inventory disappears from every list.
        env.state.publish(gpus()[1:])
        await env.kubelet.wait_devices(GPU, lambda ds: [d.ID for d in ds] == [UUID1])
        await env.kubelet.wait_devices(MEM, lambda ds: len(ds) == 4)


# --- Allocate ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_allocate_returns_the_backend_decision(plugin_dir: Path, dev_root: Path) -> None:
    async with environment(plugin_dir, dev_root) as env:
        response = await env.kubelet.allocate(GPU, [[UUID1]])
        assert env.backend.allocate_calls == [(GPU, [[UUID1]])]
        (container,) = response.container_responses
        assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": UUID1}
        assert dict(container.annotations) == {"gpulet.io/allocated": "yes"}
        assert [c.name for c in container.cdi_devices] == [f"nvidia.com/gpu={UUID1}"]
        assert [(m.container_path, m.host_path, m.read_only) for m in container.mounts] == [
            ("/run/gpulet", "/run/gpulet/x", False)
        ]
        # Only existing files: not nvidia0 (other GPU), uvm-tools or modeset (absent).
        assert [(d.container_path, d.host_path, d.permissions) for d in container.devices] == [
            ("/dev/nvidia1", "/dev/nvidia1", "rw"),
            ("/dev/nvidiactl", "/dev/nvidiactl", "rw"),
            ("/dev/nvidia-uvm", "/dev/nvidia-uvm", "rw"),
        ]

        shares = [f"{UUID0}::core-{n}" for n in range(30)]
        response = await env.kubelet.allocate(CORE, [shares, [f"{UUID1}::core-0"]])
        assert env.backend.allocate_calls[-1] == (CORE, [shares, [f"{UUID1}::core-0"]])
        first, second = response.container_responses
        assert first.devices[0].host_path == "/dev/nvidia0"
        assert second.devices[0].host_path == "/dev/nvidia1"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("invalid_core_units", grpc.StatusCode.INVALID_ARGUMENT),
        ("insufficient_capacity", grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("unhealthy_device", grpc.StatusCode.FAILED_PRECONDITION),
        ("checkpoint_lost", grpc.StatusCode.FAILED_PRECONDITION),
        ("not_ready", grpc.StatusCode.UNAVAILABLE),
        ("checkpoint_failed", grpc.StatusCode.INTERNAL),
        # A code of a newer allocator: the plugin cannot say more than that it failed.
        ("a_newer_code", grpc.StatusCode.INTERNAL),
    ],
)
async def test_allocate_rejection_maps_to_status(
    plugin_dir: Path, dev_root: Path, code: str, status: grpc.StatusCode
) -> None:
    async with environment(plugin_dir, dev_root) as env:
        env.backend.reject = Refused(code, "only 1 free GPU left on NUMA node 0")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env.kubelet.allocate(GPU, [[UUID0, UUID1]])
        assert info.value.code() == status
        assert info.value.details() == f"{code}: only 1 free GPU left on NUMA node 0"


@pytest.mark.anyio
async def test_allocate_is_bounded_when_the_backend_hangs(plugin_dir: Path, dev_root: Path) -> None:
    async with environment(plugin_dir, dev_root) as env:
        env.backend.hang = True
        started = anyio.current_time()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env.kubelet.allocate(GPU, [[UUID0]], timeout_s=5)
        assert anyio.current_time() - started < 2
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "did not answer within 0.3 s" in (info.value.details() or "")

        env.backend.hang = False
        env.backend.unavailable = True
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env.kubelet.allocate(GPU, [[UUID0]])
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "allocator unavailable: no responders" in (info.value.details() or "")


@pytest.mark.anyio
async def test_allocate_of_an_unknown_gpu_fails_cleanly(plugin_dir: Path, dev_root: Path) -> None:
    async with environment(plugin_dir, dev_root) as env:
        env.state.publish(gpus()[:1])
        await env.kubelet.wait_devices(GPU, lambda ds: len(ds) == 1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env.kubelet.allocate(GPU, [[UUID1]])
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert UUID1 in (info.value.details() or "")


# --- GetPreferredAllocation ----------------------------------------------------------------


@pytest.mark.anyio
async def test_preferred_allocation_is_delegated(plugin_dir: Path, dev_root: Path) -> None:
    async with environment(plugin_dir, dev_root) as env:
        env.backend.preferred_answer = [[UUID1]]
        assert await env.kubelet.preferred(GPU, [([UUID0, UUID1], [], 1)]) == [[UUID1]]
        assert env.backend.preferred_calls == [
            (GPU, [PreferredRequest(available=[UUID0, UUID1], must_include=[], size=1)])
        ]


@pytest.mark.anyio
async def test_preferred_allocation_falls_back_when_the_backend_fails(
    plugin_dir: Path, dev_root: Path
) -> None:
    async with environment(plugin_dir, dev_root) as env:
        available = [f"{UUID0}::mem-0", f"{UUID1}::mem-0", f"{UUID1}::mem-1", f"{UUID1}::mem-2"]
        env.backend.hang = True
        # A hint must not fail pod admission: a local answer, on one NUMA node.
        (answer,) = await env.kubelet.preferred(MEM, [(available, [], 3)])
        assert answer == available[1:]
        env.backend.hang = False

        env.backend.preferred_answer = [[UUID0, UUID0]]  # invalid: duplicates
        assert await env.kubelet.preferred(GPU, [([UUID0, UUID1], [UUID1], 2)]) == [[UUID1, UUID0]]

        env.backend.reject = Refused("insufficient_capacity", "no 3 GPUs here")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env.kubelet.preferred(GPU, [([UUID0, UUID1], [], 3)])
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.anyio
async def test_preferred_allocation_without_fallback_reports_unavailable(
    plugin_dir: Path, dev_root: Path
) -> None:
    async with environment(plugin_dir, dev_root, preferred_fallback=False) as env:
        env.backend.unavailable = True
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env.kubelet.preferred(GPU, [([UUID0, UUID1], [], 1)])
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# --- restarts and shutdown ------------------------------------------------------------------


@pytest.mark.anyio
async def test_kubelet_restart_leads_to_reregistration(plugin_dir: Path, dev_root: Path) -> None:
    async with environment(plugin_dir, dev_root) as env:
        await env.kubelet.restart(timeout_s=5)
        for resource in ALL:
            reg = await env.kubelet.wait_registered(resource, count=2)
            assert socket_mode(plugin_dir / reg.endpoint) == 0o600
        assert len(env.kubelet.registrations) == 6
        # The new kubelet gets the full list, and allocation works again.
        env.state.publish([gpus()[0], msgspec.structs.replace(gpus()[1], healthy=False)])
        await env.kubelet.wait_devices(GPU, lambda ds: health(ds)[UUID1] == "Unhealthy")
        response = await env.kubelet.allocate(GPU, [[UUID0]])
        assert dict(response.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": UUID0}

        # A restart that leaves plugin sockets alone is noticed through kubelet.sock.
        await env.kubelet.restart(timeout_s=5, delete_plugin_sockets=False)
        assert env.kubelet.registration_count(GPU) == 3


@pytest.mark.anyio
async def test_deleted_plugin_socket_is_recreated(plugin_dir: Path, dev_root: Path) -> None:
    async with environment(plugin_dir, dev_root) as env:
        path = plugin_dir / "gpulet-gpulet.io-gpu-core.sock"
        path.unlink()
        await env.kubelet.wait_registered(CORE, count=2)
        assert socket_mode(path) == 0o600
        await env.kubelet.wait_devices(CORE, lambda ds: len(ds) == 200)
        assert env.kubelet.registration_count(GPU) == 1


@pytest.mark.anyio
async def test_a_socket_that_keeps_being_replaced_is_restarted_with_a_back_off(
    plugin_dir: Path, dev_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two device plugins serving the same socket files (a second gpulet on the node)
    replace each other's socket at every look (every 50 ms here): each restarts its
    servers at most a few times a minute after the first three, and says what is likely
    wrong at most twice a minute, instead of a warning and a restart per look. (No
    kubelet: the storm is the two plugins' alone.)"""
    config = make_config(plugin_dir, dev_root)
    first = DevicePluginManager(config, DeviceList(gpus()), FakeBackend())
    second = DevicePluginManager(config, DeviceList(gpus()), FakeBackend())
    looks = 40
    async with anyio.create_task_group() as tg:
        tg.start_soon(first.run)
        tg.start_soon(second.run)
        # The window a storm would fill: 40 looks of each plugin.
        await anyio.sleep(looks * config.watch_interval_s)
        first.stop()
        second.stop()
    messages = [r.getMessage() for r in caplog.records]
    restarts = [m for m in messages if "restarting its server" in m]
    said = [m for m in messages if "a second gpulet?" in m]
    # Without the back-off: a restart per look, each side, each of the 3 resources
    # (about 240 here).
    assert len(restarts) <= 2 * 3 * (manager.REPLACED_FREE + 3), len(restarts)
    assert 1 <= len(said) <= 4, said


@pytest.mark.anyio
async def test_shutdown_ends_streams_and_removes_sockets(plugin_dir: Path, dev_root: Path) -> None:
    state = DeviceList(gpus())
    async with running_fake_kubelet(plugin_dir) as kubelet:
        async with running_plugin(
            make_config(plugin_dir, dev_root), state, FakeBackend()
        ) as manager:
            for resource in ALL:
                await kubelet.wait_devices(resource)
            paths = manager.socket_paths
            assert all(p.exists() for p in paths)
        for resource in ALL:
            assert await kubelet.wait_stream_end(resource) == grpc.StatusCode.OK
        assert not any(p.exists() for p in paths)
        assert sorted(os.listdir(plugin_dir)) == ["kubelet.sock"]


@pytest.mark.anyio
async def test_cancellation_also_removes_sockets(plugin_dir: Path, dev_root: Path) -> None:
    manager = DevicePluginManager(
        make_config(plugin_dir, dev_root), DeviceList(gpus()), FakeBackend()
    )
    async with running_fake_kubelet(plugin_dir):
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(5):
                await tg.start(manager.run)
            tg.cancel_scope.cancel()
        assert not any(p.exists() for p in manager.socket_paths)


# --- fake kubelet's pod resources API ---------------------------------------------------------


@pytest.mark.anyio
async def test_fake_pod_resources_lister(plugin_dir: Path) -> None:
    from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
    from gpulet_common.kubelet_api.podresources.v1 import api_pb2_grpc as pr_grpc

    pods = [FakePod(name="train", containers=[FakeContainer(name="main", devices={GPU: [UUID0]})])]
    sock = plugin_dir / "pod-resources.sock"
    async with (
        running_fake_kubelet(plugin_dir, pod_resources_socket=sock, pods=pods),
        grpc.aio.insecure_channel(f"unix://{sock}") as channel,
    ):
        stub = pr_grpc.PodResourcesListerStub(channel)
        listed = await stub.List(pr.ListPodResourcesRequest(), timeout=2)
        (pod,) = listed.pod_resources
        assert (pod.name, pod.namespace) == ("train", "default")
        assert list(pod.containers[0].devices[0].device_ids) == [UUID0]
        got = await stub.Get(pr.GetPodResourcesRequest(pod_name="train", pod_namespace="default"))
        assert got.pod_resources.containers[0].name == "main"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Get(pr.GetPodResourcesRequest(pod_name="gone", pod_namespace="default"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
