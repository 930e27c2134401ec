"""Commands of the health service: ``gpulet health state|clear`` and ``gpulet alerts``.

``gpulet`` imports this module and calls :func:`add_commands`; the commands talk to a
running agent over NATS (``--nats``, default ``nats://127.0.0.1:4222``) for the node
given by ``--node`` (default: this host's node name).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, BusError, Refused, RequestTimeout
from gpulet_common.cli_support import AddFlags, LoadSettings, add_gpu_flag, bind, tool_nats
from gpulet_common.messages import HealthClearRequest, HealthState, HealthStateRequest
from gpulet_common.settings import Settings
from gpulet_health.alerts import AlertsConsumer


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
        for c in gpu.conditions:
            sticky = ", sticky" if c.sticky else ""
            lines.append(
                f"    - {c.condition} [{c.severity}{sticky}] {c.reason} -> action: {c.action}"
            )
    return "\n".join(lines)


async def _request(
    settings: Settings, subject: str, value: Any, request_codec: Any, timeout_s: float
) -> HealthState:
    async with Bus.connect(
        tool_nats(settings),
        name="gpulet-health-cli",
        max_initial_attempts=3,
        limits=settings.limits,
    ) as bus:
        result: HealthState = await bus.request(
            subject, value, request_codec, codec.HEALTH_STATE, timeout_s=timeout_s
        )
        return result


def _run_request(
    args: argparse.Namespace,
    load: LoadSettings,
    what: str,
    make: Callable[[Settings], tuple[str, Any, Any]],
) -> int:
    settings = load(args)
    subject, value, request_codec = make(settings)
    try:
        state = anyio.run(lambda: _request(settings, subject, value, request_codec, args.timeout))
    except RequestTimeout:
        print(
            f"gpulet health {what}: no health service answered for node {settings.node_name!r} "
            "(is the agent running? is --node right?)",
            file=sys.stderr,
        )
        return 1
    except Refused as exc:
        print(f"gpulet health {what}: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except BusError as exc:
        print(f"gpulet health {what}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(full_builtins(state), indent=2))
    else:
        print(format_state(state))
    return 0


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
    request = HealthClearRequest(gpu=args.gpu, condition=args.condition, requested_by=args.by)
    return _run_request(
        args,
        load,
        "clear",
        lambda s: (subjects.health_clear(s.node_name), request, codec.HEALTH_CLEAR_REQUEST),
    )


async def run_alerts(settings: Settings, *, hub: bool = False, serve: bool = False) -> None:
    """Deliver until cancelled; ``serve``: ``/healthz``, ``/readyz`` and ``/metrics`` on
    ``telemetry.http_port`` too (the DaemonSet's liveness probe asks ``/healthz``)."""
    from gpulet_common.telemetry import StatusBoard, serve_http

    status = StatusBoard()
    status.set("alerts", "starting", "connecting to NATS")
    async with anyio.create_task_group() as tg:
        if serve:
            telemetry = settings.telemetry
            await tg.start(serve_http, telemetry.http_host, telemetry.http_port, status)
        async with Bus.connect(
            tool_nats(settings), name="gpulet-alerts", limits=settings.limits
        ) as bus:
            if hub:
                from gpulet_health.fleet_alerts import hub_consumer

                consumer = hub_consumer(bus, settings)
            else:
                consumer = AlertsConsumer.from_settings(bus, settings.health.alerts)
            status.set("alerts", "ready", "delivering health events")
            await consumer.run()
        tg.cancel_scope.cancel()


def _cmd_alerts(args: argparse.Namespace, load: LoadSettings) -> int:
    settings = load(args)
    alerts = settings.health.alerts
    changes: dict[str, Any] = {}
    if args.webhook:
        changes["webhooks"] = [*alerts.webhooks, *args.webhook]
    if args.alertmanager:
        changes["alertmanager_urls"] = [*alerts.alertmanager_urls, *args.alertmanager]
    if args.durable:
        changes["durable"] = args.durable
    if args.subject:
        changes["subject"] = args.subject
    if args.no_stdout:
        changes["stdout"] = False
    if args.replay_all:
        changes["start_at"] = "all"
    settings.health.alerts = msgspec.structs.replace(alerts, **changes)
    if not (
        settings.health.alerts.stdout
        or settings.health.alerts.webhooks
        or settings.health.alerts.alertmanager_urls
    ):
        print(
            "gpulet alerts: nothing to deliver to (give --webhook, --alertmanager or keep stdout)",
            file=sys.stderr,
        )
        return 2
    # Endpoints only when asked for (--metrics-port, as the DaemonSet does): the
    # default port is the agent's, which this command must not take on a node.
    serve = args.metrics_port is not None and settings.telemetry.http_port > 0
    telemetry = None
    if serve:
        from gpulet_common.logutil import setup_logging
        from gpulet_common.telemetry import Telemetry

        setup_logging(settings.telemetry.log_level, settings.telemetry.log_format)
        telemetry = Telemetry.install(settings.telemetry, "gpulet-alerts")
    try:
        anyio.run(lambda: run_alerts(settings, hub=bool(args.hub), serve=serve))
    except KeyboardInterrupt:
        return 0
    except BusError as exc:
        print(f"gpulet alerts: {exc}", file=sys.stderr)
        return 1
    finally:
        if telemetry is not None:
            telemetry.shutdown()
    return 0


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
        dest="health_command", required=True, metavar="{state,clear}"
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
        help="clear only this condition (e.g. xid:79, ecc_uncorrectable, thermal)",
    )
    clear.add_argument("--by", default="operator", help="who clears it (recorded in the event)")
    clear.add_argument(
        "--json", action="store_true", default=False, help="print the new HealthState as JSON"
    )
    clear.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the agent")
    add_flags(clear)
    clear.set_defaults(func=bind(_cmd_clear, load))

    alerts = sub.add_parser(
        "alerts",
        help="deliver health events (durable JetStream consumer) to stdout, webhooks, Alertmanager",
    )
    alerts.add_argument(
        "--webhook",
        action="append",
        default=[],
        metavar="URL",
        help="POST each event as JSON here (repeatable)",
    )
    alerts.add_argument(
        "--alertmanager",
        action="append",
        default=[],
        metavar="URL",
        help="Alertmanager base URL, e.g. http://127.0.0.1:9093 (repeatable)",
    )
    alerts.add_argument("--durable", help="durable consumer name (default gpulet-alerts)")
    alerts.add_argument(
        "--subject", help="subject filter (default gpu.health.*; one node: gpu.health.<node>)"
    )
    alerts.add_argument(
        "--no-stdout", action="store_true", help="do not print events as JSON lines"
    )
    alerts.add_argument(
        "--replay-all",
        action="store_true",
        help="a new durable starts at the oldest event in the stream instead of new ones",
    )
    alerts.add_argument(
        "--hub",
        action="store_true",
        help="consume the hub's fleet stream GPU_FLEET (every node; replicas share one "
        "durable consumer, see docs/fleet.md); connect with --nats HUB and "
        "--set nats.creds_file=FILE",
    )
    add_flags(alerts, serves=True)
    alerts.set_defaults(func=bind(_cmd_alerts, load))
