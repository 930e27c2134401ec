"""The mixed MIG strategy end to end: the real allocator and device-plugin services over
a real nats-server, the fake kubelet on the plugin's sockets (issue 27).

The profiles on the node decide which ``nvidia.com/mig-<profile>`` resources exist: an
inventory that brings MIG devices makes the plugin serve and register them (no
restart of the agent), Allocate of one goes to the allocator over NATS and gives the
MIG UUID, and a fault confined to one MIG device in the health service's state lists
that MIG device Unhealthy.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import GpuHealth, Inventory
from gpulet_common.nvml.loader import open_mock
from gpulet_common.settings import Settings
from support.allocator_stack import allocator_stack, dev_root_with, make_settings
from support.health_kv import put_health

pytestmark = pytest.mark.anyio
SMALL = "nvidia.com/mig-1g.5gb"


def inventory(scenario: str) -> Inventory:
    adapter = open_mock(scenario)
    try:
        return adapter.inventory("n", 1)
    finally:
        adapter.shutdown()


@pytest.fixture
def mixed(nats_server: EmbeddedNats, tmp_path: Path, plugin_dir: Path) -> Settings:
    return make_settings(
        nats_server.url,
        tmp_path / "state",
        plugin_dir,
        dev_root_with(tmp_path / "dev", 4),
        allocator={"mig_strategy": "mixed"},
    )


async def test_mixed_resources_follow_the_inventory(mixed: Settings) -> None:
    a100 = inventory("a100-mig-mixed")
    gpu0 = a100.gpus[0]
    small = [d.uuid for d in gpu0.mig_devices if d.profile == "1g.5gb"]
    # First without MIG devices anywhere: only the plain resources.
    bare = msgspec.structs.replace(
        a100, gpus=[msgspec.structs.replace(g, mig_devices=[]) for g in a100.gpus]
    )
    async with allocator_stack(mixed, inventory=None) as stack:
        await stack.publish_inventory(bare)
        await stack.wait_allocator_ready()
        assert stack.plugin is not None
        await stack.kubelet.wait_devices("nvidia.com/gpu", lambda d: len(d) == 1)
        assert stack.plugin.mig_specs == ()
        # Instances created: the plugin serves and registers one resource per profile.
        await stack.publish_inventory(a100)
        await stack.kubelet.wait_registered(SMALL, timeout_s=10)
        devices = await stack.kubelet.wait_devices(SMALL, lambda d: len(d) == 2, timeout_s=10)
        assert sorted(d.ID for d in devices) == sorted(small)
        await stack.kubelet.wait_registered("nvidia.com/mig-1c.3g.20gb", timeout_s=10)
        await stack.wait_for(
            lambda: stack.allocator is not None and bool(stack.allocator.core.mig.offers),
            "the allocator's MIG plan",
        )
        response = await stack.kubelet.allocate(SMALL, [[small[0]]])
        [container] = response.container_responses
        assert container.envs["NVIDIA_VISIBLE_DEVICES"] == small[0]
        # A fault confined to the other 1g.5gb: only it turns Unhealthy.
        await put_health(
            stack.bus,
            stack.node,
            GpuHealth(gpu_uuid=gpu0.uuid, unhealthy_mig_devices=[small[1]]),
        )
        seen = await stack.kubelet.wait_devices(
            SMALL,
            lambda d: {x.ID: x.health for x in d}.get(small[1]) == "Unhealthy",
            timeout_s=10,
        )
        assert {d.ID: d.health for d in seen}[small[0]] == "Healthy"
