"""The slice publisher fed by the real node read model: NATS inventory and health KV in,
ResourceSlices in the API emulator out. A fault taints, its end untaints, a GPU that
appears joins the pool, all without a restart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import msgspec
import pytest

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, Delivery
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.kube import KubeConfig
from gpulet_common.kubeapi import KubeClient
from gpulet_common.messages import Inventory, InventoryRequest
from gpulet_common.nodeview import NodeView
from gpulet_common.settings.dra import DraSettings
from gpulet_common.settings.nats import NatsSettings
from gpulet_reporter.slices.publisher import SlicePublisher
from support.health_kv import gpu_health, health_bucket, put_health
from support.kube_emulator import KubeEmulator
from support.kube_emulator_dra import dra_emulator, slices
from support.reporter_harness import make_inventory
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

NODE = "node-a"
SETTINGS = DraSettings(mode="dra", quiet_window_s=0.05, max_delay_s=0.2)


def taints(emu: KubeEmulator) -> dict[str, list[tuple[str, str, str]]]:
    return {
        d["name"]: [(t["key"], t.get("value", ""), t["effect"]) for t in d.get("taints", [])]
        for s in slices(emu)
        for d in s["spec"]["devices"]
    }


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with dra_emulator(NODE) as emulator:
        yield emulator


async def test_health_and_inventory_reach_the_slices(
    nats_server: EmbeddedNats, emu: KubeEmulator
) -> None:
    inventory = msgspec.structs.replace(make_inventory(NODE, 2), seq=1, boot_id="b")
    settings = NatsSettings(url=nats_server.url)
    async with (
        Bus.connect(settings, name="collector", max_initial_attempts=5) as collector,
        Bus.connect(settings, name="reporter", max_initial_attempts=5) as reader,
        KubeClient(KubeConfig(emu.url)) as api,
        anyio.create_task_group() as tg,
    ):

        async def answer(_request: Delivery[InventoryRequest]) -> Inventory:
            return inventory

        await tg.start(
            collector.serve,
            subjects.inventory_request(NODE),
            answer,
            codec.INVENTORY_REQUEST,
            codec.INVENTORY,
        )
        await health_bucket(collector)
        view = NodeView(reader, NODE, retry_s=0.05, who="slices")
        await tg.start(view.run)
        publisher = SlicePublisher(api, NODE, SETTINGS)
        publisher.attach(view)
        tg.start_soon(publisher.run)
        await wait_until(lambda: set(taints(emu)) == {"gpu-0", "gpu-1"}, what="pool published")

        uuid = inventory.gpus[1].uuid
        await put_health(collector, NODE, gpu_health(uuid, healthy=False, severity="fatal"))
        await wait_until(
            lambda: taints(emu)["gpu-1"] == [("gpu.gpulet.io/xid", "79", "NoSchedule")],
            what="XID 79 taint",
        )
        await put_health(collector, NODE, gpu_health(uuid, healthy=True))
        await wait_until(lambda: taints(emu)["gpu-1"] == [], what="taint removed")

        bigger = msgspec.structs.replace(make_inventory(NODE, 3), seq=2, boot_id="b")
        await collector.publish(subjects.inventory(NODE), bigger, codec.INVENTORY)
        await wait_until(lambda: len(taints(emu)) == 3, what="a GPU joins the pool")
        # A degraded inventory (NVML gone) keeps the pool instead of deleting it.
        degraded = msgspec.structs.replace(
            bigger, seq=3, gpus=[], degraded_reason="NVML_ERROR_UNINITIALIZED"
        )
        await collector.publish(subjects.inventory(NODE), degraded, codec.INVENTORY)
        await wait_until(lambda: view.inventory is not None and view.inventory.seq == 3)
        await anyio.sleep(SETTINGS.max_delay_s + 0.2)
        assert len(taints(emu)) == 3
        tg.cancel_scope.cancel()
