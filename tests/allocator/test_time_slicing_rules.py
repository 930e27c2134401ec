"""Time-slicing's rules without I/O (issue 27): replica IDs, which GPU gets how many
replicas, and the one owner model of the ledger -- a time-sliced GPU is never also
given whole or shared, and a GPU held whole or shared gives no replica.
"""

from __future__ import annotations

import msgspec
import pytest

from gpulet_allocator.decide.engine import Ledger, Owner, WholeAllocation
from gpulet_allocator.protocol import ResourceKind, parse_device_id, replica_device_id
from gpulet_allocator.timeslicing import chosen_config, plan
from gpulet_common.messages import GpuInfo
from gpulet_common.refusal import Refused
from gpulet_common.settings.sharing import (
    GpuReplicas,
    ReplicatedResource,
    TimeSlicingConfig,
    TimeSlicingSettings,
)
from support import reference

GPU = "nvidia.com/gpu"


def settings() -> TimeSlicingSettings:
    return TimeSlicingSettings(
        default_config="four",
        configs={
            "four": TimeSlicingConfig(resources=[ReplicatedResource(name=GPU, replicas=4)]),
            "mixed": TimeSlicingConfig(
                resources=[
                    ReplicatedResource(name=GPU, replicas=2),
                    ReplicatedResource(name="nvidia.com/mig-1g.10gb", replicas=3),
                ],
                gpus=[GpuReplicas(gpu="1", replicas=8), GpuReplicas(gpu="2", replicas=1)],
            ),
        },
    )


def refused(call: object, *args: object, **kwargs: object) -> Refused:
    assert callable(call)
    with pytest.raises(Refused) as err:
        call(*args, **kwargs)
    return err.value


def test_replica_ids_are_nvidias() -> None:
    uuid = "GPU-12345678-1234-1234-1234-123456789abc"
    rid = replica_device_id(uuid, 3)
    assert rid == f"{uuid}::3"
    parsed = parse_device_id(rid)
    assert (parsed.gpu_uuid, parsed.kind, parsed.unit) == (uuid, ResourceKind.REPLICA, 3)
    # gpulet's share IDs and malformed suffixes are not replicas.
    assert parse_device_id(f"{uuid}::core-3").kind is ResourceKind.CORE
    for bad in (f"{uuid}::", f"{uuid}::-1", f"{uuid}::x3", f"{uuid}::99999"):
        with pytest.raises(ValueError, match="malformed"):
            parse_device_id(bad)


def test_replicas_per_gpu_by_uuid_index_product_then_resource() -> None:
    gpus = list(reference.nvlink_pairs_8().gpus)
    s = settings()
    by_uuid = GpuReplicas(gpu=gpus[3].uuid, replicas=5)
    by_product = GpuReplicas(gpu=gpus[0].name.replace(" ", "-"), replicas=6)
    mixed = s.configs["mixed"]
    s.configs["mixed"] = msgspec.structs.replace(mixed, gpus=[*mixed.gpus, by_uuid, by_product])
    p = plan("mixed", s.configs["mixed"], gpus, GPU)
    # index 1 -> 8, index 2 -> 1 (not time-sliced), uuid of 3 -> 5, the rest by product -> 6
    expected = {g.uuid: 6 for g in gpus}
    expected[gpus[1].uuid], expected[gpus[3].uuid] = 8, 5
    del expected[gpus[2].uuid]
    assert p.replicas == expected
    # Another resource's entry is not replicated, and said so.
    assert any("mig-1g.10gb" in problem for problem in p.problems)
    assert plan("", None, gpus, GPU).replicas == {}


def test_a_mig_enabled_gpu_is_never_replicated() -> None:
    gpus = list(reference.nvlink_pairs_8().gpus)
    gpus[0] = msgspec.structs.replace(
        gpus[0], mig_mode="enabled", mig_mode_pending="enabled", mig_max_devices=7
    )
    p = plan("four", settings().configs["four"], gpus, GPU)
    assert gpus[0].uuid not in p.replicas
    assert len(p.replicas) == 7
    assert any("MIG" in problem for problem in p.problems)


def test_which_config_a_label_picks() -> None:
    s = settings()
    assert chosen_config(s, None) == ("four", "")
    assert chosen_config(s, "mixed") == ("mixed", "")
    assert chosen_config(s, "none") == ("", "")
    name, problem = chosen_config(s, "typo")
    assert name == ""
    assert "typo" in problem
    assert "four, mixed" in problem


def sliced_ledger(replicas: int = 2) -> tuple[Ledger, list[GpuInfo]]:
    gpus = list(reference.nvlink_pairs_8().gpus)
    ledger = Ledger(gpus)
    ledger.set_replicas({gpus[0].uuid: replicas})
    return ledger, gpus


