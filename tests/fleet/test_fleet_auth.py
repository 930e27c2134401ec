"""Per-node identity on real nats-servers: a node cannot speak for another.

A hub (deploy/nats/fleet/hub.conf, operator mode, full resolver) and leaf nodes
(deploy/nats/fleet-leaf.conf), each with its own credential from the IdentityStore.
What a node publishes is published by a gpulet service of that node, on its local
server, as the real health service does; whether it reaches the hub is seen by a
subscriber there and by the fleet stream. Refused messages are waited for after an
allowed one sent later on the same connection has arrived (a leaf connection keeps
order), so "not delivered" is not a guess about timing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from gpulet_alerting import fleet_hub
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.fleet.identity import Role
from gpulet_common.messages import NodeStatus
from support.deploy import inbox_prefix, password_for, set_passwords
from support.fleet import Hub, leaf_config, running_hub, running_leaves
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

N1, N2 = "gpu-node-1.example", "gpu-node-2.example"
KINDS = ("health", "samples", "inventory", "fleet", "events")


@pytest.fixture
async def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Hub]:
    set_passwords(monkeypatch)
    async with running_hub(tmp_path, servers=1) as running:
        yield running


@asynccontextmanager
async def local(server: EmbeddedNats, user: str = "health") -> AsyncIterator[NatsClient]:
    """A gpulet service's connection to its node's server."""
    nc = await nats.connect(
        server.url,
        user=user,
        password=password_for(user),
        inbox_prefix=inbox_prefix(user),
        allow_reconnect=False,
        connect_timeout=2,
    )
    try:
        yield nc
    finally:
        await nc.close()


async def collect(nc: NatsClient, *subjects_: str) -> list[Msg]:
    got: list[Msg] = []

    async def on(msg: Msg) -> None:
        got.append(msg)

    for subject in subjects_:
        await nc.subscribe(subject, cb=on)
    await nc.flush(timeout=2)
    return got


async def until_delivered(
    sender: NatsClient, subject: str, got: list[Msg], *, timeout_s: float = 15.0
) -> None:
    """Publish probes on an allowed subject until one crosses (interest takes a moment
    to reach the leaf after it connects)."""
    with anyio.fail_after(timeout_s):
        for i in range(int(timeout_s / 0.1)):
            await sender.publish(subject, f"probe {i}".encode())
            await sender.flush(timeout=2)
            await anyio.sleep(0.1)
            if any(m.subject == subject for m in got):
                return
    raise AssertionError(f"{subject} never reached the hub")


async def test_a_node_publishes_its_own_subjects_only(hub: Hub, tmp_path: Path) -> None:
    async with (
        running_leaves(tmp_path, hub, [N1, N2]) as leaves,
        Bus.connect(hub.nats_settings("viewer"), max_initial_attempts=5) as viewer,
    ):
        seen = await collect(viewer.client, *[f"gpu.{k}.*" for k in KINDS])
        async with (
            local(leaves[N1].server, "health") as health,
            local(leaves[N1].server, "collector") as collector,
        ):
            await until_delivered(health, subjects.health(N1), seen)
            await until_delivered(collector, subjects.samples(N1), seen)
            # Impersonation: node 1's own (legitimate) local users publish node 2's
            # subjects; each is allowed locally (auth.conf has the node as a wildcard).
            await health.publish(subjects.health(N2), b"forged health event")
            await health.publish(subjects.fleet_status(N2), b"forged status")
            await health.publish(subjects.fleet_events(N2), b"forged relayed event")
            await collector.publish(subjects.samples(N2), b"forged samples")
            await collector.publish(subjects.inventory(N2), b"forged inventory")
            await collector.flush(timeout=2)
            # Sent after the forgeries on the same connections: once these arrived,
            # anything sent before them that was let through would have too.
            await health.publish(subjects.health(N1), b"marker")
            await health.publish(subjects.fleet_events(N1), b"marker")
            await collector.publish(subjects.samples(N1), b"marker")
            await health.flush(timeout=2)
            await collector.flush(timeout=2)
            await wait_until(
                lambda: (
                    {m.subject for m in seen if m.data == b"marker"}
                    == {subjects.health(N1), subjects.samples(N1), subjects.fleet_events(N1)}
                ),
                timeout_s=10,
                what=f"node 1 markers at the hub: {[(m.subject, m.data) for m in seen][-8:]}",
            )
        assert not [m.subject for m in seen if N2.replace(".", "_") in m.subject]
    # The fleet stream (fed by the relays' gpu.events.<node>) holds node 1's only.
    async with Bus.connect(hub.nats_settings("admin"), max_initial_attempts=5) as admin:
        info = await admin.jetstream.stream_info(subjects.FLEET_STREAM)
        assert await _subjects_in_stream(admin, info.state.messages) == [subjects.fleet_events(N1)]


async def _subjects_in_stream(bus: Bus, count: int) -> list[str]:
    out = []
    for seq in range(1, count + 1):
        msg = await bus.jetstream.get_msg(subjects.FLEET_STREAM, seq, direct=False)
        out.append(msg.subject or "")
    return out


async def test_the_hub_sends_nothing_down_a_leaf(hub: Hub, tmp_path: Path) -> None:
    """Node 2's events cross to the hub, never from the hub into node 1."""
    async with (
        running_leaves(tmp_path, hub, [N1, N2]) as leaves,
        Bus.connect(hub.nats_settings("viewer"), max_initial_attempts=5) as viewer,
        local(leaves[N1].server, "reporter") as reporter_1,
        local(leaves[N2].server, "health") as health_2,
    ):
        at_node_1 = await collect(reporter_1, "gpu.health.*")
        at_hub = await collect(viewer.client, "gpu.health.*")
        await until_delivered(health_2, subjects.health(N2), at_hub)
        for _ in range(5):
            await health_2.publish(subjects.health(N2), b"node 2 event")
        await health_2.flush(timeout=2)
        await wait_until(
            lambda: sum(m.data == b"node 2 event" for m in at_hub) == 5, what="hub copies"
        )
        await reporter_1.flush(timeout=2)
        assert at_node_1 == []


