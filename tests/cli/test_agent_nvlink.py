"""An NVLink going down in a real `gpulet run`, driven by the CLI (issue 15).

``gpulet mock inject --fault nvlink_down`` reaches the agent's mock NVML over NATS; the
collector republishes the inventory with the pair's links down (``gpulet watch``
shows it), the health service raises ``nvlink_down`` (``gpulet health state``), and
``/metrics`` counts the links down. ``--fault nvlink_up`` undoes all of it. The
allocator's side (GetPreferredAllocation) is tests/allocator/test_nvlink_down.py.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from support.agent_process import GPULET, Agent, http_get

T = TypeVar("T")


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    running = Agent(
        tmp_path,
        "--only",
        "collector,health",
        "--nvml",
        "mock:nvlink-pairs-8gpu",
        "--set",
        "collector.slow_period_s=0.2",
        "--set",
        "collector.nvlink_state_period_s=0.5",
    )
    try:
        yield running
    finally:
        running.stop()


def gpulet(agent: Agent, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPULET, *args, "--nats", agent.nats_url, "--node", agent.node],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def inventory(agent: Agent) -> dict[str, Any]:
    watched = gpulet(agent, "watch", "gpu.inventory.*", "--count", "1", "--timeout", "10")
    assert watched.returncode == 0, watched.stderr
    data: dict[str, Any] = json.loads(watched.stdout.splitlines()[0])["data"]
    return data


def health(agent: Agent) -> dict[str, Any]:
    state = gpulet(agent, "health", "state", "--gpu", "0", "--json")
    assert state.returncode == 0, state.stderr
    data: dict[str, Any] = json.loads(state.stdout)
    return data


def pair(inv: dict[str, Any], a: int, b: int) -> tuple[int, int]:
    gpu = next(g for g in inv["gpus"] if g["index"] == a)
    link = next(p for p in gpu["topology"] if p["peer_index"] == b)
    return link.get("nvlinks", 0), link.get("nvlinks_down", 0)


def nvlink_conditions(state: dict[str, Any]) -> list[str]:
    [gpu] = state["gpus"]
    return sorted(
        c["condition"] for c in gpu["conditions"] if c["condition"].startswith("nvlink_down:")
    )


def until(read: Callable[[], T], done: Callable[[T], bool], what: str, within: float = 30) -> T:
    deadline = time.monotonic() + within
    while True:
        value = read()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}; last: {value}"
        time.sleep(0.2)


def links_down_metric(agent: Agent) -> float | None:
    status, body = http_get(f"http://127.0.0.1:{agent.http_port}/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith("gpulet_gpu_nvlinks_down{") and 'gpu="0"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_nvlink_down_and_up_through_gpulet_run(agent: Agent) -> None:
    agent.wait_ready()
    before = inventory(agent)
    assert pair(before, 0, 1) == (4, 0)

    injected = gpulet(agent, "mock", "inject", "--gpu", "0", "--fault", "nvlink_down")
    assert injected.returncode == 0, injected.stderr
    assert json.loads(injected.stdout)["applied"] is True

    down = until(lambda: inventory(agent), lambda i: pair(i, 0, 1) == (0, 4), "links down")
    assert pair(down, 0, 2) == pair(down, 0, 3) == (0, 1)
    assert pair(down, 2, 3) == (4, 0)
    state = until(lambda: health(agent), lambda s: len(nvlink_conditions(s)) == 6, "warnings")
    assert nvlink_conditions(state) == [f"nvlink_down:{link}" for link in range(6)]
    assert state["gpus"][0]["healthy"] is True
    assert until(lambda: links_down_metric(agent), lambda v: v == 6, "the metric") == 6

    # --gpu takes a UUID as well as an index, in every command.
    uuid = next(g["uuid"] for g in down["gpus"] if g["index"] == 0)
    restored = gpulet(agent, "mock", "inject", "--gpu", uuid, "--fault", "nvlink_up")
    assert restored.returncode == 0, restored.stderr
    unknown = gpulet(agent, "mock", "inject", "--gpu", "GPU-none", "--fault", "nvlink_up")
    assert unknown.returncode == 1
    assert "has no GPU GPU-none" in unknown.stderr
    back = until(lambda: inventory(agent), lambda i: pair(i, 0, 1) == (4, 0), "links up")
    assert back["gpus"][0].get("nvlinks_down", []) == []
    until(lambda: health(agent), lambda s: not nvlink_conditions(s), "the recoveries")
