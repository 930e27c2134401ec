"""dcgm-exporter's Grafana dashboard works on gpulet: every query returns data.

``gpulet run --nvml mock`` (8 mock H100s) is scraped every second by a real Prometheus
(Debian's package). The dashboard's queries, kept verbatim in ``tests/fixtures``, are
then run the way Grafana runs them: the template variables first (``label_values``
through ``/api/v1/series``), their values substituted as Grafana's "All" does (a regex
alternation of every value), then every panel's query, each of which must return a
series per GPU (or one, for an aggregate).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulet_common.embedded_nats import free_port
from support.agent_process import Agent
from support.deploy import start_prometheus, stop_process

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DASHBOARDS = [
    FIXTURES / "dcgm-dashboard-queries.txt",
    FIXTURES / "dcgm-dashboard-queries-2020.txt",
]
DEADLINE_S = 45.0
_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*([A-Za-z_][A-Za-z0-9_]*)\)$")


def queries(path: Path) -> list[str]:
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_fixtures_hold_the_dashboards_queries() -> None:
    for path in DASHBOARDS:
        found = queries(path)
        variables = [q for q in found if q.startswith("label_values(")]
        assert len(variables) == 2, path
        assert len(found) - len(variables) == 8, path
        assert all("DCGM_FI_" in q for q in found), path


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
        # GPM activity needs two slow reads: make them a second apart.
        "--set",
        "collector.slow_period_s=1",
        "--set",
        f"collector.pod_resources_socket={tmp_path / 'pod-resources.sock'}",
        # Whatever services `gpulet run` starts, none may touch the host's kubelet.
        "--set",
        f"allocator.plugin.plugin_dir={tmp_path / 'device-plugins'}/",
        "--set",
        f"allocator.pod_resources_socket={tmp_path / 'pod-resources.sock'}",
        node="dcgm-dash-node",
    )
    try:
        running.wait_readyz(lambda *_: True, timeout_s=60, what="an answer")
        yield running
    finally:
        running.stop()


class PromApi:
    def __init__(self, base: str) -> None:
        self.base = base

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        answer = _get(url)
        assert answer["status"] == "success", (expr, answer)
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def label_values(self, selector: str, label: str) -> list[str]:
        """What Grafana's label_values(selector, label) lists (its series-API form)."""
        url = f"{self.base}/api/v1/series?{urllib.parse.urlencode({'match[]': selector})}"
        answer = _get(url)
        assert answer["status"] == "success", (selector, answer)
        return sorted({s[label] for s in answer["data"] if label in s})


def _regex_escape(value: str) -> str:
    # Grafana's Prometheus datasource escapes regex metacharacters with two
    # backslashes: one for the PromQL string, one for the regex.
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value)


def _all_value(values: list[str]) -> str:
    # Grafana's "All" of a multi-value variable without a custom all value.
    return "(" + "|".join(_regex_escape(v) for v in values) + ")"


def run_dashboard(api: PromApi, path: Path) -> dict[str, list[dict[str, Any]]]:
    variables: dict[str, str] = {}
    results: dict[str, list[dict[str, Any]]] = {}
    for query in queries(path):
        filled = query
        for name, value in variables.items():
            filled = filled.replace(f"${name}", value)
        match = _LABEL_VALUES.match(filled)
        if match:
            selector, label = match.group(1), match.group(2)
            found = api.label_values(selector, label)
            assert found, f"{query}: no values"
            variables[label] = _all_value(found)
            results[query] = [{"values": found}]
        else:
            results[query] = api.query(filled)
    return results


@pytest.mark.slow
def test_every_dcgm_dashboard_query_returns_data(agent: Agent, tmp_path: Path) -> None:
    metrics_port = agent.http_port
    web_port = free_port()
    server, log = start_prometheus(tmp_path, metrics_port, web_port)
    api = PromApi(f"http://127.0.0.1:{web_port}")
    # The dashboard's slowest metric to appear: GPM activity, after two slow reads.
    ready = "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"
    results: dict[Path, dict[str, list[dict[str, Any]]]] = {}
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()[-3000:]
            agent.check_running()
            try:
                if len(api.query(ready)) == 8:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        for path in DASHBOARDS:
            results[path] = run_dashboard(api, path)
    finally:
        stop_process(server)
    context = f"agent log:\n{agent.output()[-3000:]}"
    for path, answers in results.items():
        for query, result in answers.items():
            assert result, f"{path.name}: no data for {query}\n{context}"
            if query.startswith("label_values("):
                continue
            aggregate = query.startswith(("avg(", "sum("))
            assert len(result) == (1 if aggregate else 8), (path.name, query, result)
            for series in result:
                assert float(series["value"][1]) >= 0, (query, series)
    current = results[DASHBOARDS[0]]
    assert current["label_values(DCGM_FI_DEV_FB_FREE, Hostname)"] == [
        {"values": ["dcgm-dash-node"]}
    ]
    power_total = current[
        'sum(max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (gpu))'
    ]
    # 8 mock H100s at 118 W each, give or take the mock's 2 % jitter.
    assert 8 * 118 * 0.97 < float(power_total[0]["value"][1]) < 8 * 118 * 1.03
