"""``gpulet allocator [state]|release|reset``: talk to a running allocator.

Why here
--------
The allocator service itself is ``gpulet serve allocator`` (sidecar mode); ``gpulet
allocator`` groups the operator's actions on a running one. They speak the allocator's
NATS API (:mod:`.protocol`) with the node's settings, like ``gpulet watch`` does, and
print either a table for people or JSON (``--json``).

The protocol is imported when a command runs, not when ``gpulet`` builds its parser:
it pulls in the plugin package and so grpcio, which a sidecar image without the
allocator extra does not have.

Release names allocations the way the allocator knows them: kubelet's Allocate
carries no pod UID, so an allocation is an ID (``state`` lists them; containers see
``GPULET_ALLOCATION_ID``) or the ``namespace/name`` of its pod once PodResources has
reported it.

Reset accepts the loss of the allocation record after a corrupt checkpoint (the
allocator refuses to allocate until then, unless PodResources rebuilt it). It needs
``--confirm``: GPUs that running pods hold and that PodResources could not name may
be handed out again.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpulet_common import subjects
from gpulet_common.cli_support import (
    AddFlags,
    Command,
    LoadSettings,
    ask_agent,
    bind,
    print_answer,
    usage_error,
)
from gpulet_common.codec import Codec
from gpulet_common.settings import Settings

if TYPE_CHECKING:
    from gpulet_allocator import protocol as p


def _call(
    args: argparse.Namespace,
    settings: Settings,
    what: str,
    endpoint: str,
    value: Any,
    request: Codec[Any],
    reply: Codec[Any],
    show: Callable[[Any], str],
) -> Any:
    """Ask the allocator and print its answer (as JSON with ``--json``, else
    ``show(answer)``); None (and why, on stderr) when there is no usable answer."""
    answer = ask_agent(
        settings,
        tool=f"gpulet allocator {what}",
        service="allocator",
        subject=subjects.allocator_endpoint(settings.node_name, endpoint),
        value=value,
        request=request,
        reply=reply,
        timeout_s=args.timeout,
    )
    print_answer(answer, args.json, show)
    return answer


def _mib(units: int) -> str:
    from gpulet_allocator.protocol import MEMORY_UNIT_MIB

    return f"{units * MEMORY_UNIT_MIB / 1024:g} GiB"


def format_state(state: p.StateReply) -> str:
    from gpulet_allocator.protocol import CORES_PER_GPU

    if state.lost:
        readiness = f"NOT READY ({state.lost})"
    else:
        readiness = "ready" if state.ready else "NOT READY (no inventory)"
    lines = [f"node {state.node}: {readiness}"]
    lines.append(f"checkpoint {state.checkpoint}")
    lines.append("")
    lines.append(f"{'GPU':>3}  {'UUID':<42} {'HEALTH':<9} {'CORES':>7} {'MEMORY':>17}  HELD BY")
    for g in state.gpus:
        health = "healthy" if g.healthy else "UNHEALTHY"
        if not g.present:
            health = "LOST"
        holder = g.whole or ", ".join(g.shares) or "-"
        memory = f"{_mib(g.memory_used)}/{_mib(g.memory_units)}"
        cores = f"{g.cores_used:>3}/{CORES_PER_GPU}"
        lines.append(f"{g.index:>3}  {g.uuid:<42} {health:<9} {cores} {memory:>17}  {holder}")
    lines.append("")
    if not state.allocations:
        lines.append("no allocations")
    for a in state.allocations:
        pods = sorted({f"{g.pod}/{g.container}" for g in a.grants if g.pod})
        size = (
            f"{len(a.gpus)} whole GPU(s)"
            if a.kind == "whole"
            else f"{a.cores} core units, {_mib(a.memory_units)}"
        )
        lines.append(f"{a.id}  {size} on {', '.join(a.gpus)}  pod: {', '.join(pods) or '?'}")
    return "\n".join(lines)


def _cmd_state(args: argparse.Namespace, load: LoadSettings) -> int:
    from gpulet_allocator import protocol as p

    settings = load(args)
    state = _call(
        args,
        settings,
        "state",
        p.ENDPOINT_STATE,
        p.StateRequest(),
        p.STATE_REQUEST,
        p.STATE_REPLY,
        format_state,
    )
    return 1 if state is None else 0


def _cmd_release(args: argparse.Namespace, load: LoadSettings) -> int:
    from gpulet_allocator import protocol as p

    settings = load(args)
    ids = [t for t in args.targets if "/" not in t]
    pods = [t for t in args.targets if "/" in t]
    if args.device_id and not args.resource:
        return usage_error("gpulet allocator release", "--device-id needs --resource")
    if not (ids or pods or args.device_id):
        return usage_error("gpulet allocator release", "name an allocation, a pod or --device-id")
    request = p.ReleaseRequest(
        allocation_ids=ids,
        pods=pods,
        resource=args.resource or "",
        device_ids=list(args.device_id or []),
        reason=args.reason,
    )
    reply = _call(
        args,
        settings,
        "release",
        p.ENDPOINT_RELEASE,
        request,
        p.RELEASE_REQUEST,
        p.RELEASE_REPLY,
        _format_released,
    )
    return 0 if reply is not None and reply.released else 1


def _format_released(reply: p.ReleaseReply) -> str:
    done = [f"released {a.id} ({a.kind} on {', '.join(a.gpus)})" for a in reply.released]
    return "\n".join(done) or "nothing released (no allocation matched)"


def _cmd_reset(args: argparse.Namespace, load: LoadSettings) -> int:
    from gpulet_allocator import protocol as p

    if not args.confirm:
        return usage_error(
            "gpulet allocator reset",
            "this accepts that allocations of running pods may be unknown and their GPUs "
            "handed out again; add --confirm",
        )
    settings = load(args)
    request = p.ResetRequest(confirm=True, requested_by=args.requested_by)
    reply = _call(
        args,
        settings,
        "reset",
        p.ENDPOINT_RESET,
        request,
        p.RESET_REQUEST,
        p.RESET_REPLY,
        lambda r: str(r.detail),
    )
    return 1 if reply is None else 0


def add_commands(sub: Any, add_flags: AddFlags, load: LoadSettings) -> None:

    # The service itself is `gpulet serve allocator`; `gpulet allocator` alone (or with
    # only settings flags) is `gpulet allocator state`.
    parser = sub.add_parser(
        "allocator",
        help="show (the default), release or reset a node's allocations",
        description=("Without a command: state. The service runs with `gpulet serve allocator`."),
    )
    parser.default_action = "state"

    def asks(command: argparse.ArgumentParser, run: Command) -> None:
        """The flags of a command that asks the allocator, and what it runs."""
        command.add_argument("--json", action="store_true", help="print the raw reply as JSON")
        command.add_argument("--timeout", type=float, default=2.0, help="seconds to wait")
        add_flags(command)
        command.set_defaults(func=bind(run, load))

    actions = parser.add_subparsers(
        dest="allocator_action", metavar="{state,release,reset}", required=True
    )

    state = actions.add_parser("state", help="show the node's GPUs and allocations")
    asks(state, _cmd_state)

    release = actions.add_parser(
        "release",
        help="release allocations (when kubelet's PodResources API is not available)",
    )
    release.add_argument(
        "targets",
        nargs="*",
        metavar="ALLOCATION_ID|NAMESPACE/POD",
        help="allocation IDs (see `state`) or pods as namespace/name",
    )
    release.add_argument("--resource", help="resource of --device-id, e.g. nvidia.com/gpu")
    release.add_argument(
        "--device-id", action="append", help="a device ID kubelet gave the container (repeat)"
    )
    release.add_argument("--reason", default="operator", help="recorded in the allocator's log")
    asks(release, _cmd_release)

    reset = actions.add_parser(
        "reset",
        help="accept the loss of the allocation record after a corrupt checkpoint",
        description=(
            "After a corrupt checkpoint the allocator refuses to allocate until kubelet's "
            "PodResources API rebuilt its record. Where it cannot (no PodResources, GPU "
            "shares in use), this accepts the loss: allocations rebuilt so far are kept, "
            "GPUs of running pods that were not rebuilt may be handed out again."
        ),
    )
    reset.add_argument("--confirm", action="store_true", help="required: you accept the loss")
    reset.add_argument("--requested-by", default="operator", help="recorded in the allocator's log")
    asks(reset, _cmd_reset)
