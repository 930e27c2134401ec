"""Prometheus integration: the alert rules with promtool, and a real Prometheus scrape.

The scrape test starts ``gpulet run --nvml mock`` (8 mock H100s, an embedded
nats-server) and a real Prometheus that scrapes its ``/metrics`` every second with the
shipped rules loaded. A PromQL query must then return the temperature of all 8 GPUs:
that proves the exposition format, the metric names the rules and dashboards use, and
the rule file loading into a real server.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpulet_common.embedded_nats import free_port
from support.agent_process import Agent
from support.deploy import PROMETHEUS_DIR, prometheus_tool, start_prometheus, stop_process

RULES = PROMETHEUS_DIR / "gpulet-rules.yaml"
RULES_TEST = PROMETHEUS_DIR / "gpulet-rules.test.yaml"
PROMETHEUS_RULE = PROMETHEUS_DIR / "prometheusrule.yaml"
DEADLINE_S = 30.0


def test_promtool_check_rules() -> None:
    result = subprocess.run(
        [prometheus_tool("promtool"), "check", "rules", str(RULES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules() -> None:
    result = subprocess.run(
        [prometheus_tool("promtool"), "test", "rules", RULES_TEST.name],
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load(RULES_TEST.read_text())
    tested = {
        case["alertname"]
        for t in tests["tests"]
        for case in t.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts - tested == set()


def test_prometheus_operator_rule_has_the_same_groups() -> None:
    rules = yaml.safe_load(RULES.read_text())
    custom = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert custom["apiVersion"] == "monitoring.coreos.com/v1"
    assert custom["kind"] == "PrometheusRule"
    assert custom["spec"]["groups"] == rules["groups"]


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.loads(response.read())


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    """``gpulet run --nvml mock`` on 127.0.0.1; fails at once if it exits."""
    running = Agent(
        tmp_path,
        "--set",
        "telemetry.http_host=127.0.0.1",
        # Whatever services `gpulet run` starts, none may touch the host's kubelet.
        "--set",
        f"allocator.plugin.plugin_dir={tmp_path / 'device-plugins'}/",
        "--set",
        f"allocator.pod_resources_socket={tmp_path / 'pod-resources.sock'}",
        node="prom-test-node",
    )
    try:
        running.wait_readyz(lambda *_: True, timeout_s=60, what="an answer")
        yield running
    finally:
        running.stop()


@pytest.mark.slow
def test_prometheus_scrapes_gpu_temperature_from_gpulet_run(agent: Agent, tmp_path: Path) -> None:
    metrics_port = agent.http_port
    web_port = free_port()
    shutil.copy(RULES, tmp_path / RULES.name)
    server, log = start_prometheus(tmp_path, metrics_port, web_port, rule_files=[RULES.name])
    base = f"http://127.0.0.1:{web_port}"
    query = urllib.parse.urlencode({"query": "gpulet_gpu_temperature_celsius"})
    series: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()[-3000:]
            agent.check_running()
            try:
                answer = _get(f"{base}/api/v1/query?{query}")
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                answer = {}
            series = answer.get("data", {}).get("result", [])
            if len(series) == 8:
                break
            time.sleep(0.5)
        targets = _get(f"{base}/api/v1/targets")["data"]["activeTargets"]
        rules = _get(f"{base}/api/v1/rules")["data"]["groups"]
    finally:
        stop_process(server)
    assert len(series) == 8, f"got {len(series)} series; agent log:\n{agent.output()[-3000:]}"
    assert sorted(int(s["metric"]["gpu"]) for s in series) == list(range(8))
    for s in series:
        assert s["metric"]["job"] == "gpulet"
        assert s["metric"]["UUID"].startswith("GPU-")
        assert s["metric"]["Hostname"] == "prom-test-node"
        assert 0 < float(s["value"][1]) < 120
    assert [(t["health"], t["lastError"]) for t in targets] == [("up", "")]
    assert {g["name"] for g in rules} == {"gpulet-gpu", "gpulet-agent"}
    assert all(r["health"] != "err" for g in rules for r in g["rules"]), rules
