"""Settings of remediation: evicting the pods that hold a GPU that failed (issue #28).

Opt-in: ``mode = "off"`` by default. ``report`` logs and posts an Event saying what
would be done; ``evict`` evicts, through the Eviction API, only the pods that hold the
failed GPU (docs/health.md, "Remediation"). The allocator runs it: it knows who holds
which GPU. Its API connection is the handshake's (``allocator.handshake.kubeconfig``,
``kube_context``, ``api_timeout_s``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

PositiveSeconds = Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)]
Fraction = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
GpuAction = Literal["reset_gpu", "reboot", "hardware_inspection", "operator_check"]


class RetireRule(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # A GPU with this many fatal faults within window_s is retired (an RMA candidate):
    # out of service until `gpulet health clear --retired --gpu N`. 0: never for faults.
    faults: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 3
    # The window of the fatal faults counted against faults.
    window_s: PositiveSeconds = 86400.0
    # ... or with this many failed resets (or failed verifies) in its history. 0: never.
    failed_resets: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 2


class ResetSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # How a GPU is reset: "nvidia-smi" runs `nvidia-smi --gpu-reset -i <bus id>`;
    # "mock" resets the mock NVML's GPU (with --nvml mock only).
    executor: Literal["nvidia-smi", "mock"] = "nvidia-smi"
    # The nvidia-smi to run (a name on PATH or a path).
    nvidia_smi: str = "nvidia-smi"
    # How long the reset may take before it counts as failed (hung).
    timeout_s: PositiveSeconds = 120.0
    # How long to wait for NVML to show no compute or graphics process on the GPU once
    # its pods are evicted; then the GPU escalates, naming the PIDs that hold it.
    idle_timeout_s: PositiveSeconds = 300.0
    # After a reset, no new XID may come within this window for the verify to pass.
    settle_s: PositiveSeconds = 30.0
    retire: RetireRule = msgspec.field(default_factory=RetireRule)


class FleetBreakerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Take a slot in the hub's KV (compare-and-set) before evicting or resetting a GPU,
    # give it back after: at most max_gpus, or max_percent of the fleet's GPUs, in
    # remediation at once across the fleet. Off: this node's breaker alone.
    enabled: bool = False
    # The NATS the slots live on, as this node reaches it ("": this node's own
    # connection). Its account must let the node use the bucket.
    nats_url: str = ""
    # The KV bucket of the slots (created if missing).
    bucket: str = "gpulet_remediation_slots"
    # At most this many GPUs of the fleet in remediation at once.
    max_gpus: Annotated[int, msgspec.Meta(ge=1, le=100000)] = 8
    # Percent of the fleet's GPUs (the sum of the nodes' statuses in gpulet_fleet);
    # where that is not known, max_gpus alone.
    max_percent: Annotated[float, msgspec.Meta(gt=0.0, le=100.0)] = 5.0
    # A slot older than this is dropped (its node died holding it).
    slot_ttl_s: PositiveSeconds = 3600.0


class RemediationSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # "off": nothing; "report": log and post an Event saying what would be done;
    # "evict": evict the pods holding a GPU that failed with a fatal, GPU-scoped fault;
    # "reset": evict them, then reset the GPU and return it to service once verified
    # (docs/health.md, "Remediation by reset").
    mode: Literal["off", "report", "evict", "reset"] = "off"
    # The least severity of a fault that remediates.
    min_severity: Literal["critical", "fatal"] = "critical"
    # The actions that say a fault is the GPU's (a lost or removed GPU always is).
    actions: list[GpuAction] = msgspec.field(
        default_factory=lambda: ["reset_gpu", "reboot", "hardware_inspection"]
    )
    # Circuit breaker: never remediate more than this share of the node's GPUs within
    # window_s (at least one GPU); beyond it a storm is suspected and eviction stops.
    max_fraction: Fraction = 0.5
    # The circuit breaker's window: a GPU remediated counts against the share this long.
    window_s: PositiveSeconds = 600.0
    # ... nor more than this many fault episodes of one GPU within window_s (a GPU that
    # flaps: each time it fails again after recovering); 0: no limit.
    max_faults_per_gpu: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 2
    # ... nor more than this many pods evicted on the node within window_s; 0: no limit.
    max_evictions: Annotated[int, msgspec.Meta(ge=0, le=100000)] = 16
    # An eviction a PodDisruptionBudget blocks (429) or that fails is retried with
    # exponential backoff, first after this long, for as long as the fault stands.
    retry_initial_s: PositiveSeconds = 1.0
    # The longest wait between two tries of an eviction (and between two looks while a
    # fault stands).
    retry_max_s: PositiveSeconds = 60.0
    # Namespace of the Events posted on the Node (cluster-scoped), as kubelet does.
    node_event_namespace: str = "default"
    # Remediation by reset (mode "reset").
    reset: ResetSettings = msgspec.field(default_factory=ResetSettings)
    # The fleet breaker (a hub's NATS).
    fleet: FleetBreakerSettings = msgspec.field(default_factory=FleetBreakerSettings)
