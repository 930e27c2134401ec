"""Building a service Runtime in tests: real bus to the test's nats-server, mock NVML."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from opentelemetry import metrics

from gpulet_common import config
from gpulet_common.bus import Bus
from gpulet_common.messages import Inventory
from gpulet_common.mock_nvml import MockNvml
from gpulet_common.nvml.adapter import NvmlAdapter
from gpulet_common.runtime import NvmlProvider, Runtime
from gpulet_common.settings import Settings
from gpulet_common.telemetry import StatusBoard


def agent_settings(
    nats_url: str, state_dir: Path, *, node: str = "node-1", overrides: list[str] | None = None
) -> Settings:
    tree = config.overrides_layer(
        [
            f"node_name={node}",
            f"state_dir={state_dir}",
            f"nats.url={nats_url}",
            "nats.reconnect_wait_s=0.05",
            "nats.reconnect_max_wait_s=0.25",
            "nvml.backend=mock",
            "telemetry.http_port=0",
            # Never the host's kubelet: a socket path that does not exist unless a test
            # serves a fake PodResources there.
            f"collector.pod_resources_socket={state_dir / 'pod-resources.sock'}",
            f"allocator.pod_resources_socket={state_dir / 'pod-resources.sock'}",
            *(overrides or []),
        ]
    )
    return config.build([tree])


def mock_adapter(scenario: str = "dgx-h100", **kwargs: Any) -> tuple[NvmlAdapter, MockNvml]:
    mock = MockNvml(scenario, **kwargs)
    adapter = NvmlAdapter(mock, backend="mock")
    adapter.init()
    return adapter, mock


def mock_inventory(scenario: str, node: str = "n") -> Inventory:
    """The inventory of a mock scenario, read through the adapter once."""
    adapter, _mock = mock_adapter(scenario)
    try:
        return adapter.inventory(node, 1)
    finally:
        adapter.shutdown()


@asynccontextmanager
async def runtime_for(
    settings: Settings,
    *,
    adapter: NvmlAdapter | None = None,
    meter: metrics.Meter | None = None,
    status: StatusBoard | None = None,
    name: str | None = None,
) -> AsyncIterator[Runtime]:
    """A Runtime whose NVML is ``adapter`` (or the settings' backend) and bus is real.

    ``name`` names the NATS connection; ``status`` lets several runtimes share a board.
    """
    provider = (
        NvmlProvider.preopened(settings.nvml, adapter)
        if adapter is not None
        else NvmlProvider(settings.nvml)
    )
    async with Bus.connect(
        settings.nats, name=name, meter=meter, max_initial_attempts=5, limits=settings.limits
    ) as bus:
        runtime = Runtime(
            settings=settings,
            bus=bus,
            status=status or StatusBoard(),
            nvml=provider,
            meter=meter or metrics.get_meter("test"),
        )
        try:
            yield runtime
        finally:
            provider.close()
