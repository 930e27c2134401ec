"""XID storms, by-products (45, 43) and the repeat rule, through the rule engine.

Time is the engine's input (every observation carries it), so these run on simulated
time: a 30 s storm of 10,000 lines a second takes no 30 s.
"""

from __future__ import annotations

import collections
import logging

import msgspec
import pytest

from gpulet_common.messages import GpuInfo, HealthEvent
from gpulet_common.nvml.adapter import EVENT_XID, NvmlEvent
from gpulet_common.settings.health import HealthSettings
from gpulet_health.dedup import MAX_VARIANTS
from gpulet_health.rules import RuleEngine
from gpulet_health.rules.xid import variant

NODE = "n1"
T0 = 1_700_000_000.0


def engine(**health: object) -> RuleEngine:
    e = RuleEngine(NODE, msgspec.convert(health, HealthSettings, strict=False))
    e.observe_inventory([GpuInfo(uuid=f"GPU-{i}", index=i, name="H100") for i in (0, 1)], T0)
    return e


def nvml_xid(e: RuleEngine, code: int, t: float, index: int = 0) -> list[HealthEvent]:
    event = NvmlEvent(
        gpu_index=index, gpu_uuid=f"GPU-{index}", event_type=EVENT_XID, event_data=code, timestamp=t
    )
    return e.observe_nvml_event(event)


def test_pid_and_process_name_are_not_part_of_the_message() -> None:
    assert variant("pid=1234, name=python3, Ch 00000008, intr 10000000") == (
        "Ch 00000008, intr 10000000"
    )
    assert variant("pid='<unknown>', name=<unknown>, Ch 00000010") == "Ch 00000010"
    assert variant("pid=77, GPU has fallen off the bus.") == "GPU has fallen off the bus."
    assert variant("") == ""
    assert len(variant("x" * 1000)) == 200


def test_xid_45_after_xid_79_adds_to_the_79_and_raises_nothing_of_its_own() -> None:
    e = engine(dedup_window_s=60)
    [raised] = nvml_xid(e, 79, T0 + 1)
    assert (raised.condition, raised.healthy) == ("xid:79", False)
    assert nvml_xid(e, 45, T0 + 2) == []
    assert nvml_xid(e, 45, T0 + 3) == []
    gpu = e.gpus["GPU-0"]
    assert list(gpu.conditions) == ["xid:79"]
    assert gpu.conditions["xid:79"].evidence == 2
    assert e.snapshot("GPU-0").conditions[0].evidence_count == 2
    # The 79's next summary carries the evidence with its own repeats.
    assert nvml_xid(e, 79, T0 + 4) == []
    [summary] = e.tick(T0 + 61)
    assert (summary.condition, summary.repeat_count, summary.evidence_count) == ("xid:79", 1, 2)
    assert "2 x XID 45 counted as evidence" in summary.message
    assert all(ev.xid != 45 for ev in e.tick(T0 + 200))
    # Long after the 79, while it is active, a 45 still belongs to it.
    assert nvml_xid(e, 45, T0 + 3600) == []
    assert gpu.conditions["xid:79"].evidence == 3


def test_xid_45_alone_is_informational() -> None:
    e = engine()
    [event] = nvml_xid(e, 45, T0 + 1)
    assert (event.xid, event.severity, event.healthy, event.condition) == (45, "info", True, "")
    assert e.gpus["GPU-0"].conditions == {}
    # A 45 on another GPU than the fault's is alone too.
    nvml_xid(e, 48, T0 + 2)
    [other] = nvml_xid(e, 45, T0 + 3, index=1)
    assert (other.gpu_uuid, other.severity) == ("GPU-1", "info")


def test_xid_43_after_another_fault_is_evidence_alone_an_application_xid() -> None:
    e = engine(xid_byproduct_window_s=30)
    [app] = nvml_xid(e, 13, T0)  # an application XID: reported, not a condition
    assert (app.xid, app.condition) == (13, "")
    assert nvml_xid(e, 43, T0 + 1) == []  # after it: evidence for the 13
    [alone] = nvml_xid(e, 43, T0 + 100)  # 99 s later, nothing active: its own report
    assert (alone.xid, alone.severity, alone.healthy) == (43, "warning", True)
    assert "application error" in alone.reason


