"""Per-GPU health as the reporter sees it, folded from health events and snapshots.

Two sources feed it: ``HealthEvent``s as they happen on ``gpu.health.<node>``, and a
``HealthState`` snapshot answered by the health service (asked at start, and again
at each reconcile, so a missed event is corrected within one reconcile interval).

The view mirrors the health service's model: per GPU a status and a set of active
conditions (``xid:79``, ``thermal``...). An event raises or ends one condition; a
snapshot replaces the set. Rules, each chosen so that the Device changes only when
the scheduler or an operator should care:

* The status is the health service's verdict, ``HealthEvent.healthy`` (the GPU's
  overall health after the event) or ``GpuHealth.healthy and present``.
* An unhealthy GPU's condition text is that of its worst active condition (highest
  severity; the oldest among equals: usually the root cause), the reason derived from
  the XID or the kind (``Xid79``, ``EccUncorrectable``, ``GpuLost``), the message the
  health service's human text. Because events and snapshots describe the same conditions, both paths
  produce the same text, so a reporter that restarts and learns the state from a
  snapshot renders exactly what its predecessor wrote: no write.
* A healthy GPU reads ``Healthy``; when it got there through a recovery event, the
  recovery's text (``Recovered``, ``Cleared``) is shown until the next change.
* A warning that leaves the GPU healthy (thermal slowdown, a corrected-ECC rate)
  changes nothing on the Device: it is the alerting system's business, and a flapping
  warning must not become a stream of writes.
* ``since`` -- the future ``lastTransitionTime`` -- moves only when the status flips.
* An event older than the newest information applied for its GPU is ignored
  (out-of-order delivery after a reconnect).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpulet_common.messages import GpuHealth, HealthEvent, HealthState
from gpulet_reporter.desired import GpuCondition, condition_reason

# More GPUs than any node has: a bound on what unknown GPU ids can make us hold.
MAX_GPUS = 256
_RECOVERY_KINDS = frozenset({"recovered", "cleared"})
_UNHEALTHY_SEVERITIES = frozenset({"critical", "fatal"})
_SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2, "fatal": 3}
_XID_CONDITION = re.compile(r"^xid:(\d+)$")


def reason_for(*, xid: int | None, condition: str, kind: str, text: str, healthy: bool) -> str:
    """A stable, CRD-valid reason: ``Xid79``, ``EccUncorrectable``, ``Thermal``..."""
    if xid is not None:
        return f"Xid{xid}"
    match = _XID_CONDITION.match(condition)
    if match:
        return f"Xid{match.group(1)}"
    for source in (kind, condition):
        words = re.findall(r"[A-Za-z0-9]+", source)
        camel = "".join(w[:1].upper() + w[1:] for w in words)
        if camel and camel[0].isalpha():
            return condition_reason(camel, healthy=healthy)
    return condition_reason(text, healthy=healthy)


@dataclass(slots=True)
class _Active:
    severity: str
    since: float
    reason: str
    message: str


@dataclass(slots=True)
class _Gpu:
    healthy: bool
    since: float
    as_of: float
    active: dict[str, _Active] = field(default_factory=dict)
    # Text of the event that made the GPU unhealthy or healthy, when no active
    # condition explains the status (a first event without a condition name).
    text: tuple[str, str] | None = None
    # True when the text came from a recovery event (shown while healthy).
    recovered: bool = False


class HealthView:
    def __init__(self) -> None:
        self._gpus: dict[str, _Gpu] = {}
        self._conditions: dict[str, GpuCondition] = {}

    def snapshot(self) -> Mapping[str, GpuCondition]:
        return dict(self._conditions)

    def get(self, uuid: str) -> GpuCondition | None:
        return self._conditions.get(uuid)

    def apply_event(self, event: HealthEvent) -> bool:
        """Fold one event in; returns whether the GPU's condition changed."""
        uuid = event.gpu_uuid
        if not uuid:
            return False
        gpu = self._gpus.get(uuid)
        if gpu is not None and event.observed_at < gpu.as_of:
            return False
        if gpu is None and len(self._gpus) >= MAX_GPUS:
            # Events for GPUs the inventory never lists would otherwise grow the view
            # without bound; forget() keeps only listed ones once an inventory arrives.
            return False
        first = gpu is None
        if gpu is None:
            gpu = _Gpu(
                healthy=event.healthy,
                since=event.condition_since or event.observed_at,
                as_of=event.observed_at,
            )
            self._gpus[uuid] = gpu
        gpu.as_of = event.observed_at
        recovery = event.kind in _RECOVERY_KINDS
        if recovery:
            gpu.active.pop(event.condition, None)
        elif event.condition and event.condition not in gpu.active:
            # A repeat of an active condition keeps the condition's first text, as the
            # health service's own state does: snapshot and events must agree.
            gpu.active[event.condition] = _Active(
                severity=event.severity,
                since=event.condition_since or event.observed_at,
                reason=reason_for(
                    xid=event.xid,
                    condition=event.condition,
                    kind=event.kind,
                    text=event.reason,
                    healthy=False,
                ),
                message=event.message or event.reason,
            )
        if event.healthy:
            # Healthy means no unhealthy condition is active (the health service's own
            # definition); whatever we still hold is stale, e.g. an end event we missed.
            gpu.active = {
                k: a for k, a in gpu.active.items() if a.severity not in _UNHEALTHY_SEVERITIES
            }
        flipped = not first and gpu.healthy != event.healthy
        if flipped:
            gpu.since = event.observed_at
        gpu.healthy = event.healthy
        if event.healthy:
            if flipped and recovery:
                gpu.recovered = True
                reason = "Cleared" if event.kind == "cleared" else "Recovered"
                gpu.text = (reason, event.message or event.reason)
            elif flipped:
                gpu.recovered = False
                gpu.text = None
        else:
            gpu.recovered = False
            if not recovery:
                gpu.text = (
                    reason_for(
                        xid=event.xid,
                        condition=event.condition,
                        kind=event.kind,
                        text=event.reason,
                        healthy=False,
                    ),
                    event.message or event.reason,
                )
        return self._publish(uuid, gpu)

    def apply_state(self, state: HealthState) -> bool:
        """Fold a snapshot in; returns whether any GPU's condition changed."""
        changed = False
        for health in state.gpus:
            if health.gpu_uuid:
                changed |= self._apply_gpu(health, health.updated_at or state.updated_at)
        return changed

    def _apply_gpu(self, health: GpuHealth, as_of: float) -> bool:
        uuid = health.gpu_uuid
        gpu = self._gpus.get(uuid)
        if gpu is not None and as_of < gpu.as_of:
            return False
        if gpu is None and len(self._gpus) >= MAX_GPUS:
            return False
        healthy = health.healthy and health.present
        active = {
            c.condition: _Active(
                severity=c.severity,
                since=c.since,
                reason=reason_for(
                    xid=None, condition=c.condition, kind=c.kind, text=c.reason, healthy=False
                ),
                message=c.message or c.reason,
            )
            for c in health.conditions
        }
        if gpu is None:
            unhealthy_since = [a.since for a in active.values() if a.since]
            since = min(unhealthy_since) if not healthy and unhealthy_since else as_of
            gpu = _Gpu(healthy=healthy, since=since, as_of=as_of)
            self._gpus[uuid] = gpu
        elif gpu.healthy != healthy:
            gpu.since = as_of
            gpu.recovered = False
        gpu.as_of = as_of
        gpu.healthy = healthy
        gpu.active = active
        if not healthy and not any(a.severity in _UNHEALTHY_SEVERITIES for a in active.values()):
            gpu.text = ("GpuNotPresent", "") if not health.present else gpu.text
        return self._publish(uuid, gpu)

    def forget(self, keep: set[str]) -> None:
        """Drop GPUs that left the inventory, so a re-added one starts fresh."""
        for uuid in list(self._gpus):
            if uuid not in keep:
                del self._gpus[uuid]
                self._conditions.pop(uuid, None)

    def _publish(self, uuid: str, gpu: _Gpu) -> bool:
        condition = _condition(gpu)
        if self._conditions.get(uuid) == condition:
            return False
        self._conditions[uuid] = condition
        return True


def _worst(active: Mapping[str, _Active]) -> _Active | None:
    candidates = [a for a in active.values() if a.severity in _UNHEALTHY_SEVERITIES]
    if not candidates:
        return None
    return min(
        candidates,
        key=lambda a: (-_SEVERITY_RANK.get(a.severity, 0), a.since, a.reason),
    )


def _condition(gpu: _Gpu) -> GpuCondition:
    if gpu.healthy:
        if gpu.recovered and gpu.text is not None:
            reason, message = gpu.text
            return GpuCondition(healthy=True, reason=reason, message=message, since=gpu.since)
        # "Healthy" is a placeholder: while the status agrees, the Device's own wording
        # (say, an earlier "Recovered") stands (from_event False).
        return GpuCondition(healthy=True, reason="Healthy", since=gpu.since, from_event=False)
    worst = _worst(gpu.active)
    if worst is not None:
        reason, message = worst.reason, worst.message
    elif gpu.text is not None:
        reason, message = gpu.text
    else:
        reason, message = "Unhealthy", ""
    return GpuCondition(healthy=False, reason=reason, message=message, since=gpu.since)
