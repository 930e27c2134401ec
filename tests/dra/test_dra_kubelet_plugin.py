"""The DRA kubelet plugin, rule by rule, through kubelet's gRPC over unix sockets.

Claims live in the API emulator (resource.k8s.io/v1 from support.kube_emulator_dra)
and are read with the real client; the decision core is the in-memory one of
support.dra_core (the allocator's own cores, in process and over NATS, are tested in
tests/allocator/test_dra_claims_nats.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from gpulet_allocator.kubelet.dra import plugin as plugin_module
from gpulet_allocator.kubelet.dra.claims import KubeClaimReader
from gpulet_allocator.kubelet.dra.contract import ReservedDevice
from gpulet_allocator.kubelet.dra.metrics import DraMetrics
from gpulet_allocator.kubelet.dra.plugin import DraPlugin, PluginSettings
from gpulet_allocator.kubelet.dra.server import DraKubeletPlugin, Sockets
from gpulet_allocator.kubelet.dra.status import ClaimStatusWriter
from gpulet_allocator.kubelet.dra.sweep import ClaimSweeper
from gpulet_common.dra import cdi
from gpulet_common.kube import KubeConfig
from gpulet_common.kubeapi import KubeClient
from gpulet_common.kubelet_api.dra_health.v1 import api_pb2 as h1
from gpulet_common.kubelet_api.dra_health.v1 import api_pb2_grpc as h1_grpc
from gpulet_common.kubelet_api.dra_health.v1alpha1 import api_pb2 as h1a1
from gpulet_common.kubelet_api.dra_health.v1alpha1 import api_pb2_grpc as h1a1_grpc
from gpulet_common.kubelet_api.dra_health.v1beta1 import api_pb2 as h1b1
from gpulet_common.kubelet_api.dra_health.v1beta1 import api_pb2_grpc as h1b1_grpc
from support.dra_core import InMemoryCore, InMemoryHealth
from support.fake_dra_kubelet import FakeDraKubelet, registered
from support.kube_emulator import KubeEmulator
from support.kube_emulator_dra import RESOURCE_CLAIMS, add_claim, dra_emulator
from support.metrics import MetricsProbe
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

DRIVER = "gpu.gpulet.io"
NODE = "node-a"


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with dra_emulator(NODE) as emulator:
        yield emulator


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


async def test_registration_answers_what_kubelet_checks(emu: KubeEmulator, short_dir: Path) -> None:
    async with rig(emu, short_dir) as r:
        info = r.kubelet.info
        assert (info.type, info.name) == ("DRAPlugin", DRIVER)
        assert info.endpoint == str(short_dir / "plugins" / DRIVER / "dra.sock")
        assert list(info.supported_versions) == ["v1.DRAPlugin"]
        with anyio.fail_after(2):
            await r.server.registration.registered.wait()
        assert r.server.registration.status == (True, "")


async def test_prepare_reserves_writes_cdi_and_answers_its_ids(
    emu: KubeEmulator, short_dir: Path
) -> None:
    async with rig(emu, short_dir) as r:
        uid = claim(emu, "two", result("gpu-1"), result("gpu-2", request="gpu/h100"))
        answer = await r.kubelet.prepare(("default", uid, "two"))
        entry = answer.claims[uid]
        assert entry.error == ""
        got = [
            (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
            for d in entry.devices
        ]
        assert got == [
            (["gpu"], NODE, "gpu-1", [f"{DRIVER}/gpu={uid}-gpu-1"]),
            (["gpu"], NODE, "gpu-2", [f"{DRIVER}/gpu={uid}-gpu-2"]),  # sub-request stripped
        ]
        assert sorted(d.device for d in r.core.claims[uid].devices) == ["gpu-1", "gpu-2"]
        spec = r.spec(uid)
        for device in spec["devices"]:  # one request: each device names both GPUs
            assert "NVIDIA_VISIBLE_DEVICES=GPU-1,GPU-2" in device["containerEdits"]["env"]
        assert [d["name"] for d in spec["devices"]] == [f"{uid}-gpu-1", f"{uid}-gpu-2"]


async def test_each_request_gets_its_own_gpus_in_the_cdi_spec(
    emu: KubeEmulator, short_dir: Path
) -> None:
    """A claim with requests r1 and r2: r1's CDI device carries r1's GPU only."""
    async with rig(emu, short_dir) as r:
        uid = claim(emu, "two", result("gpu-1", request="r1"), result("gpu-2", request="r2"))
        answer = await r.kubelet.prepare(("default", uid, "two"))
        by_request = {
            tuple(d.request_names): list(d.cdi_device_ids) for d in answer.claims[uid].devices
        }
        assert by_request == {
            ("r1",): [f"{DRIVER}/gpu={uid}-gpu-1"],
            ("r2",): [f"{DRIVER}/gpu={uid}-gpu-2"],
        }
        spec = r.spec(uid)
        env = {d["name"]: d["containerEdits"]["env"] for d in spec["devices"]}
        assert env[f"{uid}-gpu-1"] == ["NVIDIA_VISIBLE_DEVICES=GPU-1"]
        assert env[f"{uid}-gpu-2"] == ["NVIDIA_VISIBLE_DEVICES=GPU-2"]
        assert not any(e.startswith("NVIDIA_VISIBLE") for e in spec["containerEdits"]["env"])


async def test_one_bad_claim_never_fails_the_others(emu: KubeEmulator, short_dir: Path) -> None:
    async with rig(emu, short_dir) as r:
        good = claim(emu, "good", result("gpu-0"))
        pending = claim(emu, "pending", allocated=False)
        unknown_dev = claim(emu, "nodev", result("gpu-9"))
        other_pool = claim(emu, "elsewhere", {**result("gpu-1"), "pool": "node-b"})
        missing = str(uuid.uuid4())
        huge = str(uuid.uuid4())
        answer = await r.kubelet.prepare(
            ("default", huge, "x" * 10_000),
            ("default", good, "good"),
            ("default", pending, "pending"),
            ("default", unknown_dev, "nodev"),
            ("default", other_pool, "elsewhere"),
            ("default", missing, "gone"),
            ("default", "../../etc", "evil"),
            ("default", str(uuid.uuid4()), "good"),  # the right name, another UID
        )
        errors = {uid: e.error for uid, e in answer.claims.items()}
        assert len(errors) == 8
        assert errors[good] == ""
        # A 10,000-character name is not echoed whole.
        assert "not found" in errors[huge]
        assert len(errors[huge]) < 200, errors[huge][:300]
        assert not answer.claims[good].devices[0].HasField("share_id")
        assert "not allocated" in errors[pending]
        assert "no device gpu-9" in errors[unknown_dev]
        assert "pool 'node-b'" in errors[other_pool]
        assert "not found" in errors[missing]
        assert "not a UID" in errors["../../etc"]
        assert sum("has UID" in e for e in errors.values()) == 1
        assert set(r.core.claims) == {good}
        assert sorted(p.name for p in r.cdi_dir.iterdir()) == [f"{DRIVER}-gpu_{good}.json"]


async def test_prepare_is_idempotent(emu: KubeEmulator, short_dir: Path) -> None:
    async with rig(emu, short_dir) as r:
        uid = claim(emu, "c", result("gpu-0"))
        first = await r.kubelet.prepare(("default", uid, "c"))
        # A lost or stale spec is repaired by the repeat (NVIDIA #1380).
        cdi.spec_file(r.cdi_dir, DRIVER, uid).unlink()
        again = await r.kubelet.prepare(("default", uid, "c"), ("default", uid, "c"))
        assert again.claims[uid] == first.claims[uid]
        assert len(r.core.claims) == 1
        assert cdi.spec_file(r.cdi_dir, DRIVER, uid).exists()


async def test_only_our_drivers_results_are_taken(emu: KubeEmulator, short_dir: Path) -> None:
    async with rig(emu, short_dir) as r:
        mixed = claim(emu, "mixed", result("nic-0", driver="nic.example.com"), result("gpu-3"))
        foreign = claim(emu, "foreign", result("gpu-0", driver="gpu.nvidia.com"))
        answer = await r.kubelet.prepare(
            ("default", mixed, "mixed"), ("default", foreign, "foreign")
        )
        assert [d.device_name for d in answer.claims[mixed].devices] == ["gpu-3"]
        assert answer.claims[foreign].error == ""
        assert list(answer.claims[foreign].devices) == []
        assert set(r.core.claims) == {mixed}
        assert not cdi.spec_file(r.cdi_dir, DRIVER, foreign).exists()


async def test_a_device_held_elsewhere_is_refused_for_that_claim(
    emu: KubeEmulator, short_dir: Path
) -> None:
    core = InMemoryCore.with_gpus(4)
    core.device_plugin.add("gpu-2")
    async with rig(emu, short_dir, core) as r:
        first = claim(emu, "first", result("gpu-1"))
        second = claim(emu, "second", result("gpu-1"))
        by_plugin = claim(emu, "dp", result("gpu-2"))
        answer = await r.kubelet.prepare(("default", first, "first"))
        assert answer.claims[first].error == ""
        answer = await r.kubelet.prepare(
            ("default", second, "second"), ("default", by_plugin, "dp")
        )
        assert "held by another claim" in answer.claims[second].error
        assert "device plugin" in answer.claims[by_plugin].error
        assert set(r.core.claims) == {first}
        assert not cdi.spec_file(r.cdi_dir, DRIVER, second).exists()


async def test_two_shares_of_one_gpu_get_their_limits(emu: KubeEmulator, short_dir: Path) -> None:
    async with rig(emu, short_dir) as r:
        a = claim(
            emu,
            "a",
            result("gpu-0", shareID="s1", consumedCapacity={"cores": "30", "memory": "20Gi"}),
        )
        b = claim(
            emu,
            "b",
            result("gpu-0", shareID="s2", consumedCapacity={"cores": "50", "memory": "40Gi"}),
        )
        too_much = claim(
            emu,
            "c",
            result("gpu-0", shareID="s3", consumedCapacity={"cores": "30", "memory": "1Gi"}),
        )
        answer = await r.kubelet.prepare(("default", a, "a"), ("default", b, "b"))
        assert answer.claims[a].error == answer.claims[b].error == ""
        # Each share's ID goes back to kubelet (PodResources tells the two apart).
        assert [d.share_id for d in answer.claims[a].devices] == ["s1"]
        assert [d.share_id for d in answer.claims[b].devices] == ["s2"]
        env = r.spec(a)["devices"][0]["containerEdits"]["env"]
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30" in env
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M" in env
        answer = await r.kubelet.prepare(("default", too_much, "c"))
        assert "cores" in answer.claims[too_much].error


async def test_unprepare_is_idempotent_and_knows_no_strangers(
    emu: KubeEmulator, short_dir: Path
) -> None:
    async with rig(emu, short_dir) as r:
        uid = claim(emu, "c", result("gpu-0"))
        await r.kubelet.prepare(("default", uid, "c"))
        stranger = str(uuid.uuid4())
        for _ in range(2):
            answer = await r.kubelet.unprepare(("default", uid, "c"), ("default", stranger, "x"))
            assert {k: v.error for k, v in answer.claims.items()} == {uid: "", stranger: ""}
        assert r.core.claims == {}
        assert list(r.cdi_dir.iterdir()) == []
        assert r.server.plugin.checkpoint.claims == {}


async def test_unprepare_after_a_restart_without_the_claim(
    emu: KubeEmulator, short_dir: Path
) -> None:
    core = InMemoryCore.with_gpus(4)  # the ledger outlives the plugin (its own checkpoint)
    uid = claim(emu, "c", result("gpu-0"))
    async with rig(emu, short_dir, core) as r:
        answer = await r.kubelet.prepare(("default", uid, "c"))
        assert answer.claims[uid].error == ""
    checkpoint = json.loads((short_dir / "state" / "dra-checkpoint.json").read_text())
    assert set(checkpoint["claims"]) == {uid}
    emu.delete_object("resourceclaims", "default/c")
    async with rig(emu, short_dir, core) as r:
        assert set(r.server.plugin.checkpoint.claims) == {uid}
        undone = await r.kubelet.unprepare(("default", uid, "c"))
        assert undone.claims[uid].error == ""
        assert core.claims == {}
        assert not cdi.spec_file(r.cdi_dir, DRIVER, uid).exists()


def checkpointed(root: Path) -> set[str]:
    try:
        return set(json.loads((root / "state" / "dra-checkpoint.json").read_text())["claims"])
    except (FileNotFoundError, NotADirectoryError):
        return set()


async def test_the_checkpoint_is_written_after_the_answer_and_a_failed_write_again(
    emu: KubeEmulator, short_dir: Path
) -> None:
    # The state dir is a file: the checkpoint cannot be written, Prepare still answers
    # (what it stands on, the reservation and the CDI spec, is written first).
    async with rig(emu, short_dir) as r:
        (short_dir / "state").write_text("in the way")
        uid = claim(emu, "c", result("gpu-0"))
        assert (await r.kubelet.prepare(("default", uid, "c"))).claims[uid].error == ""
        assert set(r.server.plugin.checkpoint.claims) == {uid}
        # Out of the way: the writer tries again, without another Prepare (and makes
        # the directory itself).
        (short_dir / "state").unlink()
        await wait_until(lambda: checkpointed(short_dir) == {uid}, timeout_s=10)
        assert (await r.kubelet.unprepare(("default", uid, "c"))).claims[uid].error == ""
        await wait_until(lambda: checkpointed(short_dir) == set(), timeout_s=10)


def count_writes(r: Rig) -> list[set[str]]:
    """The claims of each checkpoint write from now on."""
    checkpoint = r.server.plugin.checkpoint
    flush, writes = checkpoint.flush, []

    def counted() -> bool:
        writes.append(set(checkpoint.claims))
        return flush()

    checkpoint.flush = counted  # type: ignore[method-assign]
    return writes


async def test_a_burst_of_prepares_is_checkpointed_in_one_write_after_it(
    emu: KubeEmulator, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugin_module, "WRITE_QUIET_S", 2.0)
    monkeypatch.setattr(plugin_module, "WRITE_MAX_DELAY_S", 3600.0)
    async with rig(emu, short_dir) as r:
        writes = count_writes(r)
        uids = [claim(emu, f"c{i}", result(f"gpu-{i}")) for i in range(4)]
        for i, uid in enumerate(uids):
            assert (await r.kubelet.prepare(("default", uid, f"c{i}"))).claims[uid].error == ""
        await wait_until(lambda: checkpointed(short_dir) == set(uids), timeout_s=10)
        assert writes == [set(uids)]


async def test_changes_that_never_pause_are_checkpointed_within_the_longest_delay(
    emu: KubeEmulator, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A quiet window that never ends: only the longest delay lets the write through.
    monkeypatch.setattr(plugin_module, "WRITE_QUIET_S", 3600.0)
    monkeypatch.setattr(plugin_module, "WRITE_MAX_DELAY_S", 0.1)
    async with rig(emu, short_dir) as r:
        uid = claim(emu, "c", result("gpu-0"))
        assert (await r.kubelet.prepare(("default", uid, "c"))).claims[uid].error == ""
        await wait_until(lambda: checkpointed(short_dir) == {uid}, timeout_s=10)


async def test_a_corrupt_checkpoint_is_kept_aside_and_the_plugin_starts(
    emu: KubeEmulator, short_dir: Path
) -> None:
    state = short_dir / "state"
    state.mkdir()
    (state / "dra-checkpoint.json").write_text("{not json")
    async with rig(emu, short_dir) as r:
        assert r.server.plugin.checkpoint.claims == {}
        uid = claim(emu, "c", result("gpu-0"))
        assert (await r.kubelet.prepare(("default", uid, "c"))).claims[uid].error == ""
    assert any(".corrupt-" in p.name for p in state.iterdir())


async def test_unprepare_during_prepare_undoes_it(emu: KubeEmulator, short_dir: Path) -> None:
    """NVIDIA's #641: Unprepare overtakes a Prepare still reading the claim."""
    async with rig(emu, short_dir) as r:
        uid = claim(emu, "slow", result("gpu-0"))
        emu.faults.delay(0.5, method="GET", path="resourceclaims/slow", count=1)
        answers: dict[str, Any] = {}

        async def prepare() -> None:
            answers["prepare"] = await r.kubelet.prepare(("default", uid, "slow"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(prepare)
            await wait_until(lambda: len(r.server.plugin.locks) > 0, what="prepare in flight")
            answers["unprepare"] = await r.kubelet.unprepare(("default", uid, "slow"))
        assert answers["prepare"].claims[uid].error == ""
        assert answers["unprepare"].claims[uid].error == ""
        # Unprepare waited for the Prepare and undid it: nothing leaks.
        assert r.core.claims == {}
        assert list(r.cdi_dir.iterdir()) == []


async def test_prepare_after_unprepare_of_a_deleted_claim_holds_nothing(
    emu: KubeEmulator, short_dir: Path
) -> None:
    async with rig(emu, short_dir) as r:
        uid = claim(emu, "c", result("gpu-0"))
        await r.kubelet.unprepare(("default", uid, "c"))
        emu.delete_object("resourceclaims", "default/c")
        answer = await r.kubelet.prepare(("default", uid, "c"))
        assert "not found" in answer.claims[uid].error
        assert r.core.claims == {}


@pytest.mark.parametrize(("pb", "pb_grpc"), [(h1a1, h1a1_grpc), (h1b1, h1b1_grpc), (h1, h1_grpc)])
async def test_health_streams_every_device_in_every_version(
    emu: KubeEmulator, short_dir: Path, pb: Any, pb_grpc: Any
) -> None:
    async with rig(emu, short_dir) as r:
        stream = r.kubelet.health_stream(pb, pb_grpc)
        with anyio.fail_after(5):
            first = await stream.read()
            assert len(first.devices) == 4
            assert {d.health for d in first.devices} == {pb.HEALTHY}
            r.health.set("gpu-2", "unhealthy", "XID 79")
            second = await stream.read()
        stream.cancel()
        bad = [d for d in second.devices if d.health == pb.UNHEALTHY]
        assert [(d.device.pool_name, d.device.device_name) for d in bad] == [(NODE, "gpu-2")]
        assert len(second.devices) == 4
        if "message" in pb.DeviceHealth.DESCRIPTOR.fields_by_name:
            assert bad[0].message == "XID 79"


async def test_a_stale_socket_is_replaced(emu: KubeEmulator, short_dir: Path) -> None:
    sockets = Sockets.for_driver(DRIVER, short_dir / "registry", short_dir / "plugins")
    for path in (sockets.registration, sockets.endpoint):
        path.parent.mkdir(parents=True)
        path.write_text("left over")
    async with rig(emu, short_dir) as r:
        answer = await r.kubelet.unprepare(("default", str(uuid.uuid4()), "x"))
        assert len(answer.claims) == 1
    assert not sockets.endpoint.exists()
    assert not sockets.registration.exists()


def test_socket_paths_that_do_not_fit_are_refused() -> None:
    from gpulet_allocator.kubelet.dra import server

    with pytest.raises(ValueError, match="longer than 107"):
        server._check_path(Path("/" + "x" * 120))


def test_a_write_in_flight_never_drops_a_claim_remembered_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's thread writes the claims it read; a claim that Prepare remembered
    on the loop while the file was being written stays held and is written next."""
    from gpulet_allocator.kubelet.dra import checkpoint as ck
    from gpulet_common.safefile import write_atomic as real_write

    store = ck.CheckpointFile(tmp_path / "dra-checkpoint.json")
    first = ck.PreparedClaim(uid="a", namespace="ns", name="a")
    second = ck.PreparedClaim(uid="b", namespace="ns", name="b")
    store.remember(first)

    def write_while_prepare_remembers(path: Path, data: bytes, **kw: Any) -> None:
        store.remember(second)  # the loop, while the thread writes
        real_write(path, data, **kw)

    monkeypatch.setattr(ck, "write_atomic", write_while_prepare_remembers)
    assert store.flush()
    monkeypatch.undo()
    assert set(store.claims) == {"a", "b"}
    assert set(json.loads(store.path.read_text())["claims"]) == {"a"}
    assert store.flush()  # the change made meanwhile is still pending
    assert set(json.loads(store.path.read_text())["claims"]) == {"a", "b"}


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

        await wait_until(lambda: devices_of("good") and devices_of("stuck"), what="status")
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


def histogram_count(probe: MetricsProbe, name: str, **attributes: str) -> int:
    data = probe.reader.get_metrics_data()
    total = 0
    for resource in data.resource_metrics if data is not None else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name != name:
                    continue
                for point in metric.data.data_points:
                    attrs = dict(point.attributes or {})
                    if all(attrs.get(k) == v for k, v in attributes.items()):
                        total += int(point.count)  # type: ignore[union-attr]
    return total


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
        assert histogram_count(probe, "gpulet.dra.prepare_duration", result="ok") == 1
        assert histogram_count(probe, "gpulet.dra.prepare_duration", result="error") == 3
        assert probe.value("gpulet.dra.prepare_errors", reason="not_found") == 1
        assert probe.value("gpulet.dra.prepare_errors", reason="invalid_claim") == 1
        assert probe.value("gpulet.dra.prepare_errors", reason="insufficient_capacity") == 1
        assert probe.value("gpulet.dra.prepared_claims") == 1
        await r.kubelet.unprepare(("default", good, "good"))
        assert probe.value("gpulet.dra.prepared_claims") == 0


# --- the sweep (.sweep): claims the API server no longer knows --------------------------


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
