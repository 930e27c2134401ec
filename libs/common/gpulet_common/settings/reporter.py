"""Settings of the reporter service (the node's Device CR and node labels).

Timing defaults follow the issue: changes inside a 500 ms quiet window coalesce into
one write, no change waits longer than 2 s, and a full re-read of the API objects
every 5 minutes corrects drift (someone editing the Device by hand).

The node condition ``GpuletGPUHealthy`` and the optional taint are described in
docs/health.md ("The node condition and taint"); their defaults: condition on, taint
policy ``none``, heartbeat every 5 minutes as node-problem-detector's, and the
condition turns ``Unknown`` after 90 s without an answer from the health service.
"""

from __future__ import annotations

from typing import Literal

from gpulet_common.settings.kube_writer import KubeWriterSettings, PositiveSeconds, Seconds


class ReporterSettings(KubeWriterSettings, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """The kubeconfig, debounce, API timeout and back-off of the Device writer are
    KubeWriterSettings' (settings/kube_writer.py)."""

    # Run the reporter (the node's Device CR and GPU node labels).
    enabled: bool = True
    # "auto": in-cluster config, else a kubeconfig, else no-cluster mode (the Device is
    # written to a file). "cluster" insists on a cluster (keeps retrying to load the
    # config); "offline" never talks to an API server. In "auto" with the mock NVML
    # backend the reporter stays offline: mock GPUs must not reach a real cluster just
    # because the laptop has a kubeconfig (set "cluster" to point it at a test cluster).
    mode: Literal["auto", "cluster", "offline"] = "auto"
    # Re-read the Device and the Node and correct drift this often (0: never).
    reconcile_interval_s: Seconds = 300.0
    # The longest Retry-After (429) honoured; a larger one is clamped to this.
    retry_after_max_s: PositiveSeconds = 60.0
    # Ask the collector / health service for their state this often until they answer.
    request_retry_s: PositiveSeconds = 5.0
    # No-cluster mode: where the Device it would apply is written; empty: <state_dir>/reporter.
    offline_output_dir: str = ""
    # Patch the node's labels (Koordinator's three, plus GFD-compatible ones).
    node_labels: bool = True
    # Include the GFD-compatible nvidia.com/* labels; switch off where GFD itself runs.
    gfd_labels: bool = True
    # Field manager recorded by the API server for our writes.
    field_manager: str = "gpulet-reporter"
    # Keep the NodeCondition GpuletGPUHealthy on the Node (PATCH nodes/status).
    node_condition: bool = True
    # Taint gpulet.io/gpu-unhealthy:NoSchedule: "none" (never; removes ours if left),
    # "all-gpus-unhealthy" (every GPU unhealthy) or "any-gpu-unhealthy" (one is enough).
    taint_policy: Literal["none", "all-gpus-unhealthy", "any-gpu-unhealthy"] = "none"
    # Refresh the condition's lastHeartbeatTime this often when nothing changed (0: never).
    condition_heartbeat_s: Seconds = 300.0
    # Ask the health service for its state this often: its answer says it is alive.
    health_probe_interval_s: PositiveSeconds = 15.0
    # Without an answer for this long the condition turns Unknown (HealthServiceUnreachable).
    health_stale_after_s: PositiveSeconds = 90.0
