"""What kubelet saw of the plugin: calls by RPC, resource and gRPC status, and their time.

Why
---
The allocator counts the requests it answered, but a call it never saw (allocator
down, NATS gone, the plugin's deadline) fails only here, in the plugin; without this,
"pods fail admission on node X" would be visible in kubelet's events alone. Names:

- ``gpulet.device_plugin.calls`` {rpc, resource, code}: ``code`` is the gRPC status
  kubelet got (``OK``, ``UNAVAILABLE`` ...);
- ``gpulet.device_plugin.call_duration`` (s) {rpc, resource};
- ``gpulet.device_plugin.preferred_fallbacks`` {resource}: GetPreferredAllocation
  answered locally because the allocator could not be asked.
"""

from __future__ import annotations

import grpc
from opentelemetry import metrics

from gpulet_common.telemetry import REQUEST_LATENCY_BUCKETS_S, create_counters


class PluginMetrics:
    def __init__(self, meter: metrics.Meter | None = None) -> None:
        meter = meter or metrics.get_meter("gpulet.device-plugin")
        self._calls, self._fallbacks = create_counters(
            meter,
            (
                "gpulet.device_plugin.calls",
                "kubelet's calls to the device plugin, by RPC, resource and gRPC status",
            ),
            (
                "gpulet.device_plugin.preferred_fallbacks",
                "GetPreferredAllocation answered locally (allocator not reachable)",
            ),
        )
        self._duration = meter.create_histogram(
            "gpulet.device_plugin.call_duration",
            unit="s",
            description="From kubelet's call reaching the plugin to its answer",
            explicit_bucket_boundaries_advisory=REQUEST_LATENCY_BUCKETS_S,
        )

    def call(self, rpc: str, resource: str, code: grpc.StatusCode, seconds: float) -> None:
        self._calls.add(1, {"rpc": rpc, "resource": resource, "code": code.name})
        self._duration.record(seconds, {"rpc": rpc, "resource": resource})

    def fallback(self, resource: str) -> None:
        self._fallbacks.add(1, {"resource": resource})
