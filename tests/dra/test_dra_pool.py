"""The node's pool as ResourceSlices: attributes, islands, sharing, taints, limits.

Every slice rendered here also passes the 1.37 OpenAPI schema of
``resource.k8s.io/v1`` (kubernetes-validate, strict), which knows field names and
types; the API server's further rules (names, lengths, counts) are
:mod:`gpulet_common.dra.limits`, tested against hand-made breaking devices.
"""

from __future__ import annotations

import kubernetes_validate
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulet_common.dra import devices as dev
from gpulet_common.dra import limits, pool, taints
from gpulet_common.messages import ActiveCondition, GpuHealth
from gpulet_common.quantity import binary, parse_whole
from gpulet_common.settings.dra import DraSettings
from support.reference import GIB, inventory_from_matrix
from support.reporter_harness import make_inventory

K8S = kubernetes_validate.latest_version()
NODE = "node-a"


def valid(body: dict[str, object]) -> None:
    kubernetes_validate.validate(body, K8S, strict=True)


def health(uuid: str, *conds: tuple[str, str, str], present: bool = True) -> GpuHealth:
    return GpuHealth(
        gpu_uuid=uuid,
        healthy=not any(s in ("critical", "fatal") for _, _, s in conds),
        present=present,
        updated_at=2000.0,
        conditions=[
            ActiveCondition(condition=c, kind=k, severity=s, reason="r", since=1000.0)  # type: ignore[arg-type]
            for c, k, s in conds
        ],
    )


def test_a_dgx_node_renders_nvidias_attribute_names() -> None:
    inventory = make_inventory(NODE, 8, driver="535.104.05", cuda="12.2")
    inventory = msgspec.structs.replace(
        inventory,
        gpus=[msgspec.structs.replace(g, compute_capability=(9, 0)) for g in inventory.gpus],
    )
    built = pool.build(inventory, {}, DraSettings(), pcie_root=lambda bus: "pci0000:17")
    assert len(built.slices) == 1
    body = built.slices[0]
    valid(body)
    spec = body["spec"]
    assert spec["driver"] == "gpu.gpulet.io"
    assert spec["nodeName"] == NODE
    assert spec["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    first = spec["devices"][0]
    assert first["name"] == "gpu-0"
    attrs = first["attributes"]
    assert attrs["type"] == {"string": "gpu"}
    assert attrs["uuid"] == {"string": inventory.gpus[0].uuid}
    assert attrs["productName"] == {"string": inventory.gpus[0].name}
    assert attrs["architecture"] == {"string": "Hopper"}
    assert attrs["brand"] == {"string": "Nvidia"}
    assert attrs["cudaComputeCapability"] == {"version": "9.0.0"}
    # Semver forbids leading zeros; two-part versions get a patch.
    assert attrs["driverVersion"] == {"version": "535.104.5"}
    assert attrs["cudaDriverVersion"] == {"version": "12.2.0"}
    assert attrs["resource.kubernetes.io/pciBusID"] == {"string": "0000:18:00.0"}
    assert attrs["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:17"}
    assert attrs["numaNode"] == {"int": 0}
    assert spec["devices"][7]["attributes"]["numaNode"] == {"int": 1}
    assert first["capacity"]["memory"]["value"] == "80Gi"


def test_unknown_versions_are_left_out_not_published_wrong() -> None:
    inventory = make_inventory(NODE, 1, driver="r550-beta", cuda=None)
    attrs = pool.build(inventory, {}, DraSettings()).devices[0]["attributes"]
    assert "driverVersion" not in attrs
    assert "cudaDriverVersion" not in attrs
    assert "cudaComputeCapability" not in attrs
    assert "resource.kubernetes.io/pcieRoot" not in attrs  # no resolver given


def test_nvlink_islands_follow_active_links() -> None:
    # Two NVLink pairs (0-1, 2-3) and a loner (4); GPU 3 reports its link, 2 does not:
    # one end is enough.
    links = [[0] * 5 for _ in range(5)]
    links[0][1] = links[1][0] = 12
    links[3][2] = 4
    levels = [[0 if i == j else 50 for j in range(5)] for i in range(5)]
    inventory = inventory_from_matrix(NODE, levels, links)
    built = pool.build(inventory, {}, DraSettings())
    islands = [d["attributes"]["nvlinkIsland"]["int"] for d in built.devices]
    assert islands == [0, 0, 2, 2, 4]


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=20))
@settings(max_examples=60, deadline=None)
def test_islands_are_the_connected_components(edges: list[tuple[int, int]]) -> None:
    links = [[0] * 8 for _ in range(8)]
    for a, b in edges:
        if a != b:
            links[a][b] = 1
    inventory = inventory_from_matrix(NODE, [[0] * 8] * 8, links)
    islands = dev.nvlink_islands(inventory.gpus)
    island_of = [islands[g.uuid] for g in sorted(inventory.gpus, key=lambda g: g.index)]
    for a, b in edges:
        assert island_of[a] == island_of[b]
    for i, island in enumerate(island_of):
        assert island <= i
        assert island_of[island] == island  # named by a member, the smallest


