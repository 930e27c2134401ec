"""The allocator service hosts the DRA kubelet plugin (``dra.plugin_host``, the default).

The real allocator service with ``dra.mode = "both"`` (the device plugin too), on a
real nats-server, the API emulator for the claims and the fake DRA kubelet over the
plugin's real sockets:

* a claim is prepared by the plugin in the allocator's own process, decided in its
  ledger (the device plugin's Allocate of that GPU is then refused);
* a failure that escapes the plugin does not end the allocator: it is said on the
  status board, the device plugin is still served, and the plugin starts again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpulet_allocator.kubelet.dra import service as dra_service
from gpulet_allocator.service import claims as claims_module
from gpulet_allocator.state.checkpoint import read_state
from gpulet_common.dra import cdi
from gpulet_common.dra.devices import device_name
from gpulet_common.settings import Settings
from gpulet_common.settings.dra import DraSettings
from support import reference
from support.allocator_stack import GPU, NODE, allocator_stack, ids, rpc_error
from support.fake_dra_kubelet import registered, wait_for_socket
from support.kube_emulator import KubeEmulator
from support.kube_emulator_dra import add_claim, dra_emulator

pytestmark = pytest.mark.anyio

DRIVER = "gpu.gpulet.io"


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with dra_emulator(NODE) as emulator:
        yield emulator


def with_dra(settings: Settings, emu: KubeEmulator, root: Path) -> Settings:
    dra = DraSettings(
        mode="both",
        kubeconfig=str(emu.write_kubeconfig(root / "kubeconfig")),
        cdi_dir=str(root / "cdi"),
        plugins_registry=str(root / "registry"),
        plugins_dir=str(root / "plugins"),
    )
    assert dra.plugin_runs_in("allocator")
    return msgspec.structs.replace(settings, dra=dra)


def allocated(emu: KubeEmulator, name: str, device: str) -> str:
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
    body: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "default"},
        "spec": {},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }
    return str(add_claim(emu, body)["metadata"]["uid"])


async def test_a_failed_plugin_is_started_again_and_the_allocator_goes_on(
    settings: Settings,
    emu: KubeEmulator,
    short_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(claims_module, "RESTART_S", 0.05)
    real_run = dra_service.DraPluginRunner.run
    starts: list[int] = []

    async def failing_once(self: dra_service.DraPluginRunner) -> None:
        starts.append(1)
        if len(starts) == 1:
            raise KeyError("a bug of ours")
        await real_run(self)

    monkeypatch.setattr(dra_service.DraPluginRunner, "run", failing_once)
    inventory = reference.nvlink_pairs_8()
    async with allocator_stack(with_dra(settings, emu, short_dir), inventory=inventory) as stack:
        assert stack.allocator is not None
        host = stack.allocator.dra
        await stack.wait_for(lambda: host.restarts >= 1, "the plugin to fail once")
        # The ledger goes on serving the device plugin.
        gpus = ids(stack, GPU)
        await stack.kubelet.allocate(GPU, [[gpus[0]]])
        # The plugin is started again, in the allocator's process, and prepares a claim
        # in the same ledger.
        await wait_for_socket(short_dir / "registry" / f"{DRIVER}-reg.sock", timeout_s=10)
        assert len(starts) == 2
        by_uuid = {g.uuid: device_name(g) for g in inventory.gpus}
        uid = allocated(emu, "one", by_uuid[gpus[1]])
        taken = allocated(emu, "taken", by_uuid[gpus[0]])
        async with registered(short_dir / "registry", DRIVER) as kubelet:
            answer = await kubelet.prepare(("default", uid, "one"), ("default", taken, "taken"))
            assert answer.claims[uid].error == ""
            [device] = answer.claims[uid].devices
            assert list(device.cdi_device_ids) == [cdi.device_id(DRIVER, uid, by_uuid[gpus[1]])]
            # The GPU the device plugin holds is refused to the claim, for that claim.
            assert gpus[0] in answer.claims[taken].error
        error = await rpc_error(stack.kubelet.allocate(GPU, [[gpus[1]]]))
        assert uid in (error.details() or "")
        # The ledger's record names the claim kubelet prepared.
        on_disk, _ = read_state(Path((await stack.state()).checkpoint))
        assert [(c.uid, c.namespace, c.name) for c in on_disk.claims] == [(uid, "default", "one")]
        status = stack.status.get(dra_service.STATUS_NAME)
        assert status is not None
        assert status.state in ("ready", "degraded")


async def test_the_failure_is_said_on_the_status_board(
    settings: Settings,
    emu: KubeEmulator,
    short_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(claims_module, "RESTART_S", 3600.0)

    async def failing(self: dra_service.DraPluginRunner) -> None:
        raise KeyError("a bug of ours")

    monkeypatch.setattr(dra_service.DraPluginRunner, "run", failing)
    async with allocator_stack(
        with_dra(settings, emu, short_dir), inventory=reference.nvlink_pairs_8()
    ) as stack:

        def said() -> bool:
            status = stack.status.get(dra_service.STATUS_NAME)
            return status is not None and "failed (KeyError)" in status.detail

        await stack.wait_for(said, "the failure on the status board")
        await stack.kubelet.allocate(GPU, [ids(stack, GPU)[:1]])
