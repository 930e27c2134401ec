"""The node condition ``GpuletGPUHealthy`` and the taint ``gpulet.io/gpu-unhealthy``.

What the cluster sees
---------------------
Outside the Device CR nothing told the cluster that a node's GPUs are bad; kubectl,
alerting on node conditions and cluster-autoscaler / remediation controllers read
``Node.status.conditions``. The reporter keeps one condition there, as
node-problem-detector keeps its own:

=========  ==========================  =====================================================
status     reason                      when
=========  ==========================  =====================================================
True       ``AllGPUsHealthy``          every GPU the node has is healthy and present
False      ``GPUsUnhealthy``           at least one is not; the message lists each
                                       (``GPU 3 GPU-5f2c... (xid, gpu_lost)``: index, UUID,
                                       the kinds of its critical/fatal conditions)
Unknown    ``HealthServiceUnreachable`` the health service has not answered its state
                                       request (``gpulet.health.state.<node>``) for
                                       ``reporter.health_stale_after_s``: NATS down, the
                                       health service dead or disabled
Unknown    ``GPUStateUnknown``         that long after start there is still no inventory
                                       or no snapshot of the ``gpu_health`` KV bucket
=========  ==========================  =====================================================

Every message ends with the node's boot ID (``; boot ID <uuid>``, from
:mod:`gpulet_common.bootid`), so that what the condition says is tied to the boot it
was seen in; health events carry the same ID (``node_boot_id``).

Failing closed: a state that cannot be trusted is not reported as healthy. It is not
reported as unhealthy either: an Unknown condition leaves the taint as it is (a taint
set for a failure stays until the health service is back and says the GPU recovered;
no taint is added for a NATS outage, which would otherwise taint a whole fleet at once).

Timestamps as node-problem-detector writes them: ``lastTransitionTime`` moves only when
the *status* changes (a new reason or message on the same status keeps it);
``lastHeartbeatTime`` is set on every write of the condition. With nothing changing, a
heartbeat write refreshes it every ``reporter.condition_heartbeat_s`` (5 minutes, NPD's
default; 0: never) -- skipped when the condition was written in the last half interval.

The taint, by ``reporter.taint_policy``: ``none`` (the default; a gpulet taint left
from another policy is removed), ``any-gpu-unhealthy`` (one unhealthy GPU taints the
node), ``all-gpus-unhealthy`` (only a node whose every GPU is unhealthy). The taint is
``gpulet.io/gpu-unhealthy:NoSchedule`` and nothing else is ever touched: other taints,
and a ``gpulet.io/gpu-unhealthy`` taint with another effect, are left as found.

GPUs that need a reboot
-----------------------
Remediation by reset (docs/health.md, "Remediation by reset") escalates a GPU a reset
cannot cure (a failed reset or verify, NODE_REBOOT, peers that would need resetting):
the node view shows it with the condition ``remediation:needs_reboot``. The reporter
then sets a second condition, ``GpuletNeedsReboot`` = True (reason ``GPUNeedsReboot``,
the message naming each GPU and why), and the taint ``gpulet.io/needs-reboot:NoSchedule``
whatever ``reporter.taint_policy`` says: the node needs its operator's tooling
(NVSentinel, a reboot controller) and gpulet never reboots it. Once no GPU needs it,
the condition turns False (``NoGPUNeedsReboot``; never written on a node that never had
it) and the taint goes. An Unknown state leaves both as they are.

Shape
-----
* :func:`evaluate` -- pure: the inventory, the health states and what is known of the
  health service's liveness become a :class:`NodeHealthIntent` (no timestamps), so
  equal intents mean no write.
* :class:`NodeHealthKeeper` -- holds the liveness facts and the last intent; offers a
  changed intent to its own :class:`~gpulet_reporter.debounce.Debouncer` (the same
  quiet window and maximum delay as the Device's), synchronously, never blocking.
* :class:`NodeHealthWriter` -- a :class:`~gpulet_reporter.writer.WriteSink` for the
  :class:`~gpulet_reporter.writer.WriteLoop`: compares with the Node it last read and
  writes only a difference. The condition goes out as a strategic merge patch of
  ``nodes/<name>/status`` holding only our condition: the API server merges
  ``status.conditions`` by ``type``, so the kubelet's and others' conditions are never
  sent nor touched, and no resourceVersion is needed (nobody else writes this type).
  ``spec.taints`` is an atomic list, so the taint is a read-modify-write: the observed
  list with only ours added or removed, a JSON merge patch carrying the observed
  ``resourceVersion``; a 409 re-reads and tries again.

The write loop's periodic tick (every ``condition_heartbeat_s``, or
``reconcile_interval_s`` when heartbeats are off) re-reads the Node, so a condition or
taint someone removed by hand is put back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, Final, Literal

import msgspec

from gpulet_common.bootid import read_boot_id
from gpulet_common.kubeapi import KubeApiError
from gpulet_common.messages import UNHEALTHY_SEVERITIES, GpuHealth, Inventory
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_reporter.debounce import Debouncer
from gpulet_reporter.desired import JsonObj, rfc3339
from gpulet_reporter.writer import NodeApi, NodeClient, api_error

log = logging.getLogger("gpulet.reporter")

CONDITION_TYPE: Final = "GpuletGPUHealthy"
TAINT_KEY: Final = "gpulet.io/gpu-unhealthy"
TAINT_EFFECT: Final = "NoSchedule"
REBOOT_CONDITION: Final = "GpuletNeedsReboot"
REBOOT_TAINT: Final = "gpulet.io/needs-reboot"
REASON_NEEDS_REBOOT: Final = "GPUNeedsReboot"
REASON_NO_REBOOT: Final = "NoGPUNeedsReboot"
NEEDS_REBOOT_CONDITION: Final = "remediation:needs_reboot"
_DETAIL_MAX: Final = 200

REASON_HEALTHY: Final = "AllGPUsHealthy"
REASON_UNHEALTHY: Final = "GPUsUnhealthy"
REASON_UNREACHABLE: Final = "HealthServiceUnreachable"
REASON_UNKNOWN: Final = "GPUStateUnknown"

# The message lists this many GPUs, then "and N more".
MESSAGE_GPUS_MAX: Final = 16

Status = Literal["True", "False", "Unknown"]
TaintPolicy = Literal["none", "all-gpus-unhealthy", "any-gpu-unhealthy"]


class NodeHealthIntent(msgspec.Struct, frozen=True, kw_only=True):
    """The condition and the taint the Node should carry; equal intents need no write.

    ``taint`` None: leave the taint as it is (the health state is not known)."""

    status: Status
    reason: str
    message: str
    taint: bool | None
    # GPUs remediation escalated: why each needs a reboot; "" none; None: not known
    # (leave the GpuletNeedsReboot condition and taint as they are).
    needs_reboot: str | None = None


# --- what to say -----------------------------------------------------------------------


def _kinds(health: GpuHealth) -> str:
    kinds: list[str] = sorted(
        {c.kind for c in health.conditions if c.severity in UNHEALTHY_SEVERITIES}
    )
    held = [c for c in health.conditions if c.kind == "remediation"]
    if held:
        # What remediation says of it (e.g. "RMA candidate: 3 fatal faults ...").
        kinds.append(f"{held[0].condition}: {held[0].message[:_DETAIL_MAX]}")
        kinds.remove("remediation")
    if kinds:
        return ", ".join(kinds)
    return "not present" if not health.present else "unhealthy"


def evaluate(
    inventory: Inventory | None,
    healths: Mapping[str, GpuHealth],
    *,
    policy: TaintPolicy,
) -> NodeHealthIntent:
    """The condition for a trusted state: the inventory's GPUs and every GPU the health
    service names (a lost GPU the inventory no longer lists counts, unhealthy)."""
    index: dict[str, int | None] = {}
    for uuid, health in healths.items():
        index[uuid] = health.info.index if health.info is not None else health.gpu_index
    for gpu in inventory.gpus if inventory is not None else ():
        index[gpu.uuid] = gpu.index
    unhealthy = sorted(
        (u for u, h in healths.items() if not (h.healthy and h.present)),
        key=lambda u: (index.get(u) is None, index.get(u) or 0, u),
    )
    total = len(index)
    reboot = "; ".join(
        f"GPU {index.get(u) if index.get(u) is not None else '?'} {u}: {c.message[:_DETAIL_MAX]}"
        for u in unhealthy[:MESSAGE_GPUS_MAX]
        for c in healths[u].conditions
        if c.condition == NEEDS_REBOOT_CONDITION
    )
    if not unhealthy:
        return NodeHealthIntent(
            status="True",
            reason=REASON_HEALTHY,
            message=f"all {total} GPUs healthy",
            taint=False,
            needs_reboot="",
        )
    listed = [
        f"GPU {index[u] if index.get(u) is not None else '?'} {u} ({_kinds(healths[u])})"
        for u in unhealthy[:MESSAGE_GPUS_MAX]
    ]
    more = len(unhealthy) - len(listed)
    message = f"{len(unhealthy)} of {total} GPUs unhealthy: " + "; ".join(listed)
    if more:
        message += f"; and {more} more"
    if policy == "any-gpu-unhealthy":
        taint = True
    elif policy == "all-gpus-unhealthy":
        taint = len(unhealthy) >= total
    else:
        taint = False
    return NodeHealthIntent(
        status="False", reason=REASON_UNHEALTHY, message=message, taint=taint, needs_reboot=reboot
    )


def unknown(reason: str, message: str, *, policy: TaintPolicy) -> NodeHealthIntent:
    # Policy "none" still removes a taint left from another policy: that needs no
    # knowledge of the GPUs. Otherwise the taint stays as it is.
    return NodeHealthIntent(
        status="Unknown",
        reason=reason,
        message=message,
        taint=False if policy == "none" else None,
    )


def with_boot_id(intent: NodeHealthIntent | None, boot_id: str) -> NodeHealthIntent | None:
    """The intent with the node's boot ID at the end of its message."""
    if intent is None or not boot_id:
        return intent
    return msgspec.structs.replace(intent, message=f"{intent.message}; boot ID {boot_id}")