def test_sharing_offers_cores_and_memory_with_request_policies() -> None:
    inventory = make_inventory(NODE, 1, memory=80 * GIB)
    device = pool.build(inventory, {}, DraSettings(sharing=True)).devices[0]
    assert device["allowMultipleAllocations"] is True
    assert device["capacity"]["cores"] == {
        "value": "100",
        "requestPolicy": {"default": "100", "validRange": {"min": "0", "max": "100", "step": "1"}},
    }
    assert device["capacity"]["memory"] == {
        "value": "80Gi",
        "requestPolicy": {
            "default": "80Gi",
            "validRange": {"min": "0", "max": "80Gi", "step": "1Gi"},
        },
    }
    whole = pool.build(inventory, {}, DraSettings(sharing=False)).devices[0]
    assert "allowMultipleAllocations" not in whole
    assert whole["capacity"] == {"memory": {"value": "80Gi"}}
    for built in (device, whole):
        valid(pool.slices(NODE, "gpu.gpulet.io", [built], 1)[0])


def test_memory_range_is_whole_steps_when_memory_is_not() -> None:
    odd = 81559871488  # an H100's 79.6 GiB as NVML reports it
    device = pool.build(make_inventory(NODE, 1, memory=odd), {}, DraSettings()).devices[0]
    memory = device["capacity"]["memory"]
    assert parse_whole(memory["value"]) == odd
    top = parse_whole(memory["requestPolicy"]["validRange"]["max"])
    assert top is not None
    assert top % GIB == 0
    assert odd - GIB < top <= odd
    assert memory["requestPolicy"]["default"] == memory["requestPolicy"]["validRange"]["max"]


@given(st.integers(0, 2**62))
def test_quantities_round_trip(value: int) -> None:
    assert parse_whole(binary(value)) == value


def test_fatal_xid_taints_noschedule_and_noexecute_by_policy() -> None:
    inventory = make_inventory(NODE, 2)
    uuid = inventory.gpus[1].uuid
    healths = {uuid: health(uuid, ("xid:79", "xid", "fatal"))}
    built = pool.build(inventory, healths, DraSettings(), now=5000.0)
    assert "taints" not in built.devices[0]
    assert built.devices[1]["taints"] == [
        {
            "key": "gpu.gpulet.io/xid",
            "value": "79",
            "effect": "NoSchedule",
            "timeAdded": "1970-01-01T00:16:40Z",  # the condition's since (1000 s)
        }
    ]
    evicting = pool.build(inventory, healths, DraSettings(unhealthy_effect="NoExecute"))
    assert evicting.devices[1]["taints"][0]["effect"] == "NoExecute"
    valid(built.slices[0])


