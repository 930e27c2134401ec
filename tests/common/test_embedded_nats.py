from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import nats
import pytest

from gpulet_common.embedded_nats import (
    EmbeddedNats,
    EmbeddedNatsError,
    NatsPortInUse,
    NatsServerGaveUp,
    RestartPolicy,
)
from gpulet_common.errors import UsageError
from gpulet_common.telemetry import StatusBoard
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

FAST = RestartPolicy(attempts=3, wait_s=0.05, max_wait_s=0.2)


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


async def test_port_zero_is_bound_by_the_server_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No pick-and-release: the server binds a free port itself and says which."""

    def no_picking(host: str = "") -> int:
        raise AssertionError("a port was picked and released for the server")

    monkeypatch.setattr("gpulet_common.embedded_nats.free_port", no_picking)
    server = EmbeddedNats(state_dir=tmp_path / "nats")
    await server.start()
    try:
        bound = server.port
        assert bound > 0
        assert server.url == f"nats://127.0.0.1:{bound}"
        stream = await anyio.connect_tcp(server.host, bound)
        assert (await stream.receive()).startswith(b"INFO ")
        await stream.aclose()
        assert not list((tmp_path / "nats").glob("*.ports"))  # read, then removed
        # A restart binds the same port again: clients reconnect to the same URL.
        await server.kill()
        await server.start()
        assert server.port == bound
    finally:
        await server.stop()


async def test_a_taken_port_is_a_usage_error_saying_so(tmp_path: Path) -> None:
    async with EmbeddedNats(state_dir=tmp_path / "a") as first:
        second = EmbeddedNats(state_dir=tmp_path / "b", port=first.port)
        with pytest.raises(NatsPortInUse, match=f"127.0.0.1:{first.port}") as caught:
            await second.start()
    assert isinstance(caught.value, UsageError)
    assert caught.value.exit_code == 2
    assert "\n" not in str(caught.value)
    assert "nats.embedded_port" in str(caught.value)


async def test_a_failed_start_carries_the_servers_fatal_line(tmp_path: Path) -> None:
    state = tmp_path / "nats"
    state.mkdir()
    (state / "jetstream").write_text("not a directory")
    server = EmbeddedNats(state_dir=state)
    with pytest.raises(EmbeddedNatsError, match="storage directory is not a directory"):
        await server.start()
    assert not server.is_running


async def test_a_killed_server_is_restarted_with_its_jetstream_data(tmp_path: Path) -> None:
    status = StatusBoard()
    server = EmbeddedNats(state_dir=tmp_path / "nats")
    await server.start()
    try:
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.05)
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        await js.publish("keep.one", b"before the crash")
        async with anyio.create_task_group() as tg:
            await tg.start(server.supervise, FAST, status)
            first_pid = server.pid
            assert first_pid is not None
            os.kill(first_pid, signal.SIGKILL)
            await wait_until(
                lambda: (c := status.get("nats-server")) is not None and c.state == "starting",
                what="nats-server starting",
            )
            detail = status.get("nats-server")
            assert detail is not None
            assert "killed by SIGKILL" in detail.detail
            await wait_until(
                lambda: (c := status.get("nats-server")) is not None and c.state == "ready",
                timeout_s=10,
                what="nats-server ready again",
            )
            assert server.pid not in (None, first_pid)
            assert server.restarts == 1
            assert server.port == int(server.url.rsplit(":", 1)[1])
            await wait_until(lambda: nc.is_connected, timeout_s=10, what="client reconnected")
            info = await js.stream_info("KEEP")
            assert info.state.messages == 1
            msg = await js.get_msg("KEEP", 1)
            assert msg.data == b"before the crash"
            await nc.close()
            tg.cancel_scope.cancel()
    finally:
        await server.stop()
    assert not server.is_running


async def test_supervision_ends_quietly_when_the_owner_stops_the_server(tmp_path: Path) -> None:
    server = EmbeddedNats(state_dir=tmp_path / "nats")
    await server.start()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(server.supervise, FAST, None)
            await server.stop()
    assert server.restarts == 0


async def test_it_gives_up_after_the_allowed_restarts(tmp_path: Path) -> None:
    status = StatusBoard()
    state = tmp_path / "nats"
    server = EmbeddedNats(state_dir=state)
    await server.start()
    pid = server.pid
    assert pid is not None
    # The server keeps its open store; a restart finds a file where the store must be.
    (state / "jetstream").rename(state / "jetstream.moved")
    (state / "jetstream").write_text("not a directory")
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(NatsServerGaveUp) as caught, anyio.fail_after(20):
        await server.supervise(FAST, status)
    message = str(caught.value)
    assert "\n" not in message
    assert f"pid {pid}) was killed by SIGKILL" in message
    assert "storage directory is not a directory" in message
    assert "gave up after 3 restart attempt(s)" in message
    assert caught.value.exit_code == 1
    component = status.get("nats-server")
    assert component is not None
    assert component.state == "failed"
    assert not status.live
    assert not server.is_running


async def test_no_restarts_allowed_gives_up_at_the_first_death(tmp_path: Path) -> None:
    server = EmbeddedNats(state_dir=tmp_path / "nats")
    await server.start()
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(NatsServerGaveUp, match="gave up after 0 restart"), anyio.fail_after(10):
        await server.supervise(RestartPolicy(attempts=0, wait_s=0.05, max_wait_s=0.05))
