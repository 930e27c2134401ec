"""NVIDIA's MIG strategies as kubelet sees them (issue 27).

For each mock MIG scenario and each ``allocator.mig_strategy``, the real device
plugin (its manager, servers and resource model) with the real decision core behind
it registers with the fake kubelet, and the resources and device counts kubelet sees
through ``ListAndWatch`` are checked against a table written from the scenario files:

* ``a100-mig-mixed``: GPU 0 = 3g.20gb, 2g.10gb, 1g.5gb, 1g.5gb; GPU 1 = 1c.3g.20gb +
  2c.3g.20gb (one GI) and 3g.20gb; GPU 2 MIG-enabled without instances; GPU 3 MIG
  disabled (40 GiB: 160 memory units of 256 MiB);
* ``h100-mig-single``: 8 GPUs, each 7 x 1g.10gb.

Then: NVIDIA's three single-layout rules, one test each; Allocate of a MIG device
through kubelet (the MIG UUID in NVIDIA_VISIBLE_DEVICES, the parent's device node and
the capability nodes); a MIG device is never given twice; health per MIG device (a
fault on one MIG device, then on its GPU) as ListAndWatch and Allocate show it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import anyio
import msgspec
import pytest

from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.kubelet.deviceplugin import DeviceList, DevicePluginManager, PluginConfig
from gpulet_allocator.kubelet.deviceplugin.resources import (
    build_inventory,
    mig_resource_specs,
    plugin_gpus_from_inventory,
)
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as dp
from gpulet_allocator.mig import MigStrategy, mig_plan
from gpulet_allocator.protocol import ContainerAllocation, PreferredRequest, resource_specs
from gpulet_common.bus import Bus
from gpulet_common.messages import GpuHealth, Inventory
from gpulet_common.nodeview import NodeView
from gpulet_common.nvml.loader import open_mock
from gpulet_common.refusal import Refused
from gpulet_common.settings.allocator import ResourceNames
from support.fake_kubelet import FakeKubelet, running_fake_kubelet

NAMES = ResourceNames()
GPU, CORE, MEM = NAMES.gpu, NAMES.core, NAMES.memory


def inventory(scenario: str) -> Inventory:
    adapter = open_mock(scenario)
    try:
        return adapter.inventory("n", 1)
    finally:
        adapter.shutdown()


# scenario -> strategy -> {resource: devices kubelet sees}
EXPECTED: dict[str, dict[MigStrategy, dict[str, int]]] = {
    "a100-mig-mixed": {
        "none": {GPU: 1, CORE: 100, MEM: 160},
        # Invalid for single (three rules broken): no MIG device, GPU 3 still whole.
        "single": {GPU: 1, CORE: 100, MEM: 160},
        "mixed": {
            GPU: 1,
            CORE: 100,
            MEM: 160,
            "nvidia.com/mig-3g.20gb": 2,
            "nvidia.com/mig-2g.10gb": 1,
            "nvidia.com/mig-1g.5gb": 2,
            "nvidia.com/mig-1c.3g.20gb": 1,
            "nvidia.com/mig-2c.3g.20gb": 1,
        },
    },
    "h100-mig-single": {
        "none": {GPU: 0, CORE: 0, MEM: 0},
        "single": {GPU: 56, CORE: 0, MEM: 0},
        "mixed": {GPU: 0, CORE: 0, MEM: 0, "nvidia.com/mig-1g.10gb": 56},
    },
}
CASES = [(s, st) for s, by in EXPECTED.items() for st in by]


_STATES: dict[int, DeviceList] = {}


def kubelet_state(core: AllocatorCore) -> DeviceList:
    """The device list the plugin serving ``core`` follows."""
    return _STATES[id(core)]


class CoreBackend:
    """The device plugin's backend, answered in-process by the real decision core."""

    def __init__(self, core: AllocatorCore) -> None:
        self.core = core

    async def allocate(
        self, resource: str, container_requests: list[list[str]]
    ) -> list[ContainerAllocation]:
        return self.core.allocate(resource, container_requests)[0]

    async def preferred(self, resource: str, requests: list[PreferredRequest]) -> list[list[str]]:
        return self.core.preferred(resource, requests)


def config(plugin_dir: Path, dev_root: Path, caps: Path) -> PluginConfig:
    return PluginConfig(
        plugin_dir=str(plugin_dir),
        dev_root=str(dev_root),
        mig_capabilities_root=str(caps),
        backend_timeout_s=2.0,
        watch_interval_s=0.05,
        register_backoff_initial_s=0.05,
        register_backoff_max_s=0.2,
        register_timeout_s=1.0,
        stop_grace_s=0.2,
    )


