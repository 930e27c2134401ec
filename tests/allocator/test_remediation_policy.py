"""Remediation's pure parts: which faults remediate, who holds the failed device, the
circuit breaker, and the loop against a fake API (evict only the holders, a
PodDisruptionBudget's 429 retried with backoff, report mode, a storm stopped).
The real server: tests/kube/test_remediation_real.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import anyio
import msgspec
import pytest

from gpulet_allocator.protocol import AllocationView, GrantView, core_device_id
from gpulet_allocator.service.remediate.breaker import Breaker
from gpulet_allocator.service.remediate.kube import EventTarget, EvictOutcome, outcome_of
from gpulet_allocator.service.remediate.policy import (
    PodInfo,
    Records,
    devices_in_scope,
    faults_of,
    holders_of,
    pod_info,
)
from gpulet_allocator.service.remediate.runner import Remediator, Sources
from gpulet_allocator.state.records import ClaimDeviceRecord, ClaimRecord
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr
from gpulet_common.messages import ActiveCondition, GpuHealth
from gpulet_common.podresources import PodResourcesUnavailable
from gpulet_common.remediation import format_plan
from gpulet_common.settings.remediation import RemediationSettings

pytestmark = pytest.mark.anyio

EVICT = RemediationSettings(mode="evict", max_fraction=0.5, window_s=600, retry_initial_s=1)


def cond(condition: str, kind: str, severity: str, action: str, **kw: Any) -> ActiveCondition:
    return ActiveCondition(
        condition=condition,
        kind=kind,  # type: ignore[arg-type]
        severity=severity,  # type: ignore[arg-type]
        action=action,  # type: ignore[arg-type]
        reason=f"{condition} happened",
        **kw,
    )


def gpu(n: int, *conditions: ActiveCondition) -> GpuHealth:
    return GpuHealth(
        gpu_uuid=f"GPU-{n}", gpu_index=n, healthy=not conditions, conditions=list(conditions)
    )


XID79 = cond("xid:79", "xid", "fatal", "reboot", sticky=True)


@pytest.mark.parametrize(
    ("condition", "remediates"),
    [
        (XID79, True),  # GPU_HAS_FALLEN_OFF_THE_BUS, RESTART_BM
        (cond("xid:48", "xid", "fatal", "reset_gpu"), True),  # DBE
        (cond("xid:95", "xid", "fatal", "reset_gpu"), True),
        (cond("ecc_uncorrectable", "ecc_uncorrectable", "fatal", "reset_gpu"), True),
        (cond("lost", "gpu_lost", "critical", "reboot"), True),
        (cond("removed", "gpu_removed", "critical", "operator_check"), True),
        (cond("recovery_action", "xid", "critical", "reset_gpu"), True),
        # An application can cause these: never, even made critical by an override.
        (cond("xid:13", "xid", "critical", "reset_gpu"), False),
        (cond("xid:109", "xid", "critical", "reset_gpu"), False),
        (cond("xid:32", "xid", "critical", "reset_gpu"), False),  # catalogue: check the app
        # Not the GPU's, or not fatal.
        (cond("nvml", "nvml_unavailable", "critical", "operator_check"), False),
        (cond("thermal", "thermal", "critical", "operator_check"), False),
        (cond("xid_repeated:74", "xid", "critical", "operator_check"), False),
        (cond("xid:8", "xid", "warning", "restart_app"), False),
    ],
)
def test_which_faults_remediate(condition: ActiveCondition, remediates: bool) -> None:
    assert bool(faults_of(gpu(1, condition), EVICT)) is remediates


def test_a_fault_names_its_catalogue_entry_and_the_worst_condition_wins() -> None:
    warn = cond("xid:8", "xid", "warning", "restart_app")
    crit = cond("xid:119", "xid", "critical", "reset_gpu")
    (fault,) = faults_of(gpu(2, warn, crit, XID79), EVICT)
    assert (fault.condition, fault.mnemonic, fault.bucket) == (
        "xid:79",
        "GPU_HAS_FALLEN_OFF_THE_BUS",
        "RESTART_BM",
    )
    assert fault.entry == "XID 79 GPU_HAS_FALLEN_OFF_THE_BUS [RESTART_BM]"
    strict = RemediationSettings(mode="evict", min_severity="fatal")
    assert [f.condition for f in faults_of(gpu(2, crit), strict)] == []


def test_a_mig_device_fault_is_scoped_to_that_device() -> None:
    mig = cond("xid:48", "xid", "fatal", "reset_gpu", mig_device="MIG-a")
    (fault,) = faults_of(gpu(3, mig), EVICT)
    assert devices_in_scope(fault, lambda _: ["MIG-a", "MIG-b"]) == {"MIG-a"}
    (whole,) = faults_of(gpu(3, XID79), EVICT)
    assert devices_in_scope(whole, lambda _: ["MIG-a", "MIG-b"]) == {"GPU-3", "MIG-a", "MIG-b"}


def grant(pod: str) -> GrantView:
    return GrantView(key=f"k-{pod}", resource="nvidia.com/gpu", kind="whole", units=1,
                     created_at=0.0, pod=pod, container="main")  # fmt: skip


def pod_resources(*pods: tuple[str, str, list[str]]) -> pr.ListPodResourcesResponse:
    response = pr.ListPodResourcesResponse()
    for ns, name, ids in pods:
        p = response.pod_resources.add(namespace=ns, name=name)
        c = p.containers.add(name="main")
        c.devices.add(resource_name="nvidia.com/gpu", device_ids=ids)
    return response


def records(pods: list[PodInfo] | None = None) -> Records:
    return Records(
        allocations=[
            AllocationView(id="a1", kind="whole", gpus=["GPU-1"], grants=[grant("ns/ledger")]),
            AllocationView(id="a2", kind="whole", gpus=["GPU-2"], grants=[grant("ns/other")]),
        ],
        claims=[
            ClaimRecord(
                uid="c1",
                namespace="ns",
                name="claim-1",
                created_at=0.0,
                devices=[ClaimDeviceRecord(device="gpu-1", uuid="GPU-1", minor=1)],
            ),
        ],
        pod_resources=pod_resources(
            ("ns", "plugin", [core_device_id("GPU-1", 3)]),
            ("ns", "elsewhere", ["GPU-2"]),
        ),
        pods=pods,
    )


def test_holders_come_from_the_ledger_podresources_and_dra_claims() -> None:
    pods = [
        PodInfo("ns", "ledger", "u1"),
        PodInfo("ns", "plugin", "u2", terminating=True),
        PodInfo("ns", "dra", "u3", claims=frozenset({"claim-1"})),
        PodInfo("ns", "other", "u4"),
        PodInfo("ns", "done", "u5", claims=frozenset({"claim-1"}), finished=True),
    ]
    found = holders_of(frozenset({"GPU-1"}), records(pods))
    assert [(h.key, h.uid, sorted(h.via), h.terminating) for h in found] == [
        ("ns/dra", "u3", ["dra_claim"], False),
        ("ns/ledger", "u1", ["ledger"], False),
        ("ns/plugin", "u2", ["podresources"], True),
    ]
    # Without the API's pod list: the ledger and PodResources still find theirs.
    assert [h.key for h in holders_of(frozenset({"GPU-1"}), records(None))] == [
        "ns/ledger",
        "ns/plugin",
    ]


def test_a_pod_recreated_under_its_name_is_not_evicted_for_the_old_ones_gpu() -> None:
    """StatefulSet web-0 was re-created on the node (a new UID) and holds GPU-2; the
    ledger still has the old web-0 on GPU-1 (not yet released). GPU-1 fails: the new
    web-0 is not a holder; were the old one still listed, its eviction would name
    the old UID as its precondition."""

    def ledger(uid: str) -> Records:
        old = msgspec.structs.replace(grant("ns/web-0"), pod_uid=uid)
        return Records(
            allocations=[AllocationView(id="a1", kind="whole", gpus=["GPU-1"], grants=[old])],
            pod_resources=pod_resources(("ns", "web-0", ["GPU-2"])),
            pods=[PodInfo("ns", "web-0", "new-uid")],
        )

    assert holders_of(frozenset({"GPU-1"}), ledger("old-uid")) == []
    # No UID recorded (no pod watch), but kubelet lists web-0 without GPU-1: stale.
    assert holders_of(frozenset({"GPU-1"}), ledger("")) == []
    # Without PodResources or the pod list: the recorded UID is the precondition.
    alone = dataclasses.replace(ledger("old-uid"), pod_resources=None, pods=None)
    [holder] = holders_of(frozenset({"GPU-1"}), alone)
    assert (holder.key, holder.uid) == ("ns/web-0", "old-uid")
    # The same pod still there: its UID, as recorded.
    same = dataclasses.replace(ledger("new-uid"), pod_resources=None)
    [holder] = holders_of(frozenset({"GPU-1"}), same)
    assert (holder.key, holder.uid) == ("ns/web-0", "new-uid")


def test_pod_info_decodes_totally() -> None:
    bad_objects: list[object] = [None, 1, "x", {}, {"metadata": []}, {"metadata": {"name": "p"}}]
    for bad in bad_objects:
        assert pod_info(bad) is None
    pod = pod_info({
        "metadata": {"namespace": "n", "name": "p", "uid": "u", "deletionTimestamp": "t"},
        "spec": {"resourceClaims": [{"name": "g", "resourceClaimName": "c"}, 5, {}]},
        "status": {"phase": "Running", "resourceClaimStatuses": [{"resourceClaimName": "d"}]},
    })  # fmt: skip
    assert pod == PodInfo("n", "p", "u", frozenset({"c", "d"}), terminating=True)


def test_eviction_answers() -> None:
    assert outcome_of(201, b"{}").result == "evicted"
    blocked = outcome_of(429, b'{"message": "would violate the disruption budget"}', "5")
    assert (blocked.result, blocked.detail, blocked.retry_after_s) == (
        "blocked_by_pdb",
        "would violate the disruption budget",
        5.0,
    )
    assert outcome_of(404, b"").result == "gone"
    assert outcome_of(500, b"not json").result == "failed"


# --- the breaker -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_breaker_holds_back_more_than_the_share_and_closes_when_the_window_passes() -> None:
    clock = Clock()
    breaker = Breaker(0.25, 600, clock)
    assert breaker.limit(8) == 2
    assert breaker.limit(1) == 1
    assert breaker.admit("a", 8).admitted
    assert breaker.admit("b", 8).admitted
    assert breaker.admit("a", 8).admitted  # already admitted: goes on
    tripped = breaker.admit("c", 8)
    assert (tripped.admitted, tripped.changed, breaker.open, breaker.trips) == (
        False,
        True,
        True,
        1,
    )
    again = breaker.admit("d", 8)
    assert (again.admitted, again.changed, breaker.trips) == (False, None, 1)
    clock.now += 599
    assert not breaker.admit("c", 8).admitted
    clock.now += 2  # a and b leave the window
    closed = breaker.admit("c", 8)
    assert (closed.admitted, closed.changed, breaker.open) == (True, None, True)  # d still held
    assert breaker.settle({"c"}) is False  # d's fault ended: closed
    assert not breaker.open


# --- the loop, against a fake API ------------------------------------------------------------


class FakeKube:
    def __init__(self, pods: list[PodInfo]) -> None:
        self.pods = pods
        self.evictions: list[str] = []
        self.events: list[tuple[EventTarget, str, str]] = []
        self.answers: dict[str, list[EvictOutcome]] = {}

    async def list_pods(self) -> list[PodInfo]:
        return self.pods

    async def evict(self, namespace: str, name: str, uid: str) -> EvictOutcome:
        self.evictions.append(f"{namespace}/{name}")
        queued = self.answers.get(name)
        return queued.pop(0) if queued else EvictOutcome("evicted", 201)

    async def post_event(
        self, target: EventTarget, reason: str, message: str, *, warning: bool = True
    ) -> bool:
        self.events.append((target, reason, message))
        return True


def remediator(
    settings: RemediationSettings,
    healths: Mapping[str, GpuHealth],
    kube: FakeKube,
    clock: Clock,
    allocations: list[AllocationView],
    node_gpus: int = 8,
) -> Remediator:
    async def no_podresources() -> pr.ListPodResourcesResponse:
        raise PodResourcesUnavailable("no kubelet here")

    sources = Sources(
        healths=lambda: healths,
        node_gpus=lambda: node_gpus,
        mig_devices=lambda _: [],
        ledger=lambda: (allocations, []),
        pod_resources=no_podresources,
    )
    return Remediator(settings, "node-a", sources, kube, clock=clock)


def whole(n: int, pod: str) -> AllocationView:
    return AllocationView(id=f"a{n}", kind="whole", gpus=[f"GPU-{n}"], grants=[grant(f"ns/{pod}")])


async def test_only_the_holders_of_the_failed_gpu_are_evicted_with_events() -> None:
    clock = Clock()
    kube = FakeKube([PodInfo("ns", "hit", "u1"), PodInfo("ns", "spared", "u2")])
    healths = {"GPU-1": gpu(1, XID79), "GPU-2": gpu(2)}
    r = remediator(EVICT, healths, kube, clock, [whole(1, "hit"), whole(2, "spared")])
    await r.step()
    assert kube.evictions == ["ns/hit"]
    assert [(t.kind, reason) for t, reason, _ in kube.events] == [
        ("Pod", "GpuletEvictedForGpuFault"),
        ("Node", "GpuletEvictedForGpuFault"),
    ]
    message = kube.events[0][2]
    assert "XID 79 GPU_HAS_FALLEN_OFF_THE_BUS [RESTART_BM]" in message
    assert "GPU-1" in message
    await r.step()  # evicted once, not again
    assert kube.evictions == ["ns/hit"]


async def test_a_pdb_refusal_is_retried_with_backoff_and_recorded_once() -> None:
    clock = Clock()
    kube = FakeKube([PodInfo("ns", "guarded", "u1")])
    kube.answers["guarded"] = [EvictOutcome("blocked_by_pdb", 429, "budget")] * 3
    r = remediator(EVICT, {"GPU-1": gpu(1, XID79)}, kube, clock, [whole(1, "guarded")])
    due = await r.step()
    assert due == clock.now + 1
    assert await r.step() == due
    assert len(kube.evictions) == 1
    delays = []
    for _ in range(3):
        assert due is not None
        clock.now = due
        before = clock.now
        due = await r.step()
        delays.append((due or 0) - before)
    assert delays[:2] == [2, 4]  # doubling; the fourth attempt is accepted
    assert len(kube.evictions) == 4
    reasons = [reason for _, reason, _ in kube.events]
    assert reasons.count("GpuletEvictionBlockedByPDB") == 1
    assert reasons.count("GpuletEvictedForGpuFault") == 2  # pod and node
    plan = await r.plan()
    assert plan.gpus[0].pods[0].state == "evicted"
    assert plan.gpus[0].pods[0].attempts == 4


async def test_report_mode_says_what_it_would_do_and_evicts_nothing() -> None:
    clock = Clock()
    kube = FakeKube([PodInfo("ns", "hit", "u1")])
    report = RemediationSettings(mode="report")
    r = remediator(report, {"GPU-1": gpu(1, XID79)}, kube, clock, [whole(1, "hit")])
    await r.step()
    await r.step()
    assert kube.evictions == []
    assert [reason for _, reason, _ in kube.events] == ["GpuletWouldEvictForGpuFault"] * 2


async def test_the_breaker_stops_a_storm_and_the_dry_run_shows_it() -> None:
    clock = Clock()
    pods = [PodInfo("ns", f"p{n}", f"u{n}") for n in range(8)]
    kube = FakeKube(pods)
    healths = {f"GPU-{n}": gpu(n, XID79) for n in range(6)} | {"GPU-7": gpu(7)}
    r = remediator(EVICT, healths, kube, clock, [whole(n, f"p{n}") for n in range(8)])
    await r.step()
    assert kube.evictions == ["ns/p0", "ns/p1", "ns/p2", "ns/p3"]  # half of 8 GPUs
    breaker_events = [m for _, reason, m in kube.events if reason == "GpuletRemediationBreakerOpen"]
    assert len(breaker_events) == 1
    assert "circuit breaker open" in breaker_events[0]
    plan = await r.plan()
    assert plan.breaker.open
    assert plan.breaker.trips == 1
    assert plan.breaker.limit == 4
    held = [g for g in plan.gpus if not g.admitted]
    assert [g.gpu_uuid for g in held] == ["GPU-4", "GPU-5"]
    assert held[0].pods[0].state == "held_by_breaker"
    text = format_plan(plan)
    assert "circuit breaker: OPEN" in text
    assert "held back by the circuit breaker" in text
    assert "problem: kubelet's PodResources: no kubelet here" in text
    await r.step()
    assert len(kube.evictions) == 4


async def test_off_does_nothing() -> None:
    kube = FakeKube([PodInfo("ns", "hit", "u1")])
    r = remediator(
        RemediationSettings(), {"GPU-1": gpu(1, XID79)}, kube, Clock(), [whole(1, "hit")]
    )
    await r.run()  # returns at once
    assert kube.evictions == []
    assert kube.events == []


async def test_a_pod_on_two_failed_gpus_is_evicted_once() -> None:
    clock = Clock()
    kube = FakeKube([PodInfo("ns", "wide", "u1")])
    both = AllocationView(id="a", kind="whole", gpus=["GPU-1", "GPU-2"], grants=[grant("ns/wide")])
    healths = {"GPU-1": gpu(1, XID79), "GPU-2": gpu(2, XID79)}
    r = remediator(EVICT, healths, kube, clock, [both])
    await r.step()
    assert kube.evictions == ["ns/wide"]
    plan = await r.plan()
    assert [p.state for g in plan.gpus for p in g.pods] == ["evicted", "evicted"]


async def test_a_failing_pass_does_not_end_the_loop() -> None:
    clock = Clock()
    kube = FakeKube([PodInfo("ns", "hit", "u1")])
    r = remediator(EVICT, {"GPU-1": gpu(1, XID79)}, kube, clock, [whole(1, "hit")])
    calls = 0

    async def broken() -> list[PodInfo]:
        nonlocal calls
        calls += 1
        raise RuntimeError("a bug")

    kube.list_pods = broken  # type: ignore[method-assign]
    with anyio.move_on_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(r.run)
            while calls < 2:
                r.poke()
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert calls >= 2
    assert kube.evictions == []
