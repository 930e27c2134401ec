"""Releasing allocations of pods that are gone, and the plugin on a node without kubelet."""

from __future__ import annotations

import tempfile
from pathlib import Path

import anyio
import pytest

from gpulet_allocator import protocol as p
from gpulet_allocator.cli import format_state
from gpulet_allocator.kubelet.deviceplugin.service import DevicePluginService
from gpulet_allocator.service import AllocatorService
from gpulet_allocator.state.checkpoint import read_state
from gpulet_common.bus import Refused
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.settings import Settings
from support import reference
from support.agent import runtime_for
from support.allocator_stack import (
    CORE,
    GPU,
    MEM,
    allocator_stack,
    dev_root_with,
    eventually,
    make_settings,
)
from support.fake_kubelet import FakeContainer, FakePod, running_fake_kubelet
from support.waiting import wait_until

pytestmark = pytest.mark.anyio


def settings_for(
    nats: EmbeddedNats, tmp_path: Path, plugin_dir: Path, **allocator: object
) -> Settings:
    return make_settings(
        nats.url,
        tmp_path / "state",
        plugin_dir,
        dev_root_with(tmp_path / "dev", 8),
        pod_resources_socket=plugin_dir / "pod-resources.sock",
        allocator=allocator,
    )


async def test_allocations_of_pods_gone_are_released_via_pod_resources(
    nats_server: EmbeddedNats, tmp_path: Path, plugin_dir: Path
) -> None:
    settings = settings_for(nats_server, tmp_path, plugin_dir)
    inventory = reference.nvlink_pairs_8()
    async with allocator_stack(settings, inventory=inventory, pod_resources=True) as stack:
        gpus = [d.ID for d in stack.kubelet.devices(GPU)]
        cores = [d.ID for d in stack.kubelet.devices(CORE)][:20]
        memory = [d.ID for d in stack.kubelet.devices(MEM)][:8]
        # Kubelet records a container's devices as it allocates them.
        stack.kubelet.pods = [
            FakePod("trainer", containers=[FakeContainer("main", {GPU: gpus[:2]})]),
            FakePod("notebook", "lab", [FakeContainer("jupyter", {CORE: cores, MEM: memory})]),
        ]
        whole = await stack.kubelet.allocate(GPU, [gpus[:2]])
        await stack.kubelet.allocate(CORE, [cores])
        await stack.kubelet.allocate(MEM, [memory])
        whole_id = whole.container_responses[0].annotations["gpulet.io/allocation"]

        async def pods_seen() -> dict[str, set[str]]:
            state = await stack.state()
            return {a.id: {f"{g.pod}/{g.container}" for g in a.grants} for a in state.allocations}

        seen: dict[str, set[str]] = {}

        async def both_pods_known() -> bool:
            nonlocal seen
            seen = await pods_seen()
            return len(seen) == 2 and all(v and "/" not in v for v in seen.values())

        await eventually(both_pods_known, "PodResources to name both pods")
        assert seen[whole_id] == {"default/trainer/main"}
        [share_id] = set(seen) - {whole_id}
        assert seen[share_id] == {"lab/notebook/jupyter"}

        # The trainer pod ends: after the grace period its GPUs are free again.
        stack.kubelet.pods = stack.kubelet.pods[1:]

        async def released() -> bool:
            return whole_id not in {a.id for a in (await stack.state()).allocations}

        await eventually(released, "the trainer's GPUs to be released")
        assert {a.id for a in (await stack.state()).allocations} == {share_id}
        again = await stack.kubelet.allocate(GPU, [gpus[:1]])
        assert again.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == gpus[0]

        # Once PodResources told which pod holds it, a pod name releases it too.
        reply = await stack.ask(
            p.ENDPOINT_RELEASE,
            p.ReleaseRequest(pods=["lab/notebook"]),
            p.RELEASE_REQUEST,
            p.RELEASE_REPLY,
        )
        assert [a.id for a in reply.released] == [share_id]


