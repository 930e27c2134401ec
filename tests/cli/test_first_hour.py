"""What a newcomer meets in the first hour, said once and plainly.

Each case runs the real ``gpulet`` as a subprocess, as a newcomer would: a client
command with no agent running says once that none is (not the NATS client's retries),
a sidecar started without its NATS says where that server should come from, a state
directory gpulet creates is named in the log, and ``gpulet serve --help`` lists the
services.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulet import services
from gpulet.agent import SIDECAR_NATS_HINT
from gpulet_common.cli_support import NOT_RUNNING_HINT, is_local
from gpulet_common.embedded_nats import free_port
from support.agent_process import GPULET, Agent
from support.waiting import wait_until


def _gpulet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPULET, *args], capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.parametrize(
    "argv",
    [
        ["health"],
        ["watch", "gpu.>"],
        ["mock", "inject", "--gpu", "1", "--xid", "79"],
        ["allocator", "state"],
    ],
)
def test_a_client_without_an_agent_says_so_once(argv: list[str]) -> None:
    """No agent on this host: one line naming the way to start one, and exit 1."""
    url = f"nats://127.0.0.1:{free_port()}"  # nobody listens there
    result = _gpulet(*argv, "--nats", url)
    assert result.returncode == 1, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"gpulet {argv[0]}"), lines[0]
    assert f"cannot connect to NATS at {url}" in lines[0]
    assert lines[0].endswith(NOT_RUNNING_HINT), lines[0]
    assert "`make run`" in NOT_RUNNING_HINT


def test_the_hint_is_for_a_server_on_this_host_only() -> None:
    assert is_local("nats://127.0.0.1:4222")
    assert is_local("nats://localhost:4222,nats://[::1]:4223")
    assert is_local("127.0.0.1:4222")
    assert not is_local("nats://nats.example:4222")
    assert not is_local("nats://127.0.0.1:4222,nats://hub.example:4222")
    assert not is_local("")


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``gpulet serve collector`` with no NATS where it is told to look, and a state
    directory that does not exist yet."""
    log = tmp_path / "serve.log"
    state = tmp_path / "new" / "state"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                *GPULET,
                "serve",
                "collector",
                "--nvml",
                "mock",
                "--nats",
                f"nats://127.0.0.1:{free_port()}",
                "--state-dir",
                str(state),
                "--metrics-port",
                "0",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "NODE_NAME": "test-node"},
        )
    try:
        yield proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.mark.anyio
async def test_a_sidecar_without_nats_says_where_the_server_should_be(
    sidecar: tuple[subprocess.Popen[bytes], Path], tmp_path: Path
) -> None:
    proc, log = sidecar

    def said(text: str) -> bool:
        assert proc.poll() is None, log.read_text()
        return text in log.read_text()

    await wait_until(lambda: said(SIDECAR_NATS_HINT), timeout_s=30, what="the NATS hint")
    # Said once, with the first failed attempt, not with every retry.
    await wait_until(
        lambda: log.read_text().count("nats: cannot connect") >= 2,
        timeout_s=30,
        what="a second attempt",
    )
    assert log.read_text().count(SIDECAR_NATS_HINT) == 1
    # The state directory it had to create is named, not made silently.
    state = tmp_path / "new" / "state"
    assert state.is_dir()
    assert f"created the state directory {state}" in log.read_text()


def test_an_existing_state_dir_is_not_announced(tmp_path: Path) -> None:
    """``config show`` shares the loader; a run on an existing directory says nothing
    about it (checked through preflight, the one place that creates it)."""
    from gpulet.cli import preflight
    from gpulet_common.config import load

    settings = load(None, overrides={"state_dir": str(tmp_path / "s"), "nvml": {"backend": "mock"}})
    settings.telemetry.http_port = 0
    assert preflight(settings, embedded_nats=False, names=["collector"]) is True
    assert preflight(settings, embedded_nats=False, names=["collector"]) is False


def test_serve_help_lists_every_service_with_what_it_does() -> None:
    result = _gpulet("serve", "--help")
    assert result.returncode == 0
    for name in services.REGISTRY:
        assert f"  {name} " in result.stdout, name
        assert services.SUMMARIES[name] in " ".join(result.stdout.split()), name


