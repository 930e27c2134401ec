"""ECC rules: uncorrectable errors, the correctable-error rate, and resets seen in counters.

* **Uncorrectable**: a double-bit event, or a rise of the volatile uncorrected counter
  not already announced by an event, raises the sticky ``ecc_uncorrectable`` (fatal,
  reset the GPU).
* **Correctable rate**: single-bit errors (events, and counter deltas not already
  counted from events) in a sliding window of ``ecc.sbe_window_s``; above
  ``ecc.sbe_rate_per_hour`` a warning ``ecc_correctable_rate``, cleared when the rate
  falls to half of it (on a sample or the tick).
* **Reset observed**: volatile counters going back mean the GPU was reset: every
  sticky condition ends and the counters take a new baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from gpulet_common.messages import GpuSample
from gpulet_common.nvml.adapter import NvmlEvent
from gpulet_health.dedup import Emit
from gpulet_health.rules.base import Family, memo
from gpulet_health.state import Condition, CountWindow, GpuState

RATE: Final = "ecc_correctable_rate"
UNCORRECTABLE: Final = "ecc_uncorrectable"


@dataclass(slots=True)
class _Ecc:
    # The last volatile counter readings: the baseline for deltas.
    corrected: int | None = None
    uncorrected: int | None = None
    # Errors already counted from NVML events and not yet seen in a counter delta, so
    # that an error reported by both an event and the next sample counts once.
    sbe_credit: int = 0
    dbe_credit: int = 0
    # Correctable errors in the rate window.
    window: CountWindow = field(default_factory=CountWindow)


class Ecc(Family):
    name = "ecc"

    def reset(self, gpu: GpuState) -> None:
        m = memo(gpu, self.name, _Ecc)
        m.corrected = m.uncorrected = None
        m.sbe_credit = m.dbe_credit = 0

    event_kinds = frozenset({"double_bit_ecc", "single_bit_ecc"})

    def nvml_event(self, gpu: GpuState, event: NvmlEvent, now: float) -> list[Emit]:
        m = memo(gpu, self.name, _Ecc)
        out: list[Emit] = []
        if "double_bit_ecc" in event.kinds:
            m.dbe_credit += 1
            out += self._uncorrectable(gpu, now, "NVML double-bit ECC event", None)
        if "single_bit_ecc" in event.kinds:
            m.sbe_credit += 1
            m.window.add(now, 1)
            out += self._rate(gpu, m, now)
        return out

    def sample(self, gpu: GpuState, sample: GpuSample, now: float) -> list[Emit]:
        m = memo(gpu, self.name, _Ecc)
        vc, vu = sample.ecc_volatile_corrected, sample.ecc_volatile_uncorrected
        went_back = [
            f"{name} {old} -> {new}"
            for name, old, new in (
                ("corrected", m.corrected, vc),
                ("uncorrected", m.uncorrected, vu),
            )
            if old is not None and new is not None and new < old
        ]
        out: list[Emit] = []
        if went_back:
            why = "volatile ECC counters went back: " + ", ".join(went_back)
            out += self.kit.reset_observed(gpu, now, why)
        else:
            if vu is not None and m.uncorrected is not None and vu > m.uncorrected:
                if m.dbe_credit:  # already raised from the NVML event: the counter confirms it
                    m.dbe_credit = 0
                else:
                    how = f"volatile uncorrected ECC counter rose by {vu - m.uncorrected} to {vu}"
                    out += self._uncorrectable(gpu, now, how, float(vu))
            if vc is not None and m.corrected is not None and vc > m.corrected:
                new = max(0, vc - m.corrected - m.sbe_credit)
                m.sbe_credit = 0
                if new:
                    m.window.add(now, new)
        if vc is not None:
            m.corrected = vc
        if vu is not None:
            m.uncorrected = vu
        if vc is not None or m.window or RATE in gpu.conditions:
            out += self._rate(gpu, m, now)
        return out

    def tick(self, gpu: GpuState, now: float) -> list[Emit]:
        m = memo(gpu, self.name, _Ecc)
        return self._rate(gpu, m, now) if m.window or RATE in gpu.conditions else []

    def _uncorrectable(
        self, gpu: GpuState, now: float, how: str, count: float | None
    ) -> list[Emit]:
        reason = f"uncorrectable (double-bit) ECC error: {how}"
        cond = Condition(
            UNCORRECTABLE, UNCORRECTABLE, "fatal", reason, "reset_gpu", now, sticky=True
        )
        cond.observed_value = count
        return self.kit.raise_(gpu, cond, now, repeats=True)

    def _rate(self, gpu: GpuState, m: _Ecc, now: float) -> list[Emit]:
        window_s, per_hour = self.s.ecc.sbe_window_s, self.s.ecc.sbe_rate_per_hour
        count = m.window.total(now, window_s)
        rate = count * 3600.0 / window_s
        return self.kit.rate(
            gpu,
            now,
            RATE,
            rate,
            per_hour,
            lambda: Condition(
                condition=RATE,
                kind=RATE,
                severity="warning",
                reason=(
                    f"{count} correctable (single-bit) ECC errors in the last {window_s:g}s: "
                    f"{rate:.0f}/h, above {per_hour:g}/h"
                ),
                action="operator_check",
                since=now,
                observed_value=rate,
                threshold=per_hour,
            ),
            lambda: (
                f"correctable ECC rate down to {rate:.0f}/h (cleared at half of {per_hour:g}/h)"
            ),
        )