class NodeHealthKeeper:
    """The liveness facts and the last intent; offers changed intents to its debouncer.

    ``answered`` is called on every answer of the health service (a state, or an error
    reply: a service that rejects a request is alive). Time is this process's monotonic
    clock, never a timestamp from a message."""

    def __init__(
        self,
        node: str,
        settings: ReporterSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        boot_id: str | None = None,
    ) -> None:
        self.node = node
        # The node's boot ID, in every message (None: read it now).
        self.boot_id = read_boot_id() if boot_id is None else boot_id
        self._settings = settings
        self._clock = clock
        self._started = clock()
        self._last_answer: float | None = None
        #: Answers from the health service so far (for tests and status).
        self.answers = 0
        self.intent: NodeHealthIntent | None = None
        self.debouncer: Debouncer[NodeHealthIntent] = Debouncer(
            settings.quiet_window_s, settings.max_delay_s, clock=clock
        )

    def answered(self) -> None:
        self._last_answer = self._clock()
        self.answers += 1

    def silent_for(self) -> float:
        """Seconds since the health service last answered (or since start)."""
        since = self._last_answer if self._last_answer is not None else self._started
        return max(0.0, self._clock() - since)

    def update(
        self,
        inventory: Inventory | None,
        healths: Mapping[str, GpuHealth],
        *,
        health_seen: bool,
    ) -> NodeHealthIntent | None:
        """Re-evaluate; a changed intent is submitted. Returns the current intent."""
        intent = with_boot_id(
            self._evaluate(inventory, healths, health_seen=health_seen), self.boot_id
        )
        if intent is not None and intent != self.intent:
            self.intent = intent
            self.debouncer.submit(intent)
        return self.intent

    def _evaluate(
        self,
        inventory: Inventory | None,
        healths: Mapping[str, GpuHealth],
        *,
        health_seen: bool,
    ) -> NodeHealthIntent | None:
        policy = self._settings.taint_policy
        stale_after = self._settings.health_stale_after_s
        silent = self.silent_for()
        if silent > stale_after:
            return unknown(
                REASON_UNREACHABLE,
                f"the health service has not answered its state request "
                f"(gpulet.health.state.{self.node}) for {stale_after:.0f} s or more: "
                "NATS unreachable, or the health service stopped or disabled",
                policy=policy,
            )
        missing = [
            what
            for what, ok in (
                ("no GPU inventory from the collector", inventory is not None),
                ("no snapshot of the gpu_health KV bucket", health_seen),
            )
            if not ok
        ]
        if not missing:
            return evaluate(inventory, healths, policy=policy)
        if self._clock() - self._started <= stale_after:
            return None  # still starting: say nothing rather than Unknown for a moment
        return unknown(
            REASON_UNKNOWN,
            "; ".join(missing) + f" {stale_after:.0f} s after start",
            policy=policy,
        )


