"""What Prepare tells beyond its answer, and what it refuses or sweeps: the claim's
configuration (gpu.gpulet.io/v1alpha1), status.devices and Events, admin access,
the gpulet_dra_* metrics, and the sweep of claims the API server lost; the plugin as
kubelet calls it (support.dra_plugin_rig)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpulet_allocator.kubelet.dra.claims import KubeClaimReader
from gpulet_allocator.kubelet.dra.metrics import DraMetrics
from gpulet_allocator.kubelet.dra.sweep import ClaimSweeper
from gpulet_common.dra import cdi
from gpulet_common.kube import KubeConfig
from gpulet_common.kubeapi import KubeClient
from gpulet_common.mock_nvml import driver_root
from support.dra_core import InMemoryCore
from support.dra_plugin_rig import DRIVER, NODE, claim, result, rig
from support.kube_emulator import KubeEmulator
from support.kube_emulator_dra import RESOURCE_CLAIMS, add_claim, dra_emulator
from support.metrics import MetricsProbe
from support.waiting import wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with dra_emulator(NODE) as emulator:
        yield emulator


def configured(
    emu: KubeEmulator, name: str, parameters: dict[str, Any], *results: dict[str, Any]
) -> str:
    """An allocated claim whose allocation carries one opaque config of our driver."""
    body: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "default"},
        "spec": {},
        "status": {
            "allocation": {
                "devices": {
                    "results": list(results),
                    "config": [
                        {
                            "source": "FromClaim",
                            "requests": [],
                            "opaque": {"driver": DRIVER, "parameters": parameters},
                        }
                    ],
                }
            }
        },
    }
    return str(add_claim(emu, body)["metadata"]["uid"])


async def test_an_invalid_config_is_refused_naming_the_field(
    emu: KubeEmulator, short_dir: Path
) -> None:
    async with rig(emu, short_dir) as r:
        bogus = configured(
            emu, "bogus", {"apiVersion": "gpu.gpulet.io/v1alpha1", "kind": "Bogus"}, result("gpu-0")
        )
        typo = configured(
            emu,
            "typo",
            {
                "apiVersion": "gpu.gpulet.io/v1alpha1",
                "kind": "GpuConfig",
                "sharing": {"strategy": "MPs"},
            },
            result("gpu-1"),
        )
        answer = await r.kubelet.prepare(("default", bogus, "bogus"), ("default", typo, "typo"))
        assert "kind: 'Bogus'" in answer.claims[bogus].error
        assert "sharing.strategy" in answer.claims[typo].error
        assert not answer.claims[bogus].devices
        assert r.core.claims == {}
        assert list((r.cdi_dir).glob("*.json")) == []


async def test_an_mps_config_limits_a_whole_gpus_clients(
    emu: KubeEmulator, short_dir: Path
) -> None:
    parameters = {
        "apiVersion": "gpu.gpulet.io/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mpsConfig": {
                "defaultActiveThreadPercentage": 25,
                "defaultPinnedDeviceMemoryLimit": "3Gi",
            },
        },
    }
    async with rig(emu, short_dir) as r:
        uid = configured(emu, "mps", parameters, result("gpu-2"))
        answer = await r.kubelet.prepare(("default", uid, "mps"))
        assert answer.claims[uid].error == ""
        env = r.spec(uid)["devices"][0]["containerEdits"]["env"]
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in env
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=3072M" in env


async def test_prepare_reports_each_device_and_a_refusal_on_the_claim(
    emu: KubeEmulator, short_dir: Path
) -> None:
    """status.devices names the GPU a claim got; a claim that can never be prepared
    says why there (Ready False) and in a Warning Event, once, however often kubelet
    retries."""
    core = InMemoryCore.with_gpus(4)
    core.device_plugin.add("gpu-2")
    async with rig(emu, short_dir, core) as r:
        good = claim(emu, "good", result("gpu-1", shareID="s1", consumedCapacity={"cores": "30"}))
        stuck = claim(emu, "stuck", result("gpu-2"))
        answer = await r.kubelet.prepare(("default", good, "good"), ("default", stuck, "stuck"))
        assert answer.claims[good].error == ""
        assert "device plugin" in answer.claims[stuck].error

        def devices_of(name: str) -> list[dict[str, Any]]:
            body = emu.get_object(RESOURCE_CLAIMS, f"default/{name}") or {}
            return list((body.get("status") or {}).get("devices") or [])

        await wait_until(
            lambda: bool(devices_of("good")) and bool(devices_of("stuck")), what="status"
        )
        [entry] = devices_of("good")
        assert (entry["driver"], entry["pool"], entry["device"], entry["shareID"]) == (
            DRIVER,
            NODE,
            "gpu-1",
            "s1",
        )
        assert entry["data"] == {"uuid": "GPU-1"}
        assert [(c["type"], c["status"], c["reason"]) for c in entry["conditions"]] == [
            ("Ready", "True", "Prepared")
        ]
        [entry] = devices_of("stuck")
        [condition] = entry["conditions"]
        assert (condition["status"], condition["reason"]) == ("False", "PrepareFailed")
        assert "device plugin" in condition["message"]
        assert "data" not in entry
        # The allocation is still there: only the devices were written.
        stored = emu.get_object(RESOURCE_CLAIMS, "default/stuck") or {}
        assert stored["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-2"
        for _ in range(3):  # kubelet retries
            await r.kubelet.prepare(("default", stuck, "stuck"))
        await wait_until(lambda: not r.status.pending, what="the writer idle")

        def events() -> list[dict[str, Any]]:
            return [
                e
                for e in emu.list_objects("events")
                if e.get("involvedObject", {}).get("uid") == stuck
            ]

        await wait_until(lambda: len(events()) == 1, what="one Event")
        [event] = events()
        assert (event["type"], event["reason"]) == ("Warning", "PrepareFailed")
        assert "device plugin" in event["message"]
        assert r.status.events == 1
        assert r.status.written == 2  # the same state again writes nothing


async def test_admin_access_sees_a_busy_gpu_and_owns_nothing(
    emu: KubeEmulator, short_dir: Path
) -> None:
    """A monitoring pod's adminAccess result (charged 0 cores and 0 memory by the
    scheduler) for a GPU another claim holds whole: prepared, never reserved, and its
    Unprepare leaves the holder alone."""
    async with rig(emu, short_dir) as r:
        busy = claim(emu, "busy", result("gpu-1"))
        admin = claim(
            emu,
            "dcgm",
            result(
                "gpu-1",
                adminAccess=True,
                shareID="a1",
                consumedCapacity={"cores": "0", "memory": "0"},
            ),
        )
        answer = await r.kubelet.prepare(("default", busy, "busy"))
        assert answer.claims[busy].error == ""
        answer = await r.kubelet.prepare(("default", admin, "dcgm"))
        assert answer.claims[admin].error == ""
        [device] = answer.claims[admin].devices
        assert (device.device_name, device.share_id) == ("gpu-1", "a1")
        assert set(r.core.claims) == {busy}  # the admin claim owns nothing
        spec = r.spec(admin)
        [gpu] = spec["devices"]
        assert [n["path"] for n in gpu["containerEdits"]["deviceNodes"]] == ["/dev/nvidia1"]
        assert "NVIDIA_VISIBLE_DEVICES=GPU-1" in gpu["containerEdits"]["env"]
        assert "env" not in spec["containerEdits"]  # no allocation of its own
        undone = await r.kubelet.unprepare(("default", admin, "dcgm"))
        assert undone.claims[admin].error == ""
        assert set(r.core.claims) == {busy}
        # Zero cores without admin access is no share: refused.
        zero = claim(emu, "zero", result("gpu-2", shareID="z", consumedCapacity={"cores": "0"}))
        answer = await r.kubelet.prepare(("default", zero, "zero"))
        assert "invalid cores" in answer.claims[zero].error


async def test_prepare_is_measured_by_result_and_reason(emu: KubeEmulator, short_dir: Path) -> None:
    probe = MetricsProbe()
    core = InMemoryCore.with_gpus(4)
    core.device_plugin.add("gpu-3")
    async with rig(emu, short_dir, core, DraMetrics(probe.meter)) as r:
        good = claim(emu, "good", result("gpu-0"))
        held = claim(emu, "held", result("gpu-3"))
        pending = claim(emu, "pending", allocated=False)
        await r.kubelet.prepare(
            ("default", good, "good"),
            ("default", held, "held"),
            ("default", pending, "pending"),
            ("default", str(uuid.uuid4()), "gone"),
        )
        assert probe.count("gpulet.dra.prepare_duration", result="ok") == 1
        assert probe.count("gpulet.dra.prepare_duration", result="error") == 3
        assert probe.value("gpulet.dra.prepare_errors", reason="not_found") == 1
        assert probe.value("gpulet.dra.prepare_errors", reason="invalid_claim") == 1
        assert probe.value("gpulet.dra.prepare_errors", reason="insufficient_capacity") == 1
        assert probe.value("gpulet.dra.prepared_claims") == 1
        await r.kubelet.unprepare(("default", good, "good"))
        assert probe.value("gpulet.dra.prepared_claims") == 0


async def test_claims_the_api_server_lost_are_unprepared(
    emu: KubeEmulator, short_dir: Path
) -> None:
    async with rig(emu, short_dir) as r, KubeClient(KubeConfig(emu.url)) as api:
        kept = claim(emu, "kept", result("gpu-0"))
        deleted = claim(emu, "deleted", result("gpu-1"))
        replaced = claim(emu, "replaced", result("gpu-2"))
        answer = await r.kubelet.prepare(
            ("default", kept, "kept"),
            ("default", deleted, "deleted"),
            ("default", replaced, "replaced"),
        )
        assert all(not c.error for c in answer.claims.values())
        plugin = r.server.plugin
        assert set(r.core.claims) == {kept, deleted, replaced}
        emu.delete_object(RESOURCE_CLAIMS, "default/deleted")
        emu.delete_object(RESOURCE_CLAIMS, "default/replaced")
        body: dict[str, Any] = {
            "metadata": {"name": "replaced", "namespace": "default"},
            "spec": {},
        }
        add_claim(emu, body)  # the same name, another object
        sweeper = ClaimSweeper(
            plugin, KubeClaimReader(api, timeout_s=5), interval_s=600, boot_id="this-boot"
        )
        # At start only claims of an earlier boot are looked at: these are this boot's.
        plugin.checkpoint.claims = {
            uid: msgspec.structs.replace(c, boot_id="this-boot")
            for uid, c in plugin.checkpoint.claims.items()
        }
        assert await sweeper.sweep(earlier_boots_only=True) == 0
        assert set(r.core.claims) == {kept, deleted, replaced}
        assert await sweeper.sweep() == 2
        assert set(r.core.claims) == {kept}
        assert set(plugin.checkpoint.claims) == {kept}
        assert cdi.spec_file(r.cdi_dir, DRIVER, kept).exists()
        assert not cdi.spec_file(r.cdi_dir, DRIVER, deleted).exists()
        assert not cdi.spec_file(r.cdi_dir, DRIVER, replaced).exists()
        assert await sweeper.sweep() == 0  # nothing more to do


async def test_a_claim_of_an_earlier_boot_is_checked_at_start(
    emu: KubeEmulator, short_dir: Path
) -> None:
    async with rig(emu, short_dir) as r, KubeClient(KubeConfig(emu.url)) as api:
        old = claim(emu, "old", result("gpu-0"))
        await r.kubelet.prepare(("default", old, "old"))
        plugin = r.server.plugin
        assert plugin.checkpoint.claims[old].boot_id == ""  # the rig's plugin has none
        emu.delete_object(RESOURCE_CLAIMS, "default/old")
        sweeper = ClaimSweeper(
            plugin, KubeClaimReader(api, timeout_s=5), interval_s=600, boot_id="after-reboot"
        )
        assert await sweeper.sweep(earlier_boots_only=True) == 1
        assert r.core.claims == {}


async def test_time_slicing_sets_the_gpus_interval_through_the_drivers_nvidia_smi(
    emu: KubeEmulator, short_dir: Path, tmp_path: Path
) -> None:
    root = driver_root.make(tmp_path / "driver", "550.54.15")
    parameters = {
        "apiVersion": "gpu.gpulet.io/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
    }
    async with rig(emu, short_dir) as r:
        plugin = r.server.plugin
        sliced = configured(emu, "sliced", parameters, result("gpu-1"))
        # No nvidia-smi on the node: the claim is refused, saying so.
        answer = await r.kubelet.prepare(("default", sliced, "sliced"))
        assert "no nvidia-smi" in answer.claims[sliced].error
        assert r.core.claims == {}
        plugin.use_driver({}, str(root / "usr/bin/nvidia-smi"))
        answer = await r.kubelet.prepare(("default", sliced, "sliced"))
        assert answer.claims[sliced].error == ""
        log = (root / "var/log/mock-nvidia-smi.log").read_text()
        assert log.splitlines() == ["compute-policy -i GPU-1 --set-timeslice=3"]
