"""Scenario files: the shipped ones, inheritance, and errors that name file, entry, problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpulet_common.mock_nvml import (
    SCENARIO_DIR,
    ScenarioError,
    list_scenarios,
    load_scenario,
    resolve_scenario,
    scenario_from_toml,
)
from gpulet_common.mock_nvml.scenario import parse_cpu_list
from gpulet_common.mock_nvml.topology import level_matrix, nvlink_matrix

SHIPPED = {
    "a100-pcie": (1, "NVIDIA A100-PCIE-40GB"),
    "a100-mig-mixed": (4, "NVIDIA A100-SXM4-40GB"),
    "h100-mig-single": (8, "NVIDIA H100 80GB HBM3"),
    "dgx-h100": (8, "NVIDIA H100 80GB HBM3"),
    "faults-demo": (8, "NVIDIA H100 80GB HBM3"),
    "numa-2x4": (8, "NVIDIA A10"),
    "nvlink-pairs-8gpu": (8, "Tesla V100-SXM2-32GB"),
    "pcie-7gpu": (7, "Tesla V100-PCIE-16GB"),
    "t4": (1, "Tesla T4"),
}


def test_shipped_scenarios_load() -> None:
    assert set(SHIPPED) <= set(list_scenarios())
    for name, (count, model) in SHIPPED.items():
        scenario = load_scenario(name)
        assert scenario.name == name
        assert scenario.description
        assert len(scenario.gpus) == count
        assert {g.name for g in scenario.gpus} == {model}
        uuids = [g.uuid for g in scenario.gpus]
        assert len(set(uuids)) == count
        assert all(u.startswith("GPU-") for u in uuids)
        assert len({g.bus_id for g in scenario.gpus}) == count


def test_identity_is_deterministic_from_the_seed() -> None:
    assert load_scenario("dgx-h100") == load_scenario("dgx-h100")
    other = scenario_from_toml('base = "dgx-h100"\nseed = 1\n')
    assert other.gpus[0].uuid != load_scenario("dgx-h100").gpus[0].uuid


def test_resolve_by_name_and_path(tmp_path: Path) -> None:
    assert resolve_scenario("t4") == SCENARIO_DIR / "t4.toml"
    path = tmp_path / "mine.toml"
    path.write_text('base = "t4"\ndescription = "my T4"\n')
    scenario = load_scenario(str(path))
    assert (scenario.name, scenario.description, scenario.gpus[0].name) == (
        "mine",
        "my T4",
        "Tesla T4",
    )
    with pytest.raises(ScenarioError, match=r"not found.*shipped scenarios: a100-mig-mixed, "):
        resolve_scenario("dgx-h200")


def test_base_merges_tables_and_replaces_arrays(tmp_path: Path) -> None:
    (tmp_path / "parent.toml").write_text(
        """
        base = "dgx-h100"
        [gpu_defaults]
        name = "NVIDIA H100 80GB HBM3 (parent)"
        """
    )
    (tmp_path / "child.toml").write_text(
        """
        base = "parent"
        [system]
        driver_version = "555.42.02"
        [[timeline]]
        at = 1
        fault = "xid"
        gpu = 7
        value = 79
        """
    )
    scenario = load_scenario(tmp_path / "child.toml")
    assert scenario.system.driver_version == "555.42.02"
    assert scenario.system.cuda_driver_version == 12040  # merged from dgx-h100
    assert {g.name for g in scenario.gpus} == {"NVIDIA H100 80GB HBM3 (parent)"}
    assert len(scenario.gpus) == 8
    assert scenario.gpus[0].temp_slowdown_c == 94
    assert [(f.fault, f.gpu, f.value) for f in scenario.timeline] == [("xid", 7, 79)]


def test_topology_resolution() -> None:
    scenario = load_scenario("pcie-7gpu")
    levels = level_matrix(scenario.topology, 7)
    assert levels[0] == [0, 10, 10, 30, 30, 30, 30]
    assert levels[6] == [30, 30, 30, 10, 10, 10, 0]
    pairs = load_scenario("nvlink-pairs-8gpu")
    links = nvlink_matrix(pairs.topology, 8)
    assert links[0] == [0, 4, 1, 1, 0, 0, 0, 0]
    assert all(sum(row) == 6 for row in links)
    explicit = scenario_from_toml(
        """
        [[gpus]]
        [[gpus]]
        [[gpus]]
        [topology]
        matrix = [["X", "PIX", "SYS"], ["PIX", "X", 40], ["SYS", "NODE", "X"]]
        """
    )
    assert level_matrix(explicit.topology, 3) == [[0, 10, 50], [10, 0, 40], [50, 40, 0]]


def test_cpu_lists() -> None:
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("") == []
    with pytest.raises(ValueError, match="backwards"):
        parse_cpu_list("5-2")


def error_of(text: str, tmp_path: Path) -> ScenarioError:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    assert str(path) in str(caught.value)
    return caught.value


@pytest.mark.parametrize(
    ("text", "entry", "problem"),
    [
        ("gpus = [ {", "", "invalid TOML"),
        (
            '[[gpus]]\n[[timeline]]\nat = 3\nfault = "meltdown"\ngpu = 0\n',
            "timeline[0] ('meltdown' at 3s)",
            "unknown fault 'meltdown' (known: xid, ecc_sbe",
        ),
        (
            '[[gpus]]\n[[gpus]]\n[[timeline]]\nat = 3\nfault = "xid"\ngpu = 2\nvalue = 79\n',
            "timeline[0] ('xid' at 3s)",
            "GPU 2 does not exist (GPUs: 0-1)",
        ),
        (
            '[[gpus]]\n[[timeline]]\nfault = "xid"\ngpu = 0\n',
            "timeline[0] ('xid' at 0s)",
            "needs value",
        ),
        (
            '[[gpus]]\n[[timeline]]\nat = -1\nfault = "lost"\ngpu = 0\n',
            "timeline[0] ('lost' at -1s)",
            "'at' must be >= 0",
        ),
        ('[[gpus]]\nnuma_node = "zero"\n', "gpus[0].numa_node", "Expected `int | null`"),
        ("[[gpus]]\nflavour = 1\n", "gpus[0]", "unknown field `flavour`"),
        ('[[gpus]]\ncpu_affinity = "0-x"\n', "gpus[0]", "invalid literal"),
        ('[[gpus]]\nbus_id = "nonsense"\n', "gpus[0].bus_id", "not DOMAIN:BUS"),
        (
            '[[gpus]]\nbus_id = "0:1:0.0"\n[[gpus]]\nbus_id = "00000000:01:0.0"\n',
            "gpus[1].bus_id",
            "used by another GPU",
        ),
        ('[[gpus]]\n[topology]\ndefault_level = "NEAR"\n', "topology.default_level", "NEAR"),
        (
            '[[gpus]]\n[topology]\ngroups = [{ level = "PIX", gpus = [0, 3] }]\n',
            "topology.groups[0]",
            "GPU 3 out of range",
        ),
        (
            "[[gpus]]\n[[gpus]]\n[topology]\nnvlinks = [{ gpus = [0, 0], links = 2 }]\n",
            "topology.nvlinks[0]",
            "paired with itself",
        ),
        (
            "[[gpus]]\nnvswitch_links = 30\n[[gpus]]\n[topology]\nnvlinks_default = 7\n",
            "gpus[0]",
            "37 NVLinks, more than NVML's maximum of 36",
        ),
        (
            '[[gpus]]\n[[gpus]]\n[topology]\nmatrix = [["X", "PIX"], ["SYS", "X"]]\n',
            "topology.matrix[0][1]",
            "differs from matrix[1][0]",
        ),
        (
            '[[gpus]]\n[[timeline]]\nat = 1\nfault = "hot_add"\n'
            'spec = { memory_total_mib = "big" }\n',
            "timeline[0] ('hot_add' at 1s).spec",
            "Expected `int`",
        ),
        ('base = "nowhere"\n', "base", "'nowhere' not found"),
    ],
)
def test_scenario_errors_name_file_entry_and_problem(
    tmp_path: Path, text: str, entry: str, problem: str
) -> None:
    error = error_of(text, tmp_path)
    assert error.entry == entry
    assert problem in error.problem


def test_circular_base_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text('base = "b"\n')
    (tmp_path / "b.toml").write_text('base = "a"\n')
    with pytest.raises(ScenarioError, match=r"circular base chain: a.toml -> b.toml -> a.toml"):
        load_scenario(tmp_path / "a.toml")


def test_hot_add_slots_count_in_timeline_order() -> None:
    # A fault on slot 1 is valid once the hot_add before it created that slot.
    text = """
        [[gpus]]
        [[timeline]]
        at = 2
        fault = "xid"
        gpu = 1
        value = 13
        [[timeline]]
        at = 1
        fault = "hot_add"
        """
    assert len(scenario_from_toml(text).timeline) == 2
    with pytest.raises(ScenarioError, match="GPU 1 does not exist"):
        scenario_from_toml(text.replace("at = 1", "at = 3"))
