"""A GPU's health as device taints, with stable keys and stable ``timeAdded``.

Keys (documented in docs/dra.md; ``<driver>`` is ``gpu.gpulet.io`` by default)
----------------------------------------------------------------------------
* ``<driver>/xid`` -- an XID condition; the value is the XID number (``79``).
* ``<driver>/unhealthy`` -- any other condition that makes the GPU unhealthy; the
  value is the condition (``thermal``, ``ecc_uncorrectable``, ``gpu_lost``...).
* ``<driver>/warning`` -- a condition that does not make the GPU unhealthy (an
  application XID, a warning, an info); effect ``None``: the scheduler still places
  claims, users and tools see why.
* ``<driver>/device-plugin`` -- in mode ``both``, the device plugin holds this GPU
  (value ``allocated``): ``NoSchedule`` so the scheduler stops picking it for claims.
* ``<driver>/time-sliced`` -- the node's time-slicing config offers this GPU to the
  device plugin as replicas (value: how many): ``NoSchedule``, since the ledger refuses
  a time-sliced GPU to a claim (docs/mig.md, "Time-slicing").

A MIG device (:mod:`.mig`) gets its GPU's taints (a GPU-wide fault, a lost GPU) and
those of the conditions confined to it (``ActiveCondition.mig_device``, e.g. an XID that
named its GPU and compute instance): a fault on one MIG device taints only that one.

The effect follows :data:`~gpulet_common.messages.UNHEALTHY_SEVERITIES`, the one rule
the node view and the device plugin also use: a condition of those severities taints
``NoSchedule`` (``NoExecute`` under the ``unhealthy_effect`` setting), any other gets
effect ``None``. A GPU that is not present gets ``<driver>/unhealthy=gpu-lost``, and the
conditions that say so (``gpu_lost``, ``gpu_removed``, ``gpu_missing``) are that same one
taint, not one value each (:data:`GONE_KINDS`). When
the health service clears the condition, the taint is simply not rendered any more:
recovery removes it.

``timeAdded`` never changes because we render again: a taint already published keeps
the time the API server holds (``known``, read from the observed slices); a new one
takes the condition's ``since`` (the health service's own record of when it began),
else ``now``. Times are RFC 3339 in whole seconds, UTC, as the server writes them back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from gpulet_common.dra import limits
from gpulet_common.messages import SEVERITY_RANK, UNHEALTHY_SEVERITIES, ActiveCondition, GpuHealth

JsonObj = dict[str, Any]
# (key, value, effect) → timeAdded, as published.
TaintKey = tuple[str, str, str]

XID: Final = "xid"
#: The value of the one taint of a GPU that is not there (lost, removed, missing).
GPU_LOST: Final = "gpu-lost"
#: Conditions that say the GPU is not there: all rendered as ``unhealthy=gpu-lost``.
GONE_KINDS: Final = frozenset({"gpu_lost", "gpu_removed", "gpu_missing"})
UNHEALTHY: Final = "unhealthy"
WARNING: Final = "warning"
DEVICE_PLUGIN: Final = "device-plugin"
TIME_SLICED: Final = "time-sliced"


def rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(int(max(0.0, seconds)), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _one(condition: ActiveCondition, driver: str, unhealthy_effect: str) -> tuple[str, str, str]:
    bad = condition.severity in UNHEALTHY_SEVERITIES
    effect = unhealthy_effect if bad else "None"
    name, _, detail = condition.condition.partition(":")
    # A MIG device's XID condition is named ``xid:<code>@<MIG UUID>``.
    detail = detail.partition("@")[0]
    if condition.kind == XID and name == XID and detail.isdigit():
        return f"{driver}/{XID}", detail, effect
    if bad and condition.kind in GONE_KINDS:
        return f"{driver}/{UNHEALTHY}", GPU_LOST, effect
    value = limits.label_value(condition.condition or condition.kind) or condition.kind
    return f"{driver}/{UNHEALTHY if bad else WARNING}", value, effect


def health_taints(
    health: GpuHealth | None,
    *,
    driver: str,
    unhealthy_effect: str = "NoSchedule",
    held_by_device_plugin: bool = False,
    mig_device: str = "",
    time_sliced: int = 0,
) -> list[tuple[TaintKey, float]]:
    """The taints one GPU deserves, worst first, each with the time its cause began
    (0 when unknown), at most :data:`~limits.MAX_TAINTS_PER_DEVICE`.

    ``mig_device``: the taints of that MIG device of the GPU instead: the GPU's own
    conditions (a GPU-wide fault taints every MIG device on it) and those confined to
    it; a condition confined to one MIG device never taints another, nor the GPU."""
    found: dict[TaintKey, tuple[int, float]] = {}

    def add(key: TaintKey, rank: int, since: float) -> None:
        held = found.get(key)
        if held is None or (rank, -since) > (held[0], -held[1]):
            found[key] = (rank, since)

    if health is not None:
        if not health.present:
            add((f"{driver}/{UNHEALTHY}", GPU_LOST, unhealthy_effect), 99, health.updated_at)
        for condition in health.conditions:
            if condition.mig_device not in ("", mig_device):
                continue
            add(
                _one(condition, driver, unhealthy_effect),
                SEVERITY_RANK.get(condition.severity, 0),
                condition.since,
            )
    if held_by_device_plugin:
        add((f"{driver}/{DEVICE_PLUGIN}", "allocated", "NoSchedule"), 50, 0.0)
    if time_sliced > 1:
        add((f"{driver}/{TIME_SLICED}", str(time_sliced), "NoSchedule"), 50, 0.0)
    ordered = sorted(found.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return [(key, since) for key, (_, since) in ordered[: limits.MAX_TAINTS_PER_DEVICE]]


def render(
    wanted: list[tuple[TaintKey, float]], known: Mapping[TaintKey, str], now: float
) -> list[JsonObj]:
    """The taints' JSON bodies, keeping each published taint's ``timeAdded``."""
    out: list[JsonObj] = []
    for (key, value, effect), since in wanted:
        added = known.get((key, value, effect)) or rfc3339(since if since > 0 else now)
        taint: JsonObj = {"key": key, "effect": effect, "timeAdded": added}
        if value:
            taint["value"] = value
        out.append(taint)
    return out


def known_times(slices: Sequence[Mapping[str, Any]]) -> dict[str, dict[TaintKey, str]]:
    """Device name → the ``timeAdded`` of each taint the observed slices carry."""
    found: dict[str, dict[TaintKey, str]] = {}
    for body in slices:
        spec = body.get("spec")
        devices = spec.get("devices") if isinstance(spec, Mapping) else None
        for device in devices if isinstance(devices, list) else []:
            if not isinstance(device, Mapping) or not isinstance(device.get("name"), str):
                continue
            for taint in device.get("taints") or []:
                if not isinstance(taint, Mapping):
                    continue
                key = (str(taint.get("key")), str(taint.get("value", "")), str(taint.get("effect")))
                added = taint.get("timeAdded")
                if isinstance(added, str) and added:
                    found.setdefault(device["name"], {})[key] = added
    return found
