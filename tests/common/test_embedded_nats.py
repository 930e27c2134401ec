from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from gpulet_common.embedded_nats import EmbeddedNats

pytestmark = pytest.mark.anyio


async def test_starts_with_jetstream_and_stops(tmp_path: Path) -> None:
    server = EmbeddedNats(state_dir=tmp_path / "nats")
    await server.start()
    try:
        assert server.is_running
        stream = await anyio.connect_tcp(server.host, server.port)
        info = await stream.receive()
        await stream.aclose()
        assert b'"jetstream":true' in info
    finally:
        await server.stop()
    assert not server.is_running
    with pytest.raises(OSError, match=r"connect|refused"):
        await anyio.connect_tcp(server.host, server.port)
    assert (tmp_path / "nats" / "jetstream").is_dir()


async def test_a_taken_port_is_reported(tmp_path: Path) -> None:
    async with EmbeddedNats.running(state_dir=tmp_path / "a") as first:
        second = EmbeddedNats(state_dir=tmp_path / "b", port=first.port)
        with pytest.raises(RuntimeError, match="nats-server exited"):
            await second.start()