async def test_a_kubelet_that_lists_nothing_for_a_moment_releases_nothing(
    nats_server: EmbeddedNats, tmp_path: Path, plugin_dir: Path
) -> None:
    """Five empty answers in a row, then the pod again: nothing is released. Counted in
    PodResources answers, not in real time, and the grace (30 s) is far longer than a
    loaded machine could stretch those answers."""
    settings = settings_for(nats_server, tmp_path, plugin_dir, release_grace_s=30.0)
    async with allocator_stack(
        settings, inventory=reference.nvlink_pairs_8(), pod_resources=True
    ) as stack:
        kubelet = stack.kubelet
        gpus = [d.ID for d in kubelet.devices(GPU)]
        pods = [FakePod("p", containers=[FakeContainer("c", {GPU: gpus[:1]})])]
        kubelet.pods = list(pods)
        await kubelet.allocate(GPU, [gpus[:1]])

        async def answers(count: int, what: str) -> None:
            """Wait until ``count`` more answers went out and the follower handled all
            but the last (it asks again only once it handled the previous one)."""
            target = kubelet.pod_lists + count + 1
            await wait_until(lambda: kubelet.pod_lists >= target, timeout_s=30, what=what)

        await answers(1, "the pod listed")
        kubelet.pods = []  # kubelet restarting, its pod list not synced yet
        await answers(5, "five empty answers")
        assert len((await stack.state()).allocations) == 1
        kubelet.pods = list(pods)
        await answers(2, "the pod listed again")
        assert len((await stack.state()).allocations) == 1


async def test_explicit_release_without_pod_resources(
    nats_server: EmbeddedNats, tmp_path: Path, plugin_dir: Path
) -> None:
    settings = settings_for(nats_server, tmp_path, plugin_dir)
    async with allocator_stack(settings, inventory=reference.nvlink_pairs_8()) as stack:
        gpus = [d.ID for d in stack.kubelet.devices(GPU)]
        first = await stack.kubelet.allocate(GPU, [gpus[:2]])
        await stack.kubelet.allocate(GPU, [gpus[2:4]])
        first_id = first.container_responses[0].envs["GPULET_ALLOCATION_ID"]
        # No PodResources here: waiting does not release anything.
        await anyio.sleep(0.5)
        state = await stack.state()
        assert len(state.allocations) == 2
        assert first_id in format_state(state)

        async def release(request: p.ReleaseRequest) -> list[str]:
            reply = await stack.ask(p.ENDPOINT_RELEASE, request, p.RELEASE_REQUEST, p.RELEASE_REPLY)
            return [a.id for a in reply.released]

        assert await release(p.ReleaseRequest(allocation_ids=[first_id])) == [first_id]
        assert await release(p.ReleaseRequest(allocation_ids=[first_id])) == []  # idempotent
        # By the device IDs kubelet gave the container.
        [second_id] = await release(p.ReleaseRequest(resource=GPU, device_ids=gpus[2:4]))
        assert second_id != first_id
        assert (await stack.state()).allocations == []
        # The GPUs can be handed out again, and the release survived on disk.
        await stack.kubelet.allocate(GPU, [gpus[:4]])

        with pytest.raises(Refused) as refused:
            await release(p.ReleaseRequest())
        assert refused.value.code == "invalid_request"


