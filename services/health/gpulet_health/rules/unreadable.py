"""GPUs that NVML counts but that cannot be read: none of them is invisible.

Why
---
Real NVML keeps a GPU that fell into GPU_IS_LOST in ``nvmlDeviceGetCount``; its handle,
or every call on it, fails. A scan lists only the GPUs that answer, so a GPU already
lost when the agent starts would drop out of every view, unless the node remembered it
(:mod:`gpulet_health.known`, the KV bucket: ``missing`` in :mod:`.presence`). This
module compares the scan with *what NVML counts* too, so that a node whose memory is
empty (a first start, a new state dir and no JetStream) still says that it has a GPU
fewer than NVML counts, and which one.

Rules
-----
* A GPU that NVML counts and that does not answer (:class:`UnreadableGpu`, by index,
  with whatever identity the adapter could still read) is matched with the GPUs the
  node had before and that the scan did not find: by UUID, then by PCI bus id, then by
  NVML index. A match is already raised as ``missing`` (or ``lost``) by
  :mod:`.presence`, under its UUID from before.
* One without a match is raised here: ``missing`` (``gpu_missing``, critical,
  present=False), under its own UUID when it could be read, else under a placeholder
  named after its index (:func:`placeholder`), with its PCI bus id and name when
  known. It shows in the KV state, and so in the Device CR and the node condition.
* A placeholder whose index answers again (or that NVML no longer counts) ends, and is
  forgotten: the GPU is listed under its real UUID from then on. Placeholders are not
  remembered as expected GPUs (:meth:`RuleEngine.expected`): they name an index, not
  a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from gpulet_common.messages import GpuInfo, UnreadableGpu
from gpulet_health.dedup import Emit
from gpulet_health.rules.base import Kit
from gpulet_health.state import Condition, GpuState

PLACEHOLDER_PREFIX: Final = "unidentified-gpu-"


def placeholder(index: int) -> str:
    """The key of a GPU whose UUID cannot be read: named after its NVML index."""
    return f"{PLACEHOLDER_PREFIX}{index}"


def is_placeholder(uuid: str) -> bool:
    return uuid.startswith(PLACEHOLDER_PREFIX)


def _bus(bus_id: str | None) -> str:
    """A PCI bus id in one form for comparison (NVML's 8-digit domain or sysfs' 4)."""
    if not bus_id:
        return ""
    domain, sep, rest = bus_id.strip().upper().partition(":")
    if not sep or rest.count(":") != 1:
        return bus_id.strip().upper()
    try:
        return f"{int(domain, 16):08X}:{rest}"
    except ValueError:
        return bus_id.strip().upper()


class Unreadable:
    """Raises the GPUs NVML counts that neither answer nor are known from before."""

    def __init__(self, kit: Kit) -> None:
        self.kit = kit

    def observe(
        self, unreadable: Sequence[UnreadableGpu], count: int, found: Sequence[GpuInfo], now: float
    ) -> list[Emit]:
        kit = self.kit
        listed = {g.uuid for g in found}
        before = [
            g for g in kit.gpus.values() if g.uuid not in listed and not is_placeholder(g.uuid)
        ]
        out: list[Emit] = []
        raised: set[str] = set()
        for gpu in unreadable:
            if self._known(gpu, before):
                continue
            key = gpu.uuid or placeholder(gpu.index)
            raised.add(key)
            out += self._raise(key, gpu, count, len(found), now)
        for state in [g for g in kit.gpus.values() if is_placeholder(g.uuid)]:
            if state.uuid not in raised:
                out += self._forget(state, now)
        return out

    @staticmethod
    def _known(gpu: UnreadableGpu, before: list[GpuState]) -> bool:
        """Whether a GPU the node had before is this one (then presence raises it)."""
        if gpu.uuid is not None:
            return any(g.uuid == gpu.uuid for g in before)
        bus = _bus(gpu.pci_bus_id)
        if bus:
            return any(g.info is not None and _bus(g.info.pci_bus_id) == bus for g in before)
        return any(g.index == gpu.index for g in before)

    def _raise(
        self, key: str, gpu: UnreadableGpu, count: int, answering: int, now: float
    ) -> list[Emit]:
        kit = self.kit
        info = GpuInfo(
            uuid=key, index=gpu.index, name=gpu.name or "", pci_bus_id=gpu.pci_bus_id or ""
        )
        state = kit.gpus.get(key)
        if state is None:
            state = GpuState(uuid=key, index=gpu.index, info=info, present=False)
            kit.gpus[key] = state
            kit.touch(state, now)
        elif state.present or state.index != gpu.index or state.info != info:
            state.present, state.index, state.info = False, gpu.index, info
            kit.touch(state, now)
        bus = f", bus {gpu.pci_bus_id}" if gpu.pci_bus_id else ""
        who = f"UUID {gpu.uuid}" if gpu.uuid else "its UUID cannot be read"
        why = "lost (GPU_IS_LOST)" if gpu.lost else f"failing ({gpu.reason})"
        reason = (
            f"GPU {gpu.index}{bus} is counted by NVML but does not answer: {why}; {who}. "
            f"NVML counts {count} GPU(s), {answering} answer"
        )
        cond = Condition("missing", "gpu_missing", "critical", reason, "reboot", now)
        return kit.raise_(state, cond, now)

    def _forget(self, state: GpuState, now: float) -> list[Emit]:
        kit = self.kit
        why = f"GPU {state.index} answers NVML again (or is no longer counted)"
        state.present = True  # the index answers: its events read healthy
        out: list[Emit] = []
        for name in list(state.conditions):
            out += kit.end(state, name, now, why)
        del kit.gpus[state.uuid]
        kit.dirty.add(state.uuid)  # its stored state goes too
        return out
