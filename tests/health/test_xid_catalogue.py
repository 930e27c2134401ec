"""The XID catalogue against the reference table, the docs, the overrides and the CLI.

The reference is the team's transcription of NVIDIA's XID catalogue
(``tests/health/data/xid_reference.md``, committed, so that CI without the shared notes
runs it); where the shared notes are checked out beside the repository
(``../shared/reference/xid-catalogue.md``), they are parsed too and must agree with it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpulet_common import config
from gpulet_common.settings.health import HealthSettings, XidRule
from gpulet_health.catalogue import BUILTIN_XIDS, XidCatalogue, markdown

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).with_name("data") / "xid_reference.md"
# ../shared beside the checkout (a worktree sits one level deeper), or shared/ inside it.
SHARED = next(
    (
        p
        for base in (ROOT.parent, ROOT.parent.parent, ROOT)
        if (p := base / "shared" / "reference" / "xid-catalogue.md").exists()
    ),
    ROOT.parent / "shared" / "reference" / "xid-catalogue.md",
)


@dataclass
class Ref:
    code: int
    mnemonic: str | None  # None: the reference gives none for this code alone
    app: str
    immediate: str
    investigatory: str | None  # None: free text, not compared
    unused: bool = False


DASH = "\u2013"  # the reference writes ranges with an en dash: 39\u201341


def _codes(text: str) -> list[int]:
    out: list[int] = []
    for part in re.findall(rf"\d+(?:{DASH}\d+)?", text):
        lo, _, hi = part.partition(DASH)
        out += range(int(lo), int(hi or lo) + 1)
    return out


def _bucket(text: str) -> str:
    text = text.strip()
    return "" if text in ("\u2014", "") else re.sub(r"\bWF_", "WORKFLOW_", text)


def _mnemonics(cell: str, count: int) -> list[str | None]:
    """The per-code mnemonics of a row's cell, where the cell spells them out."""
    cell = cell.strip()
    if count == 1:
        return [None if cell.startswith("(") else cell]
    braces = re.fullmatch(r"(\w*)\{([\w,]+)\}(\w*)", cell)
    if braces:
        names = [braces[1] + n + braces[3] for n in braces[2].split(",")]
    elif cell.startswith("CE0\u2026CE19"):
        names = [f"CE{i}_ERROR" for i in range(20)]
    else:
        names = [n.strip() for n in cell.split(",")]
    return list(names) if len(names) == count else [None] * count


def parse_reference(text: str) -> dict[int, Ref]:
    refs: dict[int, Ref] = {}
    in_use = text.split("### Codes in use", 1)[1].split("### ", 1)[0]
    for line in in_use.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or not cells[0][:1].isdigit():
            continue
        codes = _codes(cells[0])
        for code, mnemonic in zip(codes, _mnemonics(cells[1], len(codes)), strict=True):
            inv = _bucket(cells[5])
            token = re.fullmatch(r"[A-Z0-9_/]+( \(sympathetic\))?", inv) or inv == ""
            refs[code] = Ref(
                code,
                mnemonic,
                {"Y": "yes", "c": "check", "": "no"}[cells[3]],
                _bucket(cells[4]),
                inv if token else None,
            )
    unused = text.split('### "Unused" in the catalogue', 1)[1].split("### ", 1)[0]
    for line in unused.splitlines():
        found = re.match(r"- Immediate bucket (\w+): (.*)", line)
        if found:
            body = found[2].split("(")[0]
            for code in _codes(body):
                refs[code] = Ref(code, None, "no", found[1], None, unused=True)
        app = re.match(r"- Only (\d+) is app-flagged", line)
        if app:
            refs[int(app[1])].app = "yes"
    return refs


def test_the_reference_fixture_parses_into_the_whole_catalogue() -> None:
    refs = parse_reference(FIXTURE.read_text())
    assert sorted(refs) == list(range(1, 174))
    assert sum(r.unused for r in refs.values()) == 63
    assert len(refs) - 63 == 110  # 109 catalogue codes in use, and GPUd's 173


@pytest.mark.skipif(not SHARED.exists(), reason="the shared reference notes are not here")
def test_the_fixture_agrees_with_the_shared_reference() -> None:
    assert parse_reference(SHARED.read_text()) == parse_reference(FIXTURE.read_text())


def test_every_code_matches_the_reference() -> None:
    refs = parse_reference(FIXTURE.read_text())
    assert sorted(BUILTIN_XIDS) == sorted(refs)
    wrong: list[str] = []
    for code, ref in sorted(refs.items()):
        entry = BUILTIN_XIDS[code]
        if ref.mnemonic is not None and entry.mnemonic != ref.mnemonic:
            wrong.append(f"{code}: mnemonic {entry.mnemonic!r}, reference {ref.mnemonic!r}")
        if entry.app != ref.app:
            wrong.append(f"{code}: app {entry.app!r}, reference {ref.app!r}")
        if entry.immediate != ref.immediate:
            wrong.append(f"{code}: immediate {entry.immediate!r}, reference {ref.immediate!r}")
        if ref.investigatory is not None and entry.investigatory != ref.investigatory:
            wrong.append(f"{code}: investigatory {entry.investigatory!r} vs {ref.investigatory!r}")
        if ref.unused != (entry.category == "unused"):
            wrong.append(f"{code}: category {entry.category!r}, unused: {ref.unused}")
    assert wrong == []
    # The comparison is not empty: most mnemonics are spelt out per code.
    assert sum(r.mnemonic is not None for r in refs.values()) > 80


