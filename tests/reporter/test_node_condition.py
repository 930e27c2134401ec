"""The node condition ``GpuletGPUHealthy`` and the taint ``gpulet.io/gpu-unhealthy``.

End to end: a real nats-server, the real collector and health service on the mock
NVML (faults injected into the mock), the reporter, and the Kubernetes API emulator
(with the real ``nodes/status`` semantics) driven by the unmodified kubernetes-asyncio
client. Writes are counted at the emulator, from its request log.

The fail-closed test stands in for the health service (KV entries and a responder to
its state request it can stop), because it has to take the health service away while
the reporter keeps running.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from gpulet_common import codec, subjects
from gpulet_common.bootid import BOOT_ID_PATH_ENV, read_boot_id
from gpulet_common.bus import Bus, Delivery
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import (
    ActiveCondition,
    GpuHealth,
    GpuInfo,
    HealthState,
    HealthStateRequest,
)
from gpulet_reporter import node_health as nh
from support.health_harness import NODE, HealthNode, health_node
from support.health_kv import gpu_health, put_health
from support.kube_emulator import NODES, KubeEmulator
from support.reporter_harness import (
    RunningReporter,
    fast_settings,
    gpu_uuid,
    make_inventory,
    running_reporter,
)
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

STATUS_PATH = rf"^/api/v1/nodes/{NODE}/status$"
NODE_PATH = rf"^/api/v1/nodes/{NODE}$"
READY = {
    "type": "Ready",
    "status": "True",
    "reason": "KubeletReady",
    "message": "kubelet is posting ready status",
    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}
# node-problem-detector's own condition, beside ours.
KERNEL = {
    "type": "KernelDeadlock",
    "status": "False",
    "reason": "KernelHasNoDeadlock",
    "message": "kernel has no deadlock",
    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}
FOREIGN_TAINT = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
# Our key with another effect is not ours to manage.
OTHER_EFFECT = {"key": nh.TAINT_KEY, "effect": "PreferNoSchedule"}
OUR_TAINT = {"key": nh.TAINT_KEY, "effect": nh.TAINT_EFFECT}

# Every condition message ends with the node's boot ID (read as the reporter reads it).
BOOT = f"; boot ID {read_boot_id()}"


@pytest.fixture
async def emu(tmp_path: Path) -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator.running(token="t0ken") as emulator:
        node = emulator.add_node(NODE, labels={"team": "ml"})
        node["spec"] = {"taints": [FOREIGN_TAINT, OTHER_EFFECT]}
        node["status"] = {"conditions": [READY, KERNEL]}
        emulator.put_object(NODES, node)
        emulator.write_kubeconfig(tmp_path / "kubeconfig")
        yield emulator


def settings_for(tmp_path: Path, **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "kubeconfig": str(tmp_path / "kubeconfig"),
        "node_condition": True,
        "node_labels": False,  # label patches would mix with the taint's in the counts
        "health_probe_interval_s": 0.1,
        "health_stale_after_s": 10.0,
        "condition_heartbeat_s": 300.0,
    }
    values.update(overrides)
    return fast_settings(**values)


def node_of(emu: KubeEmulator) -> dict[str, Any]:
    obj = emu.get_object(NODES, NODE)
    assert obj is not None
    return obj


def condition(emu: KubeEmulator) -> dict[str, Any] | None:
    return nh.find_condition(node_of(emu))


def status_of(emu: KubeEmulator) -> str | None:
    cond = condition(emu)
    return None if cond is None else cond["status"]


def taints(emu: KubeEmulator) -> list[dict[str, Any]]:
    return list(node_of(emu)["spec"].get("taints") or [])


def tainted(emu: KubeEmulator) -> bool:
    return OUR_TAINT in taints(emu)


def writes(emu: KubeEmulator) -> tuple[int, int]:
    """(condition writes, Node writes), every PUT/PATCH the emulator answered."""
    status = [r for r in emu.stats.log if r.method in ("PATCH", "PUT")]
    return (
        sum(1 for r in status if r.path.endswith("/status")),
        sum(1 for r in status if r.path == f"/api/v1/nodes/{NODE}"),
    )


def foreign_intact(emu: KubeEmulator) -> None:
    node = node_of(emu)
    conditions = node["status"]["conditions"]
    # Ours first: a strategic merge puts a new condition before the stored ones, as the
    # real server does (tests/kube/test_differential.py).
    assert [c for c in conditions if c["type"] != nh.CONDITION_TYPE] == [READY, KERNEL]
    assert [c["type"] for c in conditions] == [nh.CONDITION_TYPE, "Ready", "KernelDeadlock"]
    assert taints(emu)[:2] == [FOREIGN_TAINT, OTHER_EFFECT]
    assert node["metadata"]["labels"]["team"] == "ml"


async def quiet_period(h: HealthNode, r: RunningReporter, *, rounds: int = 10) -> None:
    """Let the inputs keep flowing -- sample batches through the health service, probe
    answers re-evaluating the condition -- without anything changing."""

    def batches() -> float:
        return h.probe.value("gpulet.bus.messages_received", type="SampleBatch")

    keeper = r.service.node_health
    batch_target, answer_target = batches() + rounds, keeper.answers + rounds
    await wait_until(
        lambda: batches() >= batch_target and keeper.answers >= answer_target,
        timeout_s=30,
        what=f"{rounds} sample batches and health probes",
    )


async def settled(r: RunningReporter) -> None:
    """The condition's write loop holds the current intent, nothing pending."""

    def done() -> bool:
        loop = r.service.node_health_loop
        keeper = r.service.node_health
        return (
            loop is not None
            and keeper.intent is not None
            and loop.applied == keeper.intent
            and not keeper.debouncer.pending
        )

    await wait_until(done, timeout_s=15, what="the condition written")


