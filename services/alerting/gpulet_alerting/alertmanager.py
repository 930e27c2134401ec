"""The Alertmanager sink of ``gpulet alerts``: health events as Alertmanager v2 alerts.

Alertmanager mapping
--------------------
Every condition is one alert, identified by its labels ``alertname`` (from the kind:
``GpuXid``, ``GpuThermal``, ``GpuEccUncorrectable``, ...), ``node``, ``gpu`` (index),
``uuid``, ``condition`` and ``severity`` (plus ``xid`` for XIDs). Annotations carry
``summary`` (the reason), ``action``, ``description`` and the event id. ``startsAt`` is
when the condition began; while active the alert is re-sent every
``resend_interval_s`` with ``endsAt`` 4 intervals ahead (what Prometheus does), and
the ``recovered``/``cleared`` event resolves it by sending ``endsAt`` = the recovery
time. A GPU-level alert ``GpuUnhealthy`` fires while the GPU is unhealthy and resolves
when it is healthy again. One-off reports (application XIDs, a hot-added GPU, a
buffer overflow) are alerts that end after ``transient_alert_s``.

Label sets of firing alerts are remembered, so the resolve matches even if the GPU's
index changed in between. A consumer that starts without that memory (first start, or
a restart) first posts the current conditions from the ``gpu_health`` KV bucket
(``reconcile_from_kv``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import anyio

from gpulet_alerting.sinks import post_json, rfc3339
from gpulet_common.messages import GpuHealth, HealthEvent

ALERT_NAMES: dict[str, str] = {
    "xid": "GpuXid",
    "ecc_uncorrectable": "GpuEccUncorrectable",
    "ecc_correctable_rate": "GpuEccCorrectableRate",
    "remap_pending": "GpuRowRemapPending",
    "remap_failure": "GpuRowRemapFailure",
    "thermal": "GpuThermal",
    "thermal_slowdown": "GpuThermalSlowdown",
    "thermal_shutdown": "GpuThermalShutdown",
    "clock_slowdown": "GpuClockSlowdown",
    "pcie_replay_rate": "GpuPcieReplayRate",
    "nvlink_error_rate": "GpuNvlinkErrorRate",
    "nvlink_down": "GpuNvLinkDown",
    "gpu_lost": "GpuLost",
    "gpu_removed": "GpuRemoved",
    "gpu_missing": "GpuMissing",
    "gpu_added": "GpuAdded",
    "nvml_unavailable": "GpuNvmlUnavailable",
    "buffer_overflow": "GpuHealthEventsLost",
}
UNHEALTHY_ALERT = "GpuUnhealthy"
END_KINDS = frozenset({"recovered", "cleared"})


AlertKey = tuple[str, str, str]  # (node, uuid, condition or "" for GpuUnhealthy)


class AlertmanagerSink:
    """Alerts for Alertmanager's v2 API, with firing alerts re-sent periodically."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        resend_interval_s: float,
        transient_alert_s: float,
    ) -> None:
        self.name = f"alertmanager {base_url}"
        self._url = base_url.rstrip("/") + "/api/v2/alerts"
        self._timeout_s = timeout_s
        self._resend_s = resend_interval_s
        self._transient_s = transient_alert_s
        # Firing alerts, keyed by what they are about, with the payload last sent.
        self.active: dict[AlertKey, dict[str, Any]] = {}
        # The alerts computed for the event being delivered: computing them updates
        # the active set, so a retried POST must re-send these, not recompute.
        self._pending: tuple[tuple[str, str], list[dict[str, Any]]] | None = None

    # --- building alerts -------------------------------------------------------------

    def _labels(
        self,
        event_node: str,
        uuid: str,
        index: int | None,
        kind: str,
        condition: str,
        severity: str,
        xid: int | None,
    ) -> dict[str, str]:
        labels = {
            "alertname": ALERT_NAMES.get(kind, "GpuHealth"),
            "node": event_node,
            "severity": severity,
        }
        if uuid:
            labels["uuid"] = uuid
            labels["gpu"] = str(index) if index is not None else ""
        if condition:
            labels["condition"] = condition
        if xid is not None:
            labels["xid"] = str(xid)
        return {k: v for k, v in labels.items() if v}

    def _alert(
        self,
        labels: dict[str, str],
        *,
        summary: str,
        description: str,
        action: str,
        event_id: str,
        starts_at: float,
        ends_at: float,
    ) -> dict[str, Any]:
        annotations = {
            "summary": summary,
            "description": description,
            "action": action,
            "event_id": event_id,
        }
        return {
            "labels": labels,
            "annotations": {k: v for k, v in annotations.items() if v},
            "startsAt": rfc3339(starts_at),
            "endsAt": rfc3339(max(ends_at, starts_at)),
        }

    def alerts_for(self, event: HealthEvent, now: float) -> list[dict[str, Any]]:
        """The alerts to post for one event (and the active set updated)."""
        out: list[dict[str, Any]] = []
        ahead = now + 4 * self._resend_s
        if event.kind in END_KINDS:
            key: AlertKey = (event.node, event.gpu_uuid, event.condition)
            previous = self.active.pop(key, None)
            if previous is not None:
                labels = previous["labels"]
                starts = previous["startsAt"]
            else:
                labels = self._labels(
                    event.node,
                    event.gpu_uuid,
                    event.gpu_index,
                    event.condition_kind or "",
                    event.condition,
                    event.condition_severity or event.severity,
                    event.xid,
                )
                starts = rfc3339(event.condition_since or event.observed_at)
            resolved = self._alert(
                labels,
                summary=event.reason,
                description=event.message,
                action="none",
                event_id=event.event_id,
                starts_at=event.condition_since or event.observed_at,
                ends_at=event.observed_at,
            )
            resolved["startsAt"] = starts
            out.append(resolved)
        elif event.condition:
            key = (event.node, event.gpu_uuid, event.condition)
            labels = self._labels(
                event.node,
                event.gpu_uuid,
                event.gpu_index,
                event.kind,
                event.condition,
                event.condition_severity or event.severity,
                event.xid,
            )
            previous = self.active.get(key)
            if previous is not None:
                labels = previous["labels"]
            alert = self._alert(
                labels,
                summary=event.reason,
                description=self._describe(event),
                action=event.action,
                event_id=event.event_id,
                starts_at=event.condition_since or event.observed_at,
                ends_at=ahead,
            )
            self.active[key] = alert
            out.append(alert)
        else:
            labels = self._labels(
                event.node,
                event.gpu_uuid,
                event.gpu_index,
                event.kind,
                "",
                event.severity,
                event.xid,
            )
            out.append(
                self._alert(
                    labels,
                    summary=event.reason,
                    description=self._describe(event),
                    action=event.action,
                    event_id=event.event_id,
                    starts_at=event.observed_at,
                    ends_at=event.observed_at + self._transient_s,
                )
            )
        if event.gpu_uuid:
            out += self._unhealthy(event, ahead)
        return out

    def _describe(self, event: HealthEvent) -> str:
        parts = [event.message] if event.message else []
        if event.observed_value is not None:
            observed = f"observed {event.observed_value:g}"
            if event.threshold is not None:
                observed += f", threshold {event.threshold:g}"
            parts.append(observed)
        if event.repeat_count > 1:
            parts.append(f"{event.repeat_count} occurrences")
        return "; ".join(parts)

    def _unhealthy(self, event: HealthEvent, ahead: float) -> list[dict[str, Any]]:
        key: AlertKey = (event.node, event.gpu_uuid, "")
        previous = self.active.get(key)
        if not event.healthy:
            labels = (
                previous["labels"]
                if previous is not None
                else {
                    "alertname": UNHEALTHY_ALERT,
                    "node": event.node,
                    "gpu": str(event.gpu_index) if event.gpu_index is not None else "",
                    "uuid": event.gpu_uuid,
                    "severity": "critical",
                }
            )
            labels = {k: v for k, v in labels.items() if v}
            since = event.condition_since or event.observed_at
            if previous is not None:
                alert = dict(previous)
                alert["endsAt"] = rfc3339(ahead)
                if event.kind not in END_KINDS:
                    alert["annotations"] = dict(
                        previous["annotations"], latest=event.reason, event_id=event.event_id
                    )
            else:
                alert = self._alert(
                    labels,
                    summary=f"GPU {event.gpu_index} on {event.node} is unhealthy: {event.reason}",
                    description="",
                    action=event.action,
                    event_id=event.event_id,
                    starts_at=since,
                    ends_at=ahead,
                )
            self.active[key] = alert
            return [alert]
        if previous is None:
            return []
        del self.active[key]
        resolved = dict(previous)
        resolved["endsAt"] = rfc3339(event.observed_at)
        resolved["annotations"] = dict(previous["annotations"], resolved_by=event.reason)
        return [resolved]

    def reconcile(
        self, healths: Sequence[tuple[str, GpuHealth]], now: float
    ) -> list[dict[str, Any]]:
        """Alerts for the current state read from the KV bucket: (node, GPU health)."""
        ahead = now + 4 * self._resend_s
        out: list[dict[str, Any]] = []
        for node, health in healths:
            for c in health.conditions:
                xid = (
                    int(c.condition.split(":", 1)[1])
                    if c.kind == "xid" and ":" in c.condition
                    else None
                )
                labels = self._labels(
                    node, health.gpu_uuid, health.gpu_index, c.kind, c.condition, c.severity, xid
                )
                alert = self._alert(
                    labels,
                    summary=c.reason,
                    description=c.message,
                    action=c.action,
                    event_id="",
                    starts_at=c.since or now,
                    ends_at=ahead,
                )
                self.active[(node, health.gpu_uuid, c.condition)] = alert
                out.append(alert)
            if not health.healthy:
                labels = {
                    "alertname": UNHEALTHY_ALERT,
                    "node": node,
                    "gpu": str(health.gpu_index) if health.gpu_index is not None else "",
                    "uuid": health.gpu_uuid,
                    "severity": "critical",
                }
                since = min((c.since for c in health.conditions if c.since), default=now)
                first = health.conditions[0].reason if health.conditions else "not present"
                alert = self._alert(
                    {k: v for k, v in labels.items() if v},
                    summary=f"GPU {health.gpu_index} on {node} is unhealthy: {first}",
                    description="",
                    action=health.conditions[0].action if health.conditions else "operator_check",
                    event_id="",
                    starts_at=since,
                    ends_at=ahead,
                )
                self.active[(node, health.gpu_uuid, "")] = alert
                out.append(alert)
        return out

    # --- sending ---------------------------------------------------------------------

    async def post(self, alerts: list[dict[str, Any]]) -> None:
        if not alerts:
            return
        body = json.dumps(alerts).encode()
        await anyio.to_thread.run_sync(
            post_json, self._url, body, self._timeout_s, abandon_on_cancel=True
        )

    async def deliver(self, event: HealthEvent) -> None:
        pending = self._pending
        key = (event.node, event.event_id)  # per node: the consumer proved the node
        if pending is None or pending[0] != key:
            pending = self._pending = (key, self.alerts_for(event, time.time()))
        await self.post(pending[1])
        self._pending = None

    async def resend(self, now: float) -> None:
        if not self.active:
            return
        ahead = rfc3339(now + 4 * self._resend_s)
        alerts = []
        for alert in self.active.values():
            alert["endsAt"] = ahead
            alerts.append(alert)
        await self.post(alerts)
