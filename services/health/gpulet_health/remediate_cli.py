"""``gpulet health remediate --dry-run``: what remediation would do now.

The allocator plans remediation (it knows which pods hold which GPU); this command asks
it, on ``gpulet.allocator.<node>.remediation``, and prints the plan: the failed GPUs,
the pods that hold each and how they were found, why, and the circuit breaker's state.
The contract is common (:mod:`gpulet_common.remediation`); nothing of the allocator is
imported. Remediation acts by itself (``remediation.mode = "evict"``); this command
only shows, so ``--dry-run`` is required.
"""

from __future__ import annotations

import argparse
from typing import Any

from gpulet_common import subjects
from gpulet_common.cli_support import (
    AddFlags,
    LoadSettings,
    ask_agent,
    bind,
    print_answer,
    usage_error,
)
from gpulet_common.remediation import (
    ENDPOINT_REMEDIATION,
    REMEDIATION_PLAN,
    REMEDIATION_REQUEST,
    RemediationRequest,
    format_plan,
)


def _cmd_remediate(args: argparse.Namespace, load: LoadSettings) -> int:
    if not args.dry_run:
        return usage_error(
            "gpulet health remediate",
            "remediation acts by itself (remediation.mode = evict); "
            "this command only shows what it would do: add --dry-run",
        )
    settings = load(args)
    plan = ask_agent(
        settings,
        tool="gpulet health remediate",
        service="allocator",
        subject=subjects.allocator_endpoint(settings.node_name, ENDPOINT_REMEDIATION),
        value=RemediationRequest(),
        request=REMEDIATION_REQUEST,
        reply=REMEDIATION_PLAN,
        timeout_s=args.timeout,
    )
    return print_answer(plan, args.json, format_plan)


def add_remediate_command(health_sub: Any, add_flags: AddFlags, load: LoadSettings) -> None:
    remediate = health_sub.add_parser(
        "remediate",
        help="show what remediation would do now (which pods, which GPUs, why, the breaker)",
    )
    remediate.add_argument(
        "--dry-run", action="store_true", default=False, help="show, change nothing (required)"
    )
    remediate.add_argument("--json", action="store_true", default=False, help="print JSON")
    remediate.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for the allocator"
    )
    add_flags(remediate)
    remediate.set_defaults(func=bind(_cmd_remediate, load))
