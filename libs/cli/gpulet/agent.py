"""Running services: ``gpulet run`` (all of them) and ``gpulet <service>`` (one).

Start-up order: settings and logging, telemetry, the embedded nats-server (only when
no NATS URL is configured), the bus connection, the HTTP endpoints, the mock-NVML
control endpoint (only with the mock), then the services in :data:`RUN_ORDER`.
Shutdown runs the same steps backwards when SIGINT/SIGTERM cancels the task group.

Two components besides the services are on the status board, so ``/readyz`` tells
when the broker is the problem: ``nats-server`` (the embedded server, supervised and
restarted by :meth:`EmbeddedNats.supervise`; when it cannot be brought back the
supervisor's :class:`NatsServerGaveUp` ends the task group, and ``gpulet run`` with
it) and ``nats`` (this process's connection: not ready from a disconnection until
nats-py has reconnected and restored the subscriptions).
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path

import anyio
import msgspec

from gpulet.services import build
from gpulet_common.bus import Bus, describe_servers
from gpulet_common.embedded_nats import EmbeddedNats, RestartPolicy
from gpulet_common.lifecycle import Service, cancel_on_signals, run_services
from gpulet_common.runtime import NvmlProvider, Runtime
from gpulet_common.settings import Settings
from gpulet_common.telemetry import StatusBoard, serve_http

log = logging.getLogger("gpulet")

# The most a stop waits for NVML's shutdown.
NVML_CLOSE_S = 1.0


# Logged with the first failed connection of a process that starts no nats-server.
SIDECAR_NATS_HINT = (
    "this process starts no NATS server and waits for the one it is given (in the "
    "DaemonSet, the pod's NATS sidecar); `gpulet run` without --nats starts its own"
)


async def run_agent(
    settings: Settings,
    service_names: list[str],
    *,
    embedded_nats: bool,
    handle_signals: bool = True,
    task_status: anyio.abc.TaskStatus[Runtime] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run the named services in one process until cancelled or signalled."""
    status = StatusBoard()
    nvml = NvmlProvider(settings.nvml)
    try:
        async with AsyncExitStack() as stack:
            server: EmbeddedNats | None = None
            if embedded_nats:
                server = EmbeddedNats(
                    state_dir=Path(settings.state_dir) / "nats",
                    host=settings.nats.embedded_host,
                    port=settings.nats.embedded_port,
                    jetstream=settings.nats.embedded_jetstream,
                )
                await server.start()
                stack.push_async_callback(server.stop)
                settings.nats = msgspec.structs.replace(settings.nats, url=server.url)
                status.set("nats-server", "ready", server.describe())
            async with anyio.create_task_group() as tg:
                if handle_signals:
                    await tg.start(cancel_on_signals, tg.cancel_scope)
                # Supervised from before the first connection: the server may die while
                # the bus is still connecting, and the bus would wait for it forever.
                if server is not None:
                    policy = RestartPolicy.from_settings(settings.nats)
                    await tg.start(partial(server.supervise, policy, status))
                bus = await stack.enter_async_context(
                    Bus.connect(
                        settings.nats,
                        name=f"gpulet-{settings.node_name}",
                        limits=settings.limits,
                        unreachable_hint=None if server is not None else SIDECAR_NATS_HINT,
                    )
                )
                await tg.start(report_connection, bus, status)
                runtime = Runtime(settings=settings, bus=bus, status=status, nvml=nvml)
                services: list[Service] = []
                if settings.nvml.backend == "mock":
                    from gpulet_common.mock_control import MockControlService  # the mock's

                    services.append(MockControlService(runtime))
                services += build(service_names, runtime)
                if settings.telemetry.http_port:
                    await tg.start(
                        serve_http,
                        settings.telemetry.http_host,
                        settings.telemetry.http_port,
                        status,
                    )
                await tg.start(partial(run_services, services, status, handle_signals=False))
                task_status.started(runtime)
    finally:
        # Bounded like every step of a stop: a wedged driver (a GPU off the bus) can
        # hold nvmlShutdown; the process ends all the same and the thread with it.
        with anyio.CancelScope(shield=True), anyio.move_on_after(NVML_CLOSE_S) as closing:
            await anyio.to_thread.run_sync(nvml.close, abandon_on_cancel=True)
        if closing.cancelled_caught:
            log.warning("NVML did not shut down within %.1fs; stopping without it", NVML_CLOSE_S)
        log.info("stopped")


async def report_connection(
    bus: Bus,
    status: StatusBoard,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Keep the ``nats`` component in step with this process's connection."""
    task_status.started()
    while True:
        # No await between the check and the wait: a change cannot slip in between.
        if bus.is_connected:
            connected = bus.client.connected_url
            url = describe_servers(connected.geturl() if connected else "")
            status.set("nats", "ready", f"connected to {url}")
            await bus.wait_disconnected()
        else:
            status.set("nats", "starting", "connection to NATS lost; reconnecting")
            await bus.wait_reconnected()
