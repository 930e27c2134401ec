"""The pod as deployed: every service its own process, its own NATS user.

This is the DaemonSet's (and docker-compose's) layout run on one machine: a nats-server
with deploy/nats/node.conf and the mock variant of auth.conf, then ``gpulet serve collector``,
``health``, ``reporter``, ``allocator``, ``device-plugin`` and ``alerts`` as separate
processes, each connecting with its own user and password from the environment, the
way the containers get them from the Secret. A fake kubelet stands in for the real one.

It shows that the permissions let each service do its whole job, end to end: the
device plugin registers with 8 GPUs and gets an allocation from the allocator over
NATS; a fault injected with the operator's user reaches the health service, whose event
reaches the device plugin, the reporter and ``gpulet alerts``; and no process was
refused anything along the way.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import grpc
import grpc.aio
import pytest

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import MockInjectRequest
from gpulet_common.settings.nats import NatsSettings
from support.deploy import inbox_prefix, node_config, password_for, set_passwords
from support.fake_kubelet import FakeKubelet, running_fake_kubelet

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

NODE = "pod-test-node"
GPU_RESOURCE = "nvidia.com/gpu"
DEADLINE_S = 45.0  # generous: CI machines are shared

# service -> extra arguments, as the DaemonSet's containers start them.
SIDECARS: dict[str, list[str]] = {
    "collector": ["--nvml", "mock:dgx-h100"],
    "health": ["--nvml", "mock:dgx-h100"],
    "reporter": ["--set", "reporter.mode=offline"],
    "allocator": [],
    "device-plugin": [],
}


@contextmanager
def _processes(commands: dict[str, tuple[list[str], dict[str, str]]], logs: Path) -> Iterator[None]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        for name, (command, env) in commands.items():
            with (logs / f"{name}.log").open("wb") as out:
                started.append(
                    subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
                )
        yield
    finally:
        for process in started:
            if process.poll() is None:
                process.terminate()
        for process in started:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


def _env(user: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULET_")}
    env.update(
        {
            "NODE_NAME": NODE,
            "GPULET_NATS__USER": user,
            "GPULET_NATS__PASSWORD": password_for(user),
            "GPULET_NATS__INBOX_PREFIX": inbox_prefix(user),
            "GPULET_NATS__RECONNECT_MAX_WAIT_S": "0.5",
            **(extra or {}),
        }
    )
    return env


@pytest.fixture
async def pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[FakeKubelet, Path, Path, EmbeddedNats]]:
    set_passwords(monkeypatch)
    config = node_config(tmp_path, mock=True)
    state = tmp_path / "state"  # the pod's shared state dir (hostPath /var/lib/gpulet/state)
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    short = Path(tempfile.mkdtemp(prefix="gpl-"))
    plugin_dir = short / "device-plugins"
    plugin_dir.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    async with (
        EmbeddedNats(state_dir=tmp_path / "nats", config_file=config) as server,
        running_fake_kubelet(
            plugin_dir, pod_resources_socket=short / "pod-resources.sock"
        ) as kubelet,
    ):
        base = [sys.executable, "-m", "gpulet"]
        common = ["--nats", server.url, "--state-dir", str(state), "--metrics-port", "0"]
        commands: dict[str, tuple[list[str], dict[str, str]]] = {
            name: (
                [*base, "serve", name, *common, *args],
                _env(
                    name,
                    {
                        "GPULET_ALLOCATOR__PLUGIN__PLUGIN_DIR": f"{plugin_dir}/",
                        "GPULET_ALLOCATOR__POD_RESOURCES_SOCKET": str(short / "pod-resources.sock"),
                    },
                ),
            )
            for name, args in SIDECARS.items()
        }
        commands["alerts"] = (
            # --replay-all: the fault may be injected before the durable exists.
            [*base, "alerts", "--replay-all", "--nats", server.url, "--metrics-port", "0"],
            _env("alerts"),
        )
        try:
            with _processes(commands, logs):
                yield kubelet, state, logs, server
        finally:
            shutil.rmtree(short, ignore_errors=True)


def _violations(logs: Path, server: EmbeddedNats) -> list[str]:
    lines: list[str] = []
    for log in [*logs.glob("*.log"), server.state_dir / "nats-server.log"]:
        lines += [
            f"{log.name}: {line}"
            for line in log.read_text(errors="replace").splitlines()
            if "violation" in line.lower()
        ]
    return lines


async def test_each_service_does_its_job_with_its_own_nats_user(
    pod: tuple[FakeKubelet, Path, Path, EmbeddedNats],
) -> None:
    kubelet, state, logs, server = pod
    operator = NatsSettings(
        url=server.url,
        user="operator",
        password=password_for("operator"),
        inbox_prefix=inbox_prefix("operator"),
    )
    try:
        with anyio.fail_after(DEADLINE_S):
            # device plugin -> kubelet, with the inventory it read from NATS.
            devices = await kubelet.wait_devices(
                GPU_RESOURCE, lambda ds: len(ds) == 8, timeout_s=DEADLINE_S
            )
            assert {d.health for d in devices} == {"Healthy"}
            # kubelet -> device plugin -> allocator (NATS micro) -> back.
            # The plugin may register before the allocator listens; kubelet would fail
            # the pod's admission and retry, so do we.
            while True:
                try:
                    granted = await kubelet.allocate(GPU_RESOURCE, [[devices[0].ID]], timeout_s=10)
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    await anyio.sleep(0.2)
            assert len(granted.container_responses) == 1

            async with Bus.connect(operator, max_initial_attempts=3) as bus:
                health_events = await bus.client.subscribe(subjects.health(NODE))
                await bus.flush()
                # The health service subscribes once it is ready; retry until a mock
                # that runs inside it applied the fault.
                while True:
                    reply = await bus.request(
                        subjects.mock_inject(NODE),
                        MockInjectRequest(gpu=2, fault="xid", value=79.0),
                        codec.MOCK_INJECT_REQUEST,
                        codec.MOCK_INJECT_REPLY,
                        timeout_s=2,
                    )
                    assert reply.applied, reply
                    try:
                        event = await health_events.next_msg(timeout=2)
                        break
                    except TimeoutError:
                        continue
                assert b"79" in event.data

            # health -> device plugin: one GPU turns Unhealthy in ListAndWatch.
            await kubelet.wait_devices(
                GPU_RESOURCE,
                lambda ds: sorted(d.health for d in ds) == ["Healthy"] * 7 + ["Unhealthy"],
                timeout_s=DEADLINE_S,
            )
            # health -> reporter: the Device it would apply has one unhealthy GPU.
            device_file = state / "reporter" / f"device-{NODE}.json"
            while True:
                if device_file.exists():
                    text = device_file.read_text()
                    if '"health": false' in text or '"health":false' in text:
                        break
                await anyio.sleep(0.2)
            # health stream -> gpulet alerts (durable consumer) -> stdout.
            while True:
                if "79" in (logs / "alerts.log").read_text(errors="replace"):
                    break
                await anyio.sleep(0.2)
    except (TimeoutError, AssertionError):
        for log in sorted(logs.glob("*.log")):
            print(f"==== {log.name}\n{log.read_text(errors='replace')[-2500:]}")
        raise
    assert _violations(logs, server) == []
    alert_lines = [
        json.loads(line)
        for line in (logs / "alerts.log").read_text().splitlines()
        if line.startswith("{")
    ]
    assert alert_lines, "gpulet alerts printed no event"