async def test_a_node_credential_is_for_leaf_connections_only(hub: Hub) -> None:
    with pytest.raises((nats.errors.Error, OSError)):
        await nats.connect(
            hub.url,
            user_credentials=str(hub.creds("node", N1)),
            allow_reconnect=False,
            connect_timeout=2,
            max_reconnect_attempts=0,
        )


async def test_a_revoked_credential_is_refused_and_a_rotated_one_works(
    hub: Hub, tmp_path: Path
) -> None:
    async with (
        running_leaves(tmp_path, hub, [N1]) as leaves,
        Bus.connect(hub.nats_settings("viewer"), max_initial_attempts=5) as viewer,
        local(leaves[N1].server, "health") as health,
    ):
        seen = await collect(viewer.client, "gpu.health.*")
        await until_delivered(health, subjects.health(N1), seen)

        hub.store.revoke("node", node=N1)
        await hub.push_account()
        # The hub closes the live leaf connection of the revoked user ...
        log = leaves[N1].server.state_dir / "nats-server.log"
        await wait_until(
            lambda: "Authentication Revoked" in log.read_text(),
            timeout_s=10,
            what="the hub to drop the revoked leaf",
        )
        # ... and refuses it on every reconnect: nothing of node 1 reaches the hub.
        await wait_until(
            lambda: "Authorization Violation" in log.read_text(),
            timeout_s=10,
            what="a refused reconnect",
        )
        seen.clear()
        for _ in range(5):
            await health.publish(subjects.health(N1), b"after revocation")
            await health.flush(timeout=2)
            await anyio.sleep(0.1)
        # A leaf that is allowed in would have relayed it within this time (its
        # connection was refused, so there is no route to wait on).
        await anyio.sleep(1.0)
        assert [m for m in seen if m.data == b"after revocation"] == []

    # A new credential for the node (rotation) is accepted by the same hub.
    rotated = hub.creds_dir / "node-rotated.creds"
    rotated.write_text(hub.store.issue("node", node=N1).creds)
    conf = leaf_config(tmp_path / "rotated" / "conf", hub, rotated)
    async with (
        EmbeddedNats.running(state_dir=tmp_path / "rotated" / "state", config_file=conf) as leaf,
        Bus.connect(hub.nats_settings("viewer"), max_initial_attempts=5) as viewer,
        local(leaf, "health") as health,
    ):
        seen = await collect(viewer.client, "gpu.health.*")
        await until_delivered(health, subjects.health(N1), seen)


async def test_a_node_status_lands_under_its_own_key_only(hub: Hub, tmp_path: Path) -> None:
    async with (
        running_leaves(tmp_path, hub, [N1]) as leaves,
        Bus.connect(hub.nats_settings("viewer"), max_initial_attempts=5) as viewer,
        local(leaves[N1].server, "health") as health,
    ):
        seen = await collect(viewer.client, "gpu.health.*")
        await until_delivered(health, subjects.health(N1), seen)
        own = NodeStatus(node=N1, boot_id="b", seq=1, gpus=8)
        forged = NodeStatus(node=N2, boot_id="b", seq=1, gpus=8)
        await health.publish(subjects.fleet_status(N2), codec.NODE_STATUS.encode(forged))
        await health.publish(subjects.fleet_status(N1), codec.NODE_STATUS.encode(own))
        await health.flush(timeout=2)
        views: list[fleet_hub.FleetNodeStatus] = []

        async def read() -> bool:
            views[:] = await fleet_hub.read_fleet(viewer)
            return any(v.node == N1 for v in views)

        for _ in range(100):
            if await read():
                break
            await anyio.sleep(0.1)
        assert [v.node for v in views] == [N1]
        assert views[0].status == own


async def test_no_hub_user_can_feed_the_fleet_stream_or_the_fleet_view(hub: Hub) -> None:
    """Only nodes (through their leaf) write events and statuses; alerts, viewer and
    admin (JetStream management only) are refused by the server."""
    for role in ("alerts", "viewer", "admin"):
        errors = await _refusals(hub, role)
        assert len(errors) == 2, (role, errors)
        assert all("permissions violation for publish" in e for e in errors), (role, errors)


async def _refusals(hub: Hub, role: Role) -> list[str]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    nc = await nats.connect(
        hub.url,
        user_credentials=str(hub.creds(role)),
        inbox_prefix=f"_INBOX.{role}",
        error_cb=on_error,
        allow_reconnect=False,
        connect_timeout=2,
    )
    try:
        for subject in (subjects.fleet_events(N1), subjects.fleet_status(N1)):
            await nc.publish(subject, b"forged")
        await nc.flush(timeout=2)
        await wait_until(lambda: len(errors) >= 2, timeout_s=5, what=f"{role} refusals")
    finally:
        await nc.close()
    return errors