# --- writing it ----------------------------------------------------------------------


def _field(obj: Any, *path: str) -> Any:
    """``obj[path[0]][path[1]]...``, or None where a step is not a mapping: the Node is
    the API server's word, and a malformed one must not end the writer."""
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def node_taints(node: JsonObj | None) -> list[Any]:
    taints = _field(node, "spec", "taints")
    return taints if isinstance(taints, list) else []


def find_condition(node: JsonObj | None, kind: str = CONDITION_TYPE) -> JsonObj | None:
    conditions = _field(node, "status", "conditions")
    for condition in conditions if isinstance(conditions, list) else []:
        if isinstance(condition, dict) and condition.get("type") == kind:
            return condition
    return None


def is_our_taint(taint: Any, key: str = TAINT_KEY) -> bool:
    return (
        isinstance(taint, dict) and taint.get("key") == key and taint.get("effect") == TAINT_EFFECT
    )


def render_condition(
    intent: NodeHealthIntent, observed: JsonObj | None, *, now: float, kind: str = CONDITION_TYPE
) -> JsonObj:
    """The condition entry; ``lastTransitionTime`` kept while the status is unchanged."""
    stamp = rfc3339(now)
    transition = stamp
    if observed is not None and observed.get("status") == intent.status:
        transition = _as_rfc3339(observed.get("lastTransitionTime")) or stamp
    return {
        "type": kind,
        "status": intent.status,
        "reason": intent.reason,
        "message": intent.message,
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": transition,
    }


