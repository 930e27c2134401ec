"""MIG devices through DRA (issue 27): the slices, their taints, the ledger, Prepare.

On the mock's ``a100-mig-mixed`` node (GPU 0 = 3g.20gb, 2g.10gb, 2 x 1g.5gb; GPU 1 =
1c.3g.20gb + 2c.3g.20gb in one GPU instance, and 3g.20gb; GPU 2 MIG-enabled without
instances; GPU 3 MIG disabled):

* the pool lists the 7 MIG devices (``type=mig``, NVIDIA's attribute and capacity
  names) and GPU 3 whole, never GPUs 0-2, and every slice passes the 1.37 schema;
  a pending MIG mode change takes a GPU out too;
* a fault confined to one MIG device taints that device only; a GPU-wide one taints
  every MIG device of the GPU; a device-plugin holding taints the MIG device (mode
  ``both``);
* the real decision core reserves a MIG device for a claim under its MIG UUID (once:
  a second claim and the device plugin are refused), refuses the parent whole;
* the kubelet plugin's Prepare of a MIG device writes a CDI spec with the MIG UUID,
  the parent's device node and the capability nodes; its health stream names MIG
  devices, each unhealthy on its own or with its GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import kubernetes_validate
import msgspec
import pytest

from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.kubelet.deviceplugin.resources import (
    build_devices,
    plugin_gpus_from_inventory,
)
from gpulet_allocator.kubelet.dra.contract import ClaimDevice, Reservation
from gpulet_allocator.kubelet.dra.health import NodeViewHealth
from gpulet_allocator.kubelet.dra.plugin import ClaimRef, DraPlugin, PluginSettings
from gpulet_allocator.kubelet.dra.terms import claim_requests, reservation
from gpulet_allocator.protocol import ClaimDeviceRequest, ResourceKind
from gpulet_common.bus import Bus
from gpulet_common.dra import cdi, pool
from gpulet_common.dra import mig as dramig
from gpulet_common.messages import ActiveCondition, GpuHealth, GpuInfo, Inventory, MigDevice
from gpulet_common.nodeview import NodeView
from gpulet_common.refusal import Refused
from gpulet_common.settings.allocator import ResourceNames
from gpulet_common.settings.dra import DraSettings
from support.agent import mock_inventory

K8S = kubernetes_validate.latest_version()
NODE = "node-a"
DRIVER = "gpu.gpulet.io"
UID_A = "0b7c3f52-8d7e-4d7c-9c55-3c2f7d9b1a00"
UID_B = "1c8d4063-9e8f-4e8d-8d66-4d3f8e0c2b11"

# The scenario's pool: (name, profile) of each device, in order.
A100_POOL = [
    ("gpu-0-mig-3g20gb-1-0", "3g.20gb"),
    ("gpu-0-mig-2g10gb-2-0", "2g.10gb"),
    ("gpu-0-mig-1g5gb-3-0", "1g.5gb"),
    ("gpu-0-mig-1g5gb-4-0", "1g.5gb"),
    ("gpu-1-mig-1c3g20gb-1-0", "1c.3g.20gb"),
    ("gpu-1-mig-2c3g20gb-1-1", "2c.3g.20gb"),
    ("gpu-1-mig-3g20gb-2-0", "3g.20gb"),
    ("gpu-3", ""),
]


def inventory(scenario: str = "a100-mig-mixed") -> Inventory:
    return mock_inventory(scenario, NODE)


def fault_on(gpu: GpuInfo, mig: MigDevice) -> GpuHealth:
    """An XID 79 confined to one MIG device of ``gpu`` (the GPU stays healthy)."""
    return GpuHealth(
        gpu_uuid=gpu.uuid, conditions=[xid(79, mig.uuid)], unhealthy_mig_devices=[mig.uuid]
    )


def by_name(devices: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in devices}


def xid(code: int, mig_device: str = "") -> ActiveCondition:
    name = f"xid:{code}" + (f"@{mig_device}" if mig_device else "")
    return ActiveCondition(
        condition=name,
        kind="xid",
        severity="critical",
        reason="r",
        since=1000.0,
        mig_device=mig_device,
    )


def test_the_pool_lists_mig_devices_and_never_a_mig_enabled_gpu_whole() -> None:
    inv = inventory()
    built = pool.build(inv, {}, DraSettings())
    for body in built.slices:
        kubernetes_validate.validate(body, K8S, strict=True)
    assert [
        (d["name"], d["attributes"].get("profile", {}).get("string", "")) for d in built.devices
    ] == A100_POOL
    gpu0 = inv.gpus[0]
    first = built.devices[0]
    m = gpu0.mig_devices[0]
    attrs = first["attributes"]
    assert attrs["type"] == {"string": "mig"}
    assert attrs["uuid"] == {"string": m.uuid}
    assert attrs["parentUUID"] == {"string": gpu0.uuid}
    assert attrs["productName"] == {"string": gpu0.name}
    assert attrs["architecture"] == {"string": "Ampere"}
    assert attrs["cudaComputeCapability"] == {"version": "8.0.0"}
    assert (attrs["gpuInstanceId"], attrs["computeInstanceId"]) == ({"int": 1}, {"int": 0})
    assert "resource.kubernetes.io/pciBusID" in attrs
    assert "index" not in attrs
    assert "minor" not in attrs
    assert first["capacity"] == {
        "multiprocessors": {"value": "48"},
        "copyEngines": {"value": "3"},
        "decoders": {"value": "1"},
        "encoders": {"value": "0"},
        "jpegEngines": {"value": "0"},
        "ofaEngines": {"value": "0"},
        "memory": {"value": "20070Mi"},
    }
    # MIG devices are given whole: never shared, whatever the sharing setting.
    assert "allowMultipleAllocations" not in first
    assert by_name(built.devices)["gpu-3"]["allowMultipleAllocations"] is True
    # Every MIG device of the node is listed by its UUID exactly once.
    uuids = [d["attributes"]["uuid"]["string"] for d in built.devices]
    assert sorted(uuids[:-1]) == sorted(d.uuid for g in inv.gpus for d in g.mig_devices)


def test_a_pending_mig_mode_change_takes_the_gpu_out_of_the_pool() -> None:
    inv = inventory()
    gpu3 = msgspec.structs.replace(inv.gpus[3], mig_mode_pending="enabled")
    inv = msgspec.structs.replace(inv, gpus=[*inv.gpus[:3], gpu3])
    names = [d["name"] for d in pool.build(inv, {}, DraSettings()).devices]
    assert "gpu-3" not in names
    assert len(names) == 7


def test_h100_single_layout_is_56_mig_devices_and_no_gpu() -> None:
    built = pool.build(inventory("h100-mig-single"), {}, DraSettings())
    assert len(built.devices) == 56
    assert {d["attributes"]["type"]["string"] for d in built.devices} == {"mig"}
    assert {d["attributes"]["profile"]["string"] for d in built.devices} == {"1g.10gb"}
    for body in built.slices:
        kubernetes_validate.validate(body, K8S, strict=True)


@pytest.mark.parametrize(
    ("profile", "part"),
    [("1g.10gb+me", "1g10gb-me"), ("1c.2g.20gb", "1c2g20gb"), ("", ""), ("Weird Name!" * 9, "x")],
)
def test_names_are_dns_labels_and_give_back_their_ids(profile: str, part: str) -> None:
    inv = inventory()
    gpu0 = inv.gpus[0]
    m = msgspec.structs.replace(gpu0.mig_devices[0], profile=profile, gpu_instance_id=13)
    name = dramig.device_name(gpu0, m)
    assert len(name) <= 63
    if part != "x":
        assert name == "gpu-0-mig-" + (f"{part}-" if part else "") + "13-0"
    assert dramig.parse_name(name) == (0, 13, 0)
    assert dramig.parse_name("gpu-0") is None
    assert dramig.parse_name("gpu-0-mig-13") is None


def test_a_fault_on_one_mig_device_taints_that_device_only() -> None:
    inv = inventory()
    gpu0, gpu1 = inv.gpus[0], inv.gpus[1]
    target = gpu0.mig_devices[2]
    healths = {gpu0.uuid: fault_on(gpu0, target)}
    devices = by_name(pool.build(inv, healths, DraSettings()).devices)
    tainted = {n for n, d in devices.items() if d.get("taints")}
    assert tainted == {dramig.device_name(gpu0, target)}
    [taint] = devices[dramig.device_name(gpu0, target)]["taints"]
    assert (taint["key"], taint["value"], taint["effect"]) == (f"{DRIVER}/xid", "79", "NoSchedule")
    # GPU-wide (no gi/ci): every MIG device of GPU 1 and none of GPU 0.
    healths = {gpu1.uuid: GpuHealth(gpu_uuid=gpu1.uuid, healthy=False, conditions=[xid(48)])}
    devices = by_name(pool.build(inv, healths, DraSettings()).devices)
    tainted = {n for n, d in devices.items() if d.get("taints")}
    assert tainted == {dramig.device_name(gpu1, m) for m in gpu1.mig_devices}


def test_a_mig_device_the_device_plugin_holds_is_tainted_in_mode_both() -> None:
    inv = inventory()
    held = inv.gpus[0].mig_devices[0]
    devices = by_name(pool.build(inv, {}, DraSettings(mode="both"), held={held.uuid}).devices)
    tainted = {n: [t["key"] for t in d["taints"]] for n, d in devices.items() if d.get("taints")}
    assert tainted == {dramig.device_name(inv.gpus[0], held): [f"{DRIVER}/device-plugin"]}


# --- the decision core --------------------------------------------------------------------


def core_on(inv: Inventory) -> AllocatorCore:
    core = AllocatorCore(node=NODE, names=ResourceNames(), mig_strategy="mixed")
    assert core.update_inventory(inv)
    return core


def test_the_core_reserves_a_mig_device_once_and_never_its_parent_whole() -> None:
    inv = inventory()
    core = core_on(inv)
    gpu0 = inv.gpus[0]
    small = [m for m in gpu0.mig_devices if m.profile == "1g.5gb"]
    name = dramig.device_name(gpu0, small[0])
    record, _undo = core.claims.reserve(UID_A, [ClaimDeviceRequest(device=name)])
    [held] = record.devices
    assert (held.device, held.uuid, held.minor, held.cores) == (name, small[0].uuid, 0, None)
    assert core.books.ledger.device(small[0].uuid).whole_owner is not None
    # A second claim for it is refused; the device plugin's Allocate of it too.
    with pytest.raises(Refused) as again:
        core.claims.reserve(UID_B, [ClaimDeviceRequest(device=name)])
    assert again.value.code == "insufficient_capacity"
    with pytest.raises(Refused) as plugin:
        core.allocate("nvidia.com/mig-1g.5gb", [[small[0].uuid]])
    assert plugin.value.code == "insufficient_capacity"
    # The device plugin is told to list it Unhealthy (a claim holds it), and does.
    withheld = core.books.withheld()
    assert small[0].uuid in withheld
    listed = build_devices(
        ResourceKind.MIG,
        plugin_gpus_from_inventory(inv.gpus, withheld=withheld, mig=core.mig),
        "nvidia.com/mig-1g.5gb",
    )
    assert {d.id: d.healthy for d in listed} == {small[0].uuid: False, small[1].uuid: True}
    # The MIG-enabled parent, by its whole-GPU name: refused, and said why.
    with pytest.raises(Refused) as parent:
        core.claims.reserve(UID_B, [ClaimDeviceRequest(device="gpu-0")])
    assert parent.value.code == "mig_enabled"
    # A share of a MIG device: refused (given whole only).
    with pytest.raises(Refused) as share:
        core.claims.reserve(
            UID_B, [ClaimDeviceRequest(device=dramig.device_name(gpu0, small[1]), cores=30)]
        )
    assert share.value.code == "invalid_request"
    assert core.claims.release(UID_A)
    core.claims.reserve(UID_B, [ClaimDeviceRequest(device=name)])


# --- the kubelet plugin -------------------------------------------------------------------


class CoreAdapter:
    """The plugin's DecisionCore, answered in-process by the real decision core."""

    def __init__(self, core: AllocatorCore) -> None:
        self.core = core

    async def reserve_claim(
        self,
        claim_uid: str,
        devices: Sequence[ClaimDevice],
        *,
        namespace: str = "",
        name: str = "",
    ) -> Reservation:
        record, _undo = self.core.claims.reserve(
            claim_uid, claim_requests(devices), namespace=namespace, name=name
        )
        return reservation(claim_uid, claim_uid, record.devices)

    async def release_claim(self, claim_uid: str) -> bool:
        return self.core.claims.release(claim_uid)


