"""Row-remapping rules (and page retirement, its predecessor on GPUs before Ampere).

A remap pending (or retired pages pending) raises ``remap_pending`` (critical, reset the
GPU); when NVML no longer reports it, the reset applied it, so a GPU reset is observed
too. A failed remap raises ``remap_failure`` (fatal, hardware inspection). Both follow
NVML's flags; NVML does not say how many rows are pending, so the reason gives no such
count (only the rows remapped so far, named as that).
"""

from __future__ import annotations

from gpulet_common.messages import GpuSample
from gpulet_health.dedup import Emit
from gpulet_health.rules.base import Family
from gpulet_health.state import Condition, GpuState


class Remap(Family):
    name = "remap"

    def sample(self, gpu: GpuState, sample: GpuSample, now: float) -> list[Emit]:
        kit, out = self.kit, list[Emit]()
        flags = (sample.remapped_rows_pending, sample.retired_pages_pending)
        pending, active = any(flags), "remap_pending" in gpu.conditions
        if pending and not active:
            unc, corr = sample.remapped_rows_uncorrectable, sample.remapped_rows_correctable
            if not sample.remapped_rows_pending:
                what = "NVML reports a page retirement pending"
            elif unc is not None and corr is not None:
                what = (
                    "NVML reports a row remap pending (rows remapped so far: "
                    f"{unc} for uncorrectable errors, {corr} for correctable ones)"
                )
            else:
                what = "NVML reports a row remap pending"
            cond = Condition(
                condition="remap_pending",
                kind="remap_pending",
                severity="critical",
                reason=f"{what}: the GPU must be reset to apply it",
                action="reset_gpu",
                since=now,
                observed_value=float(unc) if unc is not None else None,
            )
            out += kit.raise_(gpu, cond, now)
        elif active and not pending and any(f is not None for f in flags):
            out += kit.end(
                gpu, "remap_pending", now, "no remap pending any more: the GPU was reset"
            )
            out += kit.reset_observed(gpu, now, "pending row remaps were applied")
        failed, active = sample.remapped_rows_failed, "remap_failure" in gpu.conditions
        if failed and not active:
            cond = Condition(
                condition="remap_failure",
                kind="remap_failure",
                severity="fatal",
                reason="row remapping failed: the GPU memory cannot be repaired in the field",
                action="hardware_inspection",
                since=now,
            )
            out += kit.raise_(gpu, cond, now)
        elif active and failed is not None and not failed:
            out += kit.end(gpu, "remap_failure", now, "NVML no longer reports a remap failure")
        return out
