"""The allocator's core rules and its checkpoint, without NATS or gRPC (fast, exact clocks)."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import msgspec
import pytest

from gpulet_allocator.decide.books import grant_key
from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.decide.record import PodRef
from gpulet_allocator.protocol import PreferredRequest, ReleaseRequest
from gpulet_allocator.service.podresources import live_grants
from gpulet_allocator.state.checkpoint import (
    CheckpointError,
    CheckpointFile,
    Committer,
    decode,
    encode,
)
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.messages import Inventory
from gpulet_common.refusal import Refused
from gpulet_common.settings.allocator import ResourceNames
from support import reference

GPU, CORE, MEM = "nvidia.com/gpu", "gpulet.io/gpu-core", "gpulet.io/gpu-memory"
GIB = 1024**3


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def two_cards() -> Inventory:
    return reference.inventory_from_matrix("n", [[0, 10], [10, 0]], memory_bytes=16 * GIB)


def make_core(
    clock: Clock, *, join_window_s: float = 5.0, release_grace_s: float = 60.0
) -> AllocatorCore:
    core = AllocatorCore(
        node="n",
        names=ResourceNames(),
        join_window_s=join_window_s,
        release_grace_s=release_grace_s,
        clock=clock,
        wall_clock=clock,
    )
    core.update_inventory(two_cards())
    return core


def cores(uuid: str, units: range) -> list[str]:
    return [f"{uuid}::core-{n}" for n in units]


def mems(uuid: str, units: range) -> list[str]:
    return [f"{uuid}::mem-{n}" for n in units]


U0, U1 = "GPU-n-0", "GPU-n-1"


def test_halves_join_only_within_the_window_and_in_sequence() -> None:
    clock = Clock()
    core = make_core(clock, join_window_s=1.0)
    [a], _ = core.allocate(CORE, [cores(U0, range(30))])
    [b], _ = core.allocate(MEM, [mems(U0, range(8))])
    assert a.gpus == b.gpus
    assert a.annotations == b.annotations
    [share] = [v for v in core.allocation_views() if v.kind == "share"]
    assert (share.cores, share.memory_units) == (30, 8)

    # A core-only container: memory proportional (30% of 64 units).
    [c], _ = core.allocate(CORE, [cores(U0, range(30, 60))])
    clock.now += 2.0  # the window has passed: the next memory call is its own share
    [d], _ = core.allocate(MEM, [mems(U0, range(8, 12))])
    views = {v.id: v for v in core.allocation_views()}
    assert len(views) == 3
    c_view = views[c.annotations["gpulet.io/allocation"]]
    assert (c_view.cores, c_view.memory_units) == (30, 20)
    d_view = views[d.annotations["gpulet.io/allocation"]]
    # Memory-only: cores proportional to memory (4 of 64 units), at least 1.
    assert (d_view.cores, d_view.memory_units) == (7, 4)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in d.envs

    # Two core calls in a row do not join: the second closes the first.
    clock.now += 2.0  # (d's memory half is no longer open)
    core.allocate(CORE, [cores(U1, range(10))])
    core.allocate(CORE, [cores(U1, range(10, 20))])
    assert len(core.allocation_views()) == 5


def test_a_whole_gpu_call_closes_an_open_half() -> None:
    core = make_core(Clock())
    core.allocate(CORE, [cores(U0, range(10))])
    core.allocate(GPU, [[U1]])
    core.allocate(MEM, [mems(U0, range(4))])
    assert len(core.allocation_views()) == 3


def test_a_failing_container_gives_back_the_earlier_ones() -> None:
    core = make_core(Clock())
    with pytest.raises(Refused) as refused:
        core.allocate(GPU, [[U0], ["GPU-unknown"]])
    assert refused.value.code == "unknown_device"
    assert core.allocation_views() == []
    assert core.snapshot().grants == []
    # And the ledger agrees: the card is free.
    assert core.ledger.free_whole() == [U0, U1]


def test_undo_reverts_a_join() -> None:
    core = make_core(Clock())
    core.allocate(CORE, [cores(U0, range(30))])
    _, undo = core.allocate(MEM, [mems(U0, range(8))])
    undo()
    [view] = core.allocation_views()
    assert (view.cores, view.memory_units) == (30, 20)
    assert len(view.grants) == 1


def test_malformed_and_foreign_ids_are_unknown_devices() -> None:
    core = make_core(Clock())
    for bad in (["::core-1"], [f"{U0}::core-100"], [f"{U0}::mem-64"], [f"{U0}::gpu-1"], [U0]):
        with pytest.raises(Refused) as refused:
            core.allocate(CORE if "mem" not in bad[0] else MEM, [bad])
        assert refused.value.code == "unknown_device", bad
    with pytest.raises(Refused) as refused:
        core.allocate("example.com/fpga", [[U0]])
    assert refused.value.code == "unknown_resource"
    with pytest.raises(Refused) as refused:
        core.allocate(GPU, [])
    assert refused.value.code == "invalid_request"


def test_not_ready_without_inventory() -> None:
    core = AllocatorCore(node="n", names=ResourceNames())
    with pytest.raises(Refused) as refused:
        core.allocate(GPU, [[U0]])
    assert refused.value.code == "not_ready"
    with pytest.raises(Refused):
        core.preferred(GPU, [PreferredRequest(available=[U0], size=1)])


def test_preferred_ignores_unknown_offers_but_not_unknown_requirements() -> None:
    core = make_core(Clock())
    assert core.preferred(GPU, [PreferredRequest(available=[U1, "GPU-x"], size=1)]) == [[U1]]
    with pytest.raises(Refused) as refused:
        core.preferred(GPU, [PreferredRequest(available=[U1], must_include=["GPU-x"], size=1)])
    assert refused.value.code == "unknown_device"
    # Shares are placed by Allocate: any IDs do.
    answer = core.preferred(CORE, [PreferredRequest(available=cores(U0, range(5)), size=2)])
    assert answer == [cores(U0, range(2))]


def test_a_degraded_inventory_does_not_lose_the_gpus() -> None:
    core = make_core(Clock())
    core.update_inventory(Inventory(node="n", degraded_reason="NVML: driver gone"))
    assert core.ledger.free_whole() == [U0, U1]


def test_health_before_the_inventory_is_applied_when_it_arrives() -> None:
    # The health source (the service's NodeView) knew U1 unhealthy before the
    # inventory listed it; the core keeps no copy of its own but reads it on arrival.
    health = {U1: False}
    core = AllocatorCore(node="n", names=ResourceNames(), health_of=lambda u: health.get(u, True))
    assert not core.set_health(U1, False)  # not in the ledger yet: nothing to change
    core.update_inventory(two_cards())
    assert core.ledger.free_whole() == [U0]
    health[U1] = True
    assert core.set_health(U1, True)
    assert not core.set_health(U1, True)
    assert core.ledger.free_whole() == [U0, U1]
    # A new inventory takes the health from the source again, not a stale copy.
    health[U0] = False
    core.update_inventory(two_cards())
    assert core.ledger.free_whole() == [U1]


def test_reconcile_releases_after_the_grace_only() -> None:
    clock = Clock()
    core = make_core(clock, release_grace_s=10.0)
    [whole], _ = core.allocate(GPU, [[U0]])
    core.allocate(CORE, [cores(U1, range(20))])
    core.allocate(MEM, [mems(U1, range(4))])
    key_core = grant_key("core", CORE, cores(U1, range(20)))
    key_mem = grant_key("memory", MEM, mems(U1, range(4)))
    live = {key_core: PodRef("ns/a", "c"), key_mem: PodRef("ns/a", "c")}

    assert core.reconcile(live) == []  # the whole GPU is young and just missing
    clock.now += 5
    assert core.reconcile(live) == []
    clock.now += 6
    [released] = core.reconcile(live)
    assert released.gpus == [U0]
    assert whole.annotations["gpulet.io/allocation"] == released.id
    # The share is alive through either of its grants.
    clock.now += 100
    assert core.reconcile({key_mem: PodRef("ns/a", "c")}) == []
    [share] = core.allocation_views()
    assert {g.pod for g in share.grants} == {"ns/a"}


def test_reconcile_records_the_pod_uid_and_keeps_it_for_the_same_pod_only() -> None:
    """A grant learns its pod's UID with the pod (PodResources names it, the pod watch
    knows its UID); it is checkpointed with the grant, and dropped when the grant is
    another pod's (a name re-used) without a UID known for it."""
    core = make_core(Clock())
    core.allocate(GPU, [[U0]])
    key = grant_key("whole", GPU, [U0])
    core.reconcile({key: PodRef("ns/web-0", "c", "uid-1")})
    [view] = core.allocation_views()
    assert [(g.pod, g.pod_uid) for g in view.grants] == [("ns/web-0", "uid-1")]
    stored = decode(encode(core.snapshot()))
    assert [g.pod_uid for g in stored.grants] == ["uid-1"]
    core.reconcile({key: PodRef("ns/web-0", "c")})  # the watch does not know it now
    assert [g.pod_uid for g in core.allocation_views()[0].grants] == ["uid-1"]
    core.reconcile({key: PodRef("ns/other", "c")})
    assert [g.pod_uid for g in core.allocation_views()[0].grants] == [""]


