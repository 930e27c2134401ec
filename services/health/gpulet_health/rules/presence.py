"""Presence rules: the GPU list, lost GPUs, missing GPUs and NVML as a whole.

* **Lost / removed / added**: GPU_IS_LOST, the GpuUnavailable event or a sample that
  says "lost" raise ``lost``; a GPU missing from the GPU list raises ``removed``
  (present=False). A new GPU gives ``gpu_added``.
* **Missing at start**: a GPU the node had before (restored from the KV bucket, or from
  the health service's list of expected GPUs) that the first scan does not find raises
  ``missing`` (``gpu_missing``, critical, present=False): a GPU lost or gone while the
  agent was down is not silently dropped. It ends like ``removed``, when the GPU is
  listed again.
* **Back**: a lost/removed GPU listed again by this service's own NVML scan was reset:
  its gone conditions end and a GPU reset is observed. A sample never brings a GPU
  back: the collector may have read it before the loss was seen (its batch was in
  flight), and ordering the two would mean trusting another process's clock. A sample
  of a gone GPU asks for a rescan instead, so recovery still follows within a scan.
* **NVML unavailable**: every present GPU gets ``nvml`` (critical) until NVML answers.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpulet_common.messages import GpuInfo, HealthKind
from gpulet_common.nvml.adapter import NvmlEvent
from gpulet_health.dedup import Emit
from gpulet_health.rules.base import Family, where
from gpulet_health.state import Condition, GpuState

# Conditions of a GPU that is not there; clearing one of them while the GPU is not
# present forgets the GPU (it was taken out of the node on purpose).
GONE_CONDITIONS = frozenset({"lost", "removed", "missing"})


class Presence(Family):
    name = "presence"
    _inventory_seen = False

    event_kinds = frozenset({"gpu_unavailable"})

    def nvml_event(self, gpu: GpuState, event: NvmlEvent, now: float) -> list[Emit]:
        if "gpu_unavailable" not in event.kinds:
            return []
        return self.lost(gpu, now, "NVML GpuUnavailable event")

    def inventory(
        self, gpus: Sequence[GpuInfo], now: float, scanned_at: float | None
    ) -> list[Emit]:
        """See :meth:`RuleEngine.observe_inventory`."""
        kit = self.kit
        first, self._inventory_seen = not self._inventory_seen, True
        started = scanned_at if scanned_at is not None else now
        out: list[Emit] = []
        for info in gpus:
            gpu = kit.gpus.get(info.uuid)
            if gpu is None:
                gpu = GpuState(uuid=info.uuid, index=info.index, info=info, last_answer=started)
                kit.gpus[info.uuid] = gpu
                kit.touch(gpu, now)
                if not first:
                    out += self._added(
                        gpu, now, f"GPU {info.index} ({info.name or 'GPU'}) was added"
                    )
                continue
            gpu.last_answer = max(gpu.last_answer, started)
            if gpu.index != info.index or gpu.info != info:
                gpu.index, gpu.info = info.index, info
                kit.touch(gpu, now)
            if any(c.since > started for n, c in gpu.conditions.items() if n in GONE_CONDITIONS):
                kit.rescan_wanted = True
                continue
            out += self.back(gpu, now, "it is in the node's GPU list again")
        seen = {g.uuid for g in gpus}
        for gpu in kit.gpus.values():
            if gpu.uuid in seen or not gpu.present:
                continue
            if gpu.last_answer > started:
                kit.rescan_wanted = True
                continue
            if not first:
                why = f"{where(gpu)} is no longer in the node's GPU list (NVML count dropped)"
                out += self._gone(gpu, now, "removed", "gpu_removed", why)
                continue
            known = gpu.info
            what = f" ({known.name}, bus {known.pci_bus_id})" if known and known.pci_bus_id else ""
            why = (
                f"{where(gpu)}{what} was on this node before but is missing at start: "
                f"{len(gpus)} GPU(s) answer NVML (lost, fallen off the bus or removed "
                "while the agent was down)"
            )
            out += self._gone(gpu, now, "missing", "gpu_missing", why)
        return out

    def _gone(
        self, gpu: GpuState, now: float, condition: str, kind: HealthKind, reason: str
    ) -> list[Emit]:
        gpu.present = False
        cond = Condition(condition, kind, "critical", reason, "operator_check", now)
        return self.kit.raise_(gpu, cond, now)

    def _added(self, gpu: GpuState, now: float, reason: str) -> list[Emit]:
        eid = self.kit.ids(self.kit.node, gpu.uuid, "added", now)
        event = self.kit.event(gpu, eid, now, "gpu_added", "info", reason)
        return [Emit("pass", (gpu.uuid, "added"), event)]

    @staticmethod
    def gone(gpu: GpuState) -> bool:
        """Not present, or lost/removed/missing."""
        return not gpu.present or bool(GONE_CONDITIONS.intersection(gpu.conditions))

    def back(self, gpu: GpuState, now: float, why: str) -> list[Emit]:
        """The GPU answers our scan: end removed/lost; coming back means it was reset."""
        kit = self.kit
        if not self.gone(gpu):
            return []
        returned = not gpu.present
        gpu.present = True
        kit.touch(gpu, now)
        out = kit.end(gpu, "removed", now, f"the GPU is back: {why}")
        out += kit.end(gpu, "missing", now, f"the GPU is back: {why}")
        out += kit.end(gpu, "lost", now, f"the GPU answers again: {why}")
        out += kit.reset_observed(gpu, now, "the device came back after being lost or removed")
        if returned:
            # Last, so that it carries the GPU's health after the recoveries.
            out += self._added(gpu, now, f"{where(gpu)} is back")
        kit.rescan_wanted = True
        return out

    def lost(self, gpu: GpuState, now: float, detail: str) -> list[Emit]:
        """The GPU is lost: unhealthy, and out of the usable GPU list (removed)."""
        self.kit.rescan_wanted = True
        reason = f"{where(gpu)} is lost: {detail}"
        out = self.kit.raise_(
            gpu, Condition("lost", "gpu_lost", "critical", reason, "reboot", now), now
        )
        if gpu.present:
            why = f"{where(gpu)} was taken out of the GPU list: it is lost"
            out += self._gone(gpu, now, "removed", "gpu_removed", why)
        return out

    def nvml_unavailable(self, reason: str, now: float) -> list[Emit]:
        why = f"NVML is unavailable, the GPU cannot be watched: {reason}"
        out: list[Emit] = []
        for gpu in self.kit.ordered():
            if gpu.present:
                cond = Condition("nvml", "nvml_unavailable", "critical", why, "operator_check", now)
                out += self.kit.raise_(gpu, cond, now)
        return out

    def nvml_available(self, now: float) -> list[Emit]:
        out: list[Emit] = []
        for gpu in self.kit.ordered():
            out += self.kit.end(gpu, "nvml", now, "NVML answers again")
        return out
