"""The embedded nats-server under `gpulet run` is supervised.

A real agent process with its real embedded server: SIGKILL the server and watch
``/readyz`` go not-ready with the reason, come back once the server is restarted, and
the services talk over the new server (a fault injected through the mock NVML reaches
a subscriber as a health event; the health stream kept what it held before). When the
server cannot be brought back, ``gpulet run`` exits 1 with one line saying why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from nats.aio.client import Client as NatsClient

from gpulet_common import subjects
from support.agent_process import GPULET, Agent

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    # The first restart waits 1 to 2 s (jittered back-off from 2 s): a window that a
    # poll of /readyz cannot miss, however busy the machine.
    running = Agent(
        tmp_path, "--only", "collector,health", "--set", "nats.embedded_restart_wait_s=2"
    )
    try:
        await anyio.to_thread.run_sync(running.wait_ready)
        yield running
    finally:
        await anyio.to_thread.run_sync(running.stop)


def _component(body: dict[str, Any], name: str) -> dict[str, str]:
    component: dict[str, str] = body["components"][name]
    return component


async def _inject_xid(agent: Agent, gpu: int, xid: int) -> None:
    result = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [
                *GPULET,
                "mock",
                "inject",
                "--gpu",
                str(gpu),
                "--xid",
                str(xid),
                "--nats",
                agent.nats_url,
                "--node",
                agent.node,
                "--timeout",
                "5",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["applied"] is True


async def _next_health_event(sub: Any, *, xid: int, timeout_s: float = 20) -> dict[str, Any]:
    with anyio.fail_after(timeout_s):
        async for msg in sub.messages:
            event: dict[str, Any] = json.loads(msg.data)
            if event.get("xid") == xid:
                return event
    raise AssertionError("subscription ended")


async def _stream_messages(nc: NatsClient) -> int:
    info = await nc.jetstream().stream_info(subjects.HEALTH_STREAM)
    return int(info.state.messages)


async def test_sigkilled_nats_server_is_restarted_and_services_reconnect(agent: Agent) -> None:
    nc = await nats.connect(agent.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.05)
    try:
        sub = await nc.subscribe(subjects.health(agent.node))
        await nc.flush()
        await _inject_xid(agent, gpu=1, xid=79)
        before = await _next_health_event(sub, xid=79)
        assert before["gpu_index"] == 1
        assert before["healthy"] is False
        stored = await _stream_messages(nc)
        assert stored >= 1

        old_pid = agent.nats_server_pid()
        os.kill(old_pid, signal.SIGKILL)
        _, status, body = await anyio.to_thread.run_sync(
            lambda: agent.wait_readyz(lambda code, _: code == 503, what="not ready")
        )
        assert status == 503
        assert body["ready"] is False
        # The server's death and the agent's lost connection may show in either order.
        _, _, body = await anyio.to_thread.run_sync(
            lambda: agent.wait_readyz(
                lambda _, b: _component(b, "nats-server")["state"] == "starting",
                what="nats-server restarting",
            )
        )
        assert body["ready"] is False
        detail = _component(body, "nats-server")["detail"]
        assert f"nats-server (pid {old_pid}) was killed by SIGKILL" in detail
        assert "restart 1 of 8 in " in detail

        _, _, body = await anyio.to_thread.run_sync(
            lambda: agent.wait_readyz(lambda code, _: code == 200, what="ready again")
        )
        assert "restarted after" in _component(body, "nats-server")["detail"]
        assert agent.nats_server_pid() != old_pid
        assert _component(body, "nats")["state"] == "ready"

        # The services talk over the new server: the injection request reaches the
        # mock, the collector's sample reaches health, health's event reaches us.
        await anyio.to_thread.run_sync(lambda: _wait_connected(nc))
        await nc.flush()
        await _inject_xid(agent, gpu=2, xid=48)
        after = await _next_health_event(sub, xid=48)
        assert after["gpu_index"] == 2
        assert after["healthy"] is False
        # JetStream kept its data across the crash (same store directory).
        assert await _stream_messages(nc) >= stored + 1
    finally:
        await nc.close()
    assert agent.proc.poll() is None
    assert "Traceback" not in agent.output()


def _wait_connected(nc: NatsClient, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not nc.is_connected:
        assert time.monotonic() < deadline, "the test's client did not reconnect"
        time.sleep(0.02)


def test_an_unrecoverable_nats_server_ends_gpulet_run_with_one_line(tmp_path: Path) -> None:
    agent = Agent(
        tmp_path,
        "--only",
        "collector",
        "--set",
        "nats.embedded_restart_attempts=2",
        "--set",
        "nats.embedded_restart_wait_s=0.05",
    )
    try:
        agent.wait_ready()
        pid = agent.nats_server_pid()
        # The dead server's store turns into a file: every restart fails on it.
        store = agent.state_dir / "nats" / "jetstream"
        store.rename(store.with_name("jetstream.moved"))
        store.write_text("not a directory")
        os.kill(pid, signal.SIGKILL)
        code = agent.proc.wait(30)
        output = agent.output()
    finally:
        agent.stop()
    assert code == 1, output
    assert "Traceback" not in output
    last = output.strip().splitlines()[-1]
    assert last.startswith("gpulet: the embedded nats-server could not be brought back: "), last
    assert f"nats-server (pid {pid}) was killed by SIGKILL" in last
    assert "storage directory is not a directory" in last
    assert "gave up after 2 restart attempt(s)" in last