async def test_plugin_waits_degraded_for_the_kubelet_dir(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    with tempfile.TemporaryDirectory(prefix="gpl-") as d:
        plugin_dir = Path(d) / "device-plugins"
        settings = make_settings(
            nats_server.url, tmp_path / "state", plugin_dir, dev_root_with(tmp_path / "dev", 1)
        )
        async with runtime_for(settings) as runtime, anyio.create_task_group() as tg:
            status = runtime.status
            service = DevicePluginService(runtime)
            with anyio.fail_after(5):
                await tg.start(service.run)
            current = status.get("device-plugin")
            assert current is not None
            assert current.state == "degraded"
            assert "does not exist" in current.detail
            assert str(plugin_dir) in current.detail

            # Kubelet shows up: the plugin registers without a restart.
            await anyio.Path(plugin_dir).mkdir()
            async with running_fake_kubelet(plugin_dir) as kubelet:
                await kubelet.wait_registered(GPU, timeout_s=8)

                async def ready() -> bool:
                    return getattr(status.get("device-plugin"), "state", "") == "ready"

                await eventually(ready, "the plugin to report ready")
            tg.cancel_scope.cancel()


async def test_checkpoint_path_setting_is_honoured(
    nats_server: EmbeddedNats, tmp_path: Path, plugin_dir: Path
) -> None:
    path = tmp_path / "elsewhere" / "alloc.json"
    settings = settings_for(nats_server, tmp_path, plugin_dir, checkpoint_path=str(path))
    async with allocator_stack(settings, inventory=reference.nvlink_pairs_8()) as stack:
        await stack.kubelet.allocate(GPU, [[d.ID for d in stack.kubelet.devices(GPU)][:1]])
        state = await stack.state()
        assert state.checkpoint == str(path)
        on_disk, _ = read_state(path)  # the snapshot and its journal
        assert len(on_disk.grants) == 1


async def test_disabled_services_idle_and_say_so(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    settings = make_settings(
        nats_server.url, tmp_path / "state", tmp_path / "dp", dev_root_with(tmp_path / "dev", 1)
    )
    settings.allocator.enabled = False
    async with runtime_for(settings) as runtime, anyio.create_task_group() as tg:
        status = runtime.status
        with anyio.fail_after(5):
            await tg.start(AllocatorService(runtime).run)
            await tg.start(DevicePluginService(runtime).run)
        for name in ("allocator", "device-plugin"):
            current = status.get(name)
            assert current is not None
            assert (current.state, current.detail) == (
                "ready",
                "disabled (allocator.enabled = false)",
            )
        assert not (tmp_path / "state" / "allocator").exists()
        tg.cancel_scope.cancel()


async def test_plugin_socket_paths_too_long_are_reported_not_fatal(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    plugin_dir = tmp_path / ("d" * 90)
    plugin_dir.mkdir()
    settings = make_settings(
        nats_server.url, tmp_path / "state", plugin_dir, dev_root_with(tmp_path / "dev", 1)
    )
    async with runtime_for(settings) as runtime, anyio.create_task_group() as tg:
        status = runtime.status
        await tg.start(DevicePluginService(runtime).run)

        async def reported() -> bool:
            current = status.get("device-plugin")
            return current is not None and "a unix socket allows" in current.detail

        await eventually(reported, "the plugin to report the socket path")
        current = status.get("device-plugin")
        assert current is not None
        assert current.state == "degraded"
        tg.cancel_scope.cancel()


async def test_an_unreadable_checkpoint_stops_allocations_until_it_reads(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "allocations.json"
    checkpoint.mkdir()  # reading it fails, like an I/O error would
    settings = make_settings(
        nats_server.url, tmp_path / "state", tmp_path / "dp", dev_root_with(tmp_path / "dev", 1)
    )
    settings.allocator.checkpoint_path = str(checkpoint)
    async with runtime_for(settings) as runtime, anyio.create_task_group() as tg:
        status = runtime.status
        service = AllocatorService(runtime)
        with anyio.fail_after(5):
            await tg.start(service.run)  # started, blocked: later services go on
        current = status.get("allocator")
        assert current is not None
        assert current.state == "blocked"  # not ready (/readyz 503), saying why
        assert not status.ready
        assert "not serving until it can be read" in current.detail
        assert service.micro is None

        checkpoint.rmdir()

        async def serving() -> bool:
            return service.micro is not None

        await eventually(serving, "the allocator to serve once the checkpoint reads")
        tg.cancel_scope.cancel()
