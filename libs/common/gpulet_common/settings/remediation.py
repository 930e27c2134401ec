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


class RemediationSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # "off": nothing; "report": log and post an Event saying what would be done;
    # "evict": evict the pods holding a GPU that failed with a fatal, GPU-scoped fault.
    mode: Literal["off", "report", "evict"] = "off"
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
    # An eviction a PodDisruptionBudget blocks (429) or that fails is retried with
    # exponential backoff, first after this long, for as long as the fault stands.
    retry_initial_s: PositiveSeconds = 1.0
    # The longest wait between two tries of an eviction (and between two looks while a
    # fault stands).
    retry_max_s: PositiveSeconds = 60.0
    # Namespace of the Events posted on the Node (cluster-scoped), as kubelet does.
    node_event_namespace: str = "default"
