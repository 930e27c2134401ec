"""A client of several NATS servers fails over when the one it is connected to dies.

nats-py asks our handler (``reconnect_choice``) which server to try next; naming none
made it take the first of its pool on every try, and it shuffles the pool only once
per disconnection, so a client whose first server was the dead one never moved to the
others (the fleet test's intermittent stall: its admin connection, one time in three,
waited on the hub server the test had killed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from gpulet_common.bus import Bus
from gpulet_common.bus.connection import reconnect_choice
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.settings.nats import NatsSettings
from support.waiting import wait_until

SETTINGS = NatsSettings(reconnect_wait_s=0.05, reconnect_max_wait_s=0.2)


@dataclass
class _Server:  # nats-py's Server, as far as the handler reads it
    name: str
    reconnects: int


def test_the_least_tried_server_is_next_and_the_wait_backs_off_only_when_all_fail() -> None:
    dead, alive = _Server("dead", 1), _Server("alive", 0)
    chosen, delay = reconnect_choice([dead, alive], SETTINGS)
    assert chosen is alive
    assert delay <= SETTINGS.reconnect_wait_s  # one server not yet tried: no back-off
    # Every server failed 5 times: still one of them, after a longer wait at most.
    tried = [_Server("a", 5), _Server("b", 5)]
    chosen, delay = reconnect_choice(tried, SETTINGS)
    assert chosen in tried
    assert delay <= SETTINGS.reconnect_max_wait_s
    assert reconnect_choice([], SETTINGS)[0] is None


@pytest.mark.anyio
async def test_a_client_moves_to_the_surviving_servers(tmp_path: Path) -> None:
    servers = [EmbeddedNats(state_dir=tmp_path / f"n{i}", port=0) for i in range(3)]
    for server in servers:
        await server.start()
    try:
        url = ",".join(s.url for s in servers)
        settings = NatsSettings(url=url, reconnect_wait_s=0.05, reconnect_max_wait_s=0.2)
        async with Bus.connect(settings, name="failover") as bus:
            for _round in range(2):  # two of the three die, one after the other
                current = bus.client.connected_url
                assert current is not None
                [victim] = [s for s in servers if s.port == current.port]
                await victim.kill()

                def moved(bus: Bus = bus, gone: int | None = victim.port) -> bool:
                    now = bus.client.connected_url
                    return bus.client.is_connected and now is not None and now.port != gone

                await wait_until(moved, timeout_s=10, what="a reconnect to a live server")
                await bus.flush()
    finally:
        for server in servers:
            await server.stop()
