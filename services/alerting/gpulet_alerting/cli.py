"""``gpulet alerts``: deliver health events to stdout, webhooks and Alertmanager.

``gpulet`` imports this module and calls :func:`add_commands`. The command runs the
durable consumer of :mod:`.consumer` against a node's ``GPU_HEALTH`` (``--nats``), or
with ``--hub`` the fleet's consumer of :mod:`.fleet_alerts` against the hub's
``GPU_FLEET``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio
import msgspec

from gpulet_alerting.consumer import AlertsConsumer
from gpulet_common.bus import Bus, BusError
from gpulet_common.cli_support import AddFlags, LoadSettings, bind, tool_nats
from gpulet_common.settings import Settings


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
                from gpulet_alerting.fleet_alerts import hub_consumer

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
