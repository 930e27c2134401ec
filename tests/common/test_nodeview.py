"""NodeView against a real nats-server: one read model, ordered by sequences only.

The health side is written as the health service writes it (``GpuHealth`` under
``<node>.<gpu-uuid>`` in the ``gpu_health`` bucket); the inventory side as the
collector publishes it (``seq`` / ``boot_id``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, Delivery
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import GpuHealth, GpuInfo, HealthEvent, Inventory, InventoryRequest
from gpulet_common.nodeview import NodeChange, NodeView
from gpulet_common.settings.nats import NatsSettings
from support.health_kv import gpu_health, health_bucket, put_health
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

NODE = "node-v.example"
A, B = "GPU-aaaa", "GPU-bbbb"


def _bus(server: EmbeddedNats, name: str, **kw: Any) -> AbstractAsyncContextManager[Bus]:
    return Bus.connect(NatsSettings(url=server.url, **kw), name=name, max_initial_attempts=5)


@asynccontextmanager
async def running_view(bus: Bus) -> AsyncIterator[tuple[NodeView, list[NodeChange]]]:
    view = NodeView(bus, NODE, retry_s=0.05, who="test")
    changes: list[NodeChange] = []
    view.listen(changes.append)
    async with anyio.create_task_group() as tg:
        await tg.start(view.run)
        with anyio.fail_after(5):
            await view.health_seen.wait()
        yield view, changes
        tg.cancel_scope.cancel()


def _forged_event(uuid: str) -> HealthEvent:
    return HealthEvent(
        event_id="forged",
        node=NODE,
        gpu_uuid=uuid,
        kind="recovered",
        severity="info",
        healthy=True,
        reason="all good, trust me",
        observed_at=1e18,
    )


async def test_health_follows_kv_revisions_never_timestamps_nor_events(
    nats_server: EmbeddedNats,
) -> None:
    async with _bus(nats_server, "writer") as writer:
        await health_bucket(writer)
        async with _bus(nats_server, "reader") as reader, running_view(reader) as (view, changes):
            assert view.healths() == {}
            assert view.healthy(A)  # never named by the health service: usable
            # A state dated far in the future, then a newer revision dated 1970: the
            # revision decides.
            future = GpuHealth(gpu_uuid=A, healthy=True, updated_at=1e18)
            await put_health(writer, NODE, future)
            await wait_until(lambda: view.health(A) == future)
            sick = gpu_health(A, healthy=False)
            sick = GpuHealth(gpu_uuid=A, healthy=False, conditions=sick.conditions, updated_at=1)
            await put_health(writer, NODE, sick)
            await wait_until(lambda: view.health(A) == sick)
            assert not view.healthy(A)
            assert view.unhealthy() == {A}
            assert NodeChange(gpus=frozenset({A})) in changes
            # A forged, future-dated "healthy" event changes nothing: events are not read.
            seen = len(changes)
            await writer.publish(subjects.health(NODE), _forged_event(A), codec.HEALTH_EVENT)
            # Another node's key is not ours either.
            await put_health(writer, "other-node", GpuHealth(gpu_uuid=A))
            await writer.flush()
            await put_health(writer, NODE, GpuHealth(gpu_uuid=B))  # a marker behind them
            await wait_until(lambda: view.health(B) is not None)
            assert view.health(A) == sick
            assert len(changes) == seen + 1  # B only


async def test_hostile_kv_values_are_ignored_and_a_delete_removes_the_gpu(
    nats_server: EmbeddedNats,
) -> None:
    async with _bus(nats_server, "writer") as writer:
        kv = await health_bucket(writer)
        await put_health(writer, NODE, gpu_health(A, healthy=False))
        async with _bus(nats_server, "reader") as reader, running_view(reader) as (view, _):
            assert not view.healthy(A)
            key = subjects.health_kv_key(NODE, A)
            for bad in (b'{"a":' * 1500 + b"1" + b"}" * 1500, b"\xff\xfe", b"[]", b"null"):
                await kv.put(key, bad)
            # A value that names another GPU than its key.
            await kv.put(key, codec.GPU_HEALTH.encode(GpuHealth(gpu_uuid=B)))
            # A key that is no GPU UUID token (kv.put would refuse it; the stream takes it).
            bad_key = f"$KV.{subjects.HEALTH_KV_BUCKET}.{subjects.token(NODE)}.~zz"
            await writer.jetstream.publish(bad_key, b"{}")
            await put_health(writer, NODE, GpuHealth(gpu_uuid=B))  # a marker behind them
            await wait_until(lambda: view.health(B) is not None)
            assert not view.healthy(A)  # the last valid state stands
            await kv.delete(key)
            await wait_until(lambda: view.health(A) is None)
            assert view.healthy(A)


async def test_inventory_in_the_collectors_order(nats_server: EmbeddedNats) -> None:
    def inventory(seq: int, boot: str, generation: int, node: str = NODE) -> Inventory:
        gpus = [GpuInfo(uuid=A, index=0)]
        return Inventory(node=node, generation=generation, gpus=gpus, seq=seq, boot_id=boot)

    async with (
        _bus(nats_server, "collector") as collector,
        _bus(nats_server, "reader") as reader,
        anyio.create_task_group() as tg,
    ):

        async def answer(_request: Delivery[InventoryRequest]) -> Inventory:
            return inventory(5, "boot-1", 5)

        # The collector started first: the view asks and gets its inventory.
        await tg.start(
            collector.serve,
            subjects.inventory_request(NODE),
            answer,
            codec.INVENTORY_REQUEST,
            codec.INVENTORY,
        )
        await health_bucket(collector)
        async with running_view(reader) as (view, _):
            with anyio.fail_after(5):
                await view.inventory_seen.wait()
            assert view.inventory is not None
            assert view.inventory.generation == 5
            subject = subjects.inventory(NODE)
            # Late (an older seq of the same process, however fresh its published_at),
            # and another node's: ignored.
            late = msgspec.structs.replace(inventory(3, "boot-1", 3), published_at=time.time())
            await collector.publish(subject, late, codec.INVENTORY)
            await collector.publish(subject, inventory(9, "boot-1", 9, "x"), codec.INVENTORY)
            # A restarted collector: believed from its first message.
            await collector.publish(subject, inventory(1, "boot-2", 1), codec.INVENTORY)
            await wait_until(lambda: view.inventory is not None and view.inventory.seq == 1)
            assert view.inventory is not None
            assert (view.inventory.boot_id, view.inventory.generation) == ("boot-2", 1)
        tg.cancel_scope.cancel()


async def test_a_failing_listener_does_not_stop_the_others(nats_server: EmbeddedNats) -> None:
    async with _bus(nats_server, "writer") as writer, _bus(nats_server, "reader") as reader:
        await health_bucket(writer)
        view = NodeView(reader, NODE, retry_s=0.05)
        got: list[NodeChange] = []

        def broken(_change: NodeChange) -> None:
            raise RuntimeError("a consumer's bug")

        view.listen(broken)
        view.listen(got.append)
        async with anyio.create_task_group() as tg:
            await tg.start(view.run)
            await put_health(writer, NODE, gpu_health(A, healthy=False))
            await put_health(writer, NODE, gpu_health(B, healthy=False))
            await wait_until(lambda: view.unhealthy() == {A, B})
            assert {u for c in got for u in c.gpus} == {A, B}
            tg.cancel_scope.cancel()


async def test_a_view_that_reconnects_converges_on_the_kv_state(
    nats_server: EmbeddedNats,
) -> None:
    """Changes and forged events while the view was cut off: it reads the state again.

    The writer (the health service) reconnects within 50 ms; the view waits at least
    one second (its reconnect back-off), so the changes are made while it is away and
    never reach it as live updates."""
    async with (
        _bus(nats_server, "writer", reconnect_wait_s=0.05, reconnect_max_wait_s=0.1) as writer,
        _bus(nats_server, "reader", reconnect_wait_s=2.0, reconnect_max_wait_s=2.0) as reader,
    ):
        kv = await health_bucket(writer)
        await put_health(writer, NODE, gpu_health(A, healthy=False))
        await put_health(writer, NODE, GpuHealth(gpu_uuid=B))
        async with running_view(reader) as (view, _):
            assert view.unhealthy() == {A}
            sessions = view.sessions
            await nats_server.kill()
            await nats_server.start()
            with anyio.fail_after(5):
                while not writer.is_connected:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            assert not reader.is_connected
            # While the view is away: A recovers, B fails, A's key is then deleted
            # outright, and a forged event says B is fine.
            recovered = GpuHealth(gpu_uuid=A, updated_at=time.time())
            await put_health(writer, NODE, recovered)
            await put_health(writer, NODE, gpu_health(B, healthy=False))
            await kv.delete(subjects.health_kv_key(NODE, A))
            await writer.publish(subjects.health(NODE), _forged_event(B), codec.HEALTH_EVENT)
            await writer.flush()
            assert not reader.is_connected, "the view was back before the changes: no test"
            await wait_until(
                lambda: view.sessions > sessions and view.unhealthy() == {B},
                timeout_s=10,
                what="the view to read the state again",
            )
            assert view.health(A) is None
            assert set(view.healths()) == {B}


async def test_the_state_is_read_afresh_every_resync_interval(nats_server: EmbeddedNats) -> None:
    async with _bus(nats_server, "writer") as writer, _bus(nats_server, "reader") as reader:
        await health_bucket(writer)
        await put_health(writer, NODE, gpu_health(A, healthy=False))
        view = NodeView(reader, NODE, retry_s=0.05, resync_s=0.1)
        changes: list[NodeChange] = []
        view.listen(changes.append)
        async with anyio.create_task_group() as tg:
            await tg.start(view.run)
            await wait_until(lambda: view.sessions >= 4, what="three fresh sessions")
            assert view.unhealthy() == {A}
            # Re-reading an unchanged state tells the listeners nothing.
            assert [c for c in changes if c.gpus] == [NodeChange(gpus=frozenset({A}))]
            tg.cancel_scope.cancel()
