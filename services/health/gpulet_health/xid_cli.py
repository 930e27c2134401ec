"""``gpulet health xid [CODE]``: the XID catalogue as this node's settings make it.

Design
------
Offline: it reads the settings (``--config``, environment, ``--set``) and no agent, so
it answers on a node whose agent is down too. With a code it prints that code's entry
(NVIDIA's mnemonic and buckets, whether an application can cause it, gpulet's severity
and action, whether the GPU stays healthy, where the classification comes from, an
operator's override included); without one, every code of the catalogue, one a line.
``--json`` prints the same as JSON. Registered by :func:`gpulet_health.cli.add_commands`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from gpulet_common.cli_support import AddFlags, LoadSettings, bind
from gpulet_health.catalogue import XidCatalogue, XidVerdict, describe, table


def _code(text: str) -> int:
    try:
        code = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an XID number: {text!r}") from None
    if not 0 <= code <= 1_000_000:
        raise argparse.ArgumentTypeError(f"XID numbers run from 0 up, not {code}")
    return code


def _as_json(verdict: XidVerdict) -> dict[str, Any]:
    out = dataclasses.asdict(verdict.info)
    out["application_xid"] = verdict.application
    out["unhealthy"] = verdict.unhealthy
    return out


def _cmd_xid(args: argparse.Namespace, load: LoadSettings) -> int:
    catalogue = XidCatalogue.from_settings(load(args).health)
    code: int | None = getattr(args, "code", None)
    as_json = getattr(args, "json", False)
    if code is None:
        if as_json:
            verdicts = [catalogue.lookup(e.code) for e in catalogue.entries()]
            print(json.dumps([_as_json(v) for v in verdicts], indent=2, ensure_ascii=False))
        else:
            print(table(catalogue), end="")
        return 0
    verdict = catalogue.lookup(code)
    if as_json:
        print(json.dumps(_as_json(verdict), indent=2, ensure_ascii=False))
    else:
        print(describe(verdict), end="")
    return 0


def add_xid_command(health_sub: Any, add_flags: AddFlags, load: LoadSettings) -> None:
    xid = health_sub.add_parser(
        "xid",
        help="print an XID's catalogue entry (NVIDIA's buckets, gpulet's severity and "
        "action, overrides applied); without a code, the whole catalogue",
        argument_default=argparse.SUPPRESS,
    )
    xid.add_argument("code", nargs="?", type=_code, default=None, help="the XID number, e.g. 79")
    xid.add_argument("--json", action="store_true", help="print JSON")
    add_flags(xid)
    xid.set_defaults(func=bind(_cmd_xid, load))
