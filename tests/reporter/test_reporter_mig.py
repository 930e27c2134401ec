"""The Device and the node labels of a MIG node (issue 27).

Koordinator has no MIG model: a MIG-enabled GPU (or one with a pending mode change)
is written unhealthy with the reason ``MIGEnabled`` / ``MIGPending`` so that
koord-scheduler places neither whole-GPU nor shared requests on it, and its entry's
labels describe its MIG devices. A health fault keeps its own reason.
"""

from __future__ import annotations

import msgspec

from gpulet_common.messages import ActiveCondition, GpuHealth, Inventory
from gpulet_common.nvml.loader import open_mock
from gpulet_reporter.desired import (
    ENTRY_LABEL_MIG_DEVICES,
    ENTRY_LABEL_MIG_MODE,
    ENTRY_LABEL_MIG_UNHEALTHY,
    GpuCondition,
    build_desired,
    render_devices,
)
from gpulet_reporter.health_view import HealthView
from gpulet_reporter.labels import LABEL_MIG_WITHHELD


def inventory(scenario: str) -> Inventory:
    adapter = open_mock(scenario)
    try:
        return adapter.inventory("n", 1)
    finally:
        adapter.shutdown()


def test_mig_enabled_gpus_are_unschedulable_and_described() -> None:
    inv = inventory("a100-mig-mixed")
    healthy = {g.uuid: GpuCondition(healthy=True, reason="Healthy") for g in inv.gpus}
    desired = build_desired(inv, healthy)
    entries = {e["id"]: e for e in render_devices(desired, None, now=1000.0)}
    by_index = {g.index: entries[g.uuid] for g in inv.gpus}
    for index in (0, 1, 2):
        entry = by_index[index]
        assert entry["health"] is False
        assert entry["conditions"][0]["reason"] == "MIGEnabled"
        assert "MIG enabled" in entry["conditions"][0]["message"]
        assert entry["labels"][ENTRY_LABEL_MIG_MODE] == "enabled"
    assert by_index[0]["labels"][ENTRY_LABEL_MIG_DEVICES] == (
        "3g.20gb@1/0,2g.10gb@2/0,1g.5gb@3/0,1g.5gb@4/0"
    )
    assert by_index[1]["labels"][ENTRY_LABEL_MIG_DEVICES] == (
        "1c.3g.20gb@1/0,2c.3g.20gb@1/1,3g.20gb@2/0"
    )
    assert ENTRY_LABEL_MIG_DEVICES not in by_index[2]["labels"]
    assert by_index[3]["health"] is True
    assert by_index[3]["labels"] == {ENTRY_LABEL_MIG_MODE: "disabled"}
    assert desired.node_labels[LABEL_MIG_WITHHELD] == "3"


def test_a_fault_keeps_its_reason_and_a_pending_change_says_so() -> None:
    inv = inventory("a100-mig-mixed")
    gpu0, gpu3 = inv.gpus[0], inv.gpus[3]
    pending = msgspec.structs.replace(gpu3, mig_mode_pending="enabled")
    inv = msgspec.structs.replace(inv, gpus=[gpu0, pending])
    health = {gpu0.uuid: GpuCondition(healthy=False, reason="Xid79", message="fell off")}
    entries = {e["id"]: e for e in render_devices(build_desired(inv, health), None, now=1.0)}
    assert entries[gpu0.uuid]["conditions"][0]["reason"] == "Xid79"
    assert entries[gpu3.uuid]["health"] is False
    assert entries[gpu3.uuid]["conditions"][0]["reason"] == "MIGPending"
    assert entries[gpu3.uuid]["labels"][ENTRY_LABEL_MIG_MODE] == "disabled-pending-enabled"


def test_a_gpu_without_mig_keeps_no_mig_label() -> None:
    inv = inventory("dgx-h100")
    entries = render_devices(build_desired(inv, {}), None, now=1.0)
    assert all("labels" not in e for e in entries)
    assert LABEL_MIG_WITHHELD not in build_desired(inv, {}).node_labels


def test_a_mig_device_fault_is_described_and_leaves_the_gpu_as_it_was() -> None:
    inv = inventory("a100-mig-mixed")
    gpu0 = inv.gpus[0]
    gi1 = next(d for d in gpu0.mig_devices if d.gpu_instance_id == 1)
    fault = ActiveCondition(
        condition=f"xid:79@{gi1.uuid}",
        kind="xid",
        severity="fatal",
        reason="XID 79: fell off",
        mig_device=gi1.uuid,
    )
    view = HealthView()
    view.apply(
        gpu0.uuid,
        GpuHealth(gpu_uuid=gpu0.uuid, conditions=[fault], unhealthy_mig_devices=[gi1.uuid]),
    )
    condition = view.get(gpu0.uuid)
    assert condition is not None
    assert condition.healthy
    assert condition.unhealthy_mig == (gi1.uuid,)
    entries = {
        e["id"]: e for e in render_devices(build_desired(inv, view.snapshot()), None, now=1.0)
    }
    # Still MIGEnabled for koord-scheduler, and the faulty MIG device named.
    assert entries[gpu0.uuid]["conditions"][0]["reason"] == "MIGEnabled"
    assert entries[gpu0.uuid]["labels"][ENTRY_LABEL_MIG_UNHEALTHY] == "3g.20gb@1/0"
    # A GPU-wide fault beside it: the GPU's reason is the GPU-wide one.
    gpu_wide = ActiveCondition(condition="xid:48", kind="xid", severity="fatal", reason="XID 48")
    view.apply(
        gpu0.uuid,
        GpuHealth(
            gpu_uuid=gpu0.uuid,
            healthy=False,
            conditions=[fault, gpu_wide],
            unhealthy_mig_devices=[gi1.uuid],
        ),
    )
    condition = view.get(gpu0.uuid)
    assert condition is not None
    assert condition.reason == "Xid48"