def test_a_time_sliced_gpu_goes_neither_whole_nor_shared() -> None:
    ledger, gpus = sliced_ledger()
    g0 = gpus[0].uuid
    whole = ledger.refusal(g0, whole=True)
    assert whole is not None
    assert whole.code == "time_sliced"
    assert refused(ledger.allocate_whole, Owner(allocation_id="w"), devices=[g0]).code == (
        "time_sliced"
    )
    assert refused(ledger.allocate_share, Owner(allocation_id="s"), 30, 4, device=g0).code == (
        "time_sliced"
    )
    assert g0 not in ledger.free_whole()
    # Shares placed by the allocator avoid it; whole placement does too.
    for n in range(7):
        share = ledger.allocate_share(Owner(allocation_id=f"s{n}"), 90, 1)
        assert share.device != g0
    err = refused(ledger.allocate_whole, Owner(allocation_id="all"), 8)
    assert err.code == "too_many_units"
    # Its replicas go, each once; a replica is never a share.
    r0 = replica_device_id(g0, 0)
    alloc = ledger.allocate_whole(Owner(allocation_id="r"), devices=[r0])
    assert alloc.devices == (r0,)
    assert ledger.gpu_of(r0) == g0
    assert refused(ledger.allocate_whole, Owner(allocation_id="r2"), devices=[r0]).code == (
        "insufficient_capacity"
    )
    assert ledger.refusal(replica_device_id(g0, 1), whole=False) is not None


def test_a_gpu_held_whole_or_shared_gives_no_replica() -> None:
    gpus = list(reference.nvlink_pairs_8().gpus)
    ledger = Ledger(gpus)
    g0, g1 = gpus[0].uuid, gpus[1].uuid
    ledger.allocate_whole(Owner(allocation_id="w"), devices=[g0])
    ledger.allocate_share(Owner(allocation_id="s"), 30, 4, device=g1)
    ledger.set_replicas({g0: 2, g1: 2})
    for gpu, why in ((g0, "allocated whole"), (g1, "holds shares")):
        err = refused(
            ledger.allocate_whole,
            Owner(allocation_id=f"r-{gpu}"),
            devices=[replica_device_id(gpu, 0)],
        )
        assert err.code == "time_sliced"
        assert why in err.message
    # What they held stays; released, their replicas go.
    ledger.release("w")
    ledger.allocate_whole(Owner(allocation_id="r"), devices=[replica_device_id(g0, 1)])


def test_shrinking_keeps_what_is_held_and_offers_no_more() -> None:
    ledger, gpus = sliced_ledger(4)
    g0 = gpus[0].uuid
    r3 = replica_device_id(g0, 3)
    ledger.allocate_whole(Owner(allocation_id="r3"), devices=[r3])
    ledger.set_replicas({g0: 2})
    held = ledger.get("r3")
    assert isinstance(held, WholeAllocation)
    assert held.devices == (r3,)
    assert ledger.replicas_held(g0) == 1
    # Not offered any more, held or not.
    err = refused(
        ledger.allocate_whole, Owner(allocation_id="r2"), devices=[replica_device_id(g0, 2)]
    )
    assert err.code == "unknown_device"
    assert ledger.refusal(r3, whole=True) is not None
    # No time-slicing at all: still not whole while a replica is held.
    ledger.set_replicas({})
    err = refused(ledger.allocate_whole, Owner(allocation_id="w"), devices=[g0])
    assert err.code == "time_sliced"
    assert "replicas are held" in err.message
    ledger.release("r3")
    assert ledger.refusal(g0, whole=True) is None
    ledger.allocate_whole(Owner(allocation_id="w"), devices=[g0])


def test_a_replica_follows_its_gpus_health() -> None:
    ledger, gpus = sliced_ledger(3)
    g0 = gpus[0].uuid
    ledger.set_health(g0, False)
    for n in range(3):
        err = ledger.refusal(replica_device_id(g0, n), whole=True)
        assert err is not None
        assert err.code == "unhealthy_device"


def test_fail_requests_greater_than_one() -> None:
    gpus = list(reference.nvlink_pairs_8().gpus)
    ledger = Ledger(gpus)
    ledger.set_replicas({gpus[0].uuid: 4}, fail_over_one=True)
    two = [replica_device_id(gpus[0].uuid, n) for n in range(2)]
    err = refused(ledger.allocate_whole, Owner(allocation_id="two"), devices=two)
    assert err.code == "invalid_request"
    assert "fail_requests_greater_than_one" in err.message
    ledger.set_replicas({gpus[0].uuid: 4})
    ledger.allocate_whole(Owner(allocation_id="two"), devices=two)


def test_a_held_replica_survives_a_restart() -> None:
    ledger, gpus = sliced_ledger(2)
    r1 = replica_device_id(gpus[0].uuid, 1)
    ledger.allocate_whole(Owner(allocation_id="r1"), devices=[r1])
    saved = ledger.snapshot()
    # Restored before the inventory and the plan, as the allocator starts.
    again = Ledger()
    assert again.restore(saved) == []
    again.update_inventory(gpus)
    again.set_replicas({gpus[0].uuid: 2})
    assert again.get("r1") == ledger.get("r1")
    assert refused(again.allocate_whole, Owner(allocation_id="x"), devices=[r1]).code == (
        "insufficient_capacity"
    )
    assert again.refusal(gpus[0].uuid, whole=True) is not None
    assert again.refusal(replica_device_id(gpus[0].uuid, 0), whole=True) is None
