"""The DRA kubelet plugin, rule by rule, through kubelet's gRPC over unix sockets.

Claims live in the API emulator (resource.k8s.io/v1 from support.kube_emulator_dra)
and are read with the real client; the decision core is the in-memory one of
support.dra_core (the allocator's own cores, in process and over NATS, are tested in
tests/allocator/test_dra_claims_nats.py).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpulet_allocator.kubelet.dra import checkpoint as dra_checkpoint
from gpulet_allocator.kubelet.dra import plugin as plugin_module
from gpulet_allocator.kubelet.dra.server import SOCKET_DIR_MODE, Sockets
from gpulet_common.dra import cdi
from gpulet_common.kubelet_api.dra_health.v1 import api_pb2 as h1
from gpulet_common.kubelet_api.dra_health.v1 import api_pb2_grpc as h1_grpc
from gpulet_common.kubelet_api.dra_health.v1alpha1 import api_pb2 as h1a1
from gpulet_common.kubelet_api.dra_health.v1alpha1 import api_pb2_grpc as h1a1_grpc
from gpulet_common.kubelet_api.dra_health.v1beta1 import api_pb2 as h1b1
from gpulet_common.kubelet_api.dra_health.v1beta1 import api_pb2_grpc as h1b1_grpc
from support.dra_core import InMemoryCore
from support.dra_plugin_rig import DRIVER, NODE, Rig, claim, result, rig
from support.kube_emulator import KubeEmulator
from support.kube_emulator_dra import dra_emulator
from support.waiting import wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with dra_emulator(NODE) as emulator:
        yield emulator


async def test_registration_answers_what_kubelet_checks(emu: KubeEmulator, short_dir: Path) -> None:
    async with rig(emu, short_dir) as r:
        info = r.kubelet.info
        assert (info.type, info.name) == ("DRAPlugin", DRIVER)
        assert info.endpoint == str(short_dir / "plugins" / DRIVER / "dra.sock")
        # The health services too: a real kubelet opens NodeWatchResources only for a
        # driver that names one (tests/node/test_node_health.py).
        assert list(info.supported_versions) == [
            "v1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1beta1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth",
        ]
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


async def test_the_directories_it_makes_have_exact_modes_under_any_umask(
    emu: KubeEmulator, short_dir: Path
) -> None:
    """Under umask 000, mkdir makes 0777 directories: plugins/<driver>/, the registry
    directory, a missing CDI directory and the checkpoint's are set exactly instead."""
    old = os.umask(0)
    try:
        async with rig(emu, short_dir) as r:
            uid = claim(emu, "c", result("gpu-0"))
            assert (await r.kubelet.prepare(("default", uid, "c"))).claims[uid].error == ""
            await wait_until(lambda: (short_dir / "state").exists(), timeout_s=10)
    finally:
        os.umask(old)
    modes = {
        name: oct((short_dir / name).stat().st_mode & 0o777)
        for name in ("registry", "plugins", f"plugins/{DRIVER}", "cdi", "state")
    }
    assert modes == {
        "registry": oct(SOCKET_DIR_MODE),
        "plugins": oct(SOCKET_DIR_MODE),
        f"plugins/{DRIVER}": oct(SOCKET_DIR_MODE),
        "cdi": oct(cdi.DIR_MODE),
        "state": oct(dra_checkpoint.DIR_MODE),
    }
    assert (SOCKET_DIR_MODE, cdi.DIR_MODE, dra_checkpoint.DIR_MODE) == (0o750, 0o755, 0o750)