def test_the_repeat_rule_escalates_a_recurring_warning_but_never_45_or_app_xids() -> None:
    e = engine(dedup_window_s=60, xid_repeat_count=5, xid_repeat_window_s=3600)
    out: list[HealthEvent] = []
    for burst in range(5):
        t = T0 + burst * 300  # separate bursts: outside each other's window
        for code in (92, 45, 13):
            for i in range(50):
                out += nvml_xid(e, code, t + i * 0.01)
        out += e.tick(t + 61)  # each window's summary, and a new window
        out += e.tick(t + 122)  # which ends without repeats: the burst is over
    repeated = [ev for ev in out if ev.condition.startswith("xid_repeated:")]
    assert [(ev.condition, ev.severity, ev.healthy) for ev in repeated] == [
        ("xid_repeated:92", "critical", False)
    ]
    assert sorted(e.gpus["GPU-0"].conditions) == ["xid_repeated:92"]
    # Four bursts are not five: a GPU with four does not escalate.
    other = engine(dedup_window_s=60, xid_repeat_count=5)
    for burst in range(4):
        nvml_xid(other, 92, T0 + burst * 300)
        other.tick(T0 + burst * 300 + 61)
    assert other.gpus["GPU-0"].conditions == {}


def test_distinct_messages_are_windows_of_their_own_up_to_a_bound() -> None:
    e = engine(dedup_window_s=60)
    [first] = e.observe_xid("GPU-0", 95, T0, detail="pid=1, name=a, Ch 00000001")
    assert "Ch 00000001" in first.message
    assert e.observe_xid("GPU-0", 95, T0 + 1, detail="pid=2, name=b, Ch 00000001") == []
    [new] = e.observe_xid("GPU-0", 95, T0 + 2, detail="pid=3, name=c, Ch 00000002")
    assert "Ch 00000002" in new.message
    published = 2
    for i in range(3, 200):
        published += len(e.observe_xid("GPU-0", 95, T0 + 2, detail=f"pid=1, Ch {i:08x}"))
    assert published == MAX_VARIANTS + 1  # the condition's first event, then its variants
    # The condition's end closes every variant; each one's summary comes before it.
    _, cleared = e.clear("0", None, T0 + 3)
    assert cleared[-1].kind == "cleared"
    assert sum(ev.repeat_count for ev in cleared[:-1]) == 200 - published


def test_storm_of_one_xid_is_bounded_and_counted_exactly_and_another_gets_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """10,000 lines a second of XID 95 for 30 s on one GPU (pid changing, message the
    same), an XID 48 in the middle: a few events a second at most, the exact count, and
    the 48 published the moment it comes."""
    caplog.set_level(logging.DEBUG)
    e = engine(dedup_window_s=5)
    rate, seconds = 10_000, 30
    published: list[HealthEvent] = []
    middle: list[HealthEvent] = []
    for n in range(rate * seconds):
        t = T0 + n / rate
        published += e.observe_xid("GPU-0", 95, t, detail=f"pid={n}, name=job{n % 7}, Ch 000a")
        if n == rate * seconds // 2:
            middle = e.observe_xid("GPU-0", 48, t, detail="pid=9, name=x, DBE")
            published += middle
        if n % (rate // 2) == 0:  # the service's housekeeping tick, every 0.5 s
            published += e.tick(t)
    published += e.tick(T0 + seconds + 5)
    assert [(ev.xid, ev.condition) for ev in middle] == [(48, "xid:48")]
    per_second = collections.Counter(int(ev.observed_at - T0) for ev in published)
    assert max(per_second.values()) <= 3, per_second
    assert len(published) <= 2 * seconds
    storm = [ev for ev in published if ev.xid == 95]
    assert sum(ev.repeat_count for ev in storm) == rate * seconds
    assert sum(ev.repeat_count for ev in published if ev.xid == 48) == 1
    assert len(caplog.records) < 10  # the log stays bounded
