"""The hub's fleet stream, the relay that feeds it, `gpulet alerts --hub` and the
fleet view, on real nats-servers (one hub server here; three in test_fleet_faults.py).

The node side is the real path: the health service's HealthPublisher puts events in
the node's GPU_HEALTH stream, the fleet relay hands them to the hub over the node's
leaf connection (its own credential) and acks them locally once the hub stored them.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
import pytest

from gpulet_alerting import fleet_hub
from gpulet_alerting.fleet_alerts import hub_consumer
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.messages import ActiveCondition, GpuHealth, HealthState
from gpulet_common.settings import Settings
from gpulet_common.settings.fleet import FleetSettings
from gpulet_health.fleet_status import FleetStatusPublisher
from support.deploy import inbox_prefix, password_for, set_passwords
from support.fleet import Hub, fault_event, running_hub, running_leaves, running_node
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

NODE = "gpu-node-7.example"
FLEET = FleetSettings(relay_retry_initial_s=0.05, relay_retry_max_s=0.5, replicas=1)


@pytest.fixture
async def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Hub]:
    set_passwords(monkeypatch)
    async with running_hub(tmp_path, servers=1, settings=FLEET) as running:
        yield running


async def stream_ids(hub: Hub) -> list[str]:
    async with Bus.connect(hub.nats_settings("admin"), max_initial_attempts=5) as admin:
        info = await admin.jetstream.stream_info(subjects.FLEET_STREAM)
        ids = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await admin.jetstream.get_msg(subjects.FLEET_STREAM, seq, direct=False)
            ids.append(codec.HEALTH_EVENT.decode(msg.data or b"").event_id)
        return ids


async def test_events_reach_the_fleet_stream_once_and_alerts_deliver_them(
    hub: Hub, tmp_path: Path
) -> None:
    now = time.time()
    events = [fault_event(NODE, i, now=now) for i in range(20)]
    settings = Settings(nats=hub.nats_settings("alerts"), fleet=FLEET)
    out = io.StringIO()
    async with (
        Bus.connect(settings.nats, max_initial_attempts=5) as alerts_bus,
        anyio.create_task_group() as tg,
    ):
        # `gpulet alerts --hub` first: a new durable starts with new events
        # (health.alerts.start_at), as on a node.
        consumer = hub_consumer(alerts_bus, settings, out=out)
        await tg.start(consumer.run)
        async with (
            running_leaves(tmp_path, hub, [NODE]) as leaves,
            running_node(tmp_path, leaves[NODE], FLEET) as node,
        ):
            await node.inject(events)
            await wait_until(lambda: node.relay.relayed >= 20, timeout_s=20, what="20 relayed")
            # A repeat of an event (its ack was lost, the node restarted, ...) is
            # dropped by the hub by its event id, and the hub says so.
            async with Bus.connect(
                msgspec.structs.replace(
                    hub.nats_settings("viewer"),
                    url=leaves[NODE].url,
                    user="health",
                    password=password_for("health"),
                    creds_file="",
                    inbox_prefix=subjects.fleet_relay_inbox(NODE),
                ),
                max_initial_attempts=5,
            ) as health:
                reply = await health.client.request(
                    subjects.fleet_events(NODE),
                    codec.HEALTH_EVENT.encode(events[3]),
                    timeout=5,
                    headers={"Nats-Msg-Id": subjects.event_msg_id(NODE, events[3].event_id)},
                )
                ack = json.loads(reply.data)
                assert ack["stream"] == subjects.FLEET_STREAM
                assert ack["duplicate"] is True
        await wait_until(lambda: consumer.processed >= 20, timeout_s=20, what="delivered")
        tg.cancel_scope.cancel()
    assert await stream_ids(hub) == [e.event_id for e in events]
    delivered = [json.loads(line)["event_id"] for line in out.getvalue().splitlines()]
    assert delivered == [e.event_id for e in events]


async def test_another_node_cannot_have_a_nodes_event_dropped_by_using_its_id(
    hub: Hub, tmp_path: Path
) -> None:
    """Issue 23: node B, publishing only on its own subject, with the id that node A
    will use next, had A's genuine event answered "duplicate" by the hub and lost."""
    victim, attacker = NODE, "gpu-node-8.example"
    now = time.time()
    genuine = fault_event(victim, 0, now=now)
    forged = msgspec.structs.replace(fault_event(attacker, 0, now=now), event_id=genuine.event_id)
    settings = Settings(nats=hub.nats_settings("alerts"), fleet=FLEET)
    out = io.StringIO()
    async with (
        Bus.connect(settings.nats, max_initial_attempts=5) as alerts_bus,
        anyio.create_task_group() as tg,
        running_leaves(tmp_path, hub, [victim, attacker]) as leaves,
    ):
        consumer = hub_consumer(alerts_bus, settings, out=out)
        await tg.start(consumer.run)
        # B first, on its own subject with its own credential, under A's future id:
        # bare, and in the form that A's relay uses.
        async with Bus.connect(
            msgspec.structs.replace(
                hub.nats_settings("viewer"),
                url=leaves[attacker].url,
                user="health",
                password=password_for("health"),
                creds_file="",
                inbox_prefix=subjects.fleet_relay_inbox(attacker),
            ),
            max_initial_attempts=5,
        ) as evil:
            for header in (genuine.event_id, subjects.event_msg_id(attacker, genuine.event_id)):
                reply = await evil.client.request(
                    subjects.fleet_events(attacker),
                    codec.HEALTH_EVENT.encode(forged),
                    timeout=5,
                    headers={"Nats-Msg-Id": header},
                )
                assert json.loads(reply.data)["stream"] == subjects.FLEET_STREAM
            # And an event that claims to be A's, on B's subject: the subject (which
            # B's credential confines it to) decides, so the consumer rejects it.
            await evil.client.publish(
                subjects.fleet_events(attacker),
                codec.HEALTH_EVENT.encode(fault_event(victim, 1, now=now)),
            )
        async with running_node(tmp_path, leaves[victim], FLEET) as node:
            await node.inject([genuine])
            await wait_until(lambda: node.relay.relayed >= 1, timeout_s=20, what="relayed")
            assert node.relay.duplicates == 0  # stored, not answered "duplicate"
        await wait_until(lambda: consumer.processed >= 3, timeout_s=20, what="delivered")
        tg.cancel_scope.cancel()
    delivered = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(e["node"], e["event_id"]) for e in delivered] == [
        (attacker, genuine.event_id),
        (victim, genuine.event_id),
    ]


