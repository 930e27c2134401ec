"""The DRA kubelet plugin's metrics (Prometheus ``gpulet_dra_*``).

- ``gpulet.dra.prepare_duration`` (s) {result ``ok`` | ``error``}: one claim's Prepare,
  from kubelet's call to its answer (a call of several claims records each);
- ``gpulet.dra.prepare_errors`` {reason}: refused or failed claims, ``reason`` one
  of :data:`REASONS` (a ledger refusal counts under its code, ``insufficient_capacity``
  ...);
- ``gpulet.dra.unprepare_errors`` {reason};
- ``gpulet.dra.prepared_claims``: the claims prepared now (the plugin's checkpoint);
- ``gpulet.dra.swept_claims``: claims unprepared by the sweep because the API server no
  longer knows them (:mod:`.sweep`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

from opentelemetry import metrics

from gpulet_common.telemetry import REQUEST_LATENCY_BUCKETS_S, create_counters

REASONS: Final = (
    "invalid_uid",
    "not_found",
    "read_error",
    "invalid_claim",
    "invalid_config",
    "unknown_device",
    "not_reserved",
    "cdi_write",
    "timeslice",
    "timeout",
    "internal",
    "unavailable",
)


class DraMetrics:
    def __init__(self, meter: metrics.Meter | None = None) -> None:
        meter = meter or metrics.get_meter("gpulet.dra")
        self._errors, self._unprepare_errors, self._swept = create_counters(
            meter,
            ("gpulet.dra.prepare_errors", "claims whose Prepare failed, by reason"),
            ("gpulet.dra.unprepare_errors", "claims whose Unprepare failed, by reason"),
            ("gpulet.dra.swept_claims", "claims unprepared because the API server lost them"),
        )
        self._duration = meter.create_histogram(
            "gpulet.dra.prepare_duration",
            unit="s",
            description="One claim's Prepare, from kubelet's call to its answer",
            explicit_bucket_boundaries_advisory=REQUEST_LATENCY_BUCKETS_S,
        )
        self._prepared: Callable[[], int] = lambda: 0
        meter.create_observable_gauge(
            "gpulet.dra.prepared_claims",
            callbacks=[self._observe],
            description="Claims prepared on this node now",
        )

    def watch_prepared(self, count: Callable[[], int]) -> None:
        self._prepared = count

    def _observe(self, _options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        yield metrics.Observation(self._prepared())

    def prepared(self, seconds: float, reason: str) -> None:
        self._duration.record(seconds, {"result": "error" if reason else "ok"})
        if reason:
            self._errors.add(1, {"reason": reason})

    def unprepare_failed(self, reason: str) -> None:
        self._unprepare_errors.add(1, {"reason": reason})

    def swept(self, count: int = 1) -> None:
        self._swept.add(count)
