"""Thermal rules: the configured limit, and the GPU's own slowdown and shutdown thresholds.

Above ``thermal.threshold_c`` the GPU is unhealthy (``thermal``). At the GPU's NVML
slowdown threshold, or while NVML reports a thermal clock-event reason, a warning
(``thermal_slowdown``; the reason says which); at its shutdown threshold unhealthy
(``thermal_shutdown``). Each clears only after ``thermal.recover_samples`` consecutive
samples below its threshold minus ``thermal.hysteresis_c`` (and without the thermal
clock-event reason), so a temperature oscillating around a threshold gives one raise,
not a stream of raise/recover pairs.
"""

from __future__ import annotations

from gpulet_common.messages import GpuSample, HealthKind, Severity
from gpulet_common.nvml.adapter import CLOCK_EVENTS_THERMAL, clock_event_names
from gpulet_health.dedup import Emit
from gpulet_health.rules.base import Family
from gpulet_health.state import Condition, GpuState


class Thermal(Family):
    name = "thermal"

    def sample(self, gpu: GpuState, sample: GpuSample, now: float) -> list[Emit]:
        temp = sample.temperature_c
        if temp is None:
            return []
        t = self.s.thermal
        limit = t.threshold_c
        out = self._level(
            gpu,
            now,
            temp,
            "thermal",
            "critical",
            limit,
            temp > limit,
            f"GPU temperature {temp} C is above the limit of {limit:g} C",
        )
        if not t.use_nvml_thresholds:
            return out
        info = gpu.info
        slowdown = info.temp_slowdown_c if info is not None else None
        names = clock_event_names(sample.throttle_reasons or 0, CLOCK_EVENTS_THERMAL)
        if slowdown is not None or names or "thermal_slowdown" in gpu.conditions:
            if names:
                # Raised by the GPU's own clock-event bit: say so, and give the
                # temperature and threshold as facts beside it, not as the cause.
                reason = (
                    f"the GPU reports thermal slowdown (clock-event reason {names}); "
                    f"temperature {temp} C"
                )
                if slowdown is not None:
                    reason += f", slowdown threshold {slowdown} C"
            elif slowdown is not None:
                reason = (
                    f"GPU temperature {temp} C reached the NVML slowdown threshold of {slowdown} C"
                )
            else:
                reason = f"GPU temperature {temp} C"
            hot = bool(names) or (slowdown is not None and temp >= slowdown)
            out += self._level(
                gpu,
                now,
                temp,
                "thermal_slowdown",
                "warning",
                slowdown,
                hot,
                reason,
                blocked=bool(names),
            )
        shutdown = info.temp_shutdown_c if info is not None else None
        if shutdown is not None:
            out += self._level(
                gpu,
                now,
                temp,
                "thermal_shutdown",
                "critical",
                shutdown,
                temp >= shutdown,
                f"GPU temperature {temp} C reached the NVML shutdown threshold of {shutdown} C",
            )
        return out

    def _level(
        self,
        gpu: GpuState,
        now: float,
        temp: float,
        kind: HealthKind,
        severity: Severity,
        threshold: float | None,
        hot: bool,
        reason: str,
        *,
        blocked: bool = False,
    ) -> list[Emit]:
        """A thermal condition (named as its kind) with hysteresis and N samples to clear."""
        t = self.s.thermal
        if kind not in gpu.conditions:
            if not hot:
                return []
            cond = Condition(
                condition=kind,
                kind=kind,
                severity=severity,
                reason=reason,
                action="operator_check",
                since=now,
                observed_value=float(temp),
                threshold=threshold,
                message="check cooling: fans, airflow, inlet temperature, heatsink",
            )
            return self.kit.raise_(gpu, cond, now)
        clear_below = threshold - t.hysteresis_c if threshold is not None else None
        cool = not blocked and (clear_below is None or temp < clear_below)
        count = self.kit.settled(gpu, kind, cool)
        if count < t.recover_samples:
            return []
        below = f"below {clear_below:g} C " if clear_below is not None else ""
        why = f"GPU temperature {temp} C, {below}for {count} consecutive samples"
        return self.kit.end(gpu, kind, now, why, value=float(temp))
