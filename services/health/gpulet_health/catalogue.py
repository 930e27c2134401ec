"""The XID catalogue: what each XID means, how bad it is and what to do about it.

Design
------
An XID is the driver's error code for a GPU fault. The number alone says little;
operators need a *severity* (does the GPU stay usable?) and a *recommended action*
(restart the application, reset the GPU, reboot, send the board for inspection).

The built-in table comes from NVIDIA's XID catalogue
(https://docs.nvidia.com/deploy/xid-errors/index.html) as classified by NVIDIA's
NVSentinel (https://github.com/NVIDIA/NVSentinel) and by the GPUd project
(https://github.com/leptonai/gpud, ``pkg/nvidia-query/xid/xid.go``); where the two
disagree the table says so and takes the safer reading. Three layers
decide how an XID is treated, in this order:

1. ``health.xid_overrides``: an operator's entry for a code replaces the built-in one.
2. The built-in :data:`BUILTIN_XIDS`.
3. ``health.unknown_xid`` for every other code (default *critical*, as NVIDIA's device
   plugin treats every XID outside its skip list as fatal for the GPU).

Independently, ``health.app_xids`` (default 13, 31, 43, 45, 68, 109 -- the skip list of
NVIDIA's device plugin, koordlet and HAMi) names the *application* XIDs: they are
reported with their severity and action but never make the GPU unhealthy.

Whether an XID makes the GPU unhealthy is therefore: not an application XID, and a
severity of ``critical`` or ``fatal``. Such an XID raises a *sticky* condition
``xid:<code>``: it stays until the operator clears it or a GPU reset is observed,
because the fault that caused it leaves no level to watch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpulet_common.messages import UNHEALTHY_SEVERITIES, Action, Severity
from gpulet_common.settings.health import HealthSettings, XidRule


@dataclass(frozen=True, slots=True)
class XidInfo:
    code: int
    severity: Severity
    action: Action
    description: str
    # Where the classification comes from, for the README and `gpulet health` output.
    source: str = "NVSentinel/GPUd"


def _x(code: int, severity: Severity, action: Action, description: str, source: str) -> XidInfo:
    return XidInfo(code, severity, action, description, source)


# Severity and action by XID; the source column names who classifies it so.
BUILTIN_XIDS: Mapping[int, XidInfo] = {
    x.code: x
    for x in (
        _x(
            13,
            "warning",
            "restart_app",
            "graphics engine exception",
            "NVIDIA device plugin: application",
        ),
        _x(
            31,
            "warning",
            "restart_app",
            "GPU memory page fault",
            "NVIDIA device plugin: application",
        ),
        _x(
            43,
            "warning",
            "restart_app",
            "GPU stopped processing",
            "NVIDIA device plugin: application",
        ),
        _x(45, "info", "none", "preemptive cleanup", "NVIDIA device plugin: application"),
        _x(48, "fatal", "reset_gpu", "double-bit ECC error", "NVSentinel/GPUd"),
        _x(63, "info", "none", "row-remapping or page-retirement event", "GPUd"),
        _x(64, "critical", "reset_gpu", "row-remapping or page-retirement failure", "GPUd"),
        # NVIDIA's plugin calls 68 an application error; others disagree. It is in the
        # default app_xids, so this entry matters only when an operator removes it.
        _x(
            68,
            "warning",
            "restart_app",
            "video processor exception",
            "NVIDIA device plugin (disputed)",
        ),
        _x(74, "critical", "reset_gpu", "NVLink error", "NVSentinel/GPUd"),
        _x(79, "fatal", "reboot", "GPU has fallen off the bus", "NVSentinel/GPUd"),
        _x(92, "warning", "none", "high single-bit ECC error rate", "NVSentinel/GPUd"),
        _x(94, "warning", "restart_app", "contained ECC error", "NVSentinel/GPUd"),
        _x(95, "fatal", "reset_gpu", "uncontained ECC error", "NVSentinel/GPUd"),
        # An application error for NVIDIA's plugin, a reset for NVSentinel: in app_xids
        # by default; removing it from there gives NVSentinel's reading.
        _x(
            109,
            "critical",
            "reset_gpu",
            "context switch timeout",
            "NVSentinel (plugin: application)",
        ),
        _x(119, "fatal", "reset_gpu", "GSP RPC timeout", "NVSentinel/GPUd"),
        _x(120, "fatal", "reset_gpu", "GSP error", "NVSentinel/GPUd"),
    )
}


@dataclass(frozen=True, slots=True)
class XidVerdict:
    info: XidInfo
    application: bool

    @property
    def unhealthy(self) -> bool:
        return not self.application and self.info.severity in UNHEALTHY_SEVERITIES


class XidCatalogue:
    """The effective catalogue: built-in entries, operator overrides, app XIDs."""

    def __init__(
        self,
        *,
        app_xids: Iterable[int],
        overrides: Mapping[int, XidRule] | None = None,
        unknown: XidRule | None = None,
    ) -> None:
        self._app = frozenset(app_xids)
        table = dict(BUILTIN_XIDS)
        for code, rule in (overrides or {}).items():
            base = table.get(code)
            description = rule.description or (base.description if base else f"XID {code}")
            table[code] = XidInfo(
                code, rule.severity, rule.action, description, "operator override"
            )
        self._table = table
        self._unknown = unknown or XidRule(severity="critical", action="operator_check")

    @classmethod
    def from_settings(cls, settings: HealthSettings) -> XidCatalogue:
        return cls(
            app_xids=settings.app_xids,
            overrides=settings.xid_overrides,
            unknown=settings.unknown_xid,
        )

    @property
    def app_xids(self) -> frozenset[int]:
        return self._app

    def lookup(self, code: int) -> XidVerdict:
        info = self._table.get(code)
        if info is None:
            info = XidInfo(
                code,
                self._unknown.severity,
                self._unknown.action,
                self._unknown.description or "XID not in gpulet's catalogue",
                "health.unknown_xid",
            )
        return XidVerdict(info, code in self._app)

    def entries(self) -> list[XidInfo]:
        return [self._table[c] for c in sorted(self._table)]