def test_live_grants_take_the_uid_of_the_pod_watch() -> None:
    response = pr.ListPodResourcesResponse()
    pod = response.pod_resources.add(namespace="ns", name="web-0")
    pod.containers.add(name="c").devices.add(resource_name=GPU, device_ids=[U0])
    uids = {("ns", "web-0"): "uid-9"}
    live = live_grants(response, lambda _r: "whole", lambda ns, n: uids.get((ns, n), ""))
    assert list(live.values()) == [PodRef("ns/web-0", "c", "uid-9")]
    assert list(live_grants(response, lambda _r: "whole").values()) == [PodRef("ns/web-0", "c")]


def test_reconcile_reports_a_share_joined_across_two_containers() -> None:
    core = make_core(Clock())
    core.allocate(CORE, [cores(U0, range(20))])
    core.allocate(MEM, [mems(U0, range(4))])
    live = {
        grant_key("core", CORE, cores(U0, range(20))): PodRef("ns/a", "x"),
        grant_key("memory", MEM, mems(U0, range(4))): PodRef("ns/b", "y"),
    }
    core.reconcile(live)
    core.reconcile(live)
    assert core.releases.join_mismatches == 1


def test_explicit_release_by_id_pod_and_devices() -> None:
    core = make_core(Clock())
    [a], _ = core.allocate(GPU, [[U0]])
    core.allocate(GPU, [[U1]])
    a_id = a.annotations["gpulet.io/allocation"]
    [view] = core.release(ReleaseRequest(allocation_ids=[a_id, "nope"]))
    assert view.id == a_id
    assert core.release(ReleaseRequest(allocation_ids=[a_id])) == []
    [view] = core.release(ReleaseRequest(resource=GPU, device_ids=[U1]))
    assert view.gpus == [U1]
    with pytest.raises(Refused):
        core.release(ReleaseRequest())


