"""Clock-event rules: the hardware holding the clocks down for other than heat.

HW slowdown or power brake (NVML clock-event reasons, named by the NVML adapter) raise
the warning ``clock_slowdown`` while NVML reports them; it clears after
``thermal.recover_samples`` samples without. The SW power cap is no fault (a GPU under
full load sits at its power limit with that bit set), and the thermal reasons are the
thermal rules'.
"""

from __future__ import annotations

from typing import Final

from gpulet_common.messages import GpuSample
from gpulet_common.nvml.adapter import CLOCK_EVENTS_HW_SLOWDOWN, clock_event_names
from gpulet_health.dedup import Emit
from gpulet_health.rules.base import Family
from gpulet_health.state import Condition, GpuState

SLOWDOWN: Final = "clock_slowdown"


class Clocks(Family):
    name = "clocks"

    def sample(self, gpu: GpuState, sample: GpuSample, now: float) -> list[Emit]:
        reasons = sample.throttle_reasons
        if reasons is None:
            return []
        names = clock_event_names(reasons, CLOCK_EVENTS_HW_SLOWDOWN)
        if SLOWDOWN not in gpu.conditions:
            if not names:
                return []
            cond = Condition(
                condition=SLOWDOWN,
                kind=SLOWDOWN,
                severity="warning",
                reason=f"the GPU reports {names}: the hardware holds its clocks down",
                action="operator_check",
                since=now,
                observed_value=float(reasons),
                message=(
                    "check the power supply and the node's power-brake signal (HW "
                    "slowdown is also asserted by thermal protection)"
                ),
            )
            return self.kit.raise_(gpu, cond, now)
        if self.kit.settled(gpu, SLOWDOWN, not names) < self.s.thermal.recover_samples:
            return []
        return self.kit.end(gpu, SLOWDOWN, now, "NVML no longer reports a HW slowdown")