def test_warnings_and_application_faults_are_informational() -> None:
    inventory = make_inventory(NODE, 1)
    uuid = inventory.gpus[0].uuid
    healths = {
        uuid: health(
            uuid,
            ("xid:13", "xid", "warning"),
            ("thermal_slowdown", "thermal_slowdown", "warning"),
            ("ecc_uncorrectable", "ecc_uncorrectable", "critical"),
        )
    }
    got = {
        (t["key"], t.get("value"), t["effect"])
        for t in pool.build(inventory, healths, DraSettings()).devices[0]["taints"]
    }
    assert got == {
        ("gpu.gpulet.io/xid", "13", "None"),
        ("gpu.gpulet.io/warning", "thermal_slowdown", "None"),
        ("gpu.gpulet.io/unhealthy", "ecc_uncorrectable", "NoSchedule"),
    }


def test_recovery_removes_the_taint_and_raises_the_generation() -> None:
    inventory = make_inventory(NODE, 1)
    uuid = inventory.gpus[0].uuid
    faulty = pool.build(inventory, {uuid: health(uuid, ("xid:79", "xid", "fatal"))}, DraSettings())
    healed = pool.build(inventory, {}, DraSettings(), previous=faulty)
    assert "taints" not in healed.devices[0]
    assert healed.generation == faulty.generation + 1
    again = pool.build(inventory, {}, DraSettings(), previous=healed)
    assert again.generation == healed.generation
    assert again.slices == healed.slices


def test_time_added_survives_rebuilds_and_restarts() -> None:
    inventory = make_inventory(NODE, 1)
    uuid = inventory.gpus[0].uuid
    # A condition whose start the health service did not record: "now" at first render.
    cond = GpuHealth(
        gpu_uuid=uuid,
        healthy=False,
        conditions=[
            ActiveCondition(condition="thermal", kind="thermal", severity="critical", reason="hot")
        ],
    )
    first = pool.build(inventory, {uuid: cond}, DraSettings(), now=3000.0)
    stamp = first.devices[0]["taints"][0]["timeAdded"]
    # Later, in a new process: the time comes from what the API server holds.
    known = taints.known_times(first.slices)
    later = pool.build(inventory, {uuid: cond}, DraSettings(), now=9999.0, known=known)
    assert later.devices[0]["taints"][0]["timeAdded"] == stamp
    assert later.devices == first.devices


def test_device_plugin_holdings_are_tainted_only_in_mode_both() -> None:
    inventory = make_inventory(NODE, 2)
    held = {inventory.gpus[0].uuid}
    both = pool.build(inventory, {}, DraSettings(mode="both"), held=held)
    assert both.devices[0]["taints"][0]["key"] == "gpu.gpulet.io/device-plugin"
    assert both.devices[0]["taints"][0]["effect"] == "NoSchedule"
    assert "taints" not in both.devices[1]
    dra_only = pool.build(inventory, {}, DraSettings(mode="dra"), held=held)
    assert "taints" not in dra_only.devices[0]


def test_time_sliced_gpus_are_tainted_in_every_mode() -> None:
    """The ledger refuses a time-sliced GPU to a claim (``time_sliced``): the slice
    says so with a NoSchedule taint whose value is the replica count, so the scheduler
    never picks it; a count of 1 is not time-sliced."""
    inventory = make_inventory(NODE, 3)
    a, b, _ = (g.uuid for g in inventory.gpus)
    for mode in ("dra", "both"):
        built = pool.build(inventory, {}, DraSettings(mode=mode), sliced={a: 4, b: 1})
        taint = built.devices[0]["taints"][0]
        assert (taint["key"], taint["value"], taint["effect"]) == (
            "gpu.gpulet.io/time-sliced",
            "4",
            "NoSchedule",
        )
        assert "taints" not in built.devices[1]
        assert "taints" not in built.devices[2]


def test_a_lost_gpu_is_unhealthy() -> None:
    inventory = make_inventory(NODE, 1)
    uuid = inventory.gpus[0].uuid
    built = pool.build(inventory, {uuid: health(uuid, present=False)}, DraSettings())
    assert built.devices[0]["taints"][0]["value"] == "gpu-lost"


