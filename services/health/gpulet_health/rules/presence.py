"""Presence rules: the GPU list, lost GPUs, missing GPUs and NVML as a whole.

* **Lost / removed / added**: GPU_IS_LOST, the GpuUnavailable event or a sample that
  says "lost" raise ``lost``; a GPU missing from the GPU list raises ``removed``
  (present=False). A new GPU gives ``gpu_added``.
* **Missing at start**: a GPU the node had before (restored from the KV bucket, or from
  the health service's list of expected GPUs) that the first scan does not find raises
  ``missing`` (``gpu_missing``, critical, present=False): a GPU lost or gone while the
  agent was down is not silently dropped. It ends like ``removed``, when the GPU is
  listed again.
* **Back**: a lost/removed GPU answering again (a sample, a scan) was reset: its gone
  conditions end and a GPU reset is observed.
* **NVML unavailable**: every present GPU gets ``nvml`` (critical) until NVML answers.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpulet_common.messages import GpuInfo
from gpulet_common.nvml.adapter import NvmlEvent
from gpulet_health.dedup import Emit, event_id
from gpulet_health.rules.base import Family
from gpulet_health.state import Condition, GpuState

# Conditions of a GPU that is not there; clearing one of them while the GPU is not
# present forgets the GPU (it was taken out of the node on purpose).
GONE_CONDITIONS = frozenset({"lost", "removed", "missing"})


def _where(gpu: GpuState) -> str:
    return f"GPU {gpu.index}" if gpu.index is not None else "the GPU"


class Presence(Family):
    name = "presence"
    _inventory_seen = False

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
            if first:
                out += self._missing(gpu, now, len(gpus))
            else:
                why = f"{_where(gpu)} is no longer in the node's GPU list (NVML count dropped)"
                out += self._remove(gpu, now, why)
        return out

    def _gone(self, gpu: GpuState, now: float, cond: Condition) -> list[Emit]:
        gpu.present = False
        return self.kit.raise_(gpu, cond, now)

    def _missing(self, gpu: GpuState, now: float, answering: int) -> list[Emit]:
        info = gpu.info
        what = f" ({info.name}, bus {info.pci_bus_id})" if info and info.pci_bus_id else ""
        reason = (
            f"{_where(gpu)}{what} was on this node before but is missing at start: "
            f"{answering} GPU(s) answer NVML (lost, fallen off the bus or removed "
            "while the agent was down)"
        )
        cond = Condition("missing", "gpu_missing", "critical", reason, "operator_check", now)
        return self._gone(gpu, now, cond)

    def _remove(self, gpu: GpuState, now: float, reason: str) -> list[Emit]:
        cond = Condition("removed", "gpu_removed", "critical", reason, "operator_check", now)
        return self._gone(gpu, now, cond)

    def _added(self, gpu: GpuState, now: float, reason: str) -> list[Emit]:
        eid = event_id(self.kit.node, gpu.uuid, "added", now)
        event = self.kit.event(gpu, eid, now, "gpu_added", "info", reason)
        return [Emit("pass", (gpu.uuid, "added"), event)]

    def back(self, gpu: GpuState, now: float, why: str) -> list[Emit]:
        """The GPU answers: end removed/lost; that it came back means it was reset."""
        kit = self.kit
        if gpu.present and not GONE_CONDITIONS.intersection(gpu.conditions):
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
            out += self._added(gpu, now, f"{_where(gpu)} is back")
        kit.rescan_wanted = True
        return out

    def lost(self, gpu: GpuState, now: float, detail: str) -> list[Emit]:
        """The GPU is lost: unhealthy, and out of the usable GPU list (removed)."""
        self.kit.rescan_wanted = True
        reason = f"{_where(gpu)} is lost: {detail}"
        out = self.kit.raise_(
            gpu, Condition("lost", "gpu_lost", "critical", reason, "reboot", now), now
        )
        if gpu.present:
            out += self._remove(
                gpu, now, f"{_where(gpu)} was taken out of the GPU list: it is lost"
            )
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
