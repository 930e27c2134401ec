"""The pure parts of the reporter: intent, rendering, comparison, node-label patches,
PCIe roots and the health view. No network; the CRD schema check uses the emulator's
schema loader on the shipped CRD."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import msgspec
import pytest

from gpulet_common.heal import HealRecord, overlay
from gpulet_common.messages import ActiveCondition, GpuHealth
from gpulet_reporter import desired as d
from gpulet_reporter import labels as lb
from gpulet_reporter.facts import read_machine_type
from gpulet_reporter.health_view import HealthView
from gpulet_reporter.pcie import make_resolver, sysfs_pcie_root
from support.kube_emulator import DEFAULT_CRD_PATH, CrdSchema
from support.reporter_harness import gpu_uuid, koordlet_foreign_devices, make_inventory

NODE = "node-a"
NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (80 * 2**30, "80Gi"),
        (85_520_809_984, "81559Mi"),
        (1536 * 1024, "1536Ki"),
        (1000, "1000"),
        (0, "0"),
        (2**40, "1Ti"),
    ],
)
def test_memory_quantity_is_exact_and_binary(size: int, text: str) -> None:
    assert d.memory_quantity(size) == text


def test_model_and_product_labels() -> None:
    assert lb.model_label("NVIDIA A100-SXM4-80GB") == "A100-SXM4-80GB"
    assert lb.model_label("NVIDIA H100 80GB HBM3") == "H100-80GB-HBM3"
    assert lb.model_label("Tesla T4") == "Tesla-T4"
    assert lb.product_label("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    # Whatever NVML says, the label value stays valid.
    assert lb.model_label("NVIDIA Weird (rev 2) /x" + "y" * 80) == lb.label_value(
        "Weird-(rev-2)-/x" + "y" * 80
    )
    assert len(lb.model_label("NVIDIA " + "A" * 100)) <= 63


def test_labels_of_a_uniform_node() -> None:
    inventory = make_inventory(NODE)
    inventory = msgspec.structs.replace(
        inventory,
        gpus=[msgspec.structs.replace(g, compute_capability=(9, 0)) for g in inventory.gpus],
    )
    facts = lb.NodeFacts(machine="DGXH100 ", serves_whole_gpus=True, mps_shares=True)
    labels = lb.node_labels(inventory, facts=facts)
    assert labels == {
        lb.LABEL_GPU_MODEL: "H100-80GB-HBM3",
        lb.LABEL_GPU_VENDOR: "nvidia",
        lb.LABEL_GPU_DRIVER: "550.54.15",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.memory": "81920",
        "nvidia.com/gpu.family": "hopper",
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.machine": "DGXH100",
        "nvidia.com/mps.capable": "true",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/cuda.driver-version.full": "550.54.15",
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "54",
        "nvidia.com/cuda.driver-version.revision": "15",
        "nvidia.com/cuda.runtime-version.full": "12.4",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "4",
    }
    assert set(lb.node_labels(inventory, gfd=False)) == set(lb.KOORD_LABELS)
    # Without gpulet's plugin on nvidia.com/gpu, GFD's sharing labels are not ours to set;
    # without MPS shares the node is not MPS-capable; an unreadable machine is "unknown".
    plain = lb.node_labels(inventory)
    assert "nvidia.com/gpu.sharing-strategy" not in plain
    assert "nvidia.com/gpu.replicas" not in plain
    assert plain["nvidia.com/mps.capable"] == "false"
    assert plain["nvidia.com/gpu.machine"] == "unknown"
    odd = lb.node_labels(inventory, facts=lb.NodeFacts(machine="PowerEdge XE9680 (rev/2)"))
    assert odd["nvidia.com/gpu.machine"] == "PowerEdge-XE9680--rev-2"


@pytest.mark.parametrize(
    ("capability", "family"),
    [
        ((9, 0), "hopper"),
        ((8, 0), "ampere"),
        ((8, 6), "ampere"),
        ((8, 9), "ada-lovelace"),
        ((7, 5), "turing"),
        ((7, 0), "volta"),
        ((7, 2), "volta"),
        ((6, 1), "pascal"),
        ((10, 0), "blackwell"),
        ((12, 0), "blackwell"),
        ((4, 0), "undefined"),
    ],
)
def test_gpu_family_follows_gfd(capability: tuple[int, int], family: str) -> None:
    assert lb.gpu_family(*capability) == family


def test_labels_of_a_mixed_node() -> None:
    inventory = make_inventory(NODE, 2)
    gpus = [
        msgspec.structs.replace(inventory.gpus[0], compute_capability=(9, 0)),
        msgspec.structs.replace(inventory.gpus[1], name="NVIDIA L40S", compute_capability=(8, 9)),
    ]
    mixed = msgspec.structs.replace(inventory, gpus=gpus)
    labels = lb.node_labels(mixed)
    # koordlet leaves the model out on a mixed node; it never writes it empty.
    assert lb.LABEL_GPU_MODEL not in labels
    assert lb.LABEL_GPU_MODEL not in lb.device_labels(mixed)
    assert labels[lb.LABEL_GPU_VENDOR] == "nvidia"
    assert labels["nvidia.com/gpu.count"] == "2"
    assert labels["nvidia.com/gpu.present"] == "true"
    for key in ("product", "memory", "family", "compute.major", "compute.minor"):
        assert f"nvidia.com/gpu.{key}" not in labels
    # and a Device rendered for it carries no empty model label either
    device = d.render_device(d.build_desired(mixed, {}), None, node_uid="u", now=NOW)
    assert lb.LABEL_GPU_MODEL not in device["metadata"]["labels"]


def test_module_id_is_written_where_nvml_has_it() -> None:
    inventory = make_inventory(NODE, 3)
    gpus = [
        msgspec.structs.replace(inventory.gpus[0], module_id=4),
        inventory.gpus[1],  # NVML: NOT_SUPPORTED
        msgspec.structs.replace(inventory.gpus[2], module_id=2**40),  # not an int32
    ]
    desired = d.build_desired(msgspec.structs.replace(inventory, gpus=gpus), {})
    devices = d.render_device(desired, None, node_uid="u", now=NOW)["spec"]["devices"]
    assert devices[0]["moduleID"] == 4
    assert "moduleID" not in devices[1]
    assert "moduleID" not in devices[2]
    causes = CrdSchema.from_file(DEFAULT_CRD_PATH).validate(
        d.render_device(desired, None, node_uid="u", now=NOW)
    )
    assert causes == []


def test_no_gpus_no_device_labels() -> None:
    inventory = make_inventory(NODE, 0)
    assert lb.device_labels(inventory) == {}
    assert lb.node_labels(inventory)["nvidia.com/gpu.count"] == "0"
    assert "nvidia.com/gpu.present" not in lb.node_labels(inventory)


@pytest.mark.parametrize(
    ("text", "healthy", "xid", "expected"),
    [
        ("Xid79", False, 79, "Xid79"),
        ("XID 79: GPU has fallen off the bus", False, 79, "XID79GPUHasFallenOffTheBus"),
        ("ecc uncorrectable", False, None, "EccUncorrectable"),
        ("", False, 48, "Xid48"),
        ("", False, None, "Unhealthy"),
        ("!!!", True, None, "Healthy"),
        ("79", False, None, "Unhealthy"),
    ],
)
def test_condition_reason_always_matches_the_crd(
    text: str, healthy: bool, xid: int | None, expected: str
) -> None:
    assert d.condition_reason(text, healthy=healthy, xid=xid) == expected


def test_bus_ids_and_fallback_root() -> None:
    assert d.bus_id_short("00000000:3B:00.0") == "0000:3b:00.0"
    assert d.bus_id_short("0000:3b:00.0") == "0000:3b:00.0"
    assert d.bus_id_short("3B:00.0") == "0000:3b:00.0"
    assert d.fallback_pcie_root("00000000:3B:00.0") == "pci0000:3b"
    assert d.fallback_pcie_root("garbage") == ""


def test_sysfs_pcie_root_follows_the_symlink(tmp_path: Path) -> None:
    devices = tmp_path / "sys" / "bus" / "pci" / "devices"
    real = tmp_path / "sys" / "devices" / "pci0000:3a" / "0000:3a:00.0" / "0000:3b:00.0"
    real.mkdir(parents=True)
    devices.mkdir(parents=True)
    (devices / "0000:3b:00.0").symlink_to(real)
    assert sysfs_pcie_root("00000000:3B:00.0", devices) == "pci0000:3a"
    assert sysfs_pcie_root("00000000:5E:00.0", devices) == ""
    resolve = make_resolver(devices)
    assert resolve("00000000:3B:00.0") == "pci0000:3a"
    assert resolve("00000000:5E:00.0") == "pci0000:5e"  # no sysfs entry: fallback


def _desired(health: dict[str, d.GpuCondition] | None = None, count: int = 2) -> d.DesiredState:
    return d.build_desired(make_inventory(NODE, count), health or {})


def test_rendered_device_matches_koordinator_and_the_crd() -> None:
    unhealthy = d.GpuCondition(healthy=False, reason="Xid79", message="fell off", since=NOW)
    desired = _desired({gpu_uuid(NODE, 1): unhealthy})
    device = d.render_device(desired, None, node_uid="uid-1", now=NOW + 5)
    assert device["apiVersion"] == "scheduling.koordinator.sh/v1alpha1"
    assert device["kind"] == "Device"
    assert device["metadata"]["name"] == NODE
    assert device["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "name": NODE,
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    first, second = device["spec"]["devices"]
    assert first == {
        "type": "gpu",
        "id": gpu_uuid(NODE, 0),
        "minor": 0,
        "health": True,
        "resources": {
            "koordinator.sh/gpu-core": "100",
            "koordinator.sh/gpu-memory": "80Gi",
            "koordinator.sh/gpu-memory-ratio": "100",
        },
        "conditions": [
            {
                "type": "Healthy",
                "status": "True",
                "reason": "Healthy",
                "message": "",
                "lastTransitionTime": d.rfc3339(NOW + 5),
            }
        ],
        "topology": {"socketID": -1, "nodeID": 0, "pcieID": "pci0000:18", "busID": "0000:18:00.0"},
    }
    assert second["health"] is False
    assert second["conditions"][0]["reason"] == "Xid79"
    assert second["conditions"][0]["lastTransitionTime"] == d.rfc3339(NOW)
    schema = CrdSchema.from_file(DEFAULT_CRD_PATH)
    assert schema.validate(copy.deepcopy(device)) == []


def test_transition_time_is_kept_while_the_status_holds() -> None:
    first = d.GpuCondition(healthy=False, reason="Xid79", message="a", since=NOW)
    observed = d.render_device(_desired({gpu_uuid(NODE, 0): first}), None, node_uid=None, now=NOW)
    # Another fault while still unhealthy: new text, same transition time.
    again = d.GpuCondition(healthy=False, reason="Xid48", message="b", since=NOW)
    rendered = d.render_device(
        _desired({gpu_uuid(NODE, 0): again}), observed, node_uid=None, now=NOW + 60
    )
    cond = rendered["spec"]["devices"][0]["conditions"][0]
    assert (cond["reason"], cond["lastTransitionTime"]) == ("Xid48", d.rfc3339(NOW))
    # The same state rendered later is identical: no write.
    same = d.render_device(
        _desired({gpu_uuid(NODE, 0): first}), observed, node_uid=None, now=NOW + 99
    )
    assert not d.device_differs(same, observed)
    # Recovery moves it.
    healed = d.GpuCondition(healthy=True, reason="Recovered", since=NOW + 120)
    rendered = d.render_device(
        _desired({gpu_uuid(NODE, 0): healed}), observed, node_uid=None, now=NOW + 121
    )
    cond = rendered["spec"]["devices"][0]["conditions"][0]
    assert (cond["status"], cond["lastTransitionTime"]) == ("True", d.rfc3339(NOW + 120))


def test_unknown_health_is_carried_over_from_the_observed_device() -> None:
    broken = d.GpuCondition(healthy=False, reason="Xid79", message="x", since=NOW)
    observed = d.render_device(_desired({gpu_uuid(NODE, 1): broken}), None, node_uid="u", now=NOW)
    restarted = _desired({})  # a fresh reporter that has heard nothing yet
    rendered = d.render_device(restarted, observed, node_uid="u", now=NOW + 300)
    assert not d.device_differs(rendered, observed)
    assert rendered["spec"]["devices"][1]["health"] is False
    # A snapshot (weaker text) with the same status keeps the observed wording.
    snapshot = d.GpuCondition(healthy=False, reason="Other", since=NOW + 1, from_event=False)
    rendered = d.render_device(
        _desired({gpu_uuid(NODE, 1): snapshot}), observed, node_uid="u", now=NOW + 300
    )
    assert not d.device_differs(rendered, observed)


def test_render_keeps_what_others_own_and_compare_ignores_server_fields() -> None:
    desired = _desired()
    ours = d.render_device(desired, None, node_uid="u", now=NOW)
    observed = copy.deepcopy(ours)
    observed["metadata"].update(
        resourceVersion="42",
        uid="device-uid",
        generation=3,
        creationTimestamp="2024-01-01T00:00:00Z",
        managedFields=[{"manager": "x"}],
        annotations={"someone/else": "yes"},
    )
    observed["metadata"]["labels"]["team"] = "ml"
    observed["metadata"]["ownerReferences"].append(
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "x", "uid": "ds"}
    )
    observed["status"] = {"allocations": [{"type": "gpu", "entries": []}]}
    # int quantities written by another client compare equal to our strings
    observed["spec"]["devices"][0]["resources"]["koordinator.sh/gpu-core"] = 100
    assert not d.device_differs(d.render_device(desired, observed, node_uid="u", now=NOW), observed)
    body = d.render_device(_desired(count=1), observed, node_uid="u", now=NOW)
    assert body["metadata"]["labels"]["team"] == "ml"
    assert body["metadata"]["annotations"] == {"someone/else": "yes"}
    assert body["metadata"]["resourceVersion"] == "42"
    assert body["status"] == observed["status"]
    assert [r["kind"] for r in body["metadata"]["ownerReferences"]] == ["Node", "DaemonSet"]
    assert len(body["spec"]["devices"]) == 1
    assert d.device_differs(body, observed)
    # Drift in our labels or owner is drift.
    edited = copy.deepcopy(observed)
    edited["metadata"]["labels"][lb.LABEL_GPU_MODEL] = "hacked"
    assert d.device_differs(ours, edited)
    assert d.device_differs(d.render_device(desired, observed, node_uid="other", now=NOW), observed)


def test_render_owns_only_gpu_entries_and_the_fields_it_writes() -> None:
    """koordlet's rdma and fpga entries, an untyped entry, and fields of GPU entries we
    do not write (labels, other resources, other conditions) survive as they were."""
    desired = _desired(count=2)
    observed = d.render_device(desired, None, node_uid="u", now=NOW)
    observed["metadata"]["resourceVersion"] = "9"
    foreign = koordlet_foreign_devices()
    untyped = {"id": "x-1", "health": True}
    gpu0 = observed["spec"]["devices"][0]
    gpu0["labels"] = {"team": "ml"}
    gpu0["resources"]["koordinator.sh/gpu-mem-bw"] = "100"
    other_condition = {
        "type": "Throttled",
        "status": "False",
        "reason": "None",
        "message": "",
        "lastTransitionTime": "2024-01-01T00:00:00Z",
    }
    gpu0["conditions"].append(other_condition)
    gpu0["moduleID"] = 7  # stale: NVML says nothing now, so it goes
    # koordlet order: rdma first, then our GPUs, then the fpga and an untyped entry.
    observed["spec"]["devices"] = [foreign[0], *observed["spec"]["devices"], foreign[1], untyped]
    before = copy.deepcopy(observed)

    # An unchanged intent: nothing differs, and the body is the observed list itself
    # except for the moduleID we can no longer vouch for.
    body = d.render_device(desired, observed, node_uid="u", now=NOW + 60)
    devices = body["spec"]["devices"]
    assert [e.get("type") for e in devices] == ["rdma", "gpu", "gpu", "fpga", None]
    assert devices[0] == before["spec"]["devices"][0]
    assert devices[3:] == before["spec"]["devices"][3:]
    assert msgspec.json.encode(devices[0]) == msgspec.json.encode(foreign[0])
    assert devices[1]["labels"] == {"team": "ml"}
    assert devices[1]["resources"]["koordinator.sh/gpu-mem-bw"] == "100"
    assert other_condition in devices[1]["conditions"]
    assert "moduleID" not in devices[1]
    assert observed == before  # rendering never mutates what it was given

    # A health change rewrites our fields only.
    bad = d.GpuCondition(healthy=False, reason="Xid79", message="fell off", since=NOW)
    body = d.render_device(_desired({gpu_uuid(NODE, 0): bad}), observed, node_uid="u", now=NOW + 60)
    devices = body["spec"]["devices"]
    assert devices[0] == foreign[0]
    assert devices[3] == foreign[1]
    assert devices[4] == untyped
    assert devices[1]["health"] is False
    assert devices[1]["labels"] == {"team": "ml"}
    assert [c["type"] for c in devices[1]["conditions"]] == ["Healthy", "Throttled"]
    assert d.device_differs(body, observed)

    # A GPU that left the intent leaves the list; foreign entries stay.
    body = d.render_device(_desired(count=1), observed, node_uid="u", now=NOW)
    assert [e.get("type") for e in body["spec"]["devices"]] == ["rdma", "gpu", "fpga", None]

    # With no GPU entry observed, ours go first and the foreign ones follow in order.
    only_foreign = copy.deepcopy(before)
    only_foreign["spec"]["devices"] = [foreign[1], foreign[0]]
    body = d.render_device(desired, only_foreign, node_uid="u", now=NOW)
    assert [e["type"] for e in body["spec"]["devices"]] == ["gpu", "gpu", "fpga", "rdma"]


def test_an_rdma_entry_with_a_gpu_uuid_is_not_mistaken_for_ours() -> None:
    desired = _desired(count=1)
    impostor = {"type": "rdma", "id": gpu_uuid(NODE, 0), "health": False}
    observed = {"metadata": {"name": NODE}, "spec": {"devices": [impostor]}}
    devices = d.render_device(desired, observed, node_uid="u", now=NOW)["spec"]["devices"]
    assert devices[1] == impostor
    assert devices[0]["type"] == "gpu"
    assert devices[0]["health"] is True


def _node(labels: dict[str, str], managed: str | None = None) -> d.JsonObj:
    meta: d.JsonObj = {"name": NODE, "resourceVersion": "7", "labels": labels}
    if managed is not None:
        meta["annotations"] = {lb.MANAGED_LABELS_ANNOTATION: managed}
    return {"metadata": meta}


def test_node_label_patch_touches_only_our_keys() -> None:
    want = {"a.io/x": "1", "a.io/y": "2"}
    patch = lb.node_label_patch(want, _node({"team": "ml", "a.io/x": "0"}))
    assert patch == {
        "metadata": {
            "labels": {"a.io/x": "1", "a.io/y": "2"},
            "annotations": {lb.MANAGED_LABELS_ANNOTATION: "a.io/x,a.io/y"},
            "resourceVersion": "7",
        }
    }
    # Up to date: no patch at all.
    assert lb.node_label_patch(want, _node({"team": "ml", **want}, "a.io/x,a.io/y")) is None
    # A key we set before and no longer want is removed; a foreign key never is, even
    # when it looks like one of ours.
    node = _node({"team": "ml", "a.io/x": "1", "a.io/y": "2", "a.io/z": "9"}, "a.io/x,a.io/y")
    patch = lb.node_label_patch({"a.io/x": "1"}, node)
    assert patch is not None
    assert patch["metadata"]["labels"] == {"a.io/y": None}
    assert patch["metadata"]["annotations"] == {lb.MANAGED_LABELS_ANNOTATION: "a.io/x"}


def _condition(
    name: str, severity: str, reason: str, since: float, *, kind: str = "", message: str = ""
) -> ActiveCondition:
    return ActiveCondition(
        condition=name,
        kind=kind or ("xid" if name.startswith("xid:") else name),  # type: ignore[arg-type]
        severity=severity,  # type: ignore[arg-type]
        reason=reason,
        message=message,
        since=since,
    )


def test_health_view_renders_the_health_services_state() -> None:
    view = HealthView()
    uuid = gpu_uuid(NODE, 0)
    t = time.time()
    xid79 = _condition("xid:79", "critical", "XID 79", t, message="fell off the bus")
    raised = GpuHealth(gpu_uuid=uuid, healthy=False, conditions=[xid79], updated_at=t)
    assert view.apply(uuid, raised)
    first = view.get(uuid)
    assert first is not None
    assert (first.healthy, first.reason, first.message, first.since) == (
        False,
        "Xid79",
        "fell off the bus",
        t,
    )
    # The same state written again (a repeat) changes nothing.
    assert not view.apply(uuid, msgspec.structs.replace(raised, updated_at=t + 1))
    # A worse condition shows; the transition time stays.
    xid48 = _condition("xid:48", "fatal", "XID 48: DBE", t + 2)
    worse_state = msgspec.structs.replace(raised, conditions=[xid79, xid48], updated_at=t + 2)
    assert view.apply(uuid, worse_state)
    worse = view.get(uuid)
    assert worse is not None
    assert (worse.reason, worse.message, worse.since) == ("Xid48", "XID 48: DBE", t)
    # One condition ends while another keeps the GPU unhealthy: the remaining one shows.
    assert view.apply(uuid, msgspec.structs.replace(raised, updated_at=t + 3))
    remaining = view.get(uuid)
    assert remaining is not None
    assert (remaining.healthy, remaining.reason) == (False, "Xid79")
    # Recovery, seen as it happens: "Recovered" since the state's time.
    assert view.apply(uuid, GpuHealth(gpu_uuid=uuid, updated_at=t + 4))
    healed = view.get(uuid)
    assert healed is not None
    assert (healed.healthy, healed.reason, healed.since) == (True, "Recovered", t + 4)
    # A warning on a healthy GPU changes nothing.
    hot = _condition("thermal", "warning", "slowdown", t + 5, kind="thermal_slowdown")
    assert not view.apply(uuid, GpuHealth(gpu_uuid=uuid, conditions=[hot], updated_at=t + 5))
    # Unhealthy again: the worst condition's text, the state's time.
    state = GpuHealth(
        gpu_uuid=uuid,
        healthy=False,
        updated_at=t + 6,
        conditions=[
            _condition("thermal", "critical", "Hot", t + 5.5),
            _condition("ecc_uncorrectable", "fatal", "DBE", t + 5.9),
        ],
    )
    assert view.apply(uuid, state)
    snap = view.get(uuid)
    assert snap is not None
    assert (snap.reason, snap.message, snap.since) == ("EccUncorrectable", "DBE", t + 6)
    assert not view.apply(uuid, state)
    # A GPU that is gone reads GpuNotPresent; a first word that a GPU is healthy is a
    # placeholder, not authoritative text (a restarted reporter does not reword).
    other = gpu_uuid(NODE, 1)
    assert view.apply(other, GpuHealth(gpu_uuid=other, present=False, updated_at=t))
    gone = view.get(other)
    assert gone is not None
    assert (gone.healthy, gone.reason) == (False, "GpuNotPresent")
    third = gpu_uuid(NODE, 2)
    assert view.apply(third, GpuHealth(gpu_uuid=third, updated_at=t))
    placeholder = view.get(third)
    assert placeholder is not None
    assert placeholder.healthy
    assert not placeholder.from_event
    # A state that vanished (its key deleted) leaves the view.
    assert view.apply(uuid, None)
    assert view.get(uuid) is None


def test_a_time_out_of_range_is_clamped_not_raised() -> None:
    """rfc3339(1e18) raised OSError and froze the reporter's output."""
    assert d.rfc3339(1e18) == "9999-12-31T23:59:59Z"
    assert d.rfc3339(float("nan")) == d.rfc3339(-1e18) == "1970-01-01T00:00:00Z"
    assert d.rfc3339(float("inf")) == "9999-12-31T23:59:59Z"
    uuid = gpu_uuid(NODE, 0)
    far = _condition("xid:79", "critical", "XID 79", 1e18)
    view = HealthView()
    view.apply(uuid, GpuHealth(gpu_uuid=uuid, healthy=False, conditions=[far], updated_at=1e18))
    desired = d.build_desired(make_inventory(NODE, 1), view.snapshot())
    device = d.render_device(desired, None, node_uid=None, now=NOW)
    [entry] = device["spec"]["devices"]
    assert entry["conditions"][0]["lastTransitionTime"] == "9999-12-31T23:59:59Z"