def _as_rfc3339(value: Any) -> str | None:
    """A time as the API server writes it (``...Z``, seconds). The client hands the Node
    back as a model whose times serialise as ``+00:00``; written back as they are, a
    kept transition time would change its spelling on every heartbeat."""
    if isinstance(value, datetime):
        return rfc3339(value.timestamp())
    if isinstance(value, str) and value:
        try:
            return rfc3339(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp())
        except ValueError:
            return None
    return None


def condition_differs(intent: NodeHealthIntent, observed: JsonObj | None) -> bool:
    if observed is None:
        return True
    return (observed.get("status"), observed.get("reason"), observed.get("message") or "") != (
        intent.status,
        intent.reason,
        intent.message,
    )


def taints_for(observed: Iterable[Any], wanted: bool, key: str = TAINT_KEY) -> list[Any] | None:
    """The taint list with only ours set or removed, or None when it needs no change."""
    taints = list(observed)
    has = any(is_our_taint(t, key) for t in taints)
    if has == wanted:
        return None
    kept = [t for t in taints if not is_our_taint(t, key)]
    return [*kept, {"key": key, "effect": TAINT_EFFECT}] if wanted else kept


def reboot_intent(intent: NodeHealthIntent) -> NodeHealthIntent | None:
    """The GpuletNeedsReboot condition as an intent of its own (None: leave it)."""
    if intent.needs_reboot is None:
        return None
    if intent.needs_reboot:
        return NodeHealthIntent(
            status="True",
            reason=REASON_NEEDS_REBOOT,
            message="remediation escalated (gpulet never reboots a node): " + intent.needs_reboot,
            taint=True,
        )
    return NodeHealthIntent(
        status="False", reason=REASON_NO_REBOOT, message="no GPU needs a reboot", taint=False
    )