@contextlib.asynccontextmanager
async def serving(
    inv: Inventory, strategy: MigStrategy, plugin_dir: Path, tmp_path: Path
) -> AsyncIterator[tuple[FakeKubelet, AllocatorCore, list[str]]]:
    """The plugin as the service runs it (plan, GPUs, MIG resources), before kubelet."""
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for name in ("nvidiactl", *(f"nvidia{g.minor}" for g in inv.gpus)):
        (dev / name).touch()
    caps = tmp_path / "caps"
    core = AllocatorCore(node="n", names=NAMES, mig_strategy=strategy)
    assert core.update_inventory(inv)
    plan = mig_plan(inv.gpus, strategy, GPU)
    mig_specs = mig_resource_specs(plan, GPU)
    state = DeviceList(plugin_gpus_from_inventory(inv.gpus, mig=plan))
    _STATES[id(core)] = state
    resources = [*(s.name for s in resource_specs(NAMES)), *(s.name for s in mig_specs)]
    manager = DevicePluginManager(
        config(plugin_dir, dev, caps), state, CoreBackend(core), mig_specs=mig_specs
    )
    async with running_fake_kubelet(plugin_dir) as kubelet, anyio.create_task_group() as tg:
        with anyio.fail_after(10):
            await tg.start(manager.run)
        try:
            yield kubelet, core, resources
        finally:
            manager.stop()


@pytest.mark.anyio
@pytest.mark.parametrize(("scenario", "strategy"), CASES)
async def test_kubelet_sees_the_strategys_resources(
    scenario: str, strategy: MigStrategy, plugin_dir: Path, tmp_path: Path
) -> None:
    inv = inventory(scenario)
    expected = EXPECTED[scenario][strategy]
    async with serving(inv, strategy, plugin_dir, tmp_path) as (kubelet, _core, resources):
        assert sorted(resources) == sorted(expected)
        seen: dict[str, int] = {}
        for resource in resources:
            devices = await kubelet.wait_devices(resource)
            assert all(d.health == "Healthy" for d in devices)
            seen[resource] = len(devices)
        assert {r.resource_name for r in kubelet.registrations} == set(expected)
    assert seen == expected
    # IDs are MIG UUIDs, and no MIG-enabled GPU is among any resource's devices.
    parents = {g.uuid for g in inv.gpus if g.mig_mode == "enabled"}
    migs = {d.uuid for g in inv.gpus for d in g.mig_devices}
    plan = mig_plan(inv.gpus, strategy, GPU)
    listed = build_inventory(
        [*resource_specs(NAMES), *mig_resource_specs(plan, GPU)],
        plugin_gpus_from_inventory(inv.gpus, mig=plan),
    )
    for resource, plugin_devices in listed.items():
        ids = {d.id.split("::")[0] for d in plugin_devices}
        assert not ids & parents
        if resource not in (CORE, MEM) and strategy != "none":
            assert ids <= migs | {g.uuid for g in inv.gpus if g.mig_mode != "enabled"}


def _h100_with(change: str) -> Inventory:
    inv = inventory("h100-mig-single")
    gpu0 = inv.gpus[0]
    if change == "empty":
        gpu0 = msgspec.structs.replace(gpu0, mig_devices=[])
    elif change == "disabled":
        gpu0 = msgspec.structs.replace(
            gpu0, mig_mode="disabled", mig_mode_pending="disabled", mig_devices=[]
        )
    else:
        other = msgspec.structs.replace(gpu0.mig_devices[0], profile="2g.20gb")
        gpu0 = msgspec.structs.replace(gpu0, mig_devices=[other, *gpu0.mig_devices[1:]])
    return msgspec.structs.replace(inv, gpus=[gpu0, *inv.gpus[1:]])


@pytest.mark.parametrize(
    ("change", "why", "whole"),
    [
        ("empty", "without MIG devices", 0),
        ("disabled", "beside MIG-disabled", 1),
        ("profiles", "more than one MIG profile (1g.10gb, 2g.20gb)", 0),
    ],
)
def test_an_invalid_single_layout_offers_no_mig_device(change: str, why: str, whole: int) -> None:
    inv = _h100_with(change)
    plan = mig_plan(inv.gpus, "single", GPU)
    assert why in plan.invalid
    assert plan.offers == {}
    listed = build_inventory(resource_specs(NAMES), plugin_gpus_from_inventory(inv.gpus, mig=plan))
    # The MIG-disabled GPU beside an invalid layout is still offered whole, nothing else.
    assert len(listed[GPU]) == whole
    core = AllocatorCore(node="n", names=NAMES, mig_strategy="single")
    core.update_inventory(inv)
    mig = inv.gpus[1].mig_devices[0].uuid
    with pytest.raises(Refused) as refused:
        core.allocate(GPU, [[mig]])
    assert refused.value.code == "unknown_device"
    assert "invalid single layout" in refused.value.message


def test_a_valid_single_layout_is_valid() -> None:
    assert mig_plan(inventory("h100-mig-single").gpus, "single", GPU).invalid == ""