def test_restore_round_trip_and_orphans() -> None:
    clock = Clock()
    core = make_core(clock)
    core.allocate(GPU, [[U0]])
    core.allocate(CORE, [cores(U1, range(20))])
    core.allocate(MEM, [mems(U1, range(4))])
    state = core.snapshot()

    fresh = AllocatorCore(node="n", names=ResourceNames())
    assert fresh.restore(state) == []
    fresh.update_inventory(two_cards())
    assert fresh.allocation_views() == core.allocation_views()
    # A retry after the "restart" gets the same answer.
    [again], _ = fresh.allocate(GPU, [[U0]])
    assert again.envs["NVIDIA_VISIBLE_DEVICES"] == U0
    assert len(fresh.allocation_views()) == 2

    # A grant without its allocation, and an allocation without a grant, are set aside.
    whole_id = next(
        a.owner.allocation_id for a in state.allocations if a.owner.allocation_id[0] == "w"
    )
    no_allocation = msgspec.structs.replace(
        state, allocations=[a for a in state.allocations if a.owner.allocation_id != whole_id]
    )
    [problem] = AllocatorCore(node="n", names=ResourceNames()).restore(no_allocation)
    assert f"grant {whole_id}" in problem
    no_grant = msgspec.structs.replace(
        state, grants=[g for g in state.grants if g.allocation != whole_id]
    )
    other = AllocatorCore(node="n", names=ResourceNames())
    [problem] = other.restore(no_grant)
    assert f"allocation {whole_id} has no grant" in problem
    assert [v.kind for v in other.allocation_views()] == ["share"]


