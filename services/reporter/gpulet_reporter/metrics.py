"""The reporter's metrics, created once per reporter from the runtime's meter.

What an operator alerts on (the deploy issue's rules use these names):

* ``gpulet_reporter_write_failures_total`` rising: the API server refuses or fails our
  writes (label ``reason``: ``429``, ``5xx``, ``timeout``, ``connection``, ``conflict``
  (five 409s in a row), ``4xx`` (RBAC, validation), ``internal``, ``file`` (no-cluster
  mode cannot write its file)).
* ``gpulet_reporter_pending`` at 1 for minutes: a desired state has not reached the
  API server; ``gpulet_reporter_last_success_timestamp_seconds`` says since when.

The rest explain behaviour: writes by object and verb, conflicts, retries, and
comparisons that found nothing to write.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from gpulet_common.telemetry import create_counters


class ReporterMetrics:
    def __init__(self, meter: metrics.Meter) -> None:
        # No node attribute: one reporter per process, and the scrape target names it.
        self._attrs: dict[str, str] = {}
        self.last_success: float = 0.0
        self.pending: bool = False
        self.writes_total = 0
        self.failures_total = 0
        self.conflicts_total = 0
        self.unchanged_total = 0
        self._writes, self._conflicts, self._retries, self._failures, self._unchanged = (
            create_counters(
                meter,
                ("gpulet.reporter.writes", "API writes (create, update, patch)"),
                ("gpulet.reporter.conflicts", "Writes answered 409 Conflict and re-read"),
                ("gpulet.reporter.retries", "Write attempts retried after a failure"),
                (
                    "gpulet.reporter.write_failures",
                    "Write attempts that failed (throttled, server error, timeout...)",
                ),
                (
                    "gpulet.reporter.unchanged",
                    "Desired states that matched the API server and needed no write",
                ),
            )
        )
        self._latency = meter.create_histogram(
            "gpulet.reporter.write_latency",
            unit="s",
            description="From the first unwritten change to the API server holding it",
            # Around the debounce window (0.5 s) and the maximum delay (2 s), then the
            # back-off range: the default buckets are made for milliseconds.
            explicit_bucket_boundaries_advisory=(
                0.1,
                0.25,
                0.5,
                0.75,
                1.0,
                1.5,
                2.0,
                2.5,
                3.0,
                5.0,
                10.0,
                30.0,
                60.0,
                300.0,
            ),
        )
        meter.create_observable_gauge(
            "gpulet.reporter.last_success_timestamp",
            callbacks=[self._observe_last_success],
            unit="s",
            description="Unix time of the last successful write or up-to-date check",
        )
        meter.create_observable_gauge(
            "gpulet.reporter.pending",
            callbacks=[self._observe_pending],
            description="1 while a desired state has not reached the API server",
        )

    def _observe_last_success(self, _options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self.last_success, self._attrs)

    def _observe_pending(self, _options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(1 if self.pending else 0, self._attrs)

    def wrote(self, obj: str, verb: str) -> None:
        self.writes_total += 1
        self._writes.add(1, {**self._attrs, "object": obj, "verb": verb})

    def conflict(self, obj: str) -> None:
        self.conflicts_total += 1
        self._conflicts.add(1, {**self._attrs, "object": obj})

    def failed(self, reason: str) -> None:
        self.failures_total += 1
        self._failures.add(1, {**self._attrs, "reason": reason})

    def retried(self, reason: str) -> None:
        self._retries.add(1, {**self._attrs, "reason": reason})

    def unchanged(self) -> None:
        self.unchanged_total += 1
        self._unchanged.add(1, self._attrs)

    def succeeded(self, latency_s: float | None) -> None:
        self.last_success = time.time()
        if latency_s is not None:
            self._latency.record(max(latency_s, 0.0), self._attrs)
