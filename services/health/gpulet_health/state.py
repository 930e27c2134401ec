"""Per-GPU health state: the active conditions, and health derived from them.

Design
------
A *condition* is one reason a GPU is not perfectly fine, named by a stable key:
``xid:79``, ``ecc_uncorrectable``, ``ecc_correctable_rate``, ``remap_pending``,
``remap_failure``, ``thermal``, ``thermal_slowdown``, ``thermal_shutdown``, ``lost``,
``removed``, ``missing``, ``nvml``. A condition is raised once (an event), may repeat while active
(de-duplicated), and ends once (a ``recovered`` or ``cleared`` event).

Two families:

* *level* conditions follow an observation that NVML keeps reporting (temperature,
  pending remaps, a lost device): they end by themselves when the observation clears;
* *sticky* conditions come from an edge that leaves no level behind (a fatal XID, an
  uncorrectable ECC error): they end only when the operator clears them or a GPU
  reset is observed.

Health is *derived*, never stored: a GPU is healthy when it is present and none of its
active conditions has severity ``critical`` or ``fatal``. ``warning`` conditions (the
correctable-ECC rate, the NVML slowdown threshold) are reported but leave it healthy.

The snapshot (:meth:`GpuState.snapshot`) is the wire form kept in the ``gpu_health``
KV bucket and returned by state queries; :meth:`GpuState.restore` rebuilds the state
from it when the service restarts, so sticky conditions survive a restart.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from gpulet_common.messages import (
    UNHEALTHY_SEVERITIES,
    Action,
    ActiveCondition,
    GpuHealth,
    GpuInfo,
    HealthKind,
    Severity,
)
from gpulet_health.recovery import known as known_action

# Conditions that only the operator or an observed reset end.
STICKY_KINDS: frozenset[str] = frozenset({"xid", "ecc_uncorrectable"})


@dataclass(slots=True)
class Condition:
    condition: str
    kind: HealthKind
    severity: Severity
    reason: str
    action: Action
    since: float
    sticky: bool = False
    message: str = ""
    observed_value: float | None = None
    threshold: float | None = None
    xid: int | None = None
    # By-product XIDs (45, 43 after it) counted as evidence for this condition.
    evidence: int = 0
    # The node's boot id when it was raised (a hold until a reboot compares it).
    boot_id: str = ""
    # The MIG device (UUID) the condition is confined to; "" the whole GPU.
    mig_device: str = ""
    # A hold until a GPU reset (rules/recovery.py): a reset was seen since it was raised.
    reset_seen: bool = False
    # Read back from the KV bucket at start (raised by a previous run); not on the wire.
    restored: bool = False

    @property
    def unhealthy(self) -> bool:
        return self.severity in UNHEALTHY_SEVERITIES

    def wire(self) -> ActiveCondition:
        return ActiveCondition(**_same_on_wire(self), evidence_count=self.evidence)

    @classmethod
    def from_wire(cls, c: ActiveCondition) -> Condition:
        """The condition ``c`` stands for (a restart rebuilds it from the KV bucket)."""
        xid: int | None = None
        if c.kind == "xid":
            _, _, code = c.condition.partition(":")
            code = code.partition("@")[0]
            xid = int(code) if code.isdigit() else None
        return cls(**_same_on_wire(c), xid=xid, evidence=c.evidence_count, restored=True)


# What a condition keeps under the same name on the wire (ActiveCondition). The
# evidence count is renamed (evidence_count); the observed value and threshold stay on
# the node, and the XID is read back from the condition's name.
WIRE_FIELDS: Final = (
    "condition",
    "kind",
    "severity",
    "reason",
    "message",
    "action",
    "sticky",
    "since",
    "boot_id",
    "mig_device",
    "reset_seen",
)


def _same_on_wire(c: Condition | ActiveCondition) -> dict[str, Any]:
    return {name: getattr(c, name) for name in WIRE_FIELDS}


class CountWindow:
    """Counts in a sliding time window, in one-second buckets with a running total.

    A storm of ECC events (thousands a second) costs O(1) each and at most one bucket
    per second of window in memory.
    """

    __slots__ = ("_buckets", "_total")

    def __init__(self) -> None:
        self._buckets: collections.deque[list[float]] = collections.deque()
        self._total = 0

    def __bool__(self) -> bool:
        return bool(self._buckets)

    def add(self, at: float, count: int) -> None:
        second = float(int(at))
        buckets = self._buckets
        if buckets and buckets[-1][0] >= second:
            buckets[-1][1] += count
        else:
            buckets.append([second, count])
        self._total += count

    def total(self, now: float, window_s: float) -> int:
        """The count of the last ``window_s`` seconds (older buckets are dropped)."""
        buckets = self._buckets
        while buckets and buckets[0][0] + 1.0 <= now - window_s:
            self._total -= int(buckets.popleft()[1])
        return self._total


@dataclass(slots=True)
class GpuState:
    uuid: str
    index: int | None = None
    info: GpuInfo | None = None
    present: bool = True
    conditions: dict[str, Condition] = field(default_factory=dict)
    # Consecutive samples below the clear level, per level condition (thermal).
    below: dict[str, int] = field(default_factory=dict)
    # Each rule family's memory of this GPU (counter baselines, rate windows), by family.
    memo: dict[str, object] = field(default_factory=dict)
    updated_at: float = 0.0
    # When the GPU last answered (a good sample, a scan that found it): a scan that
    # began before that cannot say it is gone.
    last_answer: float = 0.0
    # The driver's recovery action last read (gpulet_health.recovery): "" never read,
    # "unsupported" on drivers without it, else its name ("none", "gpu_reset", ...).
    recovery: str = ""

    @property
    def healthy(self) -> bool:
        return self.present and not any(
            c.unhealthy and not c.mig_device for c in self.conditions.values()
        )

    @property
    def unhealthy_migs(self) -> list[str]:
        """MIG devices an unhealthy condition confined to them marks, sorted."""
        return sorted({c.mig_device for c in self.conditions.values() if c.unhealthy} - {""})

    def snapshot(self) -> GpuHealth:
        info = self.info
        if info is not None and info.topology:
            # Identity, not topology: the inventory has that, and KV values stay small.
            info = msgspec.structs.replace(info, topology=[])
        return GpuHealth(
            gpu_uuid=self.uuid,
            gpu_index=self.index,
            healthy=self.healthy,
            present=self.present,
            conditions=[
                c.wire()
                for c in sorted(self.conditions.values(), key=lambda c: (c.since, c.condition))
            ],
            updated_at=self.updated_at,
            info=info,
            unhealthy_mig_devices=self.unhealthy_migs,
            recovery_action=self.recovery,
        )

    @classmethod
    def restore(cls, health: GpuHealth) -> GpuState:
        # An identity that names another GPU is not this GPU's: left out.
        info = (
            health.info if health.info is not None and health.info.uuid == health.gpu_uuid else None
        )
        state = cls(uuid=health.gpu_uuid, index=health.gpu_index, present=health.present, info=info)
        for c in health.conditions:
            state.conditions[c.condition] = Condition.from_wire(c)
        state.updated_at = health.updated_at
        state.recovery = known_action(health.recovery_action)
        return state
