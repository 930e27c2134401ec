"""Link error-counter rates: PCIe replays and NVLink CRC, replay and recovery errors.

The counters come with the collector's slow fields (``pcie_replay_count`` and the
NVLink totals over all links, ``nvlink_*_errors``). Their rises are counted in a sliding
window of ``link_errors.window_s``; a rate per minute above its limit
(``link_errors.pcie_replay_per_min``, ``nvlink_crc_per_min``, ``nvlink_replay_per_min``,
``nvlink_recovery_per_min``) raises a warning (``pcie_replay_rate``, kind
``pcie_replay_rate``; ``nvlink_crc_rate``, ``nvlink_replay_rate``,
``nvlink_recovery_rate``, kind ``nvlink_error_rate``), ended once the rate is down to
half its limit (on a sample or the tick). The first reading only takes a baseline (the
counters run since the driver loaded), and a counter that goes back (a GPU reset, or
an operator resetting the NVLink counters) takes a new one: no negative rate, no alarm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gpulet_common.messages import GpuSample, HealthKind
from gpulet_common.settings.health import LinkErrorSettings
from gpulet_health.dedup import Emit
from gpulet_health.rules.base import Family, memo
from gpulet_health.state import Condition, CountWindow, GpuState


@dataclass(frozen=True, slots=True)
class _Counter:
    condition: str
    kind: HealthKind
    what: str
    # The counters (GpuSample fields) whose rises are counted, and the limit.
    read: Callable[[GpuSample], tuple[int | None, ...]]
    limit: Callable[[LinkErrorSettings], float]
    message: str


_NVLINK = "check the NVLink bridges or the NVSwitch baseboard (nvidia-smi nvlink -e)"
COUNTERS: tuple[_Counter, ...] = (
    _Counter(
        "pcie_replay_rate",
        "pcie_replay_rate",
        "PCIe replays",
        lambda s: (s.pcie_replay_count,),
        lambda s: s.pcie_replay_per_min,
        "check the GPU's seating, riser and PCIe link (lspci -vv: link speed and width)",
    ),
    _Counter(
        "nvlink_crc_rate",
        "nvlink_error_rate",
        "NVLink CRC errors",
        lambda s: (s.nvlink_crc_flit_errors, s.nvlink_crc_data_errors),
        lambda s: s.nvlink_crc_per_min,
        _NVLINK,
    ),
    _Counter(
        "nvlink_replay_rate",
        "nvlink_error_rate",
        "NVLink replay errors",
        lambda s: (s.nvlink_replay_errors,),
        lambda s: s.nvlink_replay_per_min,
        _NVLINK,
    ),
    _Counter(
        "nvlink_recovery_rate",
        "nvlink_error_rate",
        "NVLink recovery errors",
        lambda s: (s.nvlink_recovery_errors,),
        lambda s: s.nvlink_recovery_per_min,
        _NVLINK,
    ),
)


@dataclass(slots=True)
class _Links:
    # The last reading of each counter (by condition, then position): the baseline.
    last: dict[tuple[str, int], int] = field(default_factory=dict)
    windows: dict[str, CountWindow] = field(default_factory=dict)


class LinkErrors(Family):
    name = "link_errors"

    def sample(self, gpu: GpuState, sample: GpuSample, now: float) -> list[Emit]:
        m = memo(gpu, self.name, _Links)
        out: list[Emit] = []
        for counter in COUNTERS:
            rose = 0
            for position, value in enumerate(counter.read(sample)):
                if value is None:
                    continue
                before = m.last.get((counter.condition, position))
                m.last[counter.condition, position] = value
                if before is not None and value > before:  # a counter going back: new baseline
                    rose += value - before
            window = m.windows.get(counter.condition)
            if rose:
                window = m.windows.setdefault(counter.condition, CountWindow())
                window.add(now, rose)
            if window or counter.condition in gpu.conditions:
                out += self._rate(gpu, m, counter, now)
        return out

    def tick(self, gpu: GpuState, now: float) -> list[Emit]:
        m = gpu.memo.get(self.name)
        if not isinstance(m, _Links):
            return []
        out: list[Emit] = []
        for counter in COUNTERS:
            if m.windows.get(counter.condition) or counter.condition in gpu.conditions:
                out += self._rate(gpu, m, counter, now)
        return out

    def _rate(self, gpu: GpuState, m: _Links, counter: _Counter, now: float) -> list[Emit]:
        s = self.s.link_errors
        window = m.windows.setdefault(counter.condition, CountWindow())
        count = window.total(now, s.window_s)
        rate, limit = count * 60.0 / s.window_s, counter.limit(s)
        return self.kit.rate(
            gpu,
            now,
            counter.condition,
            rate,
            limit,
            lambda: Condition(
                condition=counter.condition,
                kind=counter.kind,
                severity="warning",
                reason=(
                    f"{count} {counter.what} in the last {s.window_s:g}s: {rate:.3g}/min, "
                    f"above {limit:g}/min"
                ),
                action="operator_check",
                since=now,
                observed_value=rate,
                threshold=limit,
                message=counter.message,
            ),
            lambda: f"{counter.what} down to {rate:.3g}/min (cleared at half of {limit:g}/min)",
        )