def test_severity_follows_the_bucket_and_keeps_the_earlier_sixteen() -> None:
    earlier = {
        13: ("warning", "restart_app"),
        31: ("warning", "restart_app"),
        43: ("warning", "restart_app"),
        45: ("info", "none"),
        48: ("fatal", "reset_gpu"),
        63: ("info", "none"),
        64: ("critical", "reset_gpu"),
        68: ("warning", "restart_app"),
        74: ("critical", "reset_gpu"),
        79: ("fatal", "reboot"),
        92: ("warning", "none"),
        94: ("warning", "restart_app"),
        95: ("fatal", "reset_gpu"),
        109: ("critical", "reset_gpu"),
        119: ("fatal", "reset_gpu"),
        120: ("fatal", "reset_gpu"),
    }
    assert {c: (BUILTIN_XIDS[c].severity, BUILTIN_XIDS[c].action) for c in earlier} == earlier
    for entry in BUILTIN_XIDS.values():
        if entry.immediate == "RESTART_APP":
            assert entry.severity == "warning", entry
        if entry.immediate in ("RESET_GPU", "RESTART_BM", "CONTACT_SUPPORT"):
            assert entry.severity in ("critical", "fatal"), entry
    # Unused codes are still classified, with their bucket.
    assert BUILTIN_XIDS[9].severity == "critical"
    assert BUILTIN_XIDS[14].immediate == "IGNORE"


def test_docs_table_is_the_generated_one() -> None:
    doc = (ROOT / "docs" / "health.md").read_text()
    found = re.search(r"<!-- xid-table:start -->\n(.*?)<!-- xid-table:end -->", doc, re.S)
    assert found, "docs/health.md lost its xid-table markers"
    assert found[1] == markdown(BUILTIN_XIDS.values()), (
        "docs/health.md's XID table is stale: python -m gpulet_health.catalogue --markdown"
    )
    printed = subprocess.run(
        [sys.executable, "-m", "gpulet_health.catalogue", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed == found[1]


def test_an_override_changes_severity_and_keeps_the_catalogue_facts() -> None:
    settings = HealthSettings(xid_overrides={74: XidRule(severity="warning", action="none")})
    verdict = XidCatalogue.from_settings(settings).lookup(74)
    assert (verdict.info.severity, verdict.info.action) == ("warning", "none")
    assert not verdict.unhealthy
    assert verdict.info.mnemonic == "NVLINK_ERROR"
    assert verdict.info.immediate == "WORKFLOW_NVLINK_ERR"
    assert "critical / reset_gpu" in verdict.info.source


def test_overrides_from_json_config_and_errors_name_what_is_allowed(tmp_path: Path) -> None:
    path = tmp_path / "gpulet.json"
    path.write_text('{"health": {"xid_overrides": {"79": {"severity": "warning"}}}}')
    assert config.load(path, env={}).health.xid_overrides[79].severity == "warning"
    cases = {
        '{"79": {"severity": "bad"}}': (
            "health.xid_overrides.79.severity",
            "one of: info, warning, critical, fatal",
        ),
        '{"12": {}, "79": {"action": "drain"}}': (
            "health.xid_overrides.79.action",
            "one of: none, restart_app, reset_gpu, reboot, hardware_inspection, operator_check",
        ),
        '{"abc": {"severity": "warning"}}': ("health.xid_overrides", "'abc' is not a number"),
        '{"79": "warning"}': (
            "health.xid_overrides.79",
            "a table with: severity, action, description",
        ),
        '{"79": {"sevrity": "warning"}}': ("health.xid_overrides.79.sevrity", "unknown setting"),
        '{"-3": {"severity": "warning"}}': ("health", "XID numbers are 0 or more, not -3"),
    }
    for overrides, (setting, says) in cases.items():
        path.write_text(f'{{"health": {{"xid_overrides": {overrides}}}}}')
        with pytest.raises(config.ConfigError) as caught:
            config.load(path, env={})
        assert caught.value.setting == setting, overrides
        assert says in caught.value.problem, (overrides, caught.value.problem)


def test_gpulet_health_xid_prints_an_entry_and_the_table(tmp_path: Path) -> None:
    def _gpulet(*args: str) -> subprocess.CompletedProcess[str]:
        # A bare environment: no GPULET_* setting or config file of the caller's.
        return subprocess.run(
            [sys.executable, "-m", "gpulet", "health", "xid", *args],
            capture_output=True,
            text=True,
            check=False,
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        )

    one = _gpulet("45")
    assert one.returncode == 0, one.stderr
    assert "PREEMPTIVE_REMOVAL" in one.stdout
    assert "WORKFLOW_XID_45" in one.stdout
    assert re.search(r"severity:\s+info", one.stdout)
    overridden = _gpulet("79", "--set", 'health.xid_overrides={"79": {"severity": "warning"}}')
    assert overridden.returncode == 0, overridden.stderr
    assert re.search(r"severity:\s+warning", overridden.stdout)
    assert "operator override (catalogue: fatal / reboot)" in overridden.stdout
    everything = _gpulet()
    assert everything.returncode == 0, everything.stderr
    assert len(everything.stdout.splitlines()) == 1 + 173
    assert _gpulet("x9").returncode == 2
