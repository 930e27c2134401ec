"""The health service's per-GPU gauges: ``gpulet.gpu.healthy`` and ``gpulet.gpu.conditions``.

Each GPU's labels are those of the collector's gauges (dcgm-exporter style: ``gpu``,
``UUID``, ``pci_bus_id``, ``modelName``, ``Hostname``), taken from the collector's
latest inventory, so alert rules can join health with temperature and the like. The
values are read from the rule engine when the metrics are collected.
"""

from __future__ import annotations

from opentelemetry import metrics

from gpulet_common.messages import Inventory
from gpulet_health.rules import RuleEngine


class HealthGauges:
    def __init__(self, engine: RuleEngine, node: str, meter: metrics.Meter) -> None:
        self._engine = engine
        self._node = node
        self._labels_of: dict[str, dict[str, str]] = {}
        meter.create_observable_gauge(
            "gpulet.gpu.healthy",
            [self._observe_health],
            unit="1",
            description="1 while the GPU is healthy, 0 while any unhealthy condition is active",
        )
        meter.create_observable_gauge(
            "gpulet.gpu.conditions",
            [self._observe_conditions],
            unit="1",
            description="Active health conditions of the GPU, by kind and severity",
        )

    def take_labels(self, inventory: Inventory) -> None:
        self._labels_of = {
            g.uuid: {
                "gpu": str(g.index),
                "UUID": g.uuid,
                "pci_bus_id": g.pci_bus_id,
                "modelName": g.name,
                "Hostname": inventory.node,
            }
            for g in inventory.gpus
        }

    def _labels(self, uuid: str, index: int | None) -> dict[str, str]:
        return self._labels_of.get(uuid) or {
            "gpu": "" if index is None else str(index),
            "UUID": uuid,
            "Hostname": self._node,
        }

    def _observe_health(self, _options: metrics.CallbackOptions) -> list[metrics.Observation]:
        return [
            metrics.Observation(1.0 if gpu.healthy else 0.0, self._labels(gpu.uuid, gpu.index))
            for gpu in list(self._engine.gpus.values())
            if gpu.uuid
        ]

    def _observe_conditions(self, _options: metrics.CallbackOptions) -> list[metrics.Observation]:
        counts: dict[tuple[str, str, str], int] = {}
        indices: dict[str, int | None] = {}
        for gpu in list(self._engine.gpus.values()):
            indices[gpu.uuid] = gpu.index
            for condition in list(gpu.conditions.values()):
                wire = condition.wire()
                key = (gpu.uuid, wire.kind, wire.severity)
                counts[key] = counts.get(key, 0) + 1
        return [
            metrics.Observation(
                float(n), {**self._labels(uuid, indices[uuid]), "kind": kind, "severity": sev}
            )
            for (uuid, kind, sev), n in counts.items()
        ]
