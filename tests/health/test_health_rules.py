"""The rule engine, catalogue and de-duplication on their own (no NATS, no threads)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from gpulet_common import config
from gpulet_common.messages import GpuInfo, GpuSample, HealthEvent
from gpulet_common.nvml.adapter import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_GPU_UNAVAILABLE,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID,
    NvmlEvent,
)
from gpulet_common.settings.health import HealthSettings, XidRule
from gpulet_health.catalogue import BUILTIN_XIDS, XidCatalogue
from gpulet_health.dedup import Deduplicator, EventIds
from gpulet_health.rules import RuleEngine, UnknownCondition, UnknownGpu

NODE = "n1"
T0 = 1_700_000_000.0


def gpu(index: int, **kw: object) -> GpuInfo:
    return GpuInfo(uuid=f"GPU-{index}", index=index, name="H100", **kw)  # type: ignore[arg-type]


def sample(index: int, t: float, **kw: object) -> GpuSample:
    return GpuSample(uuid=f"GPU-{index}", index=index, timestamp=t, **kw)  # type: ignore[arg-type]


KEY = b"k" * 32  # the node's event-id key (the service keeps one in its state dir)


def engine(key: bytes = KEY, **health: object) -> RuleEngine:
    settings = msgspec.convert(health, HealthSettings, strict=False)
    e = RuleEngine(NODE, settings, id_key=key)
    e.observe_inventory([gpu(0, temp_slowdown_c=94, temp_shutdown_c=97), gpu(1)], T0)
    return e


def xid(index: int, code: int, t: float) -> NvmlEvent:
    return NvmlEvent(
        gpu_index=index, gpu_uuid=f"GPU-{index}", event_type=EVENT_XID, event_data=code, timestamp=t
    )


def kinds(events: list[HealthEvent]) -> list[tuple[str, str, bool]]:
    return [(e.kind, e.condition, e.healthy) for e in events]


def test_catalogue_defaults_and_overrides() -> None:
    cat = XidCatalogue.from_settings(HealthSettings())
    assert not cat.lookup(13).unhealthy
    assert cat.lookup(13).application
    assert cat.lookup(79).unhealthy
    assert cat.lookup(79).info.action == "reboot"
    assert cat.lookup(48).info.severity == "fatal"
    assert not cat.lookup(63).unhealthy  # informational
    assert cat.lookup(109).application
    assert not cat.lookup(109).unhealthy
    unknown = cat.lookup(9999)
    assert unknown.unhealthy
    assert unknown.info.action == "operator_check"
    # Operators move 109 out of the application list and soften 74.
    settings = HealthSettings(
        app_xids=[13, 31, 43, 45, 68],
        xid_overrides={74: XidRule(severity="warning", action="none")},
    )
    cat = XidCatalogue.from_settings(settings)
    assert cat.lookup(109).unhealthy
    assert cat.lookup(109).info.action == "reset_gpu"
    assert not cat.lookup(74).unhealthy
    assert cat.lookup(74).info.description == BUILTIN_XIDS[74].description


def test_xid_overrides_load_from_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "gpulet.toml"
    path.write_text(
        "[health]\napp_xids = [13]\n"
        "[health.xid_overrides.79]\nseverity = 'warning'\naction = 'none'\n"
        "[health.thermal]\nthreshold_c = 90\nrecover_samples = 5\n"
    )
    settings = config.load(path, env={"GPULET_HEALTH__ECC__SBE_RATE_PER_HOUR": "10"})
    health = settings.health
    assert health.app_xids == [13]
    assert health.xid_overrides[79].severity == "warning"
    assert health.thermal.threshold_c == 90
    assert health.thermal.recover_samples == 5
    assert health.ecc.sbe_rate_per_hour == 10
    with pytest.raises(config.ConfigError, match=r"health\.thermal\.threshold"):
        config.load(env={"GPULET_HEALTH__THERMAL__THRESHOLD": "1"})


def test_fatal_xid_is_sticky_and_app_xid_is_only_reported() -> None:
    e = engine()
    out = e.observe_nvml_event(xid(0, 79, T0 + 1))
    assert kinds(out) == [("xid", "xid:79", False)]
    assert out[0].action == "reboot"
    assert out[0].severity == "fatal"
    assert out[0].xid == 79
    out = e.observe_nvml_event(xid(1, 13, T0 + 1))
    assert kinds(out) == [("xid", "", True)]
    assert out[0].severity == "warning"
    assert out[0].action == "restart_app"
    # Samples do not end a sticky condition.
    for i in range(10):
        assert e.observe_sample(sample(0, T0 + 2 + i, temperature_c=40)) == []
    assert not e.gpus["GPU-0"].healthy
    assert e.snapshot("GPU-0").conditions[0].sticky


def test_event_ids_are_stable() -> None:
    a, b = engine(), engine()
    ea = a.observe_nvml_event(xid(0, 48, T0 + 1))
    eb = b.observe_nvml_event(xid(0, 48, T0 + 1))
    assert ea[0].event_id == eb[0].event_id
    assert ea[0].event_id == EventIds(KEY)(NODE, "GPU-0", "raise", "xid:48", T0 + 1)
    assert ea[0].event_id != a.observe_nvml_event(xid(0, 79, T0 + 1))[0].event_id


def test_event_ids_are_unguessable_without_the_node_key() -> None:
    # Issue 23: the ids were a plain hash of what the event is, so anyone who saw a
    # raise event could compute its recovery's id (and publish it first, to have the
    # genuine one dropped as a duplicate). Under another key every id differs.
    a, other = engine(), engine(key=b"x" * 32)
    raise_a = a.observe_nvml_event(xid(0, 48, T0 + 1))[0]
    raise_o = other.observe_nvml_event(xid(0, 48, T0 + 1))[0]
    assert raise_a.event_id != raise_o.event_id
    _, end_a = a.clear("0", None, T0 + 2)
    _, end_o = other.clear("0", None, T0 + 2)
    assert end_a[-1].kind == "cleared"
    assert end_a[-1].event_id != end_o[-1].event_id
    import hashlib

    # Not the unkeyed hash of the raise event's fields either.
    fields = "\x1f".join([NODE, "GPU-0", "end", "xid:48", repr(raise_a.condition_since)])
    assert end_a[-1].event_id != hashlib.sha256(fields.encode()).hexdigest()[:32]
    # A random key when none is given: two engines never share ids.
    settings = HealthSettings()
    assert EventIds()("x") != EventIds()("x")
    assert RuleEngine(NODE, settings).ids("x") != RuleEngine(NODE, settings).ids("x")


def test_dedup_folds_repeats_into_one_count() -> None:
    e = engine(dedup_window_s=10)
    first = e.observe_nvml_event(xid(0, 79, T0))
    repeats = [e.observe_nvml_event(xid(0, 79, T0 + 0.1 * i)) for i in range(1, 21)]
    assert len(first) == 1
    assert all(r == [] for r in repeats)
    assert e.tick(T0 + 5) == []
    [summary] = e.tick(T0 + 10)
    assert summary.kind == "xid"
    assert summary.repeat_count == 20
    assert summary.condition == "xid:79"
    assert summary.event_id != first[0].event_id
    assert e.tick(T0 + 21) == []  # a quiet window ends the series
    assert len(e.observe_nvml_event(xid(0, 79, T0 + 22))) == 1  # published at once again


def test_dedup_summary_comes_before_the_end_of_its_condition() -> None:
    e = engine(dedup_window_s=60)
    e.observe_nvml_event(xid(0, 48, T0))
    e.observe_nvml_event(xid(0, 48, T0 + 1))
    _, out = e.clear("0", None, T0 + 2)
    assert [(ev.kind, ev.repeat_count) for ev in out] == [("xid", 1), ("cleared", 1)]


def test_dedup_disabled_with_zero_window() -> None:
    d = Deduplicator(0, EventIds(KEY))
    ev = engine().observe_nvml_event(xid(0, 79, T0))[0]
    assert d.offer(("GPU-0", "x"), ev) == [ev]
    assert d.offer(("GPU-0", "x"), ev) == [ev]


def test_thermal_hysteresis_and_n_consecutive_samples() -> None:
    e = engine()
    t = T0
    assert e.observe_sample(sample(1, t, temperature_c=95)) == []  # at, not above
    out = e.observe_sample(sample(1, t + 1, temperature_c=96))
    assert kinds(out) == [("thermal", "thermal", False)]
    assert out[0].observed_value == 96
    assert out[0].threshold == 95
    # 91..94: below the threshold but not below threshold - hysteresis (90).
    for i, temp in enumerate([94, 91, 92, 91, 93]):
        assert e.observe_sample(sample(1, t + 2 + i, temperature_c=temp)) == []
    # Below 90 twice, then a reading at 90 resets the count.
    assert e.observe_sample(sample(1, t + 10, temperature_c=89)) == []
    assert e.observe_sample(sample(1, t + 11, temperature_c=88)) == []
    assert e.observe_sample(sample(1, t + 12, temperature_c=90)) == []
    assert e.observe_sample(sample(1, t + 13, temperature_c=80)) == []
    assert e.observe_sample(sample(1, t + 14, temperature_c=80)) == []
    out = e.observe_sample(sample(1, t + 15, temperature_c=80))
    assert kinds(out) == [("recovered", "thermal", True)]
    assert out[0].condition_kind == "thermal"
    assert out[0].condition_severity == "critical"


def test_oscillating_temperature_raises_once() -> None:
    e = engine()
    events: list[HealthEvent] = []
    for i in range(200):
        events += e.observe_sample(sample(1, T0 + i, temperature_c=93 if i % 2 else 97))
    assert kinds(events) == [("thermal", "thermal", False)]


def test_nvml_slowdown_and_shutdown_thresholds() -> None:
    e = engine()
    out = e.observe_sample(sample(0, T0, temperature_c=94))
    assert kinds(out) == [("thermal_slowdown", "thermal_slowdown", True)]
    assert out[0].severity == "warning"
    assert out[0].threshold == 94
    out = e.observe_sample(sample(0, T0 + 1, temperature_c=97))
    assert kinds(out) == [
        ("thermal", "thermal", False),
        ("thermal_shutdown", "thermal_shutdown", False),
    ]
    events: list[HealthEvent] = []
    for i in range(3):
        events += e.observe_sample(sample(0, T0 + 2 + i, temperature_c=50))
    assert sorted(ev.condition for ev in events) == [
        "thermal",
        "thermal_shutdown",
        "thermal_slowdown",
    ]
    assert events[-1].healthy
    # Throttled for temperature without a known threshold (GPU 1 has none).
    out = e.observe_sample(sample(1, T0 + 9, temperature_c=70, throttle_reasons=0x40))
    assert kinds(out) == [("thermal_slowdown", "thermal_slowdown", True)]


def test_thermal_slowdown_by_temperature_says_the_temperature_reached_the_threshold() -> None:
    [event] = engine().observe_sample(sample(0, T0, temperature_c=94))
    assert event.reason == "GPU temperature 94 C reached the NVML slowdown threshold of 94 C"


def test_thermal_slowdown_by_the_clock_event_bit_says_the_gpu_reports_it() -> None:
    # A cool GPU (34 C, threshold 94 C) whose HW thermal slowdown bit is set: the
    # temperature did not reach the threshold, and the reason must not claim it did.
    [event] = engine().observe_sample(sample(0, T0, temperature_c=34, throttle_reasons=0x40 | 0x4))
    assert event.condition == "thermal_slowdown"
    assert event.reason == (
        "the GPU reports thermal slowdown (clock-event reason HW thermal slowdown); "
        "temperature 34 C, slowdown threshold 94 C"
    )
    assert "reached" not in event.reason
    # Both bits, on a GPU without a known threshold.
    [event] = engine().observe_sample(sample(1, T0, temperature_c=70, throttle_reasons=0x60))
    assert event.reason == (
        "the GPU reports thermal slowdown (clock-event reason SW thermal slowdown and "
        "HW thermal slowdown); temperature 70 C"
    )


def test_hw_slowdown_and_power_brake_warn_and_the_sw_power_cap_does_not() -> None:
    e = engine()
    # A GPU at its power limit under full load: the SW power cap bit, all the time.
    for i in range(10):
        assert e.observe_sample(sample(0, T0 + i, temperature_c=60, throttle_reasons=0x4)) == []
    # The power brake (0x80) beside it: a warning, the GPU stays healthy.
    [event] = e.observe_sample(sample(0, T0 + 10, temperature_c=60, throttle_reasons=0x84))
    assert (event.kind, event.condition, event.severity, event.healthy) == (
        "clock_slowdown",
        "clock_slowdown",
        "warning",
        True,
    )
    assert event.reason == (
        "the GPU reports HW power brake slowdown: the hardware holds its clocks down"
    )
    # Still braked, then HW slowdown as well: no new event.
    assert e.observe_sample(sample(0, T0 + 11, temperature_c=60, throttle_reasons=0x8C)) == []
    # It ends after recover_samples (3) samples without either bit.
    assert e.observe_sample(sample(0, T0 + 12, temperature_c=60, throttle_reasons=0x4)) == []
    assert e.observe_sample(sample(0, T0 + 13, temperature_c=60, throttle_reasons=0x84)) == []
    for i in range(2):
        assert e.observe_sample(sample(0, T0 + 14 + i, throttle_reasons=0x4)) == []
    [end] = e.observe_sample(sample(0, T0 + 16, temperature_c=60, throttle_reasons=0x4))
    assert (end.kind, end.condition, end.condition_kind) == (
        "recovered",
        "clock_slowdown",
        "clock_slowdown",
    )
    # A GPU that does not report clock-event reasons: nothing to judge.
    assert e.observe_sample(sample(1, T0, temperature_c=60)) == []


def test_remap_pending_says_what_nvml_knows_and_no_invented_count() -> None:
    e = engine()
    [event] = e.observe_sample(
        sample(
            0,
            T0,
            remapped_rows_pending=True,
            remapped_rows_uncorrectable=0,
            remapped_rows_correctable=2,
        )
    )
    assert event.reason == (
        "NVML reports a row remap pending (rows remapped so far: 0 for uncorrectable "
        "errors, 2 for correctable ones): the GPU must be reset to apply it"
    )
    assert "0 row remap(s) pending" not in event.reason
    # Without the counts, none is shown.
    [event] = e.observe_sample(sample(1, T0, remapped_rows_pending=True))
    assert event.reason == "NVML reports a row remap pending: the GPU must be reset to apply it"
    [event] = engine().observe_sample(sample(1, T0, retired_pages_pending=True))
    assert event.reason == (
        "NVML reports a page retirement pending: the GPU must be reset to apply it"
    )


def test_thresholds_can_be_ignored() -> None:
    e = engine(thermal={"use_nvml_thresholds": False})
    assert e.observe_sample(sample(0, T0, temperature_c=94)) == []


def test_dbe_sticky_reset_by_counters_going_back() -> None:
    e = engine()
    e.observe_sample(sample(0, T0, ecc_volatile_uncorrected=0, ecc_volatile_corrected=0))
    dbe = NvmlEvent(
        gpu_index=0,
        gpu_uuid="GPU-0",
        event_type=EVENT_DOUBLE_BIT_ECC,
        event_data=0,
        timestamp=T0 + 1,
    )
    out = e.observe_nvml_event(dbe)
    assert kinds(out) == [("ecc_uncorrectable", "ecc_uncorrectable", False)]
    assert out[0].action == "reset_gpu"
    # The counter confirms the event: no second occurrence.
    assert (
        e.observe_sample(sample(0, T0 + 2, ecc_volatile_uncorrected=2, ecc_volatile_corrected=0))
        == []
    )
    assert (
        e.observe_sample(sample(0, T0 + 3, ecc_volatile_uncorrected=2, ecc_volatile_corrected=0))
        == []
    )
    out = e.observe_sample(sample(0, T0 + 4, ecc_volatile_uncorrected=0, ecc_volatile_corrected=0))
    assert kinds(out) == [("recovered", "ecc_uncorrectable", True)]
    assert "reset" in out[0].reason


def test_dbe_from_counter_alone() -> None:
    e = engine()
    e.observe_sample(sample(0, T0, ecc_volatile_uncorrected=0))
    out = e.observe_sample(sample(0, T0 + 1, ecc_volatile_uncorrected=3))
    assert kinds(out) == [("ecc_uncorrectable", "ecc_uncorrectable", False)]
    assert out[0].observed_value == 3


def test_sbe_rate_warning_then_clear() -> None:
    e = engine(ecc={"sbe_rate_per_hour": 360, "sbe_window_s": 60})  # > 6 in a minute
    e.observe_sample(sample(0, T0, ecc_volatile_corrected=0))
    sbe = NvmlEvent(
        gpu_index=0,
        gpu_uuid="GPU-0",
        event_type=EVENT_SINGLE_BIT_ECC,
        event_data=0,
        timestamp=T0 + 1,
    )
    assert e.observe_nvml_event(sbe) == []
    # The counter says 8 (one already counted from the event): 8 in the window > 6.
    out = e.observe_sample(sample(0, T0 + 2, ecc_volatile_corrected=8))
    assert kinds(out) == [("ecc_correctable_rate", "ecc_correctable_rate", True)]
    assert out[0].severity == "warning"
    assert out[0].observed_value == pytest.approx(480)
    assert e.tick(T0 + 30) == []
    out = e.tick(T0 + 63)
    assert kinds(out) == [("recovered", "ecc_correctable_rate", True)]


def test_remap_pending_and_failure() -> None:
    e = engine()
    out = e.observe_sample(
        sample(
            0,
            T0,
            remapped_rows_pending=True,
            remapped_rows_failed=False,
            remapped_rows_uncorrectable=1,
        )
    )
    assert kinds(out) == [("remap_pending", "remap_pending", False)]
    assert out[0].action == "reset_gpu"
    out = e.observe_sample(sample(0, T0 + 1, remapped_rows_pending=True, remapped_rows_failed=True))
    assert kinds(out) == [("remap_failure", "remap_failure", False)]
    assert out[0].action == "hardware_inspection"
    assert out[0].severity == "fatal"
    out = e.observe_sample(
        sample(0, T0 + 2, remapped_rows_pending=False, remapped_rows_failed=True)
    )
    assert kinds(out) == [("recovered", "remap_pending", False)]
    # Older GPUs: page retirement pending.
    out = e.observe_sample(sample(1, T0, retired_pages_pending=True))
    assert kinds(out) == [("remap_pending", "remap_pending", False)]


def test_lost_removed_back_and_added() -> None:
    e = engine()
    e.observe_nvml_event(xid(1, 79, T0))
    unavailable = NvmlEvent(
        gpu_index=1,
        gpu_uuid="GPU-1",
        event_type=EVENT_GPU_UNAVAILABLE,
        event_data=0,
        timestamp=T0 + 1,
    )
    out = e.observe_nvml_event(unavailable)
    # A lost GPU is out of the usable list at once: lost and removed.
    assert kinds(out) == [("gpu_lost", "lost", False), ("gpu_removed", "removed", False)]
    assert e.rescan_wanted
    assert not e.gpus["GPU-1"].present
    assert e.observe_inventory([gpu(0)], T0 + 2) == []
    out = e.observe_inventory([gpu(0), gpu(1), gpu(2)], T0 + 3)
    assert [ev.kind for ev in out] == [
        "recovered",
        "recovered",
        "recovered",
        "gpu_added",
        "gpu_added",
    ]
    assert {ev.condition for ev in out if ev.kind == "recovered"} == {"removed", "lost", "xid:79"}
    assert out[2].healthy
    assert out[3].healthy
    assert out[3].gpu_uuid == "GPU-1"
    assert out[4].gpu_uuid == "GPU-2"


def test_nvml_unavailable_marks_every_gpu() -> None:
    e = engine()
    out = e.observe_nvml_unavailable("library not found", T0)
    assert kinds(out) == [("nvml_unavailable", "nvml", False)] * 2
    out = e.observe_nvml_available(T0 + 1)
    assert kinds(out) == [("recovered", "nvml", True)] * 2


def test_clear_errors_and_restore() -> None:
    e = engine()
    e.observe_nvml_event(xid(0, 48, T0))
    with pytest.raises(UnknownGpu):
        e.clear("7", None, T0)
    with pytest.raises(UnknownCondition):
        e.clear("GPU-0", "thermal", T0)
    snapshot = e.snapshot("GPU-0")
    restored = RuleEngine(NODE, HealthSettings(), id_key=KEY)  # a restart: the same key
    restored.restore([snapshot])
    assert restored.observe_inventory([gpu(0), gpu(1)], T0 + 5) == []
    assert not restored.gpus["GPU-0"].healthy
    _, out = restored.clear("GPU-0", "xid:48", T0 + 6, by="alice")
    assert kinds(out) == [("cleared", "xid:48", True)]
    assert "alice" in out[0].reason
    assert out[0].event_id == e.clear("0", None, T0 + 7)[1][0].event_id  # same condition, same id


def test_a_scan_overtaken_by_newer_news_changes_nothing() -> None:
    e = engine()
    # GPU 1 answered a sample after the scan began: the scan missing it is stale.
    e.observe_sample(sample(1, T0 + 5, temperature_c=40))
    assert e.observe_inventory([gpu(0)], T0 + 6, scanned_at=T0 + 4) == []
    assert e.gpus["GPU-1"].present
    assert e.rescan_wanted
    # A scan that began later does remove it.
    out = e.observe_inventory([gpu(0)], T0 + 8, scanned_at=T0 + 7)
    assert kinds(out) == [("gpu_removed", "removed", False)]
    # Lost after a scan began: that scan finding it does not bring it back.
    e.observe_lost("GPU-0", T0 + 10, "test")
    assert e.observe_inventory([gpu(0)], T0 + 11, scanned_at=T0 + 9) == []
    assert not e.gpus["GPU-0"].present
    assert e.observe_lost("GPU-0", T0 + 12, "stale", scanned_at=T0 + 9) == []


def test_a_condition_goes_to_the_wire_and_back_whole() -> None:
    # Every field of the wire form is carried (a new one must be added to WIRE_FIELDS),
    # and a restored condition is the one that was stored, its XID read from its name.
    from gpulet_common.messages import ActiveCondition
    from gpulet_health.state import WIRE_FIELDS, Condition

    assert set(ActiveCondition.__struct_fields__) == {*WIRE_FIELDS, "evidence_count"}
    cond = Condition(
        "xid:79@MIG-1", "xid", "fatal", "fell off the bus", "reboot", T0, sticky=True,
        message="m", evidence=2, boot_id="b", mig_device="MIG-1", reset_seen=True,
    )  # fmt: skip
    # Marked as read back (a recovery hold says so), which the wire does not carry.
    assert Condition.from_wire(cond.wire()) == dataclasses.replace(cond, xid=79, restored=True)


def test_a_report_only_xid_says_what_its_event_says_of_the_health() -> None:
    """XID 94 (contained, a job restart fixes it) changes nothing: on a healthy GPU its
    event is healthy and says so; on a GPU already unhealthy (XID 79 before it) its
    event is unhealthy, and its reason no longer claims "the GPU stays healthy"."""
    e = engine()
    [ok] = e.observe_nvml_event(xid(0, 94, T0))
    assert ok.healthy is True
    assert "the GPU stays healthy" in ok.reason
    e.observe_nvml_event(xid(1, 79, T0))
    [after] = e.observe_nvml_event(xid(1, 94, T0 + 1))
    assert after.healthy is False
    assert "stays healthy" not in after.reason
    assert "unhealthy (xid:79)" in after.reason
