"""A MIG-enabled GPU is never handed out whole nor shared (issue 27).

Table-driven over every MIG strategy on the mock's ``a100-mig-mixed`` node (GPUs 0, 1
and 2 MIG-enabled, GPU 2 without instances; GPU 3 MIG disabled): ListAndWatch (what
the plugin lists), GetPreferredAllocation, Allocate of whole GPUs and of shares, a
share named on the card and the ledger's one answer that koord-scheduler's decisions
ask, all refuse GPUs 0-2 with ``mig_enabled``. A pending mode change is refused with
``mig_pending`` both ways (disabled -> enabled and enabled -> disabled).
"""

from __future__ import annotations

import msgspec
import pytest

from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.decide.engine import Ledger, Owner
from gpulet_allocator.kubelet.deviceplugin.resources import (
    build_inventory,
    mig_resource_specs,
    plugin_gpus_from_inventory,
)
from gpulet_allocator.mig import MigStrategy, mig_plan
from gpulet_allocator.protocol import (
    ClaimDeviceRequest,
    PreferredRequest,
    ReleaseRequest,
    core_device_id,
    resource_specs,
)
from gpulet_allocator.state.checkpoint import decode, encode
from gpulet_common.dra.devices import device_name as dra_device_name
from gpulet_common.dra.mig import device_name as mig_name
from gpulet_common.messages import GpuInfo, Inventory
from gpulet_common.nvml.loader import open_mock
from gpulet_common.refusal import Refused
from gpulet_common.settings.allocator import ResourceNames

NAMES = ResourceNames()
STRATEGIES: list[MigStrategy] = ["none", "single", "mixed"]


def inventory(scenario: str) -> Inventory:
    adapter = open_mock(scenario)
    try:
        return adapter.inventory("n", 1)
    finally:
        adapter.shutdown()


A100 = inventory("a100-mig-mixed")
PARENTS = [g.uuid for g in A100.gpus if g.mig_mode == "enabled"]
PLAIN = [g.uuid for g in A100.gpus if g.mig_mode != "enabled"]


def core_for(strategy: MigStrategy, inv: Inventory = A100) -> AllocatorCore:
    core = AllocatorCore(node="n", names=NAMES, mig_strategy=strategy)
    assert core.update_inventory(inv)
    return core


def test_the_scenario_is_what_the_table_assumes() -> None:
    assert len(PARENTS) == 3
    assert len(PLAIN) == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_list_and_watch_never_lists_a_mig_enabled_gpu(strategy: MigStrategy) -> None:
    plan = mig_plan(A100.gpus, strategy, NAMES.gpu)
    specs = [*resource_specs(NAMES), *mig_resource_specs(plan, NAMES.gpu)]
    listed = build_inventory(specs, plugin_gpus_from_inventory(A100.gpus, mig=plan))
    for resource, devices in listed.items():
        ids = {d.id for d in devices}
        parents_listed = {d.gpu_uuid for d in devices if d.id.split("::")[0] in PARENTS}
        assert not parents_listed, (resource, parents_listed)
        assert not ids & set(PARENTS)
    assert {d.id for d in listed[NAMES.gpu]} & set(PLAIN) == set(PLAIN)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("parent", PARENTS)
def test_allocate_and_preferred_refuse_a_mig_enabled_gpu(
    strategy: MigStrategy, parent: str
) -> None:
    core = core_for(strategy)
    with pytest.raises(Refused) as whole:
        core.allocate(NAMES.gpu, [[parent]])
    assert whole.value.code == "mig_enabled"
    assert "MIG enabled" in whole.value.message
    with pytest.raises(Refused) as must:
        core.preferred(
            NAMES.gpu, [PreferredRequest(available=[parent], must_include=[parent], size=1)]
        )
    assert must.value.code == "mig_enabled"
    every = [g.uuid for g in A100.gpus]
    [answer] = core.preferred(NAMES.gpu, [PreferredRequest(available=every, size=1)])
    assert answer == PLAIN
    with pytest.raises(Refused) as two:
        core.preferred(NAMES.gpu, [PreferredRequest(available=every, size=2)])
    assert two.value.code == "insufficient_capacity"
    # The ledger's one answer (koord-scheduler's decisions ask it too), whole and shared.
    for whole_card in (True, False):
        refused = core.ledger.refusal(parent, whole=whole_card)
        assert refused is not None
        assert refused.code == "mig_enabled"
    assert parent not in core.ledger.free_whole()
    assert parent not in core.withheld()
    with pytest.raises(Refused) as named_share:
        core.ledger.allocate_share(Owner(allocation_id="p"), 10, 4, device=parent)
    assert named_share.value.code == "mig_enabled"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shares_only_land_on_the_mig_disabled_gpu(strategy: MigStrategy) -> None:
    core = core_for(strategy)
    placed: set[str] = set()
    for n in range(3):
        answers, _undo = core.allocate(
            NAMES.core, [[core_device_id(PLAIN[0], u) for u in range(n * 30, n * 30 + 30)]]
        )
        placed.update(answers[0].gpus)
    assert placed == set(PLAIN)
    with pytest.raises(Refused) as full:
        core.ledger.allocate_share(Owner(allocation_id="more"), 30, 4)
    assert full.value.code in ("insufficient_capacity", "too_many_units")


