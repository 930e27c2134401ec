"""What remediation by reset reads of the node view (:class:`~gpulet_common.nodeview.NodeView`).

* :func:`known_identity`: what the node last knew of a GPU NVML cannot find now (one
  off the bus), for the baseline its verify compares with: the health service's record
  of it (``GpuHealth.info``, kept while the GPU is gone), else the collector's
  inventory.
* :func:`faults_since`: the GPU's unhealthy conditions raised after a moment (the
  health service's record, this node's clock), the quarantine's own aside: a new fault
  within the settle window fails the verify.
"""

from __future__ import annotations

from collections.abc import Callable

from gpulet_common.heal import QUARANTINE_KIND, GpuIdentity
from gpulet_common.messages import UNHEALTHY_SEVERITIES
from gpulet_common.nodeview import NodeView


def known_identity(view: NodeView) -> Callable[[str], GpuIdentity | None]:
    def of(uuid: str) -> GpuIdentity | None:
        health = view.health(uuid)
        info = health.info if health is not None else None
        if info is None:
            inventory = view.inventory
            found = [g for g in (inventory.gpus if inventory is not None else ()) if g.uuid == uuid]
            info = found[0] if found else None
        if info is None:
            return None
        return GpuIdentity(
            uuid=uuid,
            bus_id=info.pci_bus_id,
            name=info.name,
            memory_total=info.memory_total_bytes,
        )

    return of


def faults_since(view: NodeView) -> Callable[[str, float], list[str]]:
    def since(uuid: str, moment: float) -> list[str]:
        health = view.health(uuid)
        return [
            c.condition
            for c in (health.conditions if health is not None else ())
            if c.kind != QUARANTINE_KIND and c.since > moment and c.severity in UNHEALTHY_SEVERITIES
        ]

    return since