@pytest.mark.anyio
async def test_allocate_a_mig_device_through_kubelet(plugin_dir: Path, tmp_path: Path) -> None:
    inv = inventory("a100-mig-mixed")
    gpu0 = inv.gpus[0]
    small = [d for d in gpu0.mig_devices if d.profile == "1g.5gb"]
    target = small[0]
    caps = tmp_path / "caps" / f"gpu{gpu0.minor}" / "mig" / f"gi{target.gpu_instance_id}"
    (caps / f"ci{target.compute_instance_id}").mkdir(parents=True)
    (caps / "access").write_text("DeviceFileMinor: 12\nDeviceFileMode: 292\n")
    (caps / f"ci{target.compute_instance_id}" / "access").write_text("DeviceFileMinor: 13\n")
    resource = "nvidia.com/mig-1g.5gb"
    async with serving(inv, "mixed", plugin_dir, tmp_path) as (kubelet, core, _resources):
        for n in (12, 13):
            (tmp_path / "dev" / "nvidia-caps" / f"nvidia-cap{n}").touch()
        await kubelet.wait_devices(resource)
        answer = await kubelet.allocate(resource, [[target.uuid]])
        [container] = answer.container_responses
        assert container.envs["NVIDIA_VISIBLE_DEVICES"] == target.uuid
        paths = {d.host_path for d in container.devices}
        assert paths == {
            f"/dev/nvidia{gpu0.minor}",
            "/dev/nvidia-caps/nvidia-cap12",
            "/dev/nvidia-caps/nvidia-cap13",
            "/dev/nvidiactl",
        }
        # Never given twice: another container naming it (with the other 1g.5gb) is refused.
        with pytest.raises(Refused) as twice:
            core.allocate(resource, [[target.uuid, small[1].uuid]])
        assert twice.value.code == "insufficient_capacity"
        # A MIG device under another profile's resource, or the whole-GPU one, is refused.
        for wrong in ("nvidia.com/mig-3g.20gb", GPU):
            with pytest.raises(Refused) as other:
                core.allocate(wrong, [[small[1].uuid]])
            assert other.value.code == "unknown_device"
        # The preference of the MIG resource offers only free MIG devices.
        [preferred] = await kubelet.preferred(resource, [([s.uuid for s in small], [], 1)])
        assert preferred == [small[1].uuid]


# --- health per MIG device -------------------------------------------------------------


def _view_with(healths: list[GpuHealth]) -> NodeView:
    view = NodeView(cast(Bus, None), "n")
    view._replace({h.gpu_uuid: (1, h) for h in healths})
    return view


@pytest.mark.anyio
async def test_list_and_watch_shows_a_mig_device_fault_and_a_gpu_fault(
    plugin_dir: Path, tmp_path: Path
) -> None:
    inv = inventory("a100-mig-mixed")
    gpu0 = inv.gpus[0]
    gi1 = next(d for d in gpu0.mig_devices if d.gpu_instance_id == 1)
    others = {d.uuid for d in gpu0.mig_devices} - {gi1.uuid}
    plan = mig_plan(inv.gpus, "mixed", GPU)
    resources = {plan.offers[d.uuid].resource for d in gpu0.mig_devices}
    async with serving(inv, "mixed", plugin_dir, tmp_path) as (kubelet, core, _resources):
        state = kubelet_state(core)

        async def health_seen(view: NodeView) -> dict[str, str]:
            state.publish(plugin_gpus_from_inventory(inv.gpus, view.unhealthy(), mig=plan))
            for device in (gpu0.uuid, *(d.uuid for d in gpu0.mig_devices)):
                core.set_health(device, view.healthy(device))
            seen: dict[str, str] = {}
            listed = build_inventory(mig_resource_specs(plan, GPU), state.snapshot().gpus)
            for resource in resources:
                want = {d.id: d.health for d in listed[resource]}

                def arrived(devices: list[dp.Device], want: dict[str, str] = want) -> bool:
                    return {d.ID: d.health for d in devices} == want

                await kubelet.wait_devices(resource, arrived)
                seen.update({d.ID: d.health for d in kubelet.devices(resource)})
            return seen

        # gi 1 / ci 0 only: that MIG device Unhealthy, the others and the GPU not.
        only = GpuHealth(gpu_uuid=gpu0.uuid, unhealthy_mig_devices=[gi1.uuid])
        view = _view_with([only])
        assert view.healthy(gpu0.uuid)
        assert not view.healthy(gi1.uuid)
        seen = await health_seen(view)
        assert seen[gi1.uuid] == "Unhealthy"
        assert {seen[u] for u in others} == {"Healthy"}
        with pytest.raises(Refused) as refused:
            core.allocate("nvidia.com/mig-3g.20gb", [[gi1.uuid]])
        assert refused.value.code == "unhealthy_device"
        # A GPU-wide fault: every MIG device of the GPU.
        view = _view_with([GpuHealth(gpu_uuid=gpu0.uuid, healthy=False)])
        seen = await health_seen(view)
        assert {seen[d.uuid] for d in gpu0.mig_devices} == {"Unhealthy"}
        small = next(iter(others))
        with pytest.raises(Refused) as whole_gpu:
            core.allocate(plan.offers[small].resource, [[small]])
        assert whole_gpu.value.code == "unhealthy_device"
        # Recovered: all back.
        seen = await health_seen(_view_with([GpuHealth(gpu_uuid=gpu0.uuid)]))
        assert {seen[d.uuid] for d in gpu0.mig_devices} == {"Healthy"}
