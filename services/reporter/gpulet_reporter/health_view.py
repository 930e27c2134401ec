"""Per-GPU Device conditions, rendered from the health service's state.

The reporter reads each GPU's :class:`~gpulet_common.messages.GpuHealth` from the
:class:`~gpulet_common.nodeview.NodeView` (the health service's ``gpu_health`` KV
state, ordered by KV revision); it folds no events. This module turns that state into
the condition the Device carries, with rules chosen so that the Device changes only
when the scheduler or an operator should care:

* The status is the health service's verdict: ``healthy and present``.
* An unhealthy GPU's condition text is that of its worst active condition (highest
  severity; the oldest among equals: usually the root cause), the reason derived from
  the XID or the kind (``Xid79``, ``EccUncorrectable``, ``GpuLost``), the message the
  health service's human text; a GPU that is only not present reads
  ``GpuNotPresent``. A reporter that restarts renders exactly what its predecessor
  wrote from the same state: no write.
* A healthy GPU reads ``Healthy``, a placeholder that leaves the Device's own wording
  alone (``from_event`` False); when this reporter saw it recover, ``Recovered`` is
  shown until the next change.
* A GPU remediation by reset holds out of service (the node view's overlay) shows
  that hold instead: ``RemediationQuarantined``, ``RemediationNeedsReboot``,
  ``RemediationRetired`` with its message ("RMA candidate: ..." and the history's
  counts).
* A warning that leaves the GPU healthy (thermal slowdown, a corrected-ECC rate)
  changes nothing on the Device: it is the alerting system's business, and a flapping
  warning must not become a stream of writes.
* ``since`` -- the future ``lastTransitionTime`` -- moves only when the status flips
  (to the state's ``updated_at``; on first sight of an unhealthy GPU, its oldest
  unhealthy condition's ``since``). It is displayed, never used to order anything.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from gpulet_common.messages import SEVERITY_RANK, UNHEALTHY_SEVERITIES, ActiveCondition, GpuHealth
from gpulet_reporter.desired import GpuCondition, condition_reason

_XID_CONDITION = re.compile(r"^xid:(\d+)$")
REMEDIATION = "remediation"


def reason_for(*, xid: int | None, condition: str, kind: str, text: str, healthy: bool) -> str:
    """A stable, CRD-valid reason: ``Xid79``, ``EccUncorrectable``, ``Thermal``..."""
    if xid is not None:
        return f"Xid{xid}"
    match = _XID_CONDITION.fullmatch(condition)
    if match:
        return f"Xid{match.group(1)}"
    for source in (kind, condition):
        words = re.findall(r"[A-Za-z0-9]+", source)
        camel = "".join(w[:1].upper() + w[1:] for w in words)
        if camel and camel[0].isalpha():
            return condition_reason(camel, healthy=healthy)
    return condition_reason(text, healthy=healthy)


@dataclass(slots=True)
class _GpuView:
    healthy: bool
    since: float
    # True once this view saw the GPU go from unhealthy to healthy.
    recovered: bool = False


class HealthView:
    def __init__(self) -> None:
        self._gpus: dict[str, _GpuView] = {}
        self._conditions: dict[str, GpuCondition] = {}

    def snapshot(self) -> Mapping[str, GpuCondition]:
        return dict(self._conditions)

    def get(self, uuid: str) -> GpuCondition | None:
        return self._conditions.get(uuid)

    def apply(self, uuid: str, health: GpuHealth | None) -> bool:
        """Take one GPU's current state (None: no state any more); returns whether
        its condition changed."""
        if health is None:
            self._gpus.pop(uuid, None)
            return self._conditions.pop(uuid, None) is not None
        healthy = health.healthy and health.present
        gpu = self._gpus.get(uuid)
        if gpu is None:
            unhealthy_since = [c.since for c in _unhealthy(health.conditions) if c.since]
            since = min(unhealthy_since) if not healthy and unhealthy_since else health.updated_at
            gpu = self._gpus[uuid] = _GpuView(healthy=healthy, since=since)
        elif gpu.healthy != healthy:
            gpu.healthy, gpu.since, gpu.recovered = healthy, health.updated_at, healthy
        condition = _condition(gpu, health)
        if self._conditions.get(uuid) == condition:
            return False
        self._conditions[uuid] = condition
        return True


def _unhealthy(conditions: list[ActiveCondition]) -> list[ActiveCondition]:
    # A condition confined to one MIG device is not the GPU's (health per MIG device).
    return [c for c in conditions if c.severity in UNHEALTHY_SEVERITIES and not c.mig_device]


def _condition(gpu: _GpuView, health: GpuHealth) -> GpuCondition:
    migs = tuple(health.unhealthy_mig_devices)
    if gpu.healthy:
        if gpu.recovered:
            return GpuCondition(
                healthy=True, reason="Recovered", since=gpu.since, unhealthy_mig=migs
            )
        # "Healthy" is a placeholder: while the status agrees, the Device's own wording
        # (say, an earlier "Recovered") stands (from_event False).
        return GpuCondition(
            healthy=True, reason="Healthy", since=gpu.since, from_event=False, unhealthy_mig=migs
        )
    candidates = _unhealthy(health.conditions)
    # Remediation's hold (quarantined, needs a reboot, retired: an RMA candidate) says
    # what is being done about the fault, so it is what the Device shows.
    held = [c for c in candidates if c.kind == REMEDIATION]
    if candidates:
        worst = (
            held[0]
            if held
            else min(candidates, key=lambda c: (-SEVERITY_RANK[c.severity], c.since, c.condition))
        )
        reason = reason_for(
            xid=None,
            condition=worst.condition,
            kind=worst.condition if held else worst.kind,
            text=worst.reason,
            healthy=False,
        )
        message = worst.message or worst.reason
    elif not health.present:
        reason, message = "GpuNotPresent", ""
    else:
        reason, message = "Unhealthy", ""
    return GpuCondition(
        healthy=False, reason=reason, message=message, since=gpu.since, unhealthy_mig=migs
    )
