"""PCIe replay and NVLink error-counter rates through the rule engine (no NATS)."""

from __future__ import annotations

import msgspec

from gpulet_common.messages import GpuInfo, GpuSample, HealthEvent
from gpulet_common.settings.health import HealthSettings
from gpulet_health.rules import RuleEngine

T0 = 1_700_000_000.0


def engine(**links: float) -> RuleEngine:
    settings = msgspec.convert({"link_errors": {"window_s": 60, **links}}, HealthSettings)
    e = RuleEngine("n1", settings)
    e.observe_inventory([GpuInfo(uuid="GPU-0", index=0)], T0)
    return e


def at(t: float, **counters: int) -> GpuSample:
    return GpuSample(uuid="GPU-0", index=0, timestamp=T0 + t, **counters)  # type: ignore[arg-type]


def kinds(events: list[HealthEvent]) -> list[tuple[str, str, bool]]:
    return [(e.kind, e.condition, e.healthy) for e in events]


def test_pcie_replay_rate_warns_above_the_limit_and_recovers() -> None:
    e = engine(pcie_replay_per_min=8)
    # The first reading is a baseline: a counter run up since the driver loaded is no alarm.
    assert e.observe_sample(at(0, pcie_replay_count=1_000_000)) == []
    assert e.observe_sample(at(10, pcie_replay_count=1_000_008)) == []  # 8/min: at the limit
    [raised] = e.observe_sample(at(20, pcie_replay_count=1_000_009))
    assert kinds([raised]) == [("pcie_replay_rate", "pcie_replay_rate", True)]
    assert (raised.severity, raised.action) == ("warning", "operator_check")
    assert (raised.observed_value, raised.threshold) == (9.0, 8.0)
    assert raised.reason == "9 PCIe replays in the last 60s: 9/min, above 8/min"
    # Quiet samples: the rises stay in the window until it passes them.
    assert e.observe_sample(at(30, pcie_replay_count=1_000_009)) == []
    assert e.observe_sample(at(65, pcie_replay_count=1_000_009)) == []  # all 9 still in
    # By 72 s the 8 replays of 10 s have left the window: 1/min, below half the limit.
    [ended] = e.tick(T0 + 72)
    assert kinds([ended]) == [("recovered", "pcie_replay_rate", True)]
    assert ended.reason == "PCIe replays down to 1/min (cleared at half of 8/min)"
    assert e.tick(T0 + 200) == []


def test_a_counter_going_back_takes_a_new_baseline() -> None:
    e = engine(pcie_replay_per_min=8, nvlink_crc_per_min=8)
    assert e.observe_sample(at(0, pcie_replay_count=500, nvlink_crc_flit_errors=500)) == []
    # A GPU reset (or nvidia-smi nvlink -r) zeroes the counters: no negative rate.
    assert e.observe_sample(at(1, pcie_replay_count=0, nvlink_crc_flit_errors=3)) == []
    assert e.observe_sample(at(2, pcie_replay_count=8, nvlink_crc_flit_errors=11)) == []
    [raised] = e.observe_sample(at(3, pcie_replay_count=9, nvlink_crc_flit_errors=11))
    assert raised.condition == "pcie_replay_rate"
    assert raised.observed_value == 9.0  # 8 + 1 since the new baseline, not 500 - 0


def test_nvlink_crc_counts_flit_and_data_errors_together() -> None:
    e = engine(nvlink_crc_per_min=10)
    assert e.observe_sample(at(0, nvlink_crc_flit_errors=7, nvlink_crc_data_errors=70)) == []
    assert e.observe_sample(at(1, nvlink_crc_flit_errors=12, nvlink_crc_data_errors=75)) == []
    [raised] = e.observe_sample(at(2, nvlink_crc_flit_errors=12, nvlink_crc_data_errors=76))
    assert kinds([raised]) == [("nvlink_error_rate", "nvlink_crc_rate", True)]
    assert raised.observed_value == 11.0


def test_any_nvlink_replay_or_recovery_error_warns_by_default() -> None:
    e = engine()
    assert e.observe_sample(at(0, nvlink_replay_errors=4, nvlink_recovery_errors=2)) == []
    assert e.observe_sample(at(1, nvlink_replay_errors=4, nvlink_recovery_errors=2)) == []
    out = e.observe_sample(at(2, nvlink_replay_errors=5, nvlink_recovery_errors=3))
    assert kinds(out) == [
        ("nvlink_error_rate", "nvlink_replay_rate", True),
        ("nvlink_error_rate", "nvlink_recovery_rate", True),
    ]
    # More errors while active: no repeat events.
    assert e.observe_sample(at(3, nvlink_replay_errors=9, nvlink_recovery_errors=3)) == []
    # A window without errors ends both (limit 0: cleared at 0).
    assert e.tick(T0 + 60) == []
    out = e.tick(T0 + 64)
    assert sorted(ev.condition for ev in out) == ["nvlink_recovery_rate", "nvlink_replay_rate"]
    assert {ev.kind for ev in out} == {"recovered"}


def test_gpus_without_the_counters_are_left_alone() -> None:
    e = engine()
    for i in range(5):
        assert e.observe_sample(at(i, temperature_c=40)) == []
    assert e.tick(T0 + 100) == []
    assert e.snapshot("GPU-0").conditions == []
