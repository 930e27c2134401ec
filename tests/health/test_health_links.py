"""Link error-counter rates and retired pages through the real health service, a real
nats-server and the mock NVML (faults injected live, events read by a subscriber)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.mock_nvml import SCENARIO_DIR
from support.health_harness import health_node, on, samples_pass

pytestmark = pytest.mark.anyio

# Slow fields read every sample, a 1 s rate window: rates of errors per second.
FAST_LINKS = [
    "collector.slow_period_s=0.05",
    "health.link_errors.window_s=1",
    "health.link_errors.pcie_replay_per_min=120",  # 2 a second
]


async def test_pcie_replay_rate_warns_recovers_and_ignores_a_reset_counter(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    dgx = SCENARIO_DIR / "dgx-h100.toml"
    async with health_node(nats_server.url, tmp_path, overrides=FAST_LINKS, scenario=dgx) as h:
        await samples_pass(h, 2)  # the counters' baseline
        h.inject("pcie_replay", gpu=1, value=1)
        await samples_pass(h)
        assert not h.log.where(on(h, 1, "pcie_replay_rate"))  # 1 a second: fine
        h.inject("pcie_replay", gpu=1, value=5)
        [warning] = await h.log.wait_for(on(h, 1, "pcie_replay_rate"))
        assert (warning.severity, warning.healthy, warning.action) == (
            "warning",
            True,
            "operator_check",
        )
        assert warning.threshold == 120
        assert "PCIe replays in the last 1s" in warning.reason
        [ok] = await h.log.wait_for(on(h, 1, "recovered", "pcie_replay_rate"), within=5)
        assert ok.healthy
        # A GPU reset zeroes the counter: a new baseline, no negative rate, no alarm.
        h.inject("reset", gpu=1)
        await samples_pass(h, 4)
        h.inject("pcie_replay", gpu=1, value=1)
        await samples_pass(h, 4)
        assert len(h.log.where(on(h, 1, "pcie_replay_rate"))) == 1
        assert not h.log.where(on(h, 0, "pcie_replay_rate"))


async def test_nvlink_errors_warn_and_recover(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    dgx = SCENARIO_DIR / "dgx-h100.toml"
    async with health_node(nats_server.url, tmp_path, overrides=FAST_LINKS, scenario=dgx) as h:
        await samples_pass(h, 2)
        h.inject("nvlink_error", gpu=2, value=1)
        # Any replay or recovery error warns (DCGM's limit); 2 CRC errors a second do not.
        raised = await h.log.wait_for(on(h, 2, "nvlink_error_rate"), count=2)
        assert {e.condition for e in raised} == {"nvlink_replay_rate", "nvlink_recovery_rate"}
        assert all(e.healthy and e.severity == "warning" for e in raised)
        ended = await h.log.wait_for(on(h, 2, "recovered"), count=2, within=5)
        assert {e.condition for e in ended} == {"nvlink_replay_rate", "nvlink_recovery_rate"}
        assert not h.log.where(lambda e: e.condition == "nvlink_crc_rate")


async def test_retired_pages_pending_on_a_gpu_before_ampere(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    t4 = SCENARIO_DIR / "t4.toml"
    async with health_node(nats_server.url, tmp_path, scenario=t4) as h:
        await samples_pass(h, 2)
        h.inject("ecc_dbe", gpu=0)  # the T4 retires the page at the next reset
        [pending] = await h.log.wait_for(on(h, 0, "remap_pending"))
        assert (pending.healthy, pending.action) == (False, "reset_gpu")
        assert pending.reason == (
            "NVML reports a page retirement pending: the GPU must be reset to apply it"
        )
        h.inject("reset", gpu=0)
        [done] = await h.log.wait_for(on(h, 0, "recovered", "remap_pending"))
        assert "the GPU was reset" in done.reason
