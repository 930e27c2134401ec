"""NVML that cannot start yet (the driver is not loaded at boot) is retried (issue 28).

The mock's ``[system] driver_loaded_file`` makes nvmlInit fail with DRIVER_NOT_LOADED
until the file exists. The collector and the health service start anyway, are not
ready on ``/readyz`` (with the reason) while they retry with back-off, and pick NVML
up once the "driver" is loaded: the same services, no restart.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from gpulet_collector.service import CollectorService
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.mock_nvml import MockNvml
from gpulet_common.nvml.loader import open_nvml_waiting
from gpulet_common.settings.nvml import NvmlSettings
from gpulet_common.telemetry import serve_http
from gpulet_health.service import HealthService
from support.agent import agent_settings, runtime_for
from support.agent_process import http_get
from support.health_harness import until

pytestmark = pytest.mark.anyio


def _scenario(tmp_path: Path, **system: object) -> Path:
    lines = [f"{key} = {json.dumps(value)}" for key, value in system.items()]
    path = tmp_path / "late-driver.toml"
    path.write_text('base = "dgx-h100"\n[system]\n' + "\n".join(lines) + "\n")
    return path


async def test_services_wait_for_a_driver_that_loads_later(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    loaded = tmp_path / "driver-loaded"
    settings = agent_settings(
        nats_server.url,
        tmp_path / "state",
        overrides=[
            f"nvml.scenario={_scenario(tmp_path, driver_loaded_file=str(loaded))}",
            "nvml.retry_min_s=0.05",
            "nvml.retry_max_s=0.2",
            "collector.sample_period_s=0.05",
            "health.tick_s=0.1",
            "health.device_poll_s=0.1",
            "health.event_wait_timeout_ms=50",
        ],
    )
    async with runtime_for(settings) as rt, anyio.create_task_group() as tg:
        port = await tg.start(serve_http, "127.0.0.1", 0, rt.status)
        collector, health = CollectorService(rt), HealthService(rt)
        await tg.start(collector.run)
        await tg.start(health.run)

        def readyz() -> tuple[int, dict[str, dict[str, str]]]:
            code, body = http_get(f"http://127.0.0.1:{port}/readyz")
            return code, json.loads(body)["components"]

        # Several tries go by: still not ready, and /readyz says why.
        handle = await rt.nvml.get()
        await until(lambda: rt.nvml.opens >= 4, within=10)
        code, components = await anyio.to_thread.run_sync(readyz)
        assert code == 503
        for name in ("collector", "health"):
            assert components[name]["state"] == "starting", components
            assert "waiting for NVML" in components[name]["detail"]
            assert "driver is not loaded" in components[name]["detail"]
        assert handle.adapter is None
        assert collector.inventory.degraded_reason
        assert not health.engine.gpus

        loaded.touch()
        await until(lambda: rt.status.ready, within=10)
        code, components = await anyio.to_thread.run_sync(readyz)
        assert code == 200
        assert components["collector"]["state"] == components["health"]["state"] == "ready"
        await until(lambda: len(collector.inventory.gpus) == 8, within=10)
        assert collector.inventory.degraded_reason is None
        await until(lambda: len(health.engine.gpus) == 8, within=10)
        assert all(g.healthy for g in health.engine.gpus.values())
        # The same NVML serves both, opened once after the driver came.
        assert (await rt.nvml.get()).adapter is not None
        tg.cancel_scope.cancel()


def test_the_mock_fails_init_n_times_then_starts(tmp_path: Path) -> None:
    mock = MockNvml(_scenario(tmp_path, init_failures=2))
    for _ in range(2):
        with pytest.raises(mock.NVMLError_DriverNotLoaded):
            mock.nvmlInit()
    mock.nvmlInit()
    assert mock.nvmlDeviceGetCount() == 8
    assert mock.init_failures == 2


def test_a_driver_not_loaded_is_waited_for_and_no_library_under_auto_is_not(
    tmp_path: Path,
) -> None:
    scenario = _scenario(tmp_path, init_failures=1)
    adapter, reason, waiting = open_nvml_waiting(
        NvmlSettings(backend="mock", scenario=str(scenario))
    )
    assert (adapter, waiting) == (None, True)
    assert reason is not None
    assert "driver is not loaded" in reason
    absent = str(tmp_path / "libnvidia-ml.so.1")
    _, reason, waiting = open_nvml_waiting(NvmlSettings(backend="auto", library=absent))
    assert reason is not None
    assert not waiting  # a node without GPUs: degraded, ready
    _, _, waiting = open_nvml_waiting(NvmlSettings(backend="nvml", library=absent))
    assert waiting
