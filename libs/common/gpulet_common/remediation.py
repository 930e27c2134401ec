"""What remediation would do now: the allocator's answer to ``gpulet health remediate
--dry-run``.

The allocator (which knows who holds which GPU) plans remediation
(``gpulet_allocator.service.remediate``); the health CLI shows the plan. Both sides
import this contract from here, since neither service may import the other. JSON on
the wire, asked on ``gpulet.allocator.<node>.remediation``; fields are only ever added,
with defaults.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from gpulet_common.codec import Codec

ENDPOINT_REMEDIATION: Final = "remediation"

# Where one pod stands: planned (mode report, or not yet asked), asked and accepted,
# refused by a PodDisruptionBudget (429, retried), failed (retried), gone (404: the
# pod left by itself), held back by the circuit breaker.
PodState = Literal["planned", "evicted", "blocked_by_pdb", "failed", "gone", "held_by_breaker"]


class PlannedPod(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    namespace: str
    name: str
    uid: str = ""
    # How the pod was found to hold the GPU: "ledger", "podresources", "dra_claim".
    via: list[str] = []
    state: PodState = "planned"
    attempts: int = 0
    detail: str = ""


class Fault(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A condition that remediates, and the device it is scoped to: what the
    allocator's remediation acts on, and the first fields of a :class:`PlannedGpu`."""

    gpu_uuid: str
    gpu_index: int | None = None
    # The device the fault is scoped to: the GPU's UUID, or one MIG device's.
    device: str = ""
    condition: str = ""
    kind: str = ""
    severity: str = ""
    action: str = ""
    reason: str = ""
    xid: int | None = None
    # The catalogue entry (gpulet_common.xid_table): NVIDIA's mnemonic and immediate bucket.
    mnemonic: str = ""
    bucket: str = ""
    # When the condition was raised (the health service's clock, this node's): a
    # remediation by reset starts again only for a condition newer than its last start.
    since: float = 0.0

    @property
    def entry(self) -> str:
        """The catalogue entry, as Events and logs name it."""
        if self.xid is None:
            return self.kind
        return f"XID {self.xid} {self.mnemonic or '(not in the catalogue)'} [{self.bucket or '-'}]"


class PlannedGpu(Fault, frozen=True, kw_only=True, omit_defaults=True):
    """One failed GPU (or MIG device) and the pods that hold it."""

    # False: the circuit breaker holds this GPU back.
    admitted: bool = True
    pods: list[PlannedPod] = []
    # Mode reset: where the GPU's state machine stands ("quarantined" ... "returned",
    # "escalated", "retired"; "would quarantine" before it starts) and why.
    step: str = ""
    step_detail: str = ""


class BreakerView(msgspec.Struct, frozen=True, kw_only=True):
    open: bool = False
    max_fraction: float = 0.0
    window_s: float = 0.0
    node_gpus: int = 0
    # How many GPUs may be remediated within the window, and those that were.
    limit: int = 0
    in_window: list[str] = []
    trips: int = 0
    detail: str = ""
    # Pods evicted within the window, and the most allowed (0: no limit); the most
    # fault episodes of one GPU within the window (0: no limit).
    evictions: int = 0
    max_evictions: int = 0
    max_faults_per_gpu: int = 0
    # The fleet breaker (a hub's slots): what it holds back, or "" (off, or nothing).
    fleet: str = ""


class RemediationRequest(msgspec.Struct, frozen=True, kw_only=True):
    schema_version: int = 1


class RemediationPlan(msgspec.Struct, frozen=True, kw_only=True):
    schema_version: int = 1
    node: str
    mode: str
    gpus: list[PlannedGpu] = []
    breaker: BreakerView = msgspec.field(default_factory=BreakerView)
    # Where finding the holders fell short (PodResources or the API unreachable).
    problems: list[str] = []


REMEDIATION_REQUEST = Codec(RemediationRequest)
REMEDIATION_PLAN = Codec(RemediationPlan)


def format_plan(plan: RemediationPlan) -> str:
    """The plan as ``gpulet health remediate --dry-run`` prints it."""
    b = plan.breaker
    lines = [
        f"node {plan.node}: remediation.mode = {plan.mode}",
        f"circuit breaker: {'OPEN' if b.open else 'closed'}; {len(b.in_window)} of at most "
        f"{b.limit} GPU(s) of {b.node_gpus} remediated in the last {b.window_s:g} s "
        f"(max_fraction {b.max_fraction:g}, tripped {b.trips} time(s))"
        + (f": {b.detail}" if b.detail else ""),
        f"evictions: {b.evictions} in the window (at most {b.max_evictions or 'unlimited'}); "
        f"at most {b.max_faults_per_gpu or 'unlimited'} fault(s) of one GPU per window",
    ]
    if b.fleet:
        lines.append(f"fleet breaker: {b.fleet}")
    if plan.mode == "off":
        lines.append("remediation is off: below is what mode evict would do")
    if not plan.gpus:
        lines.append("no GPU has a fault that remediates: nothing to do")
    for gpu in plan.gpus:
        where = f"GPU {gpu.gpu_index} {gpu.gpu_uuid}" if gpu.gpu_index is not None else gpu.gpu_uuid
        if gpu.device and gpu.device != gpu.gpu_uuid:
            where += f" (MIG device {gpu.device})"
        entry = f"XID {gpu.xid} {gpu.mnemonic} [{gpu.bucket or '-'}]" if gpu.xid is not None else ""
        lines.append(
            f"{where}: {gpu.condition} ({gpu.kind}, {gpu.severity}, {gpu.action}) {entry}".rstrip()
        )
        lines.append(f"  why: {gpu.reason}")
        if gpu.step:
            lines.append(
                f"  reset: {gpu.step}" + (f": {gpu.step_detail}" if gpu.step_detail else "")
            )
        if not gpu.admitted:
            lines.append("  held back by the circuit breaker: no pod is evicted")
        if not gpu.pods:
            lines.append("  no pod holds it")
        for pod in gpu.pods:
            via = ",".join(pod.via)
            lines.append(
                f"  pod {pod.namespace}/{pod.name} (via {via}): {pod.state}"
                + (f", {pod.attempts} attempt(s)" if pod.attempts else "")
                + (f": {pod.detail}" if pod.detail else "")
            )
    lines.extend(f"problem: {p}" for p in plan.problems)
    return "\n".join(lines)
