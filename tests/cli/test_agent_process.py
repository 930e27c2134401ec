"""`gpulet run` as a real process: embedded NATS, mock GPUs, watch, inject, shutdown."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulet_common.embedded_nats import free_port
from support import agent_process
from support.agent_process import GPULET, Agent
from support.agent_process import http_get as _get
from support.host import HIDDEN_DRIVER, without_driver


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    running = Agent(tmp_path, "--only", "collector")
    try:
        yield running
    finally:
        running.stop()


def _gpulet(*args: str, timeout_s: float = 15) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPULET, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def test_run_watch_inject_and_metrics(agent: Agent) -> None:
    ready = agent.wait_ready()
    components = ready["components"]
    assert isinstance(components, dict)
    assert components["collector"]["state"] == "ready"
    assert components["nats-server"]["state"] == "ready"

    watched = _gpulet(
        "watch",
        "gpu.>",
        "--nats",
        agent.nats_url,
        "--node",
        "test.node",
        "--count",
        "3",
        "--timeout",
        "10",
    )
    assert watched.returncode == 0, watched.stderr
    lines = [json.loads(line) for line in watched.stdout.splitlines()]
    subjects = {line["subject"] for line in lines}
    assert "gpu.inventory.test_node" in subjects  # asked for by watch itself
    assert "gpu.samples.test_node" in subjects
    inventory = next(line["data"] for line in lines if line["subject"].startswith("gpu.inventory"))
    assert len(inventory["gpus"]) == 8

    injected = _gpulet(
        "mock",
        "inject",
        "--gpu",
        "2",
        "--xid",
        "79",
        "--nats",
        agent.nats_url,
        "--node",
        "test.node",
    )
    assert injected.returncode == 0, injected.stderr
    assert json.loads(injected.stdout)["applied"] is True
    bad = _gpulet(
        "mock",
        "inject",
        "--gpu",
        "42",
        "--xid",
        "79",
        "--nats",
        agent.nats_url,
        "--node",
        "test.node",
    )
    # A GPU the mock does not have: one line on stderr, as for a UUID it does not know.
    assert bad.returncode == 1
    assert bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "gpulet mock inject: not applied: GPU 42 does not exist (GPUs: 0-7)"
    ], bad.stderr

    status, body = _get(f"http://127.0.0.1:{agent.http_port}/metrics")
    assert status == 200
    temps = [
        line
        for line in body.decode().splitlines()
        if line.startswith("gpulet_gpu_temperature_celsius{")
    ]
    assert len(temps) == 8


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_shuts_down_cleanly_within_two_seconds(agent: Agent, signum: int) -> None:
    agent.wait_ready()
    started = time.monotonic()
    agent.proc.send_signal(signum)
    code = agent.proc.wait(5)
    elapsed = time.monotonic() - started
    assert code == 0, agent.output()
    assert elapsed < 2.0, f"shutdown took {elapsed:.2f}s"
    assert "Traceback" not in agent.output()
    assert "stopped" in agent.output()


def test_without_nvml_it_says_so_and_points_to_the_mock(tmp_path: Path) -> None:
    # "No NVML" is made, not assumed: the library path does not exist on any host.
    hide = [arg for override in without_driver() for arg in ("--set", override)]
    proc = Agent(tmp_path, "--only", "collector", "--nvml", "auto", *hide)
    try:
        ready = proc.wait_ready()
        components = ready["components"]
        assert isinstance(components, dict)
        assert components["collector"]["state"] == "degraded"
        assert "--nvml mock" in components["collector"]["detail"]
        assert "--nvml mock" in proc.output()
        assert HIDDEN_DRIVER in components["collector"]["detail"]
    finally:
        proc.stop()


def test_a_killed_agent_leaves_no_nats_server_behind(agent: Agent) -> None:
    agent.wait_ready()
    nats_port = agent.nats_port
    agent.proc.kill()
    agent.proc.wait(5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", nats_port), timeout=0.2):
                pass
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError("the embedded nats-server outlived its SIGKILLed agent")


def test_schema_lists_every_subject() -> None:
    result = _gpulet("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert {"gpu.inventory.<node>", "gpu.samples.<node>", "gpu.health.<node>"} <= set(
        schema["subjects"]
    )
    health = schema["subjects"]["gpu.health.<node>"]["payload"]
    assert health["$ref"] == "#/$defs/HealthEvent"
    assert "schema_version" in schema["$defs"]["HealthEvent"]["properties"]


def test_invalid_setting_is_a_clear_error() -> None:
    result = _gpulet("config", "show", "--set", "collector.sample_period_s=fast")
    assert result.returncode == 2
    assert "collector.sample_period_s" in result.stderr


def test_an_agent_that_exits_fails_the_wait_at_once(tmp_path: Path) -> None:
    agent = Agent(tmp_path, "--only", "collector", "--set", "nats.embedded_host=256.1.1.1")
    try:
        started = time.monotonic()
        with pytest.raises(AssertionError, match="exited with status 2"):
            agent.wait_ready(timeout_s=60)
        assert time.monotonic() - started < 30  # not the wait's whole timeout
        assert agent.attempts == 1  # not a busy port: no second start
    finally:
        agent.stop()


def test_a_metrics_port_taken_before_the_agent_binds_it_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = int(taken.getsockname()[1])
        ports = iter([busy])
        monkeypatch.setattr(agent_process, "free_port", lambda: next(ports, None) or free_port())
        agent = Agent(tmp_path, "--only", "collector")
        try:
            agent.wait_ready(timeout_s=60)
            assert agent.attempts == 2
            assert agent.http_port != busy
            assert "already in use" in agent.output()
        finally:
            agent.stop()
