"""The real health service on the mock NVML feeds the hub: fault -> node -> fleet.

One hub server, one leaf node with the full node configuration and its own
credential, and the health service (settings as components/nats-fleet sets them:
``fleet.relay_enabled``, ``fleet.status_enabled``) logged in to its node's server as the
``health`` user. An XID injected into the mock NVML must reach the hub's GPU_FLEET
stream through the relay, and ``gpulet fleet status``'s view must show the GPU
unhealthy, from the status the service publishes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from gpulet_alerting import fleet_hub
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.settings.fleet import FleetSettings
from support.deploy import inbox_prefix, password_for, set_passwords
from support.fleet import Hub, running_hub, running_leaves
from support.health_harness import NODE, health_node

pytestmark = pytest.mark.anyio


@pytest.fixture
async def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Hub]:
    set_passwords(monkeypatch)
    async with running_hub(tmp_path, servers=1, settings=FleetSettings(replicas=1)) as running:
        yield running


async def test_an_injected_xid_reaches_the_fleet_stream_and_the_fleet_view(
    hub: Hub, tmp_path: Path
) -> None:
    overrides = [
        "nats.user=health",
        f"nats.password={password_for('health')}",
        f"nats.inbox_prefix={inbox_prefix('health')}",
        "fleet.relay_enabled=true",
        "fleet.status_enabled=true",
        "fleet.status_min_interval_s=0.2",
        "fleet.status_heartbeat_s=1",
        "fleet.relay_retry_initial_s=0.05",
        "fleet.relay_retry_max_s=0.5",
    ]
    async with (
        running_leaves(tmp_path, hub, [NODE]) as leaves,
        health_node(
            leaves[NODE].url, tmp_path, overrides=overrides, collector=False, subscriber=False
        ) as node,
        Bus.connect(hub.nats_settings("admin"), max_initial_attempts=5) as admin,
        Bus.connect(hub.nats_settings("viewer"), max_initial_attempts=5) as viewer,
    ):
        node.inject("xid", gpu=1, value=79)
        uuid = node.uuid(1)

        async def xid_on_hub() -> bool:
            info = await admin.jetstream.stream_info(subjects.FLEET_STREAM)
            if not info.state.messages:
                return False
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await admin.jetstream.get_msg(subjects.FLEET_STREAM, seq, direct=False)
                event = codec.HEALTH_EVENT.decode(msg.data or b"")
                if event.node == NODE and event.xid == 79 and event.gpu_uuid == uuid:
                    return msg.subject == subjects.fleet_events(NODE)
            return False

        async def unhealthy_in_view() -> bool:
            views = await fleet_hub.read_fleet(viewer)
            return any(
                v.node == NODE
                and v.status is not None
                and [g.gpu_uuid for g in v.status.unhealthy] == [uuid]
                for v in views
            )

        for check in (xid_on_hub, unhealthy_in_view):
            for _ in range(150):
                if await check():
                    break
                await anyio.sleep(0.1)
            else:
                raise AssertionError(f"{check.__name__} never became true")