# A checkpoint as written before Owner.pod_uid became allocation_id (a whole GPU and a
# share of 20 core units), byte for byte.
OLD_CHECKPOINT = (
    b'{"version":1,"node":"n","allocations":[{"type":"share","owner":{"pod_uid":'
    b'"core-e7cf476aa4ac4b528cc0","container":"","namespace":"","name":""},"device":'
    b'"GPU-n-1","cores":20,"memory_units":13},{"type":"whole","owner":{"pod_uid":'
    b'"whole-2027a5cf127acb8ec5cc","container":"","namespace":"","name":""},"devices":'
    b'["GPU-n-0"]}],"grants":[{"key":"core-e7cf476aa4ac4b528cc0","resource":'
    b'"gpulet.io/gpu-core","kind":"core","units":20,"allocation":'
    b'"core-e7cf476aa4ac4b528cc0","created_at":1000.0},{"key":"whole-2027a5cf127acb8ec5cc",'
    b'"resource":"nvidia.com/gpu","kind":"whole","units":1,"allocation":'
    b'"whole-2027a5cf127acb8ec5cc","created_at":1000.0}],"lost":""}'
)


def test_a_checkpoint_written_before_the_rename_loads_and_is_written_alike() -> None:
    state = decode(OLD_CHECKPOINT)
    core = AllocatorCore(node="n", names=ResourceNames(), clock=Clock(), wall_clock=Clock())
    assert core.restore(state) == []
    core.update_inventory(two_cards())
    assert sorted((v.id, v.kind, tuple(v.gpus)) for v in core.allocation_views()) == [
        ("core-e7cf476aa4ac4b528cc0", "share", (U1,)),
        ("whole-2027a5cf127acb8ec5cc", "whole", (U0,)),
    ]
    # The same calls get the recorded answers, and the file is written as before (with
    # the DRA claims' and MIG links' lists added since, empty).
    [again], _ = core.allocate(GPU, [[U0]])
    assert again.annotations["gpulet.io/allocation"] == "whole-2027a5cf127acb8ec5cc"
    # (and, since, sealed with a checksum: state/seal.py).
    written = OLD_CHECKPOINT.replace(b',"lost"', b',"claims":[],"mig_links":[],"lost"')
    assert encode(core.snapshot()).startswith(written[:-1] + b',"checksum":"')


def test_checkpoint_file_is_atomic_and_survives_corruption(tmp_path: Path) -> None:
    path = tmp_path / "allocator" / "allocations.json"
    store = CheckpointFile(path)
    assert store.load().status == "missing"
    core = make_core(Clock())
    core.allocate(GPU, [[U0]])
    store.write(encode(core.snapshot()))
    (path.parent / f".{path.name}.abc.tmp").write_bytes(b"half a write")
    loaded = store.load()
    assert loaded.status == "ok"
    assert loaded.state == core.snapshot()
    assert not list(path.parent.glob("*.tmp"))

    path.write_bytes(b'{"version": 1, "allocations": [{"type": "what"}]}')
    loaded = store.load()
    assert loaded.status == "corrupt"
    assert loaded.state.allocations == []
    assert loaded.state.lost  # fails closed: see test_allocator_lost_record.py
    assert loaded.corrupt_copy is not None
    assert loaded.corrupt_copy.name.startswith(path.name + ".corrupt-")

    path.write_bytes(b'{"version": 99}')
    assert "unsupported checkpoint version 99" in store.load().detail


@pytest.mark.anyio
async def test_group_commit_covers_concurrent_changes_with_few_writes() -> None:
    written: list[bytes] = []
    version = 0
    committer = Committer(lambda: str(version).encode(), written.append)
    async with anyio.create_task_group() as tg:
        await tg.start(committer.run)
        done = 0

        async def change() -> None:
            nonlocal version, done
            version += 1
            await committer.wait(version)
            done += 1

        with anyio.fail_after(5):
            async with anyio.create_task_group() as waiters:
                for _ in range(50):
                    waiters.start_soon(change)
        tg.cancel_scope.cancel()
    assert done == 50
    assert len(written) <= 3
    assert written[-1] == b"50"


@pytest.mark.anyio
async def test_a_failed_write_fails_the_changes_it_covered() -> None:
    fail = True

    def write(data: bytes) -> None:
        if fail:
            raise OSError(28, os.strerror(28))

    errors: list[str | None] = []
    committer = Committer(lambda: b"x", write, on_error=errors.append)
    async with anyio.create_task_group() as tg:
        await tg.start(committer.run)
        with anyio.fail_after(5), pytest.raises(CheckpointError, match="No space left"):
            await committer.wait(1)
        fail = False
        with anyio.fail_after(5):
            await committer.wait(2)
        tg.cancel_scope.cancel()
    assert errors[0] is not None
    assert errors[-1] is None
