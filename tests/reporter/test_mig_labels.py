"""GFD's MIG labels for the mock's MIG scenarios (issue 27).

The names and values follow gpu-feature-discovery's (``internal/lm``, its
``TestMigStrategySingleLabels`` cases): ``mig.capable``, ``mig.strategy``; under
``single`` the ``nvidia.com/gpu.*`` labels describe the MIG device, or read
``count=0``, ``memory=0``, ``<product>-MIG-INVALID`` for an invalid layout; under
``mixed`` one ``nvidia.com/mig-<profile>.*`` set per profile.
"""

from __future__ import annotations

import msgspec
import pytest

from gpulet_common.messages import Inventory
from gpulet_common.nvml.loader import open_mock
from gpulet_reporter.labels import NodeFacts, node_labels

ATTRS: tuple[str, ...] = ("multiprocessors", "slices.gi", "slices.ci", "engines.copy")
ATTRS += ("engines.decoder", "engines.encoder", "engines.jpeg", "engines.ofa")


def inventory(scenario: str) -> Inventory:
    adapter = open_mock(scenario)
    try:
        return adapter.inventory("n", 1)
    finally:
        adapter.shutdown()


def labels(scenario: str, strategy: str, inv: Inventory | None = None) -> dict[str, str]:
    return node_labels(inv or inventory(scenario), facts=NodeFacts(mig_strategy=strategy))


def test_single_on_the_h100_node_describes_its_mig_devices() -> None:
    got = labels("h100-mig-single", "single")
    assert got["nvidia.com/mig.capable"] == "true"
    assert got["nvidia.com/mig.strategy"] == "single"
    assert got["nvidia.com/gpu.count"] == "56"
    assert got["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"
    assert got["nvidia.com/gpu.slices.gi"] == "1"
    assert got["nvidia.com/gpu.slices.ci"] == "1"
    for attr in ATTRS:
        assert got[f"nvidia.com/gpu.{attr}"].isdigit()
    assert int(got["nvidia.com/gpu.memory"]) < 10 * 1024


@pytest.mark.parametrize("scenario", ["a100-mig-mixed", "h100-mig-single"])
def test_an_invalid_single_layout_reads_mig_invalid(scenario: str) -> None:
    inv = inventory(scenario)
    if scenario == "h100-mig-single":
        # One GPU without instances: invalid for single.
        gpu0 = msgspec.structs.replace(inv.gpus[0], mig_devices=[])
        inv = msgspec.structs.replace(inv, gpus=[gpu0, *inv.gpus[1:]])
    got = labels(scenario, "single", inv)
    product = inv.gpus[0].name.replace(" ", "-")
    assert got["nvidia.com/gpu.count"] == "0"
    assert got["nvidia.com/gpu.memory"] == "0"
    assert got["nvidia.com/gpu.product"] == f"{product}-MIG-INVALID"
    assert not any(k.startswith("nvidia.com/mig-") for k in got)


def test_mixed_on_the_a100_node_one_set_per_profile() -> None:
    got = labels("a100-mig-mixed", "mixed")
    assert got["nvidia.com/mig.strategy"] == "mixed"
    assert got["nvidia.com/gpu.count"] == "1"
    counts = {
        k.removeprefix("nvidia.com/mig-").removesuffix(".count"): v
        for k, v in got.items()
        if k.startswith("nvidia.com/mig-") and k.endswith(".count")
    }
    assert counts == {
        "3g.20gb": "2",
        "2g.10gb": "1",
        "1g.5gb": "2",
        "1c.3g.20gb": "1",
        "2c.3g.20gb": "1",
    }
    assert got["nvidia.com/mig-1g.5gb.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    assert got["nvidia.com/mig-2c.3g.20gb.slices.ci"] == "2"
    assert got["nvidia.com/mig-2c.3g.20gb.slices.gi"] == "3"
    for attr in ATTRS:
        assert f"nvidia.com/mig-3g.20gb.{attr}" in got


def test_none_sets_no_strategy_and_a_node_without_mig_no_mig_label() -> None:
    got = labels("a100-mig-mixed", "none")
    assert got["nvidia.com/mig.capable"] == "true"
    assert "nvidia.com/mig.strategy" not in got
    assert not any(k.startswith("nvidia.com/mig-") for k in got)
    plain = labels("t4", "mixed")
    assert plain.get("nvidia.com/mig.capable", "false") == "false"
    assert not any(k.startswith("nvidia.com/mig-") for k in plain)
