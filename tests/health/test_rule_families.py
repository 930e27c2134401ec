"""The rule engine's family interface: one module and one line add a family; the
de-duplication stage folds what families emit; the rules read no NVML bits."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

import gpulet_health.rules as rules
from gpulet_common.messages import SEVERITY_RANK, UNHEALTHY_SEVERITIES, GpuInfo, GpuSample
from gpulet_common.nvml.adapter import EVENT_DOUBLE_BIT_ECC, EVENT_XID, NvmlEvent
from gpulet_common.settings.health import HealthSettings
from gpulet_health.dedup import Emit
from gpulet_health.rules.base import Family, memo
from gpulet_health.state import Condition, GpuState

T0 = 1_700_000_000.0
RULES_DIR = Path(rules.__file__).parent


class _Seen:
    def __init__(self) -> None:
        self.samples = 0


class Probe(Family):
    """A family that raises a repeating warning on every sample above 50 C."""

    name = "probe"
    resets = 0

    def sample(self, gpu: GpuState, sample: GpuSample, now: float) -> list[Emit]:
        memo(gpu, self.name, _Seen).samples += 1
        if (sample.temperature_c or 0) <= 50:
            return self.kit.end(gpu, "probe", now, "cool again")
        cond = Condition("probe", "thermal", "warning", "hot probe", "none", now)
        return self.kit.raise_(gpu, cond, now, repeats=True)

    def reset(self, gpu: GpuState) -> None:
        Probe.resets += 1


def test_a_family_is_one_class_and_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules, "FAMILIES", (*rules.FAMILIES, Probe))
    engine = rules.RuleEngine("n1", HealthSettings(dedup_window_s=10))
    engine.observe_inventory([GpuInfo(uuid="GPU-0", index=0)], T0)

    def hot(t: float, temp: int = 60, ecc: int | None = None) -> GpuSample:
        return GpuSample(
            uuid="GPU-0", index=0, timestamp=t, temperature_c=temp, ecc_volatile_corrected=ecc
        )

    [raised] = engine.observe_sample(hot(T0))
    assert (raised.condition, raised.kind, raised.healthy) == ("probe", "thermal", True)
    # Repeats are occurrences the de-duplication stage folds into one summary.
    for i in range(1, 6):
        assert engine.observe_sample(hot(T0 + i)) == []
    [summary] = engine.tick(T0 + 10)
    assert (summary.condition, summary.repeat_count) == ("probe", 5)
    assert memo(engine.gpus["GPU-0"], "probe", _Seen).samples == 6
    # A reset observed (volatile ECC counters going back) reaches every family.
    Probe.resets = 0
    engine.observe_sample(hot(T0 + 11, ecc=5))
    assert engine.observe_sample(hot(T0 + 12, ecc=1)) == []  # nothing sticky to end
    assert Probe.resets == 1
    # The end publishes the pending summary first, then itself.
    out = engine.observe_sample(hot(T0 + 13, temp=40))
    assert [(e.kind, e.condition, e.repeat_count) for e in out] == [
        ("thermal", "probe", 2),
        ("recovered", "probe", 1),
    ]


def test_nvml_events_are_read_by_name() -> None:
    event = NvmlEvent(gpu_index=0, gpu_uuid="G", event_type=EVENT_XID, event_data=79, timestamp=T0)
    assert event.kinds == {"xid"}
    both = NvmlEvent(
        gpu_index=0,
        gpu_uuid="G",
        event_type=EVENT_XID | EVENT_DOUBLE_BIT_ECC,
        event_data=0,
        timestamp=T0,
    )
    assert both.kinds == {"xid", "double_bit_ecc"}
    assert (
        NvmlEvent(gpu_index=0, gpu_uuid="G", event_type=1 << 30, event_data=0, timestamp=T0).kinds
        == set()
    )


@pytest.mark.parametrize("path", sorted(RULES_DIR.glob("*.py")), ids=lambda p: p.name)
def test_rules_read_no_nvml_bits(path: Path) -> None:
    source = path.read_text()
    imported = [
        alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    ]
    assert not [name for name in imported if name.startswith("EVENT_")]
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    assert not [
        t.string for t in tokens if t.type == tokenize.NUMBER and t.string.lower().startswith("0x")
    ]


def test_one_severity_ranking() -> None:
    assert sorted(SEVERITY_RANK, key=SEVERITY_RANK.__getitem__) == [
        "info",
        "warning",
        "critical",
        "fatal",
    ]
    assert {"critical", "fatal"} == UNHEALTHY_SEVERITIES
