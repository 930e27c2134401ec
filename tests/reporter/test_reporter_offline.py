"""Finding the cluster (in-cluster, kubeconfig, none) and the no-cluster mode."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from gpulet_common import codec, subjects
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.kubeapi import KubeClient, api_path
from gpulet_common.settings import Settings
from gpulet_common.settings.nats import NatsSettings
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_reporter.kube import KubeConfigError, load_target
from support.health_kv import gpu_health, put_health
from support.kube_emulator import DEFAULT_CRD_PATH, CrdSchema, KubeEmulator
from support.reporter_harness import (
    fast_settings,
    gpu_uuid,
    make_inventory,
    running_reporter,
    wait_until,
)

pytestmark = pytest.mark.anyio

NODE = "laptop"


async def _can_read_node(configuration: Any, node: str) -> str:
    async with KubeClient(configuration) as api:
        found = await api.get(api_path("", "v1", "nodes", name=node), timeout_s=5)
        return str(found["metadata"]["name"])


async def test_kubeconfig_from_the_environment_settings_and_home(tmp_path: Path) -> None:
    async with KubeEmulator.running(token="secret") as emu:
        emu.add_node(NODE)
        path = emu.write_kubeconfig(tmp_path / "config")
        home = tmp_path / "home"
        (home / ".kube").mkdir(parents=True)
        emu.write_kubeconfig(home / ".kube" / "config")

        target = await load_target(ReporterSettings(), env={"KUBECONFIG": str(path)})
        assert (target.offline, target.server) == (False, emu.url)
        assert target.source == f"kubeconfig {path}"
        assert await _can_read_node(target.configuration, NODE) == NODE

        target = await load_target(ReporterSettings(kubeconfig=str(path)), env={})
        assert await _can_read_node(target.configuration, NODE) == NODE

        target = await load_target(ReporterSettings(), env={"HOME": str(home)})
        assert target.source == f"kubeconfig {home / '.kube' / 'config'}"

        target = await load_target(
            ReporterSettings(kubeconfig=str(path), kube_context="kube-emulator"), env={}
        )
        assert target.source.endswith("(context kube-emulator)")


async def test_unusable_or_absent_configs(tmp_path: Path) -> None:
    nothing = await load_target(ReporterSettings(), env={"HOME": str(tmp_path)})
    assert nothing.offline
    assert nothing.offline_reason == "not in a cluster and no kubeconfig found"

    bad = tmp_path / "bad-config"
    bad.write_text("clusters: [this is not: a kubeconfig")
    broken = await load_target(ReporterSettings(kubeconfig=str(bad)), env={})
    assert broken.offline
    assert f"kubeconfig {bad} unusable" in broken.offline_reason

    missing = await load_target(ReporterSettings(kubeconfig=str(tmp_path / "nope")), env={})
    assert "not found" in missing.offline_reason
    with pytest.raises(KubeConfigError, match="not found"):
        await load_target(
            ReporterSettings(mode="cluster", kubeconfig=str(tmp_path / "nope")), env={}
        )

    forced = await load_target(ReporterSettings(mode="offline"), env={"KUBECONFIG": str(bad)})
    assert forced.offline_reason == "reporter.mode is offline"


async def test_mock_gpus_stay_offline_unless_cluster_mode_is_asked_for(tmp_path: Path) -> None:
    async with KubeEmulator.running() as emu:
        path = emu.write_kubeconfig(tmp_path / "config")
        env = {"KUBECONFIG": str(path)}
        mock = await load_target(ReporterSettings(), nvml_backend="mock", env=env)
        assert mock.offline
        assert "mock NVML" in mock.offline_reason
        asked = await load_target(ReporterSettings(mode="cluster"), nvml_backend="mock", env=env)
        assert not asked.offline


async def test_in_cluster_config_comes_first(tmp_path: Path) -> None:
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    (sa / "ca.crt").write_text("not really a certificate")
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text("this would be used only outside a cluster")
    env = {
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBECONFIG": str(kubeconfig),
    }
    target = await load_target(ReporterSettings(), env=env, sa_dir=sa)
    assert target.source == "in-cluster"
    assert target.server == "https://10.0.0.1:443"
    configuration: Any = target.configuration
    assert configuration.token == "sa-token"
    assert configuration.configuration.ssl_ca_cert == str(sa / "ca.crt")
    # Without the service account token it is not "in a cluster".
    (sa / "token").unlink()
    fallback = await load_target(ReporterSettings(), env=env, sa_dir=sa)
    assert fallback.offline
    assert "unusable" in fallback.offline_reason


async def test_no_cluster_mode_writes_the_device_to_a_file_and_the_log(
    nats_server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="gpulet.reporter")
    settings = fast_settings(mode="auto")
    env = {"HOME": str(tmp_path / "home")}
    out = tmp_path / "state" / "reporter"
    device_file = out / f"device-{NODE}.json"
    labels_file = out / f"node-labels-{NODE}.json"
    bad = gpu_uuid(NODE, 1)
    async with running_reporter(nats_server.url, tmp_path, NODE, settings, env=env) as r:
        await r.bus.publish(subjects.inventory(NODE), make_inventory(NODE, 2), codec.INVENTORY)
        await put_health(r.bus, NODE, gpu_health(bad, healthy=False))

        def written() -> bool:
            if not device_file.exists():
                return False
            devices = json.loads(device_file.read_text())["spec"]["devices"]
            return len(devices) == 2 and devices[1]["health"] is False

        await wait_until(written, within=5)
        await wait_until(lambda: r.service.metrics.pending is False)
        assert r.service.target is not None
        assert r.service.target.offline_reason == "not in a cluster and no kubeconfig found"
        first_mtime = device_file.stat().st_mtime_ns
        writes = r.service.metrics.writes_total
        # The same inputs again: nothing is rewritten.
        for _ in range(5):
            await r.bus.publish(subjects.inventory(NODE), make_inventory(NODE, 2), codec.INVENTORY)
        await anyio.sleep(0.4)
        assert device_file.stat().st_mtime_ns == first_mtime
        assert r.service.metrics.writes_total == writes
        status = r.runtime.status.get("reporter")
        assert status is not None
        assert "no cluster" in status.detail

    device = json.loads(device_file.read_text())
    assert device["kind"] == "Device"
    assert device["metadata"]["name"] == NODE
    assert "resourceVersion" not in device["metadata"]
    assert CrdSchema.from_file(DEFAULT_CRD_PATH).validate(device) == []
    labels = json.loads(labels_file.read_text())
    assert labels["nvidia.com/gpu.count"] == "2"
    assert "no cluster (not in a cluster and no kubeconfig found)" in caplog.text
    # At INFO one line says what changed and where it is; the whole Device (240 lines
    # for 8 GPUs) is logged at debug level only.
    info = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    debug = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    assert f"the Device this node would apply (2 GPUs, 1 unhealthy) is in {device_file}" in info
    assert bad not in info
    assert bad in debug

    # A restart with the same state: the file is read back and not rewritten.
    async with running_reporter(nats_server.url, tmp_path, NODE, settings, env=env) as r:
        await r.bus.publish(subjects.inventory(NODE), make_inventory(NODE, 2), codec.INVENTORY)
        await wait_until(lambda: r.service.loop is not None and r.service.loop.applied is not None)
        assert r.service.metrics.writes_total == 0
    assert device_file.stat().st_mtime_ns == first_mtime


async def test_gpulet_run_on_a_laptop_shows_the_device(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """Collector (mock NVML) and reporter in one agent, as ``gpulet run`` starts them."""
    from gpulet.agent import run_agent

    settings = Settings(
        node_name=NODE,
        state_dir=str(tmp_path / "state"),
        nats=NatsSettings(url=nats_server.url),
        reporter=ReporterSettings(quiet_window_s=0.05, max_delay_s=0.2),
    )
    settings.nvml.backend = "mock"
    settings.telemetry.http_port = 0
    device_file = tmp_path / "state" / "reporter" / f"device-{NODE}.json"

    agent = partial(
        run_agent, settings, ["collector", "reporter"], embedded_nats=False, handle_signals=False
    )

    async with anyio.create_task_group() as tg:
        await tg.start(agent)
        await wait_until(device_file.exists, within=10)
        tg.cancel_scope.cancel()
    device = json.loads(device_file.read_text())
    assert len(device["spec"]["devices"]) == 8  # the dgx-h100 scenario
    assert device["metadata"]["labels"]["node.koordinator.sh/gpu-model"]


async def test_reporter_preview_asks_the_running_agent(
    nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What its help says: the agent's inventory over NATS, never NVML of its own."""
    from gpulet.agent import run_agent
    from gpulet_reporter.cli import PreviewError, preview

    agent_settings = Settings(
        node_name=NODE,
        state_dir=str(tmp_path / "agent"),
        nats=NatsSettings(url=nats_server.url),
    )
    agent_settings.nvml.backend = "mock"
    agent_settings.nvml.scenario = "t4"
    agent_settings.telemetry.http_port = 0
    # The preview's own settings: no NVML it could open (a real backend without a
    # library), so an answer can only have come from the agent.
    # No NATS URL configured, as beside `make run`: the node-local server, which here
    # is the test's.
    monkeypatch.setattr("gpulet_common.cli_support.LOCAL_NATS_URL", nats_server.url)
    settings = Settings(node_name=NODE, state_dir=str(tmp_path / "preview"))
    settings.nvml.backend = "nvml"
    settings.nvml.library = str(tmp_path / "no-libnvidia-ml.so")

    with pytest.raises(PreviewError, match="is the agent running"):
        await preview(settings, timeout_s=0.3)

    agent = partial(
        run_agent, agent_settings, ["collector"], embedded_nats=False, handle_signals=False
    )

    async with anyio.create_task_group() as tg:
        await tg.start(agent)
        result = await preview(settings, timeout_s=5)
        tg.cancel_scope.cancel()
    device = result["device"]
    assert device["metadata"]["name"] == NODE
    assert device["metadata"]["labels"]["node.koordinator.sh/gpu-model"] == "Tesla-T4"
    assert CrdSchema.from_file(DEFAULT_CRD_PATH).validate(device) == []
    assert result["nodeLabels"]["nvidia.com/gpu.product"] == "Tesla-T4"
    # No health service in that agent: the condition says it does not know.
    condition = result["nodeCondition"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "GpuletGPUHealthy",
        "Unknown",
        "HealthServiceUnreachable",
    )
    assert result["nodeTaint"]["present"] is False  # policy none: never ours
    assert not (tmp_path / "preview").exists()  # nothing written