def test_machine_type_is_read_like_gfd(tmp_path: Path) -> None:
    product = tmp_path / "product_name"
    product.write_text("DGXH100\n")
    assert read_machine_type(product) == "DGXH100"
    assert read_machine_type(tmp_path / "missing") == "unknown"
    product.write_bytes(b"\xff\xfe")
    assert read_machine_type(product) == "unknown"
    product.write_text("x" * 5000)
    assert read_machine_type(product) == "unknown"
    product.write_text("  \n")
    assert read_machine_type(product) == "unknown"


def test_last_reset_is_an_entry_label_until_there_is_none() -> None:
    """Remediation by reset's last verified reset (time and cause) is the GPU entry's
    ``gpulet.io/last-reset``; the reporter owns the label, so it goes when the view
    has none (an entry's other labels are kept)."""
    text = "2026-12-06T03:10:42Z xid:79 (XID 79 GPU_HAS_FALLEN_OFF_THE_BUS [RESTART_BM])"
    reset = d.build_desired(make_inventory(NODE, 2), {}, last_resets={gpu_uuid(NODE, 1): text})
    device = d.render_device(reset, None, node_uid="uid-1", now=NOW)
    first, second = device["spec"]["devices"]
    assert "labels" not in first
    assert second["labels"] == {"gpulet.io/last-reset": text}
    assert CrdSchema.from_file(DEFAULT_CRD_PATH).validate(device) == []
    second["labels"]["team"] = "ml"
    plain = d.build_desired(make_inventory(NODE, 2), {})
    again = d.render_device(plain, device, node_uid="uid-1", now=NOW)
    assert again["spec"]["devices"][1]["labels"] == {"team": "ml"}


def test_a_gpu_remediation_holds_shows_the_hold_in_the_device() -> None:
    """A retired GPU's entry says so (an RMA candidate, with its history), however
    fatal the fault that started it."""
    xid = ActiveCondition(
        condition="xid:79", kind="xid", severity="fatal", reason="off the bus", since=NOW - 60
    )
    sick = GpuHealth(gpu_uuid=gpu_uuid(NODE, 1), healthy=False, conditions=[xid], updated_at=NOW)
    record = HealRecord(
        gpu_uuid=gpu_uuid(NODE, 1),
        state="retired",
        started_at=NOW,
        detail="RMA candidate: 3 fatal faults within 86400 s (3 fatal fault(s), 2 reset(s))",
    )
    view = HealthView()
    view.apply(gpu_uuid(NODE, 1), overlay(sick, record))
    condition = view.get(gpu_uuid(NODE, 1))
    assert condition is not None
    assert (condition.healthy, condition.reason) == (False, "RemediationRetired")
    assert condition.message.startswith("RMA candidate: 3 fatal faults")
    view.apply(gpu_uuid(NODE, 1), sick)  # back to the fault alone
    condition = view.get(gpu_uuid(NODE, 1))
    assert condition is not None
    assert condition.reason == "Xid79"
