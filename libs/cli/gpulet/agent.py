"""Running services: ``gpulet run`` (all of them) and ``gpulet <service>`` (one).

Start-up order: settings and logging, telemetry, the embedded nats-server (only when
no NATS URL is configured), the bus connection, the HTTP endpoints, the mock-NVML
control endpoint (only with the mock), then the services in :data:`RUN_ORDER`.
Shutdown runs the same steps backwards when SIGINT/SIGTERM cancels the task group.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path

import anyio
import msgspec

from gpulet.services import build
from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.lifecycle import Service, cancel_on_signals, run_services
from gpulet_common.mock_control import MockControlService
from gpulet_common.runtime import NvmlProvider, Runtime
from gpulet_common.settings import Settings
from gpulet_common.telemetry import StatusBoard, serve_http

log = logging.getLogger("gpulet")


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
                status.set("nats-server", "ready", server.url)
            bus = await stack.enter_async_context(
                Bus.connect(
                    settings.nats,
                    name=f"gpulet-{settings.node_name}",
                    limits=settings.limits,
                )
            )
            runtime = Runtime(settings=settings, bus=bus, status=status, nvml=nvml)
            services: list[Service] = []
            if settings.nvml.backend == "mock":
                services.append(MockControlService(runtime))
            services += build(service_names, runtime)
            async with anyio.create_task_group() as tg:
                if handle_signals:
                    await tg.start(cancel_on_signals, tg.cancel_scope)
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
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(nvml.close)
        log.info("stopped")
