"""Health per MIG device (issue 27): an XID that names gi/ci marks only that MIG device;
an XID without them marks the GPU, and so every MIG device on it.

The rule engine on its own, with the mock's ``a100-mig-mixed`` inventory (GPU 0: gi 1
3g.20gb, gi 2 2g.10gb, gi 3 and gi 4 1g.5gb; GPU 1: gi 1 split into ci 0 and ci 1).
"""

from __future__ import annotations

import msgspec

from gpulet_common.messages import Inventory
from gpulet_common.nvml.adapter import EVENT_XID, NvmlEvent
from gpulet_common.nvml.loader import open_mock
from gpulet_common.settings.health import HealthSettings
from gpulet_health.rules import RuleEngine
from gpulet_health.state import GpuState

T0 = 1_700_000_000.0


def inventory() -> Inventory:
    adapter = open_mock("a100-mig-mixed")
    try:
        return adapter.inventory("n1", 1)
    finally:
        adapter.shutdown()


INV = inventory()
GPU0, GPU1 = INV.gpus[0], INV.gpus[1]


def engine() -> RuleEngine:
    e = RuleEngine("n1", HealthSettings(), id_key=b"k" * 32)
    e.observe_inventory(INV.gpus, T0)
    return e


def xid(uuid: str, code: int, t: float, gi: int | None = None, ci: int | None = None) -> NvmlEvent:
    return NvmlEvent(
        gpu_index=0,
        gpu_uuid=uuid,
        event_type=EVENT_XID,
        event_data=code,
        timestamp=t,
        gpu_instance_id=gi,
        compute_instance_id=ci,
    )


def test_a_fault_on_gi1_ci0_marks_only_that_mig_device() -> None:
    e = engine()
    target = next(
        d for d in GPU0.mig_devices if (d.gpu_instance_id, d.compute_instance_id) == (1, 0)
    )
    events = e.observe_nvml_event(xid(GPU0.uuid, 79, T0 + 1, gi=1, ci=0))
    assert [ev.condition for ev in events] == [f"xid:79@{target.uuid}"]
    health = e.snapshot(GPU0.uuid)
    assert health.healthy
    assert health.unhealthy_mig_devices == [target.uuid]
    [condition] = health.conditions
    assert condition.mig_device == target.uuid
    assert "gi 1, ci 0" in condition.reason
    # The other GPU's gi 1 / ci 0 is another MIG device: untouched.
    assert e.snapshot(GPU1.uuid).unhealthy_mig_devices == []
    # The state survives a restart (the KV copy restored).
    restored = GpuState.restore(msgspec.json.decode(msgspec.json.encode(health), type=type(health)))
    assert restored.healthy
    assert restored.unhealthy_migs == [target.uuid]
    assert restored.conditions[f"xid:79@{target.uuid}"].xid == 79


def test_one_compute_instance_of_a_split_gpu_instance() -> None:
    e = engine()
    ci1 = next(d for d in GPU1.mig_devices if (d.gpu_instance_id, d.compute_instance_id) == (1, 1))
    e.observe_nvml_event(xid(GPU1.uuid, 79, T0 + 1, gi=1, ci=1))
    assert e.snapshot(GPU1.uuid).unhealthy_mig_devices == [ci1.uuid]
    # gi 1 alone is ambiguous there (two compute instances): the whole GPU.
    e.observe_nvml_event(xid(GPU1.uuid, 48, T0 + 2, gi=1))
    assert not e.snapshot(GPU1.uuid).healthy


def test_an_xid_without_gi_ci_marks_the_gpu() -> None:
    e = engine()
    events = e.observe_nvml_event(xid(GPU0.uuid, 79, T0 + 1))
    assert [ev.condition for ev in events] == ["xid:79"]
    health = e.snapshot(GPU0.uuid)
    assert not health.healthy
    assert health.unhealthy_mig_devices == []


def test_an_unknown_gi_is_the_gpus_fault() -> None:
    e = engine()
    e.observe_nvml_event(xid(GPU0.uuid, 79, T0 + 1, gi=9, ci=0))
    assert not e.snapshot(GPU0.uuid).healthy