class NodeHealthWriter:
    """A :class:`~gpulet_reporter.writer.WriteSink` of :class:`NodeHealthIntent`."""

    def __init__(
        self,
        target: NodeApi,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        server: str = "",
    ) -> None:
        self._kube = NodeClient.of(target, missing="its GPU condition and taint wait")
        self._node = target.node
        self._settings = target.settings
        self._metrics = target.metrics
        self._clock = clock
        self._monotonic = monotonic
        self.description = f"API server {server} (node condition)" if server else "node condition"
        self._heartbeat_due = False
        self._last_write: float | None = None

    @property
    def node_object(self) -> JsonObj | None:
        return self._kube.node_object

    @staticmethod
    def tick_interval(settings: ReporterSettings) -> float:
        """The write loop's periodic tick: heartbeats, and re-reading the Node."""
        ticks = [s for s in (settings.condition_heartbeat_s, settings.reconcile_interval_s) if s]
        return min(ticks) if ticks else 0.0

    async def refresh(self) -> None:
        self._kube.node_read = False
        heartbeat = self._settings.condition_heartbeat_s
        if heartbeat > 0 and (
            self._last_write is None or self._monotonic() - self._last_write >= heartbeat / 2
        ):
            self._heartbeat_due = True

    async def apply(self, desired: NodeHealthIntent) -> bool:
        if not self._kube.node_read:
            await self._kube.read_node()
        wrote = await self._apply_condition(desired)
        wrote = await self._apply_taint(desired) or wrote
        reboot = reboot_intent(desired)
        if reboot is None:
            return wrote
        observed = find_condition(self.node_object, REBOOT_CONDITION)
        if observed is not None or reboot.status == "True":
            wrote = await self._apply_condition(reboot, REBOOT_CONDITION) or wrote
        return await self._apply_taint(reboot, REBOOT_TAINT) or wrote

    async def _apply_condition(self, intent: NodeHealthIntent, kind: str = CONDITION_TYPE) -> bool:
        if self.node_object is None:
            return False
        observed = find_condition(self.node_object, kind)
        changed = condition_differs(intent, observed)
        if not changed and not self._heartbeat_due:
            return False
        condition = render_condition(intent, observed, now=self._clock(), kind=kind)
        try:
            result = await self._kube.call(
                "patch node status",
                self._kube.api.patch,
                self._kube.node_path + "/status",
                {"status": {"conditions": [condition]}},
                patch="strategic",
                field_manager=self._settings.field_manager,
            )
        except KubeApiError as exc:
            if exc.status == 404:
                self._kube.node_object = None
                return False
            raise api_error(exc, "patch node status") from exc
        self._kube.node_object = self._kube.as_dict(result)
        if kind == CONDITION_TYPE:
            self._heartbeat_due = False
        self._last_write = self._monotonic()
        self._metrics.wrote("node_status", "patch")
        if changed:
            log.info(
                "node %s: condition %s=%s (%s) %s",
                self._node,
                kind,
                intent.status,
                intent.reason,
                intent.message,
            )
        return True

    async def _apply_taint(self, intent: NodeHealthIntent, key: str = TAINT_KEY) -> bool:
        wanted = intent.taint
        if wanted is None:
            return False

        def build(node: JsonObj) -> JsonObj | None:
            taints = taints_for(node_taints(node), wanted, key)
            if taints is None:
                return None
            patch: JsonObj = {"spec": {"taints": taints or None}}
            version = _field(node, "metadata", "resourceVersion")
            if isinstance(version, str) and version:
                patch["metadata"] = {"resourceVersion": version}
            return patch

        if await self._kube.patch_node("patch node taints", build, "node_taint") is None:
            return False
        log.info(
            "node %s: taint %s:%s %s",
            self._node,
            key,
            TAINT_EFFECT,
            "added" if wanted else "removed",
        )
        return True