def test_a_lost_gpu_is_one_taint_whatever_conditions_say_so() -> None:
    """Not present, with the lost, removed and missing conditions: one taint
    ``unhealthy=gpu-lost``, not one per value."""
    inventory = make_inventory(NODE, 1)
    uuid = inventory.gpus[0].uuid
    gone = health(
        uuid,
        ("lost", "gpu_lost", "critical"),
        ("removed", "gpu_removed", "critical"),
        ("missing", "gpu_missing", "critical"),
        present=False,
    )
    built = pool.build(inventory, {uuid: gone}, DraSettings())
    taints_of = [(t["key"], t.get("value")) for t in built.devices[0]["taints"]]
    assert taints_of == [("gpu.gpulet.io/unhealthy", "gpu-lost")]


def test_a_gpu_missing_at_start_stays_in_the_pool_tainted() -> None:
    """The inventory lacks GPU 3 (lost before the agent started); the health service
    remembers it (not present, with its identity): the pool keeps its device, under
    the name it had, tainted ``gpu-lost`` -- 8 devices, as in the Device."""
    full = make_inventory(NODE, 8)
    missing = full.gpus[3]
    inventory = msgspec.structs.replace(full, gpus=[g for g in full.gpus if g is not missing])
    gone = msgspec.structs.replace(
        health(missing.uuid, ("missing", "gpu_missing", "critical"), present=False),
        info=missing,
    )
    built = pool.build(inventory, {missing.uuid: gone}, DraSettings())
    assert [d["name"] for d in built.devices] == [dev.device_name(g) for g in full.gpus]
    [device] = [d for d in built.devices if d["name"] == dev.device_name(missing)]
    assert device["attributes"]["uuid"] == {"string": missing.uuid}
    assert [(t["key"], t.get("value")) for t in device["taints"]] == [
        ("gpu.gpulet.io/unhealthy", "gpu-lost")
    ]
    for body in built.slices:
        valid(body)
    # Another GPU answering at its index since: that one has the name, not the memory.
    moved = msgspec.structs.replace(full.gpus[7], index=3, minor=3, uuid="GPU-other")
    again = msgspec.structs.replace(inventory, gpus=[*inventory.gpus[:7], moved])
    names = [d["name"] for d in pool.build(again, {missing.uuid: gone}, DraSettings()).devices]
    assert names.count(dev.device_name(missing)) == 1


def test_slices_split_at_the_limits() -> None:
    big = make_inventory(NODE, 130)
    built = pool.build(big, {}, DraSettings())
    assert [len(s["spec"]["devices"]) for s in built.slices] == [128, 2]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in built.slices} == {2}
    assert len({s["metadata"]["name"] for s in built.slices}) == 2
    uuid = big.gpus[5].uuid
    tainted = pool.build(big, {uuid: health(uuid, ("xid:79", "xid", "fatal"))}, DraSettings())
    assert [len(s["spec"]["devices"]) for s in tainted.slices] == [64, 64, 2]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in tainted.slices} == {3}
    for body in tainted.slices:
        valid(body)


def test_no_gpu_no_slice() -> None:
    assert pool.build(make_inventory(NODE, 0), {}, DraSettings()).slices == []


def test_long_node_names_give_valid_slice_names() -> None:
    node = "n" * 253
    name = pool.slice_name(node, "gpu.gpulet.io", 3)
    assert limits.is_dns_subdomain(name)
    assert name.endswith("-3")
    assert name != pool.slice_name("n" * 252, "gpu.gpulet.io", 3)