class OneClaim:
    def __init__(self, uid: str, *devices: str) -> None:
        self.body = {
            "metadata": {"uid": uid, "namespace": "ns", "name": "c"},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {"request": "mig", "driver": DRIVER, "pool": NODE, "device": d}
                            for d in devices
                        ]
                    }
                }
            },
        }

    async def get_claim(self, namespace: str, name: str, uid: str = "") -> dict[str, Any] | None:
        return self.body


@pytest.mark.anyio
async def test_prepare_of_a_mig_device_gives_its_uuid_parent_node_and_caps(tmp_path: Path) -> None:
    inv = inventory()
    gpu0 = inv.gpus[0]
    target = gpu0.mig_devices[1]
    name = dramig.device_name(gpu0, target)
    caps = tmp_path / "caps" / "gpu0" / "mig" / f"gi{target.gpu_instance_id}"
    (caps / f"ci{target.compute_instance_id}").mkdir(parents=True)
    (caps / "access").write_text("DeviceFileMinor: 21\nDeviceFileMode: 292\n")
    (caps / f"ci{target.compute_instance_id}" / "access").write_text("DeviceFileMinor: 22\n")
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for node in ("nvidiactl", "nvidia0", "nvidia-caps/nvidia-cap21", "nvidia-caps/nvidia-cap22"):
        (dev / node).touch()
    core = core_on(inv)
    settings = PluginSettings(
        driver=DRIVER,
        pool=NODE,
        cdi_dir=tmp_path / "cdi",
        checkpoint=tmp_path / "checkpoint.json",
        dev_root=dev,
        mig_capabilities_root=tmp_path / "caps",
    )
    plugin = DraPlugin(CoreAdapter(core), OneClaim(UID_A, name), settings)
    result = (await plugin.prepare([ClaimRef("ns", UID_A, "c")]))[UID_A]
    assert result.error == ""
    assert [d.cdi_ids for d in result.devices] == [[cdi.device_id(DRIVER, UID_A, name)]]
    spec = msgspec.json.decode(cdi.spec_file(tmp_path / "cdi", DRIVER, UID_A).read_bytes())
    [device] = spec["devices"]
    assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidia0",
        "/dev/nvidia-caps/nvidia-cap21",
        "/dev/nvidia-caps/nvidia-cap22",
    ]
    assert f"NVIDIA_VISIBLE_DEVICES={target.uuid}" in device["containerEdits"]["env"]
    assert core.books.ledger.device(target.uuid).whole_owner is not None
    # The parent, allocated to a claim by name, is refused for that claim alone.
    refused = await DraPlugin(CoreAdapter(core), OneClaim(UID_B, "gpu-0"), settings).prepare(
        [ClaimRef("ns", UID_B, "c")]
    )
    assert "mig_enabled" in refused[UID_B].error or "MIG enabled" in refused[UID_B].error
    assert await plugin.unprepare([ClaimRef("ns", UID_A, "c")]) == {UID_A: ""}
    assert core.books.ledger.device(target.uuid).whole_owner is None


def static_view(inv: Inventory, healths: dict[str, GpuHealth]) -> NodeView:
    """A node read model holding a fixed inventory and health (never run: no bus)."""
    view = NodeView(cast(Bus, None), NODE)
    view.inventory = inv
    view._replace({uuid: (1, h) for uuid, h in healths.items()})
    return view


def test_health_stream_names_mig_devices_each_on_its_own() -> None:
    inv = inventory()
    gpu0, gpu1 = inv.gpus[0], inv.gpus[1]
    sick = gpu0.mig_devices[0]
    healths = {
        gpu0.uuid: fault_on(gpu0, sick),
        gpu1.uuid: GpuHealth(gpu_uuid=gpu1.uuid, healthy=False, conditions=[xid(48)]),
    }
    states = {
        d.device: d.health for d in NodeViewHealth(static_view(inv, healths), NODE).device_health()
    }
    assert [n for n, _ in A100_POOL] == list(states)
    unhealthy = {n for n, h in states.items() if h == "unhealthy"}
    assert unhealthy == {
        dramig.device_name(gpu0, sick),
        *(dramig.device_name(gpu1, m) for m in gpu1.mig_devices),
    }