async def test_the_relay_loses_nothing_while_the_hub_is_down(hub: Hub, tmp_path: Path) -> None:
    now = time.time()
    async with (
        running_leaves(tmp_path, hub, [NODE]) as leaves,
        running_node(tmp_path, leaves[NODE], FLEET) as node,
    ):
        await node.inject([fault_event(NODE, i, now=now) for i in range(5)])
        await wait_until(lambda: node.relay.relayed >= 5, timeout_s=20, what="first 5")
        await hub.servers[0].kill()
        # Published on the node while it has no hub: stored in its GPU_HEALTH only.
        await node.inject([fault_event(NODE, i, now=now) for i in range(5, 15)])
        await wait_until(
            lambda: node.publisher.published_count >= 15, timeout_s=10, what="stored locally"
        )
        assert node.relay.relayed == 5
        await hub.servers[0].start()
        await wait_until(lambda: node.relay.relayed >= 15, timeout_s=30, what="relayed after")
    assert await stream_ids(hub) == [f"{subjects.token(NODE)}-{i:06d}" for i in range(15)]


async def test_fleet_status_shows_nodes_last_heard_and_unhealthy_gpus(
    hub: Hub, tmp_path: Path
) -> None:
    healthy = GpuHealth(gpu_uuid="GPU-a", gpu_index=0)
    sick = GpuHealth(
        gpu_uuid="GPU-b",
        gpu_index=1,
        healthy=False,
        conditions=[ActiveCondition(condition="xid:79", kind="xid", severity="fatal", reason="x")],
    )
    state = HealthState(node=NODE, gpus=[healthy])
    clock = [0.0]
    async with (
        running_leaves(tmp_path, hub, [NODE]) as leaves,
        Bus.connect(
            msgspec.structs.replace(
                hub.nats_settings("viewer"),
                url=leaves[NODE].url,
                user="health",
                password=password_for("health"),
                creds_file="",
                inbox_prefix=inbox_prefix("health"),
            ),
            max_initial_attempts=5,
        ) as health,
        Bus.connect(hub.nats_settings("viewer"), max_initial_attempts=5) as viewer,
    ):
        status = FleetStatusPublisher(
            health,
            NODE,
            lambda: state,
            FleetSettings(status_min_interval_s=1, status_heartbeat_s=30),
            clock=lambda: clock[0],
        )

        async def fleet() -> list[fleet_hub.FleetNodeStatus]:
            return await fleet_hub.read_fleet(viewer)

        async def until(predicate: object) -> list[fleet_hub.FleetNodeStatus]:
            for _ in range(150):
                views = await fleet()
                if callable(predicate) and predicate(views):
                    return views
                # The leaf's interest in gpu.fleet.* takes a moment after it connects;
                # the publisher re-sends at its heartbeat, which this clock forces.
                clock[0] += 31
                await status.tick()
                await anyio.sleep(0.1)
            raise AssertionError("the fleet view never showed it")

        assert await status.tick()
        assert not await status.tick()  # unchanged, heartbeat not due: rate-limited
        views = await until(lambda v: len(v) == 1)
        assert views[0].node == NODE
        assert views[0].status is not None
        assert views[0].status.unhealthy == []
        assert abs(views[0].last_heard - time.time()) < 30

        state = HealthState(node=NODE, gpus=[healthy, sick])
        assert await status.tick()  # changed: sent at once
        views = await until(lambda v: v and v[0].status and v[0].status.unhealthy)
        assert views[0].status is not None
        assert views[0].status.gpus == 2
        assert [g.gpu_uuid for g in views[0].status.unhealthy] == ["GPU-b"]
        table = fleet_hub.format_fleet(views, stale_after_s=90)
        assert NODE in table
        assert "xid:79" in table
        assert "1 nodes, 1 unhealthy GPUs, 0 stale" in table
