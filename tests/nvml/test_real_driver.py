"""What the real driver reports, read through the same loader the services use.

Each test runs twice: against the real NVML (``needs_driver``: only where
``libnvidia-ml.so.1`` loads) and against the mock NVML through the same
:func:`~gpulet_common.nvml.open_nvml` path, so that the assertions themselves run on
every host. They only *read* from the GPUs: inventory, samples and the event wait of
the health service; nothing is set, reset or injected.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from gpulet_collector.service import CollectorService
from gpulet_common import codec, subjects
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import HealthEvent
from gpulet_common.nvml import open_nvml
from gpulet_common.settings.nvml import NvmlSettings
from gpulet_health.service import HealthService
from support.agent import agent_settings, runtime_for
from support.host import needs_driver

BACKENDS = [pytest.param("nvml", marks=needs_driver, id="real-nvml"), pytest.param("mock")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_inventory_and_samples_of_every_gpu(backend: str) -> None:
    adapter, reason = open_nvml(NvmlSettings(backend=backend))  # type: ignore[arg-type]
    assert adapter is not None, reason
    try:
        count = adapter.module.nvmlDeviceGetCount()
        assert count >= 1
        inventory = adapter.inventory("real", 1)
        assert inventory.nvml_backend == backend
        assert inventory.driver_version
        assert inventory.degraded_reason is None
        assert [g.index for g in inventory.gpus] == list(range(count))
        assert len({g.uuid for g in inventory.gpus}) == count
        for gpu in inventory.gpus:
            assert gpu.uuid.startswith(("GPU-", "MIG-"))
            assert gpu.name
            assert gpu.memory_total_bytes > 0
            assert gpu.pci_bus_id
            sample = adapter.sample(gpu.index)
            assert sample.uuid == gpu.uuid
            assert sample.error is None
            assert sample.temperature_c is not None
            assert 0 < sample.temperature_c < 120
            assert sample.memory_used_bytes is not None
            assert sample.memory_used_bytes <= gpu.memory_total_bytes
    finally:
        adapter.shutdown()


@pytest.mark.anyio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_idle_healthy_gpus_raise_no_health_event(
    backend: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    settings = agent_settings(
        nats_server.url,
        tmp_path,
        # The kernel log is off: its ring buffer may hold XIDs from before this test
        # (a real XID 31 of someone's program), which are history, not the idle GPU.
        overrides=[
            f"nvml.backend={backend}",
            "collector.sample_period_s=0.1",
            "health.kmsg.enabled=false",
        ],
    )
    events: list[HealthEvent] = []
    async with runtime_for(settings) as rt:
        node = settings.node_name
        async with (
            rt.bus.subscribe(subjects.health(node), codec.HEALTH_EVENT) as health,
            rt.bus.subscribe(subjects.samples(node), codec.SAMPLES) as batches,
            anyio.create_task_group() as tg,
        ):
            await rt.bus.flush()

            async def record() -> None:
                events.extend([delivery.value async for delivery in health])

            tg.start_soon(record)
            await tg.start(CollectorService(rt).run)
            await tg.start(HealthService(rt).run)
            # Twenty sample periods read and judged by the health service.
            seen = 0
            with anyio.fail_after(30):
                async for delivery in batches:
                    assert all(s.error is None for s in delivery.value.samples)
                    seen += 1
                    if seen == 20:
                        break
            await rt.bus.flush()
            tg.cancel_scope.cancel()
    assert events == []


@needs_driver
def test_auto_takes_the_real_driver_where_there_is_one() -> None:
    adapter, reason = open_nvml(NvmlSettings(backend="auto"))
    assert adapter is not None, reason
    try:
        assert adapter.backend == "nvml"
    finally:
        adapter.shutdown()