@pytest.mark.parametrize(
    ("device", "needle"),
    [
        ({"name": "GPU_0"}, "DNS label"),
        ({"name": "gpu-0", "attributes": {"a" * 33: {"int": 1}}}, "identifier"),
        ({"name": "gpu-0", "attributes": {"x": {"string": "s" * 65}}}, "not valid"),
        ({"name": "gpu-0", "attributes": {"x": {"version": "1.02.3"}}}, "not valid"),
        ({"name": "gpu-0", "attributes": {"x": {"int": 1, "bool": True}}}, "exactly one"),
        ({"name": "gpu-0", "attributes": {f"a{i}": {"int": i} for i in range(33)}}, "> 32"),
        ({"name": "gpu-0", "taints": [{"key": "k", "value": "v" * 64, "effect": "None"}]}, "value"),
        ({"name": "gpu-0", "taints": [{"key": "k", "effect": "Evict"}]}, "effect"),
        ({"name": "gpu-0", "taints": [{"key": "k", "effect": "None"}] * 17}, "taints >"),
    ],
)
def test_limits_name_each_broken_rule(device: dict[str, object], needle: str) -> None:
    problems = limits.device_problems(device)
    assert any(needle in p for p in problems), problems


def test_a_hostile_inventory_is_refused_not_published() -> None:
    inventory = make_inventory(NODE, 2)
    twin = msgspec.structs.replace(inventory.gpus[1], minor=0)  # two gpu-0
    with pytest.raises(pool.PoolError, match="not unique"):
        pool.build(
            msgspec.structs.replace(inventory, gpus=[inventory.gpus[0], twin]), {}, DraSettings()
        )


@given(
    st.lists(
        st.tuples(
            st.text(min_size=0, max_size=120),
            st.sampled_from(["xid", "thermal", "ecc_uncorrectable", "nvlink_down"]),
            st.sampled_from(["info", "warning", "critical", "fatal"]),
        ),
        max_size=24,
    )
)
@settings(max_examples=80, deadline=None)
def test_any_health_renders_a_valid_device(conds: list[tuple[str, str, str]]) -> None:
    inventory = make_inventory(NODE, 1)
    uuid = inventory.gpus[0].uuid
    built = pool.build(inventory, {uuid: health(uuid, *conds)}, DraSettings())
    assert limits.device_problems(built.devices[0]) == []
    assert len(built.devices[0].get("taints", [])) <= limits.MAX_TAINTS_PER_DEVICE


def test_full_bandwidth_islands_on_the_nvlink_pairs_scenario() -> None:
    """nvlink-pairs-8gpu: pairs (0,1) (2,3) (4,5) (6,7) have 4 links, the other pairs of
    a quad 1 link. nvlinkIsland joins each quad over any link; nvlinkFullIsland only
    the 4-link pairs, so matchAttribute on it never pairs GPUs linked by 1 link."""
    from support.agent import mock_inventory

    inventory = mock_inventory("nvlink-pairs-8gpu", NODE)
    built = pool.build(inventory, {}, DraSettings())
    attrs = {d["name"]: d["attributes"] for d in built.devices}
    ordered = [attrs[f"gpu-{i}"] for i in range(8)]
    assert [a["nvlinkIsland"]["int"] for a in ordered] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert [a["nvlinkFullIsland"]["int"] for a in ordered] == [0, 0, 2, 2, 4, 4, 6, 6]
    assert {a["nvlinkFullLinks"]["int"] for a in ordered} == {4}
    assert {a["nvlinkLinks"]["int"] for a in ordered} == {6}
    for body in built.slices:
        valid(body)


def test_a_gpu_without_a_full_bandwidth_link_is_its_own_full_island() -> None:
    # 0-1 with 4 links, 1-2 with 2: GPU 2 is on 0's island, not on its full one.
    links = [[0, 4, 0], [4, 0, 2], [0, 2, 0]]
    levels = [[0 if i == j else 50 for j in range(3)] for i in range(3)]
    built = pool.build(inventory_from_matrix(NODE, levels, links), {}, DraSettings())
    got = [
        (a["nvlinkIsland"]["int"], a["nvlinkFullIsland"]["int"], a["nvlinkFullLinks"]["int"])
        for a in (d["attributes"] for d in built.devices)
    ]
    assert got == [(0, 0, 4), (0, 0, 4), (0, 2, 0)]
