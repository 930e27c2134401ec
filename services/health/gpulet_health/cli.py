"""Commands of the health service: ``gpulet health state|clear``.

``gpulet`` imports this module and calls :func:`add_commands`; the commands talk to a
running agent over NATS (``--nats``, default ``nats://127.0.0.1:4222``) for the node
given by ``--node`` (default: this host's node name). ``gpulet alerts`` is the
alerting package's (gpulet_alerting.cli).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import msgspec

from gpulet_common import codec, subjects
from gpulet_common.cli_support import (
    AddFlags,
    LoadSettings,
    add_gpu_flag,
    ask_agent,
    bind,
    print_answer,
)
from gpulet_common.messages import HealthClearRequest, HealthState, HealthStateRequest
from gpulet_common.settings import Settings
from gpulet_health.heal_cli import add_remediation_command, cmd_clear_retired
from gpulet_health.remediate_cli import add_remediate_command
from gpulet_health.xid_cli import add_xid_command


def full_builtins(value: Any) -> Any:
    """Like msgspec.to_builtins, but with the fields the wire omits at their default
    (``healthy: true``, ``present: true``): a person reading JSON should see them."""
    if isinstance(value, msgspec.Struct):
        return {f: full_builtins(getattr(value, f)) for f in value.__struct_fields__}
    if isinstance(value, list | tuple):
        return [full_builtins(v) for v in value]
    return msgspec.to_builtins(value)


def format_state(state: HealthState) -> str:
    lines = [f"node {state.node}"]
    for gpu in state.gpus:
        verdict = "healthy" if gpu.healthy else "UNHEALTHY"
        if not gpu.present:
            verdict += " (not present)"
        lines.append(
            f"  GPU {gpu.gpu_index if gpu.gpu_index is not None else '?'} {gpu.gpu_uuid}: {verdict}"
        )
        action = gpu.recovery_action
        held = any(c.condition == "recovery_action" for c in gpu.conditions)
        if held or action not in ("", "none", "unsupported"):
            lines.append(f"    recovery action (NVML field 230): {action or 'not read'}")
        for c in gpu.conditions:
            sticky = ", sticky" if c.sticky else ""
            lines.append(
                f"    - {c.condition} [{c.severity}{sticky}] {c.reason} -> action: {c.action}"
            )
    return "\n".join(lines)


def _run_request(
    args: argparse.Namespace,
    load: LoadSettings,
    what: str,
    make: Callable[[Settings], tuple[str, Any, Any]],
) -> int:
    settings = load(args)
    subject, value, request_codec = make(settings)
    state = ask_agent(
        settings,
        tool=f"gpulet health {what}",
        service="health service",
        subject=subject,
        value=value,
        request=request_codec,
        reply=codec.HEALTH_STATE,
        timeout_s=args.timeout,
    )
    return print_answer(state, args.json, format_state, full_builtins)


def _cmd_state(args: argparse.Namespace, load: LoadSettings) -> int:
    return _run_request(
        args,
        load,
        "state",
        lambda s: (
            subjects.health_state(s.node_name),
            HealthStateRequest(gpu=args.gpu),
            codec.HEALTH_STATE_REQUEST,
        ),
    )


def _cmd_clear(args: argparse.Namespace, load: LoadSettings) -> int:
    if args.retired:
        return cmd_clear_retired(args, load)
    request = HealthClearRequest(gpu=args.gpu, condition=args.condition, requested_by=args.by)
    return _run_request(
        args,
        load,
        "clear",
        lambda s: (subjects.health_clear(s.node_name), request, codec.HEALTH_CLEAR_REQUEST),
    )


def add_commands(sub: Any, add_flags: AddFlags, load: LoadSettings) -> None:

    # `gpulet health` groups the operator tools; the service itself is `gpulet serve
    # health`. Without a command it is `state`: `gpulet health --node X` shows that
    # node's health, it never starts a service.
    health = sub.add_parser(
        "health",
        help="show (the default) or clear the GPU health of a node",
        description="Without a command: state. The service runs with `gpulet serve health`.",
    )
    health.default_action = "state"
    health_sub = health.add_subparsers(
        dest="health_command",
        required=True,
        metavar="{state,clear,xid,remediate,remediation}",
    )

    state = health_sub.add_parser(
        "state",
        help="print each GPU's health and active conditions",
    )
    add_gpu_flag(state, "only this GPU")
    state.add_argument(
        "--json", action="store_true", default=False, help="print the HealthState as JSON"
    )
    state.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the agent")
    add_flags(state)
    state.set_defaults(func=bind(_cmd_state, load))

    clear = health_sub.add_parser(
        "clear",
        help="clear sticky conditions (fatal XID, uncorrectable ECC) of a GPU",
    )
    add_gpu_flag(clear, "the GPU", required=True)
    clear.add_argument(
        "--condition",
        default=None,
        help=(
            "clear only this condition (e.g. xid:79, ecc_uncorrectable, thermal); on a GPU "
            "that is not present, missing/removed/lost forgets the GPU"
        ),
    )
    clear.add_argument("--by", default="operator", help="who clears it (recorded in the event)")
    clear.add_argument(
        "--retired",
        action="store_true",
        default=False,
        help="take a GPU remediation retired (an RMA candidate) back into service",
    )
    clear.add_argument(
        "--json", action="store_true", default=False, help="print the new HealthState as JSON"
    )
    clear.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the agent")
    add_flags(clear)
    clear.set_defaults(func=bind(_cmd_clear, load))
    add_xid_command(health_sub, add_flags, load)
    add_remediate_command(health_sub, add_flags, load)
    add_remediation_command(health_sub, add_flags, load)
