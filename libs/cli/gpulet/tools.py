"""Operator tools that talk to a running agent: watch, schema, mock."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

import anyio
import msgspec

from gpulet_common import catalog, codec, subjects
from gpulet_common.bus import Bus, BusError, Refused, RequestTimeout
from gpulet_common.cli_support import (
    AddFlags,
    LoadSettings,
    add_gpu_flag,
    bind,
    gpu_index,
    tool_bus,
)
from gpulet_common.messages import InventoryRequest, MockInjectRequest
from gpulet_common.mock_nvml.faultspec import FAULT_KINDS
from gpulet_common.settings import Settings
from gpulet_common.untrusted import UntrustedDocumentError, json_document


async def watch(
    settings: Settings, subject: str, *, count: int, timeout_s: float, raw: bool
) -> int:
    received = 0
    async with tool_bus(settings, "gpulet-watch") as bus:
        sub = await bus.client.subscribe(subject)
        if catalog.could_match(subject, subjects.inventory(settings.node_name)):
            # The inventory is published on change; ask for it so the watcher sees it now.
            await bus.client.publish(
                subjects.inventory_request(settings.node_name),
                codec.INVENTORY_REQUEST.encode(InventoryRequest(reason="gpulet watch")),
            )
        with anyio.move_on_after(timeout_s if timeout_s > 0 else float("inf")):
            async for msg in sub.messages:
                msg_codec = None if raw else catalog.codec_for(msg.subject)
                if msg_codec is None:
                    body: Any = msg.data.decode(errors="replace")
                    # Shown parsed when it is JSON of a sane depth, as text otherwise.
                    with contextlib.suppress(UntrustedDocumentError):
                        body = json_document(
                            msg.data,
                            max_bytes=bus.limits.max_bytes,
                            max_depth=bus.limits.max_depth,
                            what=msg.subject,
                        )
                else:
                    delivery = bus.decode(msg, msg_codec)
                    if delivery is None:
                        print(
                            f"# {msg.subject}: bad {msg_codec.name}, dropped",
                            file=sys.stderr,
                        )
                        continue
                    body = msgspec.to_builtins(delivery.value)
                print(json.dumps({"subject": msg.subject, "data": body}), flush=True)
                received += 1
                if count and received >= count:
                    break
    return 0


def _cmd_watch(args: argparse.Namespace, load: LoadSettings) -> int:
    settings = load(args)
    try:
        return anyio.run(
            lambda: watch(
                settings, args.subject, count=args.count, timeout_s=args.timeout, raw=args.raw
            )
        )
    except BusError as exc:
        print(f"gpulet watch: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _cmd_schema(args: argparse.Namespace, _load: LoadSettings) -> int:
    schemas = catalog.json_schemas()
    if args.subject:
        wanted = {k: v for k, v in schemas["subjects"].items() if args.subject in k}
        if not wanted:
            print(f"gpulet schema: no subject matches {args.subject!r}", file=sys.stderr)
            return 1
        schemas["subjects"] = wanted
    print(json.dumps(schemas, indent=2))
    return 0


async def _index_of(bus: Bus, settings: Settings, uuid: str, timeout_s: float) -> int | None:
    """The index of the GPU ``uuid`` in the agent's inventory (the mock takes indices)."""
    inventory = await bus.request(
        subjects.inventory_request(settings.node_name),
        InventoryRequest(reason="gpulet mock inject"),
        codec.INVENTORY_REQUEST,
        codec.INVENTORY,
        timeout_s=timeout_s,
    )
    return next((g.index for g in inventory.gpus if g.uuid == uuid), None)


