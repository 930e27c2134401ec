"""Credentials never reach logs or `gpulet config show`; NATS auth is enforced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import anyio
import pytest

from gpulet_common.embedded_nats import EmbeddedNats, free_port

pytestmark = pytest.mark.anyio

SECRET = "s3cr3t-Pa55w0rd-xyz"
TOKEN = "tok-9f8e7d6c5b4a"


def _wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    for _ in range(int(timeout_s / 0.1)):
        assert proc.poll() is None, "agent exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("agent not ready")


async def test_no_credentials_in_logs_with_password_auth(tmp_path: Path) -> None:
    conf = tmp_path / "auth.conf"
    conf.write_text(f'authorization {{ users = [ {{ user: "gpulet", password: "{SECRET}" }} ] }}\n')
    async with EmbeddedNats(state_dir=tmp_path / "nats", config_file=conf) as server:
        # The agent is a real process; its blocking handling runs off the event loop.
        await anyio.to_thread.run_sync(_run_agent_and_a_refused_client, tmp_path, server.port)


def _run_agent_and_a_refused_client(tmp_path: Path, nats_port: int) -> None:
    http_port = free_port()
    log = tmp_path / "agent.log"
    env = {**os.environ, "GPULET_NATS__USER": "gpulet", "GPULET_NATS__PASSWORD": SECRET}
    with log.open("wb") as out:
        # Credentials in the URL too, the way people paste them.
        url = f"nats://gpulet:{SECRET}@127.0.0.1:{nats_port}"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpulet",
                "run",
                "--only",
                "collector",
                "--nvml",
                "mock",
                "--nats",
                url,
                "--state-dir",
                str(tmp_path / "s"),
                "--metrics-port",
                str(http_port),
                "--log-level",
                "debug",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            _wait_ready(http_port, proc)
        finally:
            proc.terminate()
            proc.wait(10)
    text = log.read_text()
    assert "nats: connected to nats://" in text
    assert SECRET not in text

    # A wrong password is refused by the server, and the error log leaks nothing.
    log2 = tmp_path / "refused.log"
    with log2.open("wb") as out:
        refused = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpulet",
                "watch",
                "gpu.>",
                "--timeout",
                "1",
                "--nats",
                f"nats://gpulet:wrong-{SECRET}@127.0.0.1:{nats_port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=60,
            check=False,
        )
    assert refused.returncode != 0
    assert "uthorization" in log2.read_text()
    assert SECRET not in log2.read_text()


def test_config_show_masks_secrets() -> None:
    env = {**os.environ, "GPULET_NATS__PASSWORD": SECRET, "GPULET_NATS__TOKEN": TOKEN}
    shown = subprocess.run(
        [sys.executable, "-m", "gpulet", "config", "show", "--nats", f"nats://u:{SECRET}@h:4222"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=True,
    )
    assert SECRET not in shown.stdout
    assert TOKEN not in shown.stdout
    nats = json.loads(shown.stdout)["nats"]
    assert nats["password"] == "***"
    assert nats["token"] == "***"
    assert nats["url"] == "nats://***@h:4222"
