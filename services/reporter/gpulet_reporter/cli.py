"""``gpulet reporter-preview``: print the Device, node labels, node condition and taint
this node would get.

It asks the running agent (``--nats``, default the node-local server, as every tool
does) for its inventory and health state, exactly as the reporter does at start, and
renders them with the reporter's own code (:class:`~gpulet_reporter.core.ReporterCore`:
the GPUs the health service keeps as absent stay in the Device; the node-health
evaluation, with the node's boot ID), so it shows what the agent's reporter writes
(tests/health/test_expected_gpus.py compares the two). It never opens NVML itself:
beside a running agent that would compete for the GPUs, and a preview that reads other
GPUs than the agent's would answer another question. To preview without GPUs, run the agent with the
mock (``gpulet run --nvml mock:dgx-h100``) and ask it.

Nothing is written anywhere; ``--device-only`` prints just the Device, ready for
``kubectl apply -f -``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import anyio

from gpulet_common import codec, subjects
from gpulet_common.bootid import read_boot_id
from gpulet_common.bus import BusError, Refused, RequestTimeout
from gpulet_common.cli_support import AddFlags, LoadSettings, tool_bus
from gpulet_common.messages import HealthState, HealthStateRequest, Inventory, InventoryRequest
from gpulet_common.settings import Settings
from gpulet_reporter.desired import render_device
from gpulet_reporter.facts import node_facts, read_machine_type
from gpulet_reporter.pcie import make_resolver


class PreviewError(Exception):
    pass


async def _from_agent(settings: Settings, timeout_s: float) -> tuple[Inventory, HealthState | None]:
    async with tool_bus(settings, "gpulet-reporter-preview") as bus:
        try:
            inventory = await bus.request(
                subjects.inventory_request(settings.node_name),
                InventoryRequest(reason="gpulet reporter-preview"),
                codec.INVENTORY_REQUEST,
                codec.INVENTORY,
                timeout_s=timeout_s,
            )
        except (RequestTimeout, Refused) as exc:
            raise PreviewError(
                f"no inventory from the agent of node {settings.node_name!r}: {exc} "
                "(is the agent running? is --node right?)"
            ) from exc
        try:
            state: HealthState | None = await bus.request(
                subjects.health_state(settings.node_name),
                HealthStateRequest(),
                codec.HEALTH_STATE_REQUEST,
                codec.HEALTH_STATE,
                timeout_s=timeout_s,
            )
        except (RequestTimeout, Refused):
            state = None
    return inventory, state


async def preview(settings: Settings, *, timeout_s: float = 2.0) -> dict[str, Any]:
    """The Device and node labels, as the running agent's reporter renders them."""
    # Here, not at the top: node_health pulls in the Kubernetes client (~40 MB), and
    # every `gpulet` process (a collector sidecar too) imports this module's commands.
    from gpulet_reporter.core import ReporterCore
    from gpulet_reporter.node_health import (
        REASON_UNREACHABLE,
        TAINT_EFFECT,
        TAINT_KEY,
        evaluate,
        render_condition,
        unknown,
        with_boot_id,
    )

    inventory, state = await _from_agent(settings, timeout_s)
    # The reporter's own code with the reporter's inputs: its core (the GPUs the health
    # service keeps as absent stay in the Device), its node-health evaluation and the
    # node's boot ID in the condition.
    core = ReporterCore(
        settings.node_name,
        settings.reporter,
        pcie_root=make_resolver(),
        facts=node_facts(settings, read_machine_type()),
    )
    core.on_inventory(inventory)
    for health in state.gpus if state is not None else ():
        core.on_health(health.gpu_uuid, health)
    desired = core.desired
    if desired is None:
        raise PreviewError(
            f"the agent of node {settings.node_name!r} has no usable inventory yet: "
            f"{inventory.degraded_reason or 'no GPUs listed'}"
        )
    now = time.time()
    device = render_device(desired, None, node_uid=None, now=now)
    labels = dict(desired.node_labels) if settings.reporter.node_labels else {}
    policy = settings.reporter.taint_policy
    if state is not None:
        healths = {g.gpu_uuid: g for g in state.gpus}
        intent = evaluate(inventory, healths, policy=policy)
    else:
        intent = unknown(REASON_UNREACHABLE, "the health service did not answer", policy=policy)
    intent = with_boot_id(intent, read_boot_id()) or intent
    result: dict[str, Any] = {"device": device, "nodeLabels": labels}
    if settings.reporter.node_condition:
        result["nodeCondition"] = render_condition(intent, None, now=now)
        # true: the taint would be added; false: removed; null: left as it is.
        result["nodeTaint"] = {
            "key": TAINT_KEY,
            "effect": TAINT_EFFECT,
            "present": intent.taint,
        }
    return result


def _cmd_preview(args: argparse.Namespace, load: LoadSettings) -> int:
    settings = load(args)
    try:
        result = anyio.run(lambda: preview(settings, timeout_s=args.timeout))
    except (PreviewError, BusError) as exc:
        print(f"gpulet reporter-preview: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result["device"] if args.device_only else result, indent=2))
    return 0


def add_commands(sub: Any, add_flags: AddFlags, load: LoadSettings) -> None:
    p = sub.add_parser(
        "reporter-preview",
        help="print the Device CR and node labels the running agent's reporter renders "
        "(asks the agent over NATS; writes nothing)",
    )
    p.add_argument("--device-only", action="store_true", help="print only the Device object")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the agent")
    add_flags(p)
    p.set_defaults(func=lambda args: _cmd_preview(args, load))
