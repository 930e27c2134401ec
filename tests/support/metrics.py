"""Reading OpenTelemetry metrics in tests through an in-memory reader."""

from __future__ import annotations

from typing import Any

from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader


class MetricsProbe:
    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.meter: metrics.Meter = self.provider.get_meter("test")

    def value(self, name: str, **attributes: Any) -> float:
        """Sum of the data points of ``name`` whose attributes include ``attributes``."""
        data = self.reader.get_metrics_data()
        total = 0.0
        if data is None:
            return total
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != name:
                        continue
                    for point in metric.data.data_points:
                        attrs = dict(point.attributes or {})
                        if all(attrs.get(k) == v for k, v in attributes.items()):
                            total += float(point.value)  # type: ignore[union-attr]
        return total