async def inject(
    settings: Settings, request: MockInjectRequest, timeout_s: float, *, gpu: str | None = None
) -> int:
    """Send ``request``; ``gpu`` (a UUID or an index) names its GPU."""
    async with tool_bus(settings, "gpulet-mock") as bus:
        try:
            if gpu is not None:
                index = gpu_index(gpu)
                if index is None:
                    index = await _index_of(bus, settings, gpu, timeout_s)
                    if index is None:
                        print(
                            f"gpulet mock inject: node {settings.node_name!r} has no GPU {gpu}",
                            file=sys.stderr,
                        )
                        return 1
                request = msgspec.structs.replace(request, gpu=index)
            reply = await bus.request(
                subjects.mock_inject(settings.node_name),
                request,
                codec.MOCK_INJECT_REQUEST,
                codec.MOCK_INJECT_REPLY,
                timeout_s=timeout_s,
            )
        except RequestTimeout:
            print(
                "gpulet mock inject: no agent with a mock NVML answered for node "
                f"{settings.node_name!r} (is `gpulet run --nvml mock` running? is --node right?)",
                file=sys.stderr,
            )
            return 1
        except Refused as exc:
            print(f"gpulet mock inject: rejected: {exc}", file=sys.stderr)
            return 1
    if not reply.applied:
        # What the mock refused (no GPU 9, a fault it does not know) is one line on
        # stderr, like a GPU the inventory does not list (above).
        print(f"gpulet mock inject: not applied: {reply.detail}", file=sys.stderr)
        return 1
    print(json.dumps(msgspec.to_builtins(reply)))
    return 0


def _cmd_mock_inject(args: argparse.Namespace, load: LoadSettings) -> int:
    settings = load(args)
    fault, value = args.fault, args.value
    if args.xid is not None:
        fault, value = "xid", float(args.xid)
    if not fault:
        print("gpulet mock inject: give --fault or --xid", file=sys.stderr)
        return 2
    request = MockInjectRequest(
        fault=fault, value=value, duration_s=args.duration, gi=args.gi, ci=args.ci
    )
    try:
        return anyio.run(lambda: inject(settings, request, args.timeout, gpu=args.gpu))
    except BusError as exc:
        print(f"gpulet mock inject: {exc}", file=sys.stderr)
        return 1


def _cmd_mock_scenarios(_args: argparse.Namespace, _load: LoadSettings) -> int:
    from gpulet_common.mock_nvml.scenario import list_scenarios

    for name in list_scenarios():
        print(name)
    return 0


def add_commands(sub: Any, add_flags: AddFlags, load: LoadSettings) -> None:

    w = sub.add_parser("watch", help="print decoded messages of a subject as JSON lines")
    w.add_argument("subject", help="subject or wildcard, e.g. 'gpu.>' or 'gpu.health.*'")
    w.add_argument("--count", type=int, default=0, help="stop after N messages (0: never)")
    w.add_argument("--timeout", type=float, default=0, help="stop after S seconds (0: never)")
    w.add_argument("--raw", action="store_true", help="print payloads without decoding")
    add_flags(w)
    w.set_defaults(func=bind(_cmd_watch, load))

    s = sub.add_parser("schema", help="print the JSON Schema of every subject's payload")
    s.add_argument("subject", nargs="?", help="only subjects containing this text")
    s.set_defaults(func=bind(_cmd_schema, load))

    mock = sub.add_parser("mock", help="drive the mock NVML of a running agent")
    mock_sub = mock.add_subparsers(dest="mock_command", required=True)
    inj = mock_sub.add_parser("inject", help="inject a fault, e.g. --gpu 2 --xid 79")
    add_gpu_flag(inj, "the GPU (omit for node-wide faults)")
    inj.add_argument("--xid", type=int, help="shorthand for --fault xid --value N")
    inj.add_argument(
        "--fault",
        help=", ".join(FAULT_KINDS),
    )
    inj.add_argument(
        "--value", type=float, help="fault value (XID code, temperature, count, NVLink number)"
    )
    inj.add_argument("--duration", type=float, help="seconds the fault lasts, where it applies")
    inj.add_argument("--gi", type=int, help="an XID on one MIG device: its GPU-instance id")
    inj.add_argument("--ci", type=int, help="an XID on one MIG device: its compute-instance id")
    inj.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the agent")
    add_flags(inj)
    inj.set_defaults(func=bind(_cmd_mock_inject, load))
    scen = mock_sub.add_parser("scenarios", help="list the shipped mock scenarios")
    scen.set_defaults(func=bind(_cmd_mock_scenarios, load))