def test_a_first_run_is_quiet(tmp_path: Path) -> None:
    """``gpulet run`` on the mock: the reporter's Device as one line, not 240, and the
    allocator's inventory line once, not at every republish (every 30 s; here 0.1 s)."""
    agent = Agent(
        tmp_path,
        "--set",
        "collector.inventory_republish_s=0.1",
        # Not this host's kubelet directory, whatever happens to be there.
        "--set",
        f"allocator.plugin.plugin_dir={tmp_path / 'no-kubelet'}/",
    )
    try:
        agent.wait_ready()
        seen = _gpulet(
            "watch",
            f"gpu.inventory.{agent.node.replace('.', '_')}",
            "--count",
            "8",
            "--timeout",
            "20",
            "--nats",
            agent.nats_url,
        )
        assert len(seen.stdout.splitlines()) == 8, seen
        # Eight inventories went by: the allocator heard the same ones.
        done = agent.wait_readyz(
            lambda _, body: "8 GPUs" in str(body.get("components", {}).get("allocator")),
            what="the allocator to hold the inventory",
        )
        assert done
        log = agent.output()
    finally:
        agent.stop()
    assert log.count("gpulet.allocator: inventory generation 1: 8 GPUs") == 1, log
    assert log.count("the Device this node would apply (8 GPUs, 0 unhealthy)") == 1, log
    assert '"kind": "Device"' not in log
    assert len(log.splitlines()) < 60, log


def test_another_mock_scenario_on_the_same_state_dir_starts_clean(tmp_path: Path) -> None:
    """The README's MIG example, then ``make run``: no phantom A100s in the H100 node."""
    no_kubelet = f"allocator.plugin.plugin_dir={tmp_path / 'no-kubelet'}/"
    first = Agent(tmp_path, "--nvml", "mock:a100-mig-mixed", "--set", no_kubelet)
    try:
        first.wait_readyz(
            lambda _, body: "4 GPUs watched" in str(body.get("components", {}).get("health")),
            what="the health service to watch the 4 A100s",
        )
        expected = first.state_dir / "health" / "gpus.json"
        first.wait_readyz(lambda *_: expected.exists(), what="the expected GPUs on disk")
    finally:
        first.stop()

    second = Agent(tmp_path, "--set", no_kubelet)  # the default: dgx-h100
    try:
        _, _, body = second.wait_readyz(
            lambda _, body: "watched" in str(body.get("components", {}).get("health")),
            what="the health service to start",
        )
        health = _gpulet("health", "--nats", second.nats_url, "--node", second.node)
        log = second.output()
    finally:
        second.stop()
    assert "8 GPUs watched, 0 unhealthy" in str(body["components"]["health"]), body
    assert health.returncode == 0, health
    assert "not present" not in health.stdout
    assert health.stdout.count(": healthy") == 8, health.stdout
    aside = second.state_dir / "previous-mock-a100-mig-mixed"
    assert (
        f"held the GPUs of mock scenario 'a100-mig-mixed', this run is mock scenario "
        f"'dgx-h100': forgetting those GPUs (their health, NATS store and allocations are "
        f"kept in {aside}); starting clean"
    ) in log
    assert (aside / "health" / "gpus.json").exists()
    assert (second.state_dir / "nvml-source").read_text() == "mock:dgx-h100\n"


def test_the_same_scenario_keeps_its_state(tmp_path: Path) -> None:
    from gpulet.gpu_source import switch_source
    from gpulet_common.config import load

    state = tmp_path / "state"
    (state / "health").mkdir(parents=True)
    (state / "health" / "gpus.json").write_text("{}")

    def run(nvml: dict[str, str]) -> str | None:
        return switch_source(load(None, overrides={"state_dir": str(state), "nvml": nvml}))

    assert run({"backend": "mock"}) is None  # first run: recorded, nothing moved
    assert run({"backend": "mock", "scenario": "dgx-h100"}) is None
    assert (state / "health" / "gpus.json").exists()
    assert run({"backend": "auto"}) is None  # decided at run time: not checked
    said = run({"backend": "nvml"})
    assert said is not None
    assert "the real NVML" in said
    assert not (state / "health").exists()
    assert (state / "previous-mock-dgx-h100" / "health" / "gpus.json").exists()
