"""The DRA health source from the real node read model (NATS inventory and health KV)."""

from __future__ import annotations

from typing import cast

import anyio
import msgspec
import pytest

from gpulet_allocator.kubelet.dra.health import NodeViewHealth
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, Delivery
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import Inventory, InventoryRequest
from gpulet_common.nodeview import NodeView
from gpulet_common.settings.nats import NatsSettings
from support.health_kv import gpu_health, health_bucket, put_health
from support.reporter_harness import make_inventory
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

NODE = "node-a"


async def test_health_follows_the_node_view(nats_server: EmbeddedNats) -> None:
    inventory = msgspec.structs.replace(make_inventory(NODE, 2), seq=1, boot_id="b")
    settings = NatsSettings(url=nats_server.url)
    async with (
        Bus.connect(settings, name="writer", max_initial_attempts=5) as writer,
        Bus.connect(settings, name="plugin", max_initial_attempts=5) as reader,
        anyio.create_task_group() as tg,
    ):

        async def answer(_request: Delivery[InventoryRequest]) -> Inventory:
            return inventory

        await health_bucket(writer)
        view = NodeView(reader, NODE, retry_s=0.05, who="dra health")
        source = NodeViewHealth(view, NODE)
        assert source.device_health() == []  # no inventory yet: nothing to claim
        # The collector answers the view's request (a publish could race the view's
        # subscription on another connection).
        await tg.start(
            writer.serve,
            subjects.inventory_request(NODE),
            answer,
            codec.INVENTORY_REQUEST,
            codec.INVENTORY,
        )
        await tg.start(view.run)
        await wait_until(lambda: len(source.device_health()) == 2, what="inventory")
        assert {(d.device, d.health) for d in source.device_health()} == {
            ("gpu-0", "healthy"),
            ("gpu-1", "healthy"),
        }
        version = await source.wait_changed(-1)
        uuid = inventory.gpus[1].uuid
        await put_health(writer, NODE, gpu_health(uuid, healthy=False, severity="fatal"))
        with anyio.fail_after(5):
            while True:
                version = await source.wait_changed(version)
                sick = [d for d in source.device_health() if d.health == "unhealthy"]
                if sick:
                    break
        assert [(d.pool, d.device) for d in sick] == [(NODE, "gpu-1")]
        assert "xid:79" in sick[0].message
        await put_health(writer, NODE, gpu_health(uuid, healthy=True))
        await wait_until(
            lambda: all(d.health == "healthy" for d in source.device_health()),
            what="recovered",
        )
        tg.cancel_scope.cancel()


async def test_a_dead_mps_daemon_is_a_fault_of_its_gpus_shares() -> None:
    """The allocator's MPS supervisor names GPUs whose control daemon is down: the DRA
    health stream reports them unhealthy with why, and streams again when it changes."""
    inventory = make_inventory(NODE, 2)
    view = NodeView(cast(Bus, None), NODE)
    view.inventory = inventory
    faults: dict[str, str] = {}
    source = NodeViewHealth(view, NODE, lambda: faults)
    assert {d.health for d in source.device_health()} == {"healthy"}
    version = await source.wait_changed(-1)
    faults[inventory.gpus[1].uuid] = "the MPS control daemon stopped answering"
    source.changed()
    assert await source.wait_changed(version) > version
    states = {d.device: (d.health, d.message) for d in source.device_health()}
    assert states["gpu-0"] == ("healthy", "")
    assert states["gpu-1"] == ("unhealthy", "MPS: the MPS control daemon stopped answering")
