"""The import graph keeps its layers: read from the source, not from a convention.

* ``gpulet_common`` (libs/common) is the bottom: it imports no service and not the CLI.
* A service never imports another service's internals; what two services share lives
  in ``gpulet_common``.
* Only the CLI (libs/cli, ``gpulet``) puts services together.
* The node's health service (``gpulet_health``) imports nothing of its consumers:
  neither the alerting package (``gpulet_alerting``: alert delivery, the fleet hub)
  nor the fleet's credential tooling (``gpulet_common.fleet``); and those import
  nothing of it.
* Inside the allocator, the decision core (``decide/``, its engine included), the
  contract (``protocol``) and the kept state (``state/``) never import a kubelet
  adapter (``kubelet/``) or the NATS service (``service/``); the engine imports only
  the contract besides itself. The kubelet adapters import the core and the contract,
  never the service.

Every ``import`` and ``from ... import`` is read with :mod:`ast`, including the ones
inside functions and ``TYPE_CHECKING`` blocks, so a lazy import does not slip by.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {
    "gpulet_allocator": ROOT / "services" / "allocator" / "gpulet_allocator",
    "gpulet_collector": ROOT / "services" / "collector" / "gpulet_collector",
    "gpulet_health": ROOT / "services" / "health" / "gpulet_health",
    "gpulet_alerting": ROOT / "services" / "alerting" / "gpulet_alerting",
    "gpulet_reporter": ROOT / "services" / "reporter" / "gpulet_reporter",
}
COMMON = ROOT / "libs" / "common" / "gpulet_common"


def imported(package_dir: Path, *, full: bool = False) -> Iterator[tuple[str, str]]:
    """(module file relative to the repo, package it imports: top level or ``full``)."""
    for path in sorted(package_dir.rglob("*.py")):
        if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield str(path.relative_to(ROOT)), _name(alias.name, full)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield str(path.relative_to(ROOT)), _name(node.module, full)


def _name(module: str, full: bool) -> str:
    return module if full else module.split(".")[0]


def test_the_scan_sees_imports() -> None:
    # The checks below are only as good as the scan: it must find known imports.
    found = set(imported(SERVICES["gpulet_allocator"]))
    assert any(pkg == "gpulet_common" for _, pkg in found)
    assert any(pkg == "gpulet_allocator" for _, pkg in found)


def test_common_imports_no_service_and_not_the_cli() -> None:
    upward = set(SERVICES) | {"gpulet"}
    bad = sorted((f, pkg) for f, pkg in imported(COMMON) if pkg in upward)
    assert bad == []


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_no_service_imports_another(service: str) -> None:
    others = (set(SERVICES) - {service}) | {"gpulet"}
    bad = sorted((f, pkg) for f, pkg in imported(SERVICES[service]) if pkg in others)
    assert bad == []


def test_node_health_imports_nothing_of_its_consumers() -> None:
    health = set(imported(SERVICES["gpulet_health"], full=True))
    assert any(m.startswith("gpulet_common") for _, m in health)  # the scan sees them
    bad = sorted(
        (f, m)
        for f, m in health
        if m.split(".")[0] == "gpulet_alerting" or m.startswith("gpulet_common.fleet")
    )
    assert bad == []
    # Nor the other way round: what consumes health events knows them from the wire.
    back = sorted((f, m) for f, m in imported(SERVICES["gpulet_alerting"]) if m == "gpulet_health")
    assert back == []
    # And the hub's side is not in the node's packages (nor in libs/common).
    assert not (SERVICES["gpulet_health"] / "alerts.py").exists()
    assert not (SERVICES["gpulet_health"] / "fleet_alerts.py").exists()
    assert not (COMMON / "fleet" / "hub.py").exists()


ALLOCATOR = SERVICES["gpulet_allocator"]
# Where decisions are made (decide/, the engine inside it), the contract, and what is
# kept on disk: none of it imports a kubelet adapter or the NATS service.
DECISION_LAYER = ("decide/", "protocol.py", "state/")
KUBELET_ADAPTERS = "kubelet/"


def _allocator_imports() -> list[tuple[str, str]]:
    prefix = str(ALLOCATOR.relative_to(ROOT)) + "/"
    return [(f.removeprefix(prefix), m) for f, m in imported(ALLOCATOR, full=True)]


def test_the_allocator_decision_layer_never_imports_the_kubelet_adapters() -> None:
    found = _allocator_imports()
    decision = [(f, m) for f, m in found if f.startswith(DECISION_LAYER)]
    assert any(m == "gpulet_allocator.protocol" for _, m in decision)  # the scan sees them
    upward = ("gpulet_allocator.kubelet", "gpulet_allocator.service", "gpulet_allocator.cli")
    bad = sorted((f, m) for f, m in decision if m.startswith(upward))
    assert bad == []
    engine_bad = sorted(
        (f, m)
        for f, m in decision
        if f.startswith("decide/engine/")
        and m.startswith("gpulet_allocator")
        and not m.startswith(("gpulet_allocator.decide.engine", "gpulet_allocator.protocol"))
    )
    assert engine_bad == []


def test_the_kubelet_adapters_use_the_core_interface_not_the_service() -> None:
    """Kubelet's calls enter in kubelet/ (the device plugin today, DRA's kubelet plugin
    beside it later): they may import the decision core and the contract, never the
    NATS service's internals, and the core never imports them (the test above)."""
    found = _allocator_imports()
    adapters = [(f, m) for f, m in found if f.startswith(KUBELET_ADAPTERS)]
    assert any(m.startswith("gpulet_allocator.protocol") for _, m in adapters)
    bad = sorted(
        (f, m)
        for f, m in adapters
        if m.startswith(("gpulet_allocator.service", "gpulet_allocator.cli"))
    )
    assert bad == []


def test_the_cli_loads_no_kubernetes_client_until_a_command_needs_it() -> None:
    # Every sidecar is a `gpulet` process; the Kubernetes client costs ~40 MB of RSS and
    # only the reporter and the allocator's pod watch use it.
    code = (
        "import sys, gpulet.cli; gpulet.cli.build_parser(); "
        "print('kubernetes_asyncio' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False", out.stderr
