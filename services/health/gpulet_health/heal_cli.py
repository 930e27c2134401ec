"""``gpulet health remediation`` and ``gpulet health clear --retired``: remediation by
reset's state machines, read from (and a retirement cleared in) the node's
``gpulet_heal`` KV bucket.

The allocator runs the machines (docs/health.md, "Remediation by reset"); the records
are the common contract (:mod:`gpulet_common.heal`), so this tool reads them from NATS
without asking the allocator, and works while it is down. Every entry is decoded
totally: one that does not decode is shown as unreadable, never skipped.

``clear --retired`` takes a GPU out of retirement: the history's ``retired`` flag is
cleared by a compare-and-set on its revision (an entry written meanwhile makes it fail,
said, rather than be overwritten); the allocator's machine sees it and returns the GPU
to service. The history itself is kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import anyio
import msgspec
import nats.js.errors

from gpulet_common import subjects
from gpulet_common.bus import Bus, kv_keys
from gpulet_common.cli_support import (
    AddFlags,
    LoadSettings,
    add_gpu_flag,
    bind,
    gpu_index,
    tool_bus,
)
from gpulet_common.codec import MalformedMessage
from gpulet_common.heal import (
    FAULT_HISTORY,
    HEAL_KV_BUCKET,
    HEAL_RECORD,
    FaultHistory,
    HealRecord,
    history_key,
    machine_prefix,
)
from gpulet_common.validate import RejectedMessage

TOOL = "gpulet health remediation"
STEPS_SHOWN = 6


class Machines(msgspec.Struct, kw_only=True):
    """What the tool read: each GPU's machine and history, and entries it could not."""

    node: str
    machines: list[HealRecord] = []
    histories: list[FaultHistory] = []
    unreadable: list[str] = []


async def read_machines(bus: Bus, node: str) -> Machines | None:
    """The node's machines and histories; None when the bucket does not exist."""
    try:
        kv = await bus.jetstream.key_value(HEAL_KV_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return None
    found = Machines(node=node)
    node_prefix = f"{subjects.token(node)}."
    for key in await kv_keys(bus.jetstream, HEAL_KV_BUCKET, node_prefix):
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue
        try:
            if key.startswith(machine_prefix(node)):
                found.machines.append(HEAL_RECORD.decode(entry.value or b""))
            else:
                found.histories.append(FAULT_HISTORY.decode(entry.value or b""))
        except (MalformedMessage, RejectedMessage) as exc:
            found.unreadable.append(f"{key}: {exc}")
    found.machines.sort(key=lambda r: (r.gpu_index is None, r.gpu_index or 0, r.gpu_uuid))
    return found


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds)) if seconds else "-"


def format_machines(found: Machines, gpu: str | None = None) -> str:
    histories = {h.gpu_uuid: h for h in found.histories}
    lines = [f"node {found.node}: remediation by reset"]
    shown = [r for r in found.machines if _named(r.gpu_uuid, r.gpu_index, gpu)]
    if not shown:
        lines.append("  no GPU has been remediated by reset")
    for record in shown:
        index = record.gpu_index if record.gpu_index is not None else "?"
        lines.append(
            f"  GPU {index} {record.gpu_uuid}: {record.state} since {_when(record.since)}"
            f" (started {_when(record.started_at)}, resets {record.resets})"
        )
        lines.append(f"    cause: {record.cause or '-'}")
        if record.detail:
            lines.append(f"    detail: {record.detail}")
        if record.pids:
            lines.append(f"    PIDs holding it: {', '.join(map(str, record.pids))}")
        lines.extend(f"    {step}" for step in record.steps[-STEPS_SHOWN:])
        history = histories.get(record.gpu_uuid)
        if history is not None:
            retired = f"; RETIRED: {history.retired_reason}" if history.retired else ""
            lines.append(f"    history: {history.summary()}{retired}")
    lines.extend(f"  unreadable: {what}" for what in found.unreadable)
    return "\n".join(lines)


def _named(uuid: str, index: int | None, gpu: str | None) -> bool:
    if gpu is None:
        return True
    wanted = gpu_index(gpu)
    return index == wanted if wanted is not None else uuid == gpu


def _cmd_remediation(args: argparse.Namespace, load: LoadSettings) -> int:
    settings = load(args)

    async def read() -> Machines | None:
        async with tool_bus(settings, "gpulet-health-remediation") as bus:
            return await read_machines(bus, settings.node_name)

    try:
        found = anyio.run(read)
    except Exception as exc:  # a bus that cannot be reached: said, exit 1
        print(f"{TOOL}: {exc}", file=sys.stderr)
        return 1
    if found is None:
        found = Machines(node=settings.node_name)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(found)).decode() + "\n")
    else:
        print(format_machines(found, args.gpu))
    return 0


async def clear_retired(bus: Bus, node: str, gpu: str, by: str) -> str:
    """Clear the retirement of ``gpu`` (UUID or index); what was done, or raises
    ValueError saying why not."""
    found = await read_machines(bus, node)
    uuid = gpu
    if found is not None and gpu_index(gpu) is not None:
        named = [r.gpu_uuid for r in found.machines if r.gpu_index == gpu_index(gpu)]
        if not named:
            raise ValueError(f"no remediation record names GPU {gpu} on node {node}")
        uuid = named[0]
    try:
        kv = await bus.jetstream.key_value(HEAL_KV_BUCKET)
        entry = await kv.get(history_key(node, uuid))
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError) as exc:
        raise ValueError(f"GPU {uuid} has no fault history on node {node}") from exc
    try:
        history = FAULT_HISTORY.decode(entry.value or b"")
    except (MalformedMessage, RejectedMessage) as exc:
        # An unreadable history kept the GPU out; the operator's clear starts it afresh.
        history = FaultHistory(gpu_uuid=uuid, retired=True, retired_reason=str(exc))
    if not history.retired:
        raise ValueError(f"GPU {uuid} is not retired")
    history.retired, history.retired_reason = False, ""
    history.add("reset", time.time(), f"retirement cleared by {by}")
    try:
        await kv.update(history_key(node, uuid), FAULT_HISTORY.encode(history), last=entry.revision)
    except nats.js.errors.KeyWrongLastSequenceError as exc:
        raise ValueError(f"GPU {uuid}'s history changed meanwhile; run it again") from exc
    return f"GPU {uuid}: retirement cleared by {by} ({history.summary()})"


def cmd_clear_retired(args: argparse.Namespace, load: LoadSettings) -> int:
    settings = load(args)

    async def clear() -> str:
        async with tool_bus(settings, "gpulet-health-clear") as bus:
            return await clear_retired(bus, settings.node_name, args.gpu, args.by)

    try:
        print(anyio.run(clear))
    except ValueError as exc:
        print(f"gpulet health clear --retired: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a bus that cannot be reached: said, exit 1
        print(f"gpulet health clear --retired: {exc}", file=sys.stderr)
        return 1
    return 0


def add_remediation_command(health_sub: Any, add_flags: AddFlags, load: LoadSettings) -> None:
    remediation = health_sub.add_parser(
        "remediation",
        help="show each GPU's remediation-by-reset state machine and fault history",
    )
    add_gpu_flag(remediation, "only this GPU")
    remediation.add_argument("--json", action="store_true", default=False, help="print JSON")
    add_flags(remediation)
    remediation.set_defaults(func=bind(_cmd_remediation, load))
