"""The XID catalogue: what each XID means, how bad it is and what to do about it.

Design
------
An XID is the driver's error code for a GPU fault. The number alone says little;
operators need a *severity* (does the GPU stay usable?) and a *recommended action*
(restart the application, reset the GPU, reboot, send the board for inspection).

The built-in table is NVIDIA's whole XID catalogue, codes 1 to 173 ("Unused" ones
included, with their bucket), kept as data in :mod:`gpulet_common.xid_table`: NVIDIA's
mnemonic and resolution buckets (immediate and investigatory), whether an application
can cause the code, our category, and gpulet's severity and action derived from the
immediate bucket (that module's docstring gives the mapping and its exceptions). The
sources are NVIDIA's public "Analyzing Xid Errors with the Xid Catalog" page
(docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html) and GPUd's generated
mirror of it (leptonai/gpud ``components/accelerator/nvidia/xid/catalog_generated.go``).
Three layers decide how an XID is treated, in this order:

1. ``health.xid_overrides``: an operator's entry for a code replaces the built-in
   severity and action (and description, if given); the catalogue's other facts stay.
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

``python -m gpulet_health.catalogue --markdown`` prints the table of docs/health.md
(a test keeps the two in step); ``gpulet health xid [CODE]`` prints entries.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpulet_common.messages import UNHEALTHY_SEVERITIES, Action, Severity
from gpulet_common.settings.health import HealthSettings, XidRule
from gpulet_common.xid_table import NOTES, ROWS, AppCause

CATALOGUE_SOURCE = "NVIDIA XID catalogue"


@dataclass(frozen=True, slots=True)
class XidInfo:
    code: int
    severity: Severity
    action: Action
    description: str
    # Where the severity and action come from, for `gpulet health xid` and events.
    source: str = CATALOGUE_SOURCE
    mnemonic: str = ""
    category: str = ""
    # Can an application cause it: "yes", "check" (the catalogue says check the app), "no".
    app: AppCause = "no"
    # NVIDIA's resolution buckets ("" where the catalogue gives none).
    immediate: str = ""
    investigatory: str = ""
    note: str = ""

    @property
    def in_catalogue(self) -> bool:
        return bool(self.mnemonic or self.immediate or self.category)


BUILTIN_XIDS: Mapping[int, XidInfo] = {
    row.code: XidInfo(
        row.code,
        row.severity,
        row.action,
        row.description,
        CATALOGUE_SOURCE,
        row.mnemonic,
        row.category,
        row.app,
        row.immediate,
        row.investigatory,
        NOTES.get(row.code, ""),
    )
    for row in ROWS
}


@dataclass(frozen=True, slots=True)
class XidVerdict:
    info: XidInfo
    application: bool

    @property
    def unhealthy(self) -> bool:
        return not self.application and self.info.severity in UNHEALTHY_SEVERITIES


def _overridden(code: int, rule: XidRule) -> XidInfo:
    base = BUILTIN_XIDS.get(code)
    if base is None:
        return XidInfo(
            code, rule.severity, rule.action, rule.description or f"XID {code}", "operator override"
        )
    return XidInfo(
        code,
        rule.severity,
        rule.action,
        rule.description or base.description,
        f"operator override (catalogue: {base.severity} / {base.action})",
        base.mnemonic,
        base.category,
        base.app,
        base.immediate,
        base.investigatory,
        base.note,
    )


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
            table[code] = _overridden(code, rule)
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


# --- printing ------------------------------------------------------------------------

_APP = {"yes": "yes", "check": "check app", "no": "-"}


def _cell(text: str) -> str:
    return (text or "-").replace("|", "\\|")


def markdown(entries: Iterable[XidInfo]) -> str:
    """The catalogue as a Markdown table (docs/health.md's, from the built-in table)."""
    lines = [
        "| XID | Mnemonic | Category | App? | Immediate | Investigatory | Severity | Action |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        cells = [
            str(e.code),
            e.mnemonic,
            e.category,
            _APP[e.app],
            e.immediate,
            e.investigatory,
            e.severity,
            e.action,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def describe(verdict: XidVerdict) -> str:
    """One entry, as ``gpulet health xid CODE`` prints it."""
    e = verdict.info
    healthy = "no (the GPU is unhealthy until cleared or reset)"
    if verdict.application:
        healthy = "yes: an application XID (health.app_xids), reported only"
    elif not verdict.unhealthy:
        healthy = "yes: reported only"
    fields = [
        ("XID", str(e.code)),
        ("mnemonic", e.mnemonic or "-"),
        ("description", e.description),
        ("category", e.category or "-"),
        ("application can cause it", _APP[e.app].replace("-", "no")),
        ("NVIDIA immediate", e.immediate or "-"),
        ("NVIDIA investigatory", e.investigatory or "-"),
        ("severity", e.severity),
        ("action", e.action),
        ("GPU stays healthy", healthy),
        ("source", e.source),
    ]
    if e.note:
        fields.append(("note", e.note))
    width = max(len(k) for k, _ in fields)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in fields) + "\n"


def table(catalogue: XidCatalogue) -> str:
    """Every entry, one line each, as ``gpulet health xid`` prints it."""
    rows = [("XID", "MNEMONIC", "SEVERITY", "ACTION", "APP", "IMMEDIATE")]
    for e in catalogue.entries():
        app = "app-xid" if e.code in catalogue.app_xids else _APP[e.app]
        rows.append((str(e.code), e.mnemonic or "-", e.severity, e.action, app, e.immediate or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return (
        "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        )
        + "\n"
    )


def main(argv: list[str]) -> int:
    if argv != ["--markdown"]:
        print("usage: python -m gpulet_health.catalogue --markdown", file=sys.stderr)
        return 2
    sys.stdout.write(markdown(BUILTIN_XIDS.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
