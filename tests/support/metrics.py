"""Reading OpenTelemetry metrics in tests through an in-memory reader."""

from __future__ import annotations

from collections.abc import Iterator
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
        return sum(float(p.value) for p in self._points(name, attributes))

    def count(self, name: str, **attributes: Any) -> int:
        """Sum of the counts of histogram ``name``'s points whose attributes include
        ``attributes`` (how many values were recorded)."""
        return sum(int(p.count) for p in self._points(name, attributes))

    def _points(self, name: str, attributes: dict[str, Any]) -> Iterator[Any]:
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data is not None else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != name:
                        continue
                    for point in metric.data.data_points:
                        attrs = dict(point.attributes or {})
                        if all(attrs.get(k) == v for k, v in attributes.items()):
                            yield point
