"""The DRA kubelet plugin under test: the real plugin and its gRPC server on unix
sockets, claims in the API emulator read with the real client, the in-memory decision
core of support.dra_core, and the fake kubelet registered (tests/dra)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from gpulet_allocator.kubelet.dra.claims import KubeClaimReader
from gpulet_allocator.kubelet.dra.contract import ReservedDevice
from gpulet_allocator.kubelet.dra.metrics import DraMetrics
from gpulet_allocator.kubelet.dra.plugin import DraPlugin, PluginSettings
from gpulet_allocator.kubelet.dra.server import DraKubeletPlugin, Sockets
from gpulet_allocator.kubelet.dra.status import ClaimStatusWriter
from gpulet_common.dra import cdi
from gpulet_common.kube import KubeConfig
from gpulet_common.kubeapi import KubeClient
from support.dra_core import InMemoryCore, InMemoryHealth
from support.fake_dra_kubelet import FakeDraKubelet, registered
from support.kube_emulator import KubeEmulator
from support.kube_emulator_dra import add_claim

DRIVER = "gpu.gpulet.io"
NODE = "node-a"


def result(device: str, request: str = "gpu", driver: str = DRIVER, **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": NODE, "device": device, **extra}


def claim(emu: KubeEmulator, name: str, *results: dict[str, Any], allocated: bool = True) -> str:
    body: dict[str, Any] = {"metadata": {"name": name, "namespace": "default"}, "spec": {}}
    if allocated:
        body["status"] = {"allocation": {"devices": {"results": list(results)}}}
    return str(add_claim(emu, body)["metadata"]["uid"])


@dataclass
class Rig:
    emu: KubeEmulator
    core: InMemoryCore
    health: InMemoryHealth
    root: Path
    kubelet: FakeDraKubelet
    server: DraKubeletPlugin
    status: ClaimStatusWriter

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    def spec(self, uid: str) -> dict[str, Any]:
        return dict(json.loads(cdi.spec_file(self.cdi_dir, DRIVER, uid).read_text()))


@asynccontextmanager
async def rig(
    emu: KubeEmulator,
    root: Path,
    core: InMemoryCore | None = None,
    metrics: DraMetrics | None = None,
) -> AsyncIterator[Rig]:
    core = core if core is not None else InMemoryCore.with_gpus(4)
    health = InMemoryHealth(NODE, sorted(core.gpus))
    settings = PluginSettings(
        driver=DRIVER,
        pool=NODE,
        cdi_dir=root / "cdi",
        checkpoint=root / "state" / "dra-checkpoint.json",
        dev_root=root,
    )
    sockets = Sockets.for_driver(DRIVER, root / "registry", root / "plugins")
    async with (
        KubeClient(KubeConfig(emu.url)) as api,
        anyio.create_task_group() as tg,
    ):
        status = ClaimStatusWriter(api, DRIVER, NODE, timeout_s=5)
        plugin = DraPlugin(core, KubeClaimReader(api, timeout_s=5), settings, status, metrics)
        gpus = core.gpus
        plugin.lookup = lambda name: (
            ReservedDevice(name, gpus[name].uuid, gpus[name].minor) if name in gpus else None
        )
        server = DraKubeletPlugin(plugin, health, sockets, DRIVER)
        await tg.start(server.run)
        tg.start_soon(status.run)
        async with registered(root / "registry", DRIVER) as kubelet:
            yield Rig(emu, core, health, root, kubelet, server, status)
        tg.cancel_scope.cancel()
