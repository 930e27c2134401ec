"""Remediation by reset's wiring in the allocator's remediation service: the machine is
built on this process's NVML and the node's KV with the executor the settings name, and
not at all (evictions only, said) where it cannot reset."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.service.remediate.nvml_port import NvmlGpu
from gpulet_allocator.service.remediate.reset_exec import MockExecutor, NvidiaSmiExecutor
from gpulet_allocator.service.remediate.service import RemediationService
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.nodeview import NodeView
from gpulet_common.settings.allocator import ResourceNames
from gpulet_common.settings.remediation import RemediationSettings, ResetSettings
from support.agent import agent_settings, mock_adapter, runtime_for

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("executor", "expected"), [("mock", MockExecutor), ("nvidia-smi", NvidiaSmiExecutor)]
)
async def test_the_machine_is_built_on_the_runtimes_nvml(
    nats_server: EmbeddedNats, tmp_path: Path, executor: str, expected: type
) -> None:
    settings = msgspec.structs.replace(
        agent_settings(nats_server.url, tmp_path),
        remediation=RemediationSettings(
            mode="reset",
            reset=ResetSettings(executor=executor),  # type: ignore[arg-type]
        ),
    )
    adapter, mock = mock_adapter("dgx-h100")
    async with runtime_for(settings, adapter=adapter) as rt:
        view = NodeView(rt.bus, rt.node)
        core = AllocatorCore(node=rt.node, names=ResourceNames())
        service = RemediationService(settings, rt.node, core, view, rt.meter, rt)
        healer = await service._healer()
        assert healer is not None
        assert isinstance(healer.executor, expected)
        assert isinstance(healer.gpu, NvmlGpu)
        # It reads the mock: GPU 0 found by its UUID.
        found = await healer.gpu.identity(mock.scenario.gpus[0].uuid)
        assert found is not None
        assert found.bus_id == mock.scenario.gpus[0].bus_id
        assert await healer.store.records() == []


async def test_no_nvml_no_machine(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    settings = msgspec.structs.replace(
        agent_settings(nats_server.url, tmp_path, overrides=["nvml.backend=nvml"]),
        remediation=RemediationSettings(mode="reset"),
    )
    settings = msgspec.structs.replace(
        settings, nvml=msgspec.structs.replace(settings.nvml, library=str(tmp_path / "none.so"))
    )
    async with runtime_for(settings) as rt:
        view = NodeView(rt.bus, rt.node)
        core = AllocatorCore(node=rt.node, names=ResourceNames())
        service = RemediationService(settings, rt.node, core, view, rt.meter, rt)
        assert await service._healer() is None
