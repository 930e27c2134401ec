"""XID rules: an XID (an NVML event, or a kernel-log line) classified by the catalogue.

Application XIDs and info/warning XIDs are reported only (a one-off event); critical
and fatal ones raise the sticky ``xid:<code>``, whose repeats are occurrences.
"""

from __future__ import annotations

from gpulet_common.nvml.adapter import NvmlEvent
from gpulet_health.dedup import Emit
from gpulet_health.rules.base import Family
from gpulet_health.state import Condition, GpuState


class Xid(Family):
    name = "xid"

    def nvml_event(self, gpu: GpuState, event: NvmlEvent, now: float) -> list[Emit]:
        return self.observe(gpu, event.event_data, now) if "xid" in event.kinds else []

    def observe(self, gpu: GpuState, code: int, now: float, seen_in: str = "") -> list[Emit]:
        """An XID on a GPU; ``seen_in`` says where, when not from an NVML event."""
        verdict = self.kit.catalogue.lookup(code)
        info = verdict.info
        where = f"; {seen_in}" if seen_in else ""
        if not verdict.unhealthy:
            why = "an application error" if verdict.application else info.severity
            return self.kit.report(
                gpu,
                f"xid:{code}",
                now,
                "xid",
                info.severity,
                f"XID {code}: {info.description} ({why}: the GPU stays healthy){where}",
                action=info.action,
                value=float(code),
                xid=code,
            )
        return self.kit.raise_(
            gpu,
            Condition(
                condition=f"xid:{code}",
                kind="xid",
                severity=info.severity,
                reason=f"XID {code}: {info.description}{where}",
                action=info.action,
                since=now,
                sticky=True,
                observed_value=float(code),
                xid=code,
                message=f"classified by {info.source}",
            ),
            now,
            repeats=True,
        )
