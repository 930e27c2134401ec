"""Time-slicing through the decision core (issue 27): every adapter gets one answer.

kubelet's Allocate of replica IDs, of whole GPUs and of shares, and a DRA claim, all
go through :class:`~gpulet_allocator.decide.core.AllocatorCore` and the ledger's one
refusal: a time-sliced GPU has one owner model whichever adapter asks.
"""

from __future__ import annotations

import pytest

from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.decide.record import HeldDevices, PodRef
from gpulet_allocator.protocol import ClaimDeviceRequest, PreferredRequest
from gpulet_common.refusal import Refused
from gpulet_common.settings.allocator import ResourceNames
from gpulet_common.settings.sharing import (
    GpuReplicas,
    ReplicatedResource,
    TimeSlicingConfig,
    TimeSlicingSettings,
)
from support import reference

GPU, CORE, MEM = "nvidia.com/gpu", "gpulet.io/gpu-core", "gpulet.io/gpu-memory"


def make_core() -> AllocatorCore:
    settings = TimeSlicingSettings(
        configs={
            # GPU 0 only: the others stay whole.
            "first": TimeSlicingConfig(
                resources=[ReplicatedResource(name=GPU, replicas=1)],
                gpus=[GpuReplicas(gpu="0", replicas=3)],
                fail_requests_greater_than_one=True,
            ),
        }
    )
    core = AllocatorCore(node="n", names=ResourceNames(), time_slicing=settings)
    core.update_inventory(reference.nvlink_pairs_8())
    return core


def refusal(call: object, *args: object) -> Refused:
    assert callable(call)
    with pytest.raises(Refused) as err:
        call(*args)
    return err.value


def test_a_label_picks_the_config_and_a_typo_keeps_it() -> None:
    core = make_core()
    g0 = core.books.inventory.gpus[0].uuid if core.books.inventory else ""
    assert core.time_slicing.replicas() == {}
    assert core.time_slicing.select("first")
    assert core.time_slicing.replicas() == {g0: 3}
    assert not core.time_slicing.select("frist")
    assert "frist" in core.time_slicing.problem
    assert core.time_slicing.replicas() == {g0: 3}
    assert core.time_slicing.select(None)
    assert core.time_slicing.replicas() == {}
    assert core.time_slicing.problem == ""


def test_every_adapter_gets_the_one_owner_answer() -> None:
    core = make_core()
    core.time_slicing.select("first")
    gpus = [g.uuid for g in core.books.inventory.gpus] if core.books.inventory else []
    g0, g1 = gpus[0], gpus[1]
    # Whole: refused, with the ledger's code.
    assert refusal(core.allocate, GPU, [[g0]]).code == "time_sliced"
    # Shares: placed elsewhere, never on the time-sliced GPU.
    answers, _undo = core.allocate(CORE, [[f"{g1}::core-{n}" for n in range(50)]])
    core.allocate(MEM, [[f"{g1}::mem-{n}" for n in range(4)]])
    assert answers[0].gpus != [g0]
    # A DRA claim of it, whole or shared: refused the same way.
    minor = core.books.minors()[g0]
    for device in (
        ClaimDeviceRequest(device=f"gpu-{minor}"),
        ClaimDeviceRequest(device=f"gpu-{minor}", cores=10, memory_bytes=2**30),
    ):
        assert refusal(core.claims.reserve, "claim-1", [device]).code == "time_sliced"
    # A replica: given as its GPU; two in one container are refused by the config.
    [answer], _undo = core.allocate(GPU, [[f"{g0}::2"]])
    assert answer.gpus == [g0]
    assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == g0
    assert refusal(core.allocate, GPU, [[f"{g0}::0", f"{g0}::1"]]).code == "invalid_request"
    # A replica kubelet was never offered is not a device of this node.
    assert refusal(core.allocate, GPU, [[f"{g0}::7"]]).code == "unknown_device"
    assert refusal(core.allocate, GPU, [[f"{g1}::0"]]).code == "unknown_device"
    # Preferences pick among the free replicas only.
    offered = [f"{g0}::{n}" for n in range(3)]
    [[pick]] = core.preferred(GPU, [PreferredRequest(available=offered, size=1)])
    assert pick in (f"{g0}::0", f"{g0}::1")


def test_a_lost_record_adopts_replicas_from_kubelet_as_replicas() -> None:
    """PodResources names replicas: each is adopted as its own card, never as its GPU
    taken whole (two containers on one GPU would then conflict)."""
    core = make_core()
    core.time_slicing.select("first")
    g0 = core.books.inventory.gpus[0].uuid if core.books.inventory else ""
    held = [
        HeldDevices(ref=PodRef(pod=f"ml/p{n}", container="main"), resource=GPU, device_ids=(rid,))
        for n, rid in enumerate((f"{g0}::0", f"{g0}::2"))
    ]
    adoption = core.adopt(held)
    assert (adoption.adopted, adoption.conflicts) == (2, ())
    assert core.ledger.replicas_held(g0) == 2
    assert refusal(core.allocate, GPU, [[g0]]).code == "time_sliced"
    [answer], _undo = core.allocate(GPU, [[f"{g0}::1"]])
    assert answer.gpus == [g0]


def test_configs_from_a_file_win_and_the_config_in_force_outlives_its_removal() -> None:
    core = make_core()
    gpus = core.books.inventory.gpus if core.books.inventory else []
    four = TimeSlicingConfig(resources=[ReplicatedResource(name=GPU, replicas=4)])
    assert not core.time_slicing.select("from-file")
    assert core.time_slicing.set_file_configs({"from-file": four})
    assert core.time_slicing.select("from-file") is False  # already in force
    assert core.time_slicing.replicas() == {g.uuid: 4 for g in gpus}
    # The file loses the config: it stays in force (the label still names it), also
    # across a new inventory, until the label names another.
    assert not core.time_slicing.set_file_configs({})
    core.update_inventory(reference.nvlink_pairs_8())
    assert core.time_slicing.replicas() == {g.uuid: 4 for g in gpus}
    assert core.time_slicing.select("first")
    assert core.time_slicing.replicas() == {gpus[0].uuid: 3}
