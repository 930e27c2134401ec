"""GFD's sharing labels under time-slicing (issue 27).

gpu-feature-discovery (``internal/lm``) writes ``nvidia.com/gpu.replicas``,
``nvidia.com/gpu.sharing-strategy`` (``time-slicing`` / ``none``) and appends
``-SHARED`` to ``nvidia.com/gpu.product`` when the GPUs are replicated under their own
resource name; ``nvidia.com/gpu.count`` stays the count of physical GPUs.
"""

from __future__ import annotations

from gpulet_common.messages import Inventory
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_reporter.core import ReporterCore
from gpulet_reporter.labels import NodeFacts, node_labels
from support import reference

PRODUCT = "nvidia.com/gpu.product"
REPLICAS = "nvidia.com/gpu.replicas"
STRATEGY = "nvidia.com/gpu.sharing-strategy"


def inventory(scenario: str) -> Inventory:
    return reference.mock_inventory(scenario)


def labels(inv: Inventory, replicas: dict[str, int], strategy: str = "none") -> dict[str, str]:
    facts = NodeFacts(serves_whole_gpus=True, replicas=replicas, mig_strategy=strategy)
    return node_labels(inv, facts=facts)


def test_time_sliced_h100_node_reads_as_gfd_writes_it() -> None:
    inv = inventory("dgx-h100")
    got = labels(inv, {g.uuid: 4 for g in inv.gpus})
    assert got[REPLICAS] == "4"
    assert got[STRATEGY] == "time-slicing"
    assert got[PRODUCT] == "NVIDIA-H100-80GB-HBM3-SHARED"
    assert got["nvidia.com/gpu.count"] == "8"


def test_no_time_slicing_reads_none_and_one_replica() -> None:
    inv = inventory("dgx-h100")
    got = labels(inv, {})
    assert (got[REPLICAS], got[STRATEGY], got[PRODUCT]) == ("1", "none", "NVIDIA-H100-80GB-HBM3")


def test_gpus_with_different_counts_leave_replicas_out() -> None:
    inv = inventory("dgx-h100")
    replicas = {g.uuid: 2 for g in inv.gpus}
    replicas[inv.gpus[0].uuid] = 8
    got = labels(inv, replicas)
    assert REPLICAS not in got
    assert got[STRATEGY] == "time-slicing"
    assert got[PRODUCT].endswith("-SHARED")


def test_mig_products_never_read_shared() -> None:
    inv = inventory("a100-mig-mixed")
    plain = [g for g in inv.gpus if g.mig_mode != "enabled"]
    got = labels(inv, {g.uuid: 3 for g in plain}, strategy="mixed")
    assert got[STRATEGY] == "time-slicing"
    mig_products = [
        v for k, v in got.items() if k.startswith("nvidia.com/mig-") and k.endswith(".product")
    ]
    assert mig_products
    assert not any("SHARED" in v for v in mig_products)


def test_the_reporter_relabels_when_the_allocator_changes_the_replicas() -> None:
    inv = inventory("dgx-h100")
    core = ReporterCore(inv.node, ReporterSettings(), facts=NodeFacts(serves_whole_gpus=True))
    core.on_inventory(inv)
    assert core.desired is not None
    assert core.desired.node_labels[STRATEGY] == "none"
    core.on_replicas({g.uuid: 2 for g in inv.gpus})
    assert core.desired.node_labels[REPLICAS] == "2"
    assert core.desired.node_labels[PRODUCT] == "NVIDIA-H100-80GB-HBM3-SHARED"
    core.on_replicas({})
    assert core.desired.node_labels[STRATEGY] == "none"
