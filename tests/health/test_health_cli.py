"""``gpulet health state|clear`` as an operator runs them, against a running service."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from gpulet_common.embedded_nats import EmbeddedNats, free_port
from support.agent_process import GPULET, http_get
from support.health_harness import health_node

pytestmark = pytest.mark.anyio


async def gpulet(*args: str) -> tuple[int, str, str]:
    result = await anyio.run_process([sys.executable, "-m", "gpulet", *args], check=False)
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def test_health_state_and_clear_commands(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with health_node(nats_server.url, tmp_path, collector=False) as h:
        h.inject("xid", gpu=0, value=79)
        await h.log.wait_for(lambda e: e.xid == 79)
        where = ["--nats", nats_server.url, "--node", h.node]

        code, out, err = await gpulet("health", "state", "--json", *where)
        assert code == 0, err
        state = json.loads(out)
        assert [g["healthy"] for g in state["gpus"]] == [False, True, True, True, True]

        code, out, err = await gpulet("health", *where, "state", "--gpu", "0")
        assert code == 0, err
        assert "UNHEALTHY" in out
        assert "xid:79" in out
        assert "action: reboot" in out

        code, out, err = await gpulet("health", "clear", "--gpu", "0", "--by", "ops-oncall", *where)
        assert code == 0, err
        assert "healthy" in out
        assert "UNHEALTHY" not in out
        [cleared] = await h.log.wait_for(lambda e: e.kind == "cleared")
        assert cleared.healthy
        assert "ops-oncall" in cleared.reason

        code, _, err = await gpulet("health", "clear", "--gpu", "9", *where)
        assert code == 1
        assert "unknown_gpu" in err
        code, _, err = await gpulet(
            "health", "state", "--nats", nats_server.url, "--node", "nobody", "--timeout", "0.5"
        )
        assert code == 1
        assert "no health service answered" in err


async def test_alerts_with_a_metrics_port_answers_its_liveness_probe(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # The DaemonSet's alerts container: --metrics-port=5683 and an httpGet /healthz probe.
    port = free_port()
    with (tmp_path / "alerts.log").open("wb") as log:
        process = await anyio.open_process(
            [*GPULET, "alerts", "--nats", nats_server.url, "--metrics-port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    async with process:
        try:
            with anyio.fail_after(60):
                while True:
                    assert process.returncode is None, (tmp_path / "alerts.log").read_text()
                    try:
                        status, body = await anyio.to_thread.run_sync(
                            http_get, f"http://127.0.0.1:{port}/readyz"
                        )
                    except OSError:
                        status, body = 0, b"{}"
                    if status == 200:
                        break
                    await anyio.sleep(0.1)
            assert json.loads(body)["components"]["alerts"]["state"] == "ready"
            url = f"http://127.0.0.1:{port}/healthz"
            status, _ = await anyio.to_thread.run_sync(http_get, url)
            assert status == 200
        finally:
            process.terminate()
            with anyio.fail_after(10):
                await process.wait()