async def test_condition_and_taint_follow_gpu_health_both_ways(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    """The judged flow: healthy -> a GPU overheats (mock NVML) -> False + taint ->
    it cools down -> True + taint removed; no write while nothing changes; foreign
    conditions and taints untouched throughout."""
    settings = settings_for(tmp_path, taint_policy="any-gpu-unhealthy")
    async with (
        health_node(nats_server.url, tmp_path, subscriber=False) as h,
        running_reporter(nats_server.url, tmp_path / "reporter", NODE, settings) as r,
    ):
        await wait_until(lambda: status_of(emu) == "True", timeout_s=15, what="condition True")
        await settled(r)
        cond = condition(emu)
        assert cond is not None
        assert (cond["reason"], cond["message"]) == ("AllGPUsHealthy", "all 5 GPUs healthy" + BOOT)
        assert cond["lastHeartbeatTime"] == cond["lastTransitionTime"]
        healthy_since = cond["lastTransitionTime"]
        assert not tainted(emu)
        foreign_intact(emu)
        assert writes(emu) == (1, 0)

        # Steady and healthy: no write at all.
        await quiet_period(h, r)
        assert writes(emu) == (1, 0)

        # A GPU overheats: False, listed by index, UUID and kind; tainted.
        await anyio.sleep(1.05)  # metav1.Time has second precision
        hot = h.uuid(1)
        h.inject("temperature", gpu=1, value=99)
        await wait_until(lambda: status_of(emu) == "False", timeout_s=15, what="condition False")
        await wait_until(lambda: tainted(emu), timeout_s=15, what="our taint")
        await settled(r)
        cond = condition(emu)
        assert cond is not None
        assert cond["reason"] == "GPUsUnhealthy"
        assert cond["message"] == f"1 of 5 GPUs unhealthy: GPU 1 {hot} (thermal){BOOT}"
        assert cond["lastTransitionTime"] != healthy_since
        failed_since = cond["lastTransitionTime"]
        assert taints(emu) == [FOREIGN_TAINT, OTHER_EFFECT, OUR_TAINT]
        foreign_intact(emu)
        assert writes(emu) == (2, 1)

        # Steady and unhealthy: no write either.
        await quiet_period(h, r)
        assert writes(emu) == (2, 1)

        # It cools down: True again, the taint gone, the foreign ones kept.
        await anyio.sleep(1.05)
        h.inject("temperature", gpu=1, value=85)
        await wait_until(lambda: status_of(emu) == "True", timeout_s=15, what="condition True")
        await wait_until(lambda: not tainted(emu), timeout_s=15, what="our taint removed")
        await settled(r)
        cond = condition(emu)
        assert cond is not None
        assert cond["reason"] == "AllGPUsHealthy"
        assert cond["lastTransitionTime"] not in (healthy_since, failed_since)
        assert taints(emu) == [FOREIGN_TAINT, OTHER_EFFECT]
        foreign_intact(emu)
        await quiet_period(h, r)
        assert writes(emu) == (3, 2)
        assert r.probe.value("gpulet.reporter.writes", object="node_status", verb="patch") == 3
        assert r.probe.value("gpulet.reporter.writes", object="node_taint", verb="patch") == 2


async def test_all_gpus_unhealthy_policy_taints_only_a_node_with_no_good_gpu(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    settings = settings_for(tmp_path, taint_policy="all-gpus-unhealthy")
    async with (
        health_node(nats_server.url, tmp_path, subscriber=False) as h,
        running_reporter(nats_server.url, tmp_path / "reporter", NODE, settings) as r,
    ):
        await wait_until(lambda: status_of(emu) == "True", timeout_s=15, what="condition True")
        # One GPU of five: the condition says so, the node stays schedulable.
        h.inject("temperature", gpu=0, value=99)
        await wait_until(lambda: status_of(emu) == "False", timeout_s=15, what="condition False")
        await settled(r)
        await quiet_period(h, r, rounds=5)
        assert not tainted(emu)
        assert writes(emu)[1] == 0
        # All five: tainted.
        for gpu in range(1, 5):
            h.inject("temperature", gpu=gpu, value=99)
        await wait_until(lambda: tainted(emu), timeout_s=15, what="our taint")
        cond = condition(emu)
        assert cond is not None
        assert cond["message"].startswith("5 of 5 GPUs unhealthy: GPU 0 ")
        assert writes(emu)[1] == 1
        # One comes back: not all unhealthy any more, the taint goes, the condition stays False.
        h.inject("temperature", gpu=3, value=85)
        await wait_until(lambda: not tainted(emu), timeout_s=15, what="our taint removed")
        await settled(r)
        cond = condition(emu)
        assert cond is not None
        assert (cond["status"], cond["message"].split(":")[0]) == ("False", "4 of 5 GPUs unhealthy")
        foreign_intact(emu)
        assert writes(emu)[1] == 2


async def _serve_state(bus: Bus, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    async def answer(_request: Delivery[HealthStateRequest]) -> HealthState:
        return HealthState(node=NODE)

    await bus.serve(
        subjects.health_state(NODE),
        answer,
        codec.HEALTH_STATE_REQUEST,
        codec.HEALTH_STATE,
        task_status=task_status,
    )


async def test_fails_closed_when_the_health_service_stops_answering(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    """No answer for ``health_stale_after_s``: Unknown (HealthServiceUnreachable), the
    taint left as it was; answers again: the real state back, with a new transition."""
    settings = settings_for(tmp_path, taint_policy="any-gpu-unhealthy", health_stale_after_s=1.0)
    bad = gpu_uuid(NODE, 1)
    async with running_reporter(nats_server.url, tmp_path, NODE, settings) as r:
        async with anyio.create_task_group() as responder:
            await responder.start(_serve_state, r.bus)
            await r.bus.publish(subjects.inventory(NODE), make_inventory(NODE, 2), codec.INVENTORY)
            await put_health(r.bus, NODE, gpu_health(bad, healthy=False))
            await wait_until(lambda: tainted(emu), timeout_s=15, what="our taint")
            cond = condition(emu)
            assert cond is not None
            assert cond["message"] == f"1 of 2 GPUs unhealthy: GPU 1 {bad} (xid){BOOT}"
            responder.cancel_scope.cancel()
        await wait_until(lambda: status_of(emu) == "Unknown", timeout_s=15, what="Unknown")
        cond = condition(emu)
        assert cond is not None
        assert cond["reason"] == "HealthServiceUnreachable"
        assert f"gpulet.health.state.{NODE}" in cond["message"]
        unknown_since = cond["lastTransitionTime"]
        assert tainted(emu)  # not removed on a state nobody vouches for
        foreign_intact(emu)
        # While it stays unreachable, nothing more is written.
        before = writes(emu)
        answers = r.service.node_health.answers
        await anyio.sleep(0.5)
        assert writes(emu) == before
        assert r.service.node_health.answers == answers

        # Meanwhile the GPU recovered; the health service comes back and says so.
        await anyio.sleep(0.6)
        await put_health(r.bus, NODE, gpu_health(bad, healthy=True))
        async with anyio.create_task_group() as responder:
            await responder.start(_serve_state, r.bus)
            await wait_until(lambda: status_of(emu) == "True", timeout_s=15, what="True")
            await wait_until(lambda: not tainted(emu), timeout_s=15, what="taint removed")
            cond = condition(emu)
            assert cond is not None
            assert cond["lastTransitionTime"] != unknown_since
            foreign_intact(emu)
            responder.cancel_scope.cancel()


async def test_a_restarted_reporter_writes_nothing_when_nothing_changed(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    """The condition and taint a reporter wrote are what its successor would write:
    it compares with the Node it reads and writes nothing (the transition time is the
    predecessor's, so there is nothing to correct either)."""
    settings = settings_for(tmp_path, taint_policy="any-gpu-unhealthy")
    bad = gpu_uuid(NODE, 1)

    async def one_run(run: int) -> None:
        async with (
            running_reporter(nats_server.url, tmp_path / f"run{run}", NODE, settings) as r,
            anyio.create_task_group() as responder,
        ):
            await responder.start(_serve_state, r.bus)
            await r.bus.publish(subjects.inventory(NODE), make_inventory(NODE, 2), codec.INVENTORY)
            if run == 0:
                await put_health(r.bus, NODE, gpu_health(bad, healthy=False))
                await wait_until(lambda: tainted(emu), timeout_s=15, what="our taint")
            await settled(r)
            keeper = r.service.node_health
            assert keeper.intent is not None
            assert keeper.intent.status == "False"
            answers = keeper.answers
            await wait_until(lambda: keeper.answers >= answers + 5, timeout_s=15, what="probes")
            responder.cancel_scope.cancel()

    await one_run(0)
    first = copy.deepcopy(condition(emu))
    assert writes(emu) == (1, 1)
    await one_run(1)
    assert writes(emu) == (1, 1)
    assert condition(emu) == first


async def test_heartbeat_refreshes_only_the_heartbeat_time(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    settings = settings_for(tmp_path, condition_heartbeat_s=1.0)
    async with (
        running_reporter(nats_server.url, tmp_path, NODE, settings) as r,
        anyio.create_task_group() as responder,
    ):
        await responder.start(_serve_state, r.bus)
        await r.bus.publish(subjects.inventory(NODE), make_inventory(NODE, 2), codec.INVENTORY)
        await wait_until(lambda: status_of(emu) == "True", timeout_s=15, what="True")
        first = copy.deepcopy(condition(emu))
        assert first is not None
        await wait_until(
            lambda: (condition(emu) or {}).get("lastHeartbeatTime") != first["lastHeartbeatTime"],
            timeout_s=15,
            what="a heartbeat",
        )
        later = condition(emu)
        assert later is not None
        assert later["lastTransitionTime"] == first["lastTransitionTime"]
        assert {k: v for k, v in later.items() if k != "lastHeartbeatTime"} == {
            k: v for k, v in first.items() if k != "lastHeartbeatTime"
        }
        assert writes(emu)[1] == 0  # a heartbeat touches nodes/status only
        responder.cancel_scope.cancel()


async def test_taint_write_rereads_on_conflict_and_keeps_a_concurrent_taint(
    nats_server: EmbeddedNats, emu: KubeEmulator, tmp_path: Path
) -> None:
    """Someone adds a taint between our read and our write: our PATCH (carrying the
    stale resourceVersion) gets 409, we re-read and write again; theirs survives."""
    settings = settings_for(tmp_path, taint_policy="any-gpu-unhealthy")
    bad = gpu_uuid(NODE, 0)
    late = {"key": "late.example.com/drain", "effect": "NoExecute"}
    async with (
        running_reporter(nats_server.url, tmp_path, NODE, settings) as r,
        anyio.create_task_group() as responder,
    ):
        await responder.start(_serve_state, r.bus)
        await r.bus.publish(subjects.inventory(NODE), make_inventory(NODE, 2), codec.INVENTORY)
        await wait_until(lambda: status_of(emu) == "True", timeout_s=15, what="True")
        await settled(r)
        # The concurrent writer, then a conflict for our next Node write, as the real
        # server answers a PATCH whose resourceVersion is no longer current.
        node = node_of(emu)
        node["spec"]["taints"] = [*taints(emu), late]
        emu.put_object(NODES, node)
        rule = emu.faults.fail_next(1, 409, method="PATCH", path=NODE_PATH)
        await put_health(r.bus, NODE, gpu_health(bad, healthy=False))
        await wait_until(lambda: tainted(emu), timeout_s=15, what="our taint")
        assert rule.exhausted
        assert taints(emu) == [FOREIGN_TAINT, OTHER_EFFECT, late, OUR_TAINT]
        assert r.probe.value("gpulet.reporter.conflicts", object="node") == 1
        responder.cancel_scope.cancel()


# --- the pure part -------------------------------------------------------------------


def _health(uuid: str, index: int, *, kinds: tuple[str, ...] = (), present: bool = True) -> Any:
    conditions = [
        ActiveCondition(condition=k, kind=k, severity="critical", reason=k)  # type: ignore[arg-type]
        for k in kinds
    ]
    return GpuHealth(
        gpu_uuid=uuid,
        healthy=not kinds and present,
        present=present,
        conditions=conditions,
        info=GpuInfo(uuid=uuid, index=index, name="x", memory_total_bytes=1, pci_bus_id="0:0"),
    )


@pytest.mark.parametrize(
    ("policy", "bad", "taint"),
    [
        ("none", 1, False),
        ("any-gpu-unhealthy", 0, False),
        ("any-gpu-unhealthy", 1, True),
        ("all-gpus-unhealthy", 1, False),
        ("all-gpus-unhealthy", 2, True),
    ],
)
def test_evaluate_policies(policy: Any, bad: int, taint: bool) -> None:
    inventory = make_inventory("n", 2)
    healths = {
        g.uuid: _health(g.uuid, g.index, kinds=("xid",) if g.index < bad else ())
        for g in inventory.gpus
    }
    intent = nh.evaluate(inventory, healths, policy=policy)
    assert intent.taint is taint
    assert intent.status == ("False" if bad else "True")


def test_evaluate_message_names_lost_gpus_and_is_bounded() -> None:
    inventory = make_inventory("n", 20)
    healths: dict[str, Any] = {
        g.uuid: _health(g.uuid, g.index, kinds=("xid", "ecc_uncorrectable"))
        for g in inventory.gpus[:18]
    }
    lost = "GPU-lost"
    healths[lost] = _health(lost, 20, present=False)
    intent = nh.evaluate(inventory, healths, policy="none")
    assert intent.message.startswith(
        f"19 of 21 GPUs unhealthy: GPU 0 {inventory.gpus[0].uuid} (ecc_uncorrectable, xid); "
    )
    assert intent.message.endswith("; and 3 more")
    assert intent.message.count("GPU-") == nh.MESSAGE_GPUS_MAX
    small = nh.evaluate(None, {lost: healths[lost]}, policy="none")
    assert small.message == f"1 of 1 GPUs unhealthy: GPU 20 {lost} (not present)"


def test_keeper_waits_at_start_then_says_why_it_does_not_know() -> None:
    now = [0.0]
    clock: Callable[[], float] = lambda: now[0]  # noqa: E731
    keeper = nh.NodeHealthKeeper("n", fast_settings(health_stale_after_s=10.0), clock=clock)
    assert keeper.update(None, {}, health_seen=False) is None  # starting: silence
    now[0] = 9.0
    keeper.answered()
    assert keeper.update(None, {}, health_seen=True) is None
    now[0] = 10.5
    intent = keeper.update(None, {}, health_seen=True)
    assert intent is not None
    assert (intent.status, intent.reason) == ("Unknown", "GPUStateUnknown")
    assert "no GPU inventory" in intent.message
    assert intent.taint is False  # policy none: a taint of ours is never wanted
    now[0] = 30.0
    intent = keeper.update(make_inventory("n", 1), {}, health_seen=True)
    assert intent is not None
    assert intent.reason == "HealthServiceUnreachable"
    keeper.answered()
    intent = keeper.update(make_inventory("n", 1), {}, health_seen=True)
    assert intent is not None
    assert intent.status == "True"
    assert keeper.debouncer.submitted == 3
    # The same input again: nothing offered.
    keeper.update(make_inventory("n", 1), {}, health_seen=True)
    assert keeper.debouncer.submitted == 3


def test_the_message_names_the_boot_it_was_seen_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "boot_id"
    path.write_text("3c3f3c3e-8a0b-4c64-9b7f-0d5e1f2a7b11\n")
    monkeypatch.setenv(BOOT_ID_PATH_ENV, str(path))
    keeper = nh.NodeHealthKeeper("n", fast_settings(), clock=lambda: 0.0)
    keeper.answered()
    intent = keeper.update(make_inventory("n", 2), {}, health_seen=True)
    assert intent is not None
    assert intent.message == "all 2 GPUs healthy; boot ID 3c3f3c3e-8a0b-4c64-9b7f-0d5e1f2a7b11"
    # Unreadable or nonsense: "unknown", never an error.
    path.write_bytes(b"\x00" * 10)
    assert read_boot_id() == "unknown"
    monkeypatch.setenv(BOOT_ID_PATH_ENV, str(tmp_path / "absent"))
    assert nh.NodeHealthKeeper("n", fast_settings()).boot_id == "unknown"


@pytest.mark.parametrize(
    "node",
    [
        {"status": ["not", "a", "mapping"], "spec": "nor this"},
        {"status": {"conditions": {"type": "GpuletGPUHealthy"}}, "spec": {"taints": "x"}},
        {"status": {"conditions": [1, None, "GpuletGPUHealthy"]}, "spec": {"taints": {"a": 1}}},
        {"status": None, "spec": None, "metadata": ["rv"]},
        {},
    ],
)
def test_a_malformed_node_reads_as_having_neither_condition_nor_taint(node: Any) -> None:
    # The Node is the API server's word: odd shapes read as absent, never raise.
    assert nh.find_condition(node) is None
    assert nh.node_taints(node) == []
    assert nh.taints_for(nh.node_taints(node), True) == [
        {"key": nh.TAINT_KEY, "effect": nh.TAINT_EFFECT}
    ]
    assert nh.taints_for(nh.node_taints(node), False) is None


def test_foreign_taint_entries_of_any_shape_are_kept() -> None:
    odd = [1, "x", {"key": nh.TAINT_KEY, "effect": "NoExecute"}, {"key": "other"}]
    node = {"spec": {"taints": [*odd, {"key": nh.TAINT_KEY, "effect": nh.TAINT_EFFECT}]}}
    assert nh.taints_for(nh.node_taints(node), False) == odd
    assert nh.taints_for(nh.node_taints(node), True) is None