@pytest.mark.parametrize(("current", "pending"), [("disabled", "enabled"), ("enabled", "disabled")])
def test_a_pending_mode_change_is_refused(current: str, pending: str) -> None:
    plain = A100.gpus[3]
    changing = msgspec.structs.replace(plain, mig_mode=current, mig_mode_pending=pending)
    ledger = Ledger([changing])
    for whole in (True, False):
        refused = ledger.refusal(plain.uuid, whole=whole)
        assert refused is not None
        assert refused.code == "mig_pending"
        assert f"{current} -> {pending}" in refused.message
    assert ledger.free_whole() == []
    # Back to a settled, disabled mode: the GPU goes whole again, no restart.
    ledger.update_inventory([plain])
    assert ledger.refusal(plain.uuid, whole=True) is None


# --- a held MIG device keeps its parent and its place (issue 36) -----------------------

MIG_1G = "nvidia.com/mig-1g.5gb"


def _with_gpu0(inv: Inventory, **changes: object) -> Inventory:
    gpus = [msgspec.structs.replace(inv.gpus[0], **changes), *inv.gpus[1:]]
    return msgspec.structs.replace(inv, gpus=gpus)


def _restarted(core: AllocatorCore, inv: Inventory) -> AllocatorCore:
    """A new allocator from ``core``'s checkpoint (encoded and decoded), on ``inv``."""
    again = core_for("mixed", inv)
    assert again.restore(decode(encode(core.snapshot()))) == []
    return again


def _whole_refusals(core: AllocatorCore, gpu: GpuInfo) -> list[str]:
    """How the device plugin and DRA answer a whole-GPU request for ``gpu``."""
    codes = []
    with pytest.raises(Refused) as plugin:
        core.allocate(NAMES.gpu, [[gpu.uuid]])
    codes.append(plugin.value.code)
    with pytest.raises(Refused) as dra:
        core.claims.reserve("claim-whole", [ClaimDeviceRequest(device=dra_device_name(gpu))])
    codes.append(dra.value.code)
    return codes


@pytest.mark.parametrize("holder", ["device-plugin", "dra"])
def test_a_held_mig_device_keeps_its_parent_from_going_whole(holder: str) -> None:
    """MIG disabled on GPU 0 while a container or a claim holds one of its MIG devices:
    GPU 0 is refused whole (device plugin and DRA), after a restart too, until the
    holder is released."""
    gpu0 = A100.gpus[0]
    mig = next(d for d in gpu0.mig_devices if d.profile == "1g.5gb")
    core = core_for("mixed")
    if holder == "device-plugin":
        [answer], _ = core.allocate(MIG_1G, [[mig.uuid]])
        held = answer.annotations["gpulet.io/allocation"]
    else:
        core.claims.reserve("claim-mig", [ClaimDeviceRequest(device=mig_name(gpu0, mig))])
        held = "claim-mig"
    plain = _with_gpu0(A100, mig_mode="disabled", mig_mode_pending="disabled", mig_devices=[])
    assert core.update_inventory(plain)
    assert _whole_refusals(core, plain.gpus[0]) == ["insufficient_capacity"] * 2
    again = _restarted(core, plain)
    assert _whole_refusals(again, plain.gpus[0]) == ["insufficient_capacity"] * 2
    with pytest.raises(Refused, match=f"its MIG device {mig.uuid} is held"):
        again.allocate(NAMES.gpu, [[gpu0.uuid]])
    if holder == "device-plugin":
        again.release(ReleaseRequest(allocation_ids=[held]))
    else:
        assert again.claims.release(held)
    again.allocate(NAMES.gpu, [[gpu0.uuid]])


def test_a_mig_device_recreated_in_the_same_place_waits_for_the_holder() -> None:
    """A held 1g.5gb re-created with a new UUID but the same GPU and compute instance
    (the same DRA name, the same /dev/nvidia-caps nodes) goes to nobody else, after a
    restart too, until the first holder is released."""
    gpu0 = A100.gpus[0]
    mig = next(d for d in gpu0.mig_devices if d.profile == "1g.5gb")
    core = core_for("mixed")
    [answer], _ = core.allocate(MIG_1G, [[mig.uuid]])
    reborn = msgspec.structs.replace(mig, uuid="MIG-reborn-0000")
    devices = [reborn if d.uuid == mig.uuid else d for d in gpu0.mig_devices]
    relaid = _with_gpu0(A100, mig_devices=devices)
    assert core.update_inventory(relaid)
    for c in (core, _restarted(core, relaid)):
        with pytest.raises(Refused, match=r"GPU instance .* is still held as") as plugin:
            c.allocate(MIG_1G, [[reborn.uuid]])
        assert plugin.value.code == "insufficient_capacity"
        with pytest.raises(Refused) as dra:
            c.claims.reserve("claim-2", [ClaimDeviceRequest(device=mig_name(gpu0, reborn))])
        assert dra.value.code == "insufficient_capacity"
    again = _restarted(core, relaid)
    again.release(ReleaseRequest(allocation_ids=[answer.annotations["gpulet.io/allocation"]]))
    again.allocate(MIG_1G, [[reborn.uuid]])
