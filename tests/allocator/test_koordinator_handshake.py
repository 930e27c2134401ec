"""koord-scheduler's decisions followed end to end.

The real allocator and device plugin over a real nats-server, the fake kubelet on the
plugin's sockets, and the Kubernetes API emulator holding the pods: the allocator
lists and watches this node's pods through kubernetes-asyncio exactly as in a
cluster, and posts its Events there. Pods are written into the emulator the way the
scheduler's binding leaves them (``spec.nodeName``, ``PodScheduled``, the
``scheduling.koordinator.sh/device-allocated`` annotation).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from gpulet_common.messages import Inventory
from gpulet_common.settings import Settings
from support.agent import mock_inventory
from support.allocator_stack import GPU, NODE, allocator_stack, ids, rpc_error
from support.koord_handshake import (
    CORE,
    RATIO,
    bound,
    decision,
    events_for,
    gpus,
    handshake_settings,
    shares,
    synced,
    unbound,
)
from support.kube_emulator import KubeEmulator, cluster_with_node

pytestmark = pytest.mark.anyio


@pytest.fixture
async def emu(tmp_path: Path) -> AsyncIterator[KubeEmulator]:
    async with cluster_with_node(NODE, tmp_path / "kubeconfig") as emulator:
        yield emulator


def h100_inventory() -> Inventory:
    return mock_inventory("dgx-h100", NODE)


def by_minor(inventory: Inventory) -> dict[int, str]:
    return {g.minor if g.minor is not None else g.index: g.uuid for g in inventory.gpus}


async def test_whole_gpus_follow_the_annotated_minors(
    settings: Settings, tmp_path: Path, emu: KubeEmulator
) -> None:
    inventory = h100_inventory()
    minor = by_minor(inventory)
    config = handshake_settings(settings, tmp_path)
    async with allocator_stack(config, inventory=inventory) as stack:
        await synced(stack)
        await bound(stack, emu, "train", gpus(2), decision(5, 6))
        available = ids(stack, GPU)
        [preferred] = await stack.kubelet.preferred(GPU, [(available, [], 2)])
        assert sorted(preferred) == sorted([minor[5], minor[6]])
        response = await stack.kubelet.allocate(GPU, [preferred])
        [answer] = response.container_responses
        assert sorted(answer.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(preferred)
        assert [d.host_path for d in answer.devices][:2] == ["/dev/nvidia5", "/dev/nvidia6"]
        core = stack.allocator.core if stack.allocator else None
        assert core is not None
        assert core.handshake.followed == 2  # the hint and the allocation
        [allocation] = (await stack.state()).allocations
        assert sorted(allocation.gpus) == sorted(preferred)
        assert allocation.grants[0].pod == "ml/train"
        # With its UID: an eviction for it names that pod, not a later one of its name.
        pod = emu.get_object("pods", "ml/train")
        assert pod is not None
        pod_uid = pod["metadata"]["uid"]
        assert allocation.grants[0].pod_uid == pod_uid != ""

        # The pod is allocated now: the next pod without a decision is gpulet's to place
        # (as without Koordinator), never the annotated pod's GPUs again.
        await bound(stack, emu, "plain", gpus(2), None)
        free = [u for u in available if u not in preferred]
        [chosen] = await stack.kubelet.preferred(GPU, [(free, [], 2)])
        assert not set(chosen) & set(preferred)
        await stack.kubelet.allocate(GPU, [chosen])

        # Kubelet ignoring the hint: its IDs are checked against the decision.
        await bound(stack, emu, "mismatch", gpus(1), decision(0))
        other = next(
            u for u in available if u not in preferred and u not in chosen and u != minor[0]
        )
        error = await rpc_error(stack.kubelet.allocate(GPU, [[other]]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = error.details() or ""
        assert "scheduler_decision" in details
        assert "ml/mismatch" in details
        assert f"minor 0 ({minor[0]})" in details
        await stack.wait_for(lambda: bool(events_for(emu, "mismatch")), "the Event")
        [event] = events_for(emu, "mismatch")
        assert event["type"] == "Warning"
        assert event["involvedObject"]["namespace"] == "ml"
        assert f"minor 0 ({minor[0]})" in event["message"]


async def test_a_share_is_pinned_to_the_annotated_card_with_its_mps_limits(
    settings: Settings, tmp_path: Path, emu: KubeEmulator
) -> None:
    inventory = h100_inventory()
    minor = by_minor(inventory)
    card = next(g for g in inventory.gpus if g.uuid == minor[3])
    config = handshake_settings(settings, tmp_path, profile="koordinator")
    async with allocator_stack(config, inventory=inventory) as stack:
        await synced(stack)
        await bound(stack, emu, "infer", shares(30, 25), decision(3, core=30, ratio=25))
        # Kubelet picks any 30 core IDs (of card 0, say); the card comes from the decision.
        core_ids = ids(stack, CORE)[:30]
        ratio_ids = ids(stack, RATIO)[:25]
        first = (await stack.kubelet.allocate(CORE, [core_ids])).container_responses[0]
        second = (await stack.kubelet.allocate(RATIO, [ratio_ids])).container_responses[0]
        limit_mib = card.memory_total_bytes * 25 // 100 // 2**20
        for answer in (first, second):
            assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == minor[3]
            assert answer.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
            assert answer.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={limit_mib}M"
            assert answer.devices[0].host_path == "/dev/nvidia3"
        assert first.envs["GPULET_ALLOCATION_ID"] == second.envs["GPULET_ALLOCATION_ID"]
        state = await stack.state()
        [allocation] = state.allocations
        assert allocation.kind == "share"
        assert allocation.gpus == [minor[3]]
        assert allocation.cores == 30
        gpu3 = next(g for g in state.gpus if g.uuid == minor[3])
        assert gpu3.cores_used == 30

        # Without a decision, a Koordinator share is not gpulet's to guess.
        error = await rpc_error(stack.kubelet.allocate(CORE, [ids(stack, CORE)[40:50]]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no pending pod" in (error.details() or "")


async def test_a_decision_for_an_unhealthy_gpu_is_refused_with_an_event(
    settings: Settings, tmp_path: Path, emu: KubeEmulator
) -> None:
    inventory = h100_inventory()
    minor = by_minor(inventory)
    config = handshake_settings(settings, tmp_path)
    async with allocator_stack(config, inventory=inventory) as stack:
        await synced(stack)
        await stack.publish_health(minor[2], healthy=False)
        core = stack.allocator.core if stack.allocator else None
        assert core is not None
        await stack.wait_for(lambda: not core.ledger.device(minor[2]).healthy, "GPU 2 unhealthy")
        await bound(stack, emu, "doomed", gpus(1), decision(2))
        available = ids(stack, GPU)
        error = await rpc_error(stack.kubelet.preferred(GPU, [(available, [], 1)]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"GPU minor 2 ({minor[2]}) is unhealthy" in (error.details() or "")
        error = await rpc_error(stack.kubelet.allocate(GPU, [[minor[2]]]))
        assert f"GPU minor 2 ({minor[2]}) is unhealthy" in (error.details() or "")
        # Never another card instead: nothing was allocated.
        assert (await stack.state()).allocations == []
        await stack.wait_for(lambda: bool(events_for(emu, "doomed")), "the Event")
        [event] = events_for(emu, "doomed")  # the same message twice: one Event
        assert "unhealthy" in event["message"]
        assert "ml/doomed" in event["message"]


async def test_two_annotated_pods_admitted_back_to_back_are_told_apart(
    settings: Settings, tmp_path: Path, emu: KubeEmulator
) -> None:
    inventory = h100_inventory()
    minor = by_minor(inventory)
    config = handshake_settings(settings, tmp_path)
    async with allocator_stack(config, inventory=inventory) as stack:
        await synced(stack)
        await bound(stack, emu, "older", gpus(1), decision(0), at="2026-01-01T00:00:00Z")
        await bound(stack, emu, "newer", gpus(1), decision(7), at="2026-01-01T00:00:05Z")
        available = ids(stack, GPU)
        # Kubelet admits the older binding first: hint and allocation of minor 0.
        [first] = await stack.kubelet.preferred(GPU, [(available, [], 1)])
        assert first == [minor[0]]
        await stack.kubelet.allocate(GPU, [first])
        # Then the newer pod, back to back.
        rest = [u for u in available if u != minor[0]]
        [second] = await stack.kubelet.preferred(GPU, [(rest, [], 1)])
        assert second == [minor[7]]
        await stack.kubelet.allocate(GPU, [second])
        pods = {a.grants[0].pod: a.gpus for a in (await stack.state()).allocations}
        assert pods == {"ml/older": [minor[0]], "ml/newer": [minor[7]]}

        # Out of order and without hints: kubelet's IDs name the pod whose decision they
        # are, even though the other one was bound earlier.
        await bound(stack, emu, "a", gpus(1), decision(1), at="2026-01-01T00:01:00Z")
        await bound(stack, emu, "b", gpus(1), decision(4), at="2026-01-01T00:01:05Z")
        await stack.kubelet.allocate(GPU, [[minor[4]]])
        await stack.kubelet.allocate(GPU, [[minor[1]]])
        pods = {a.grants[0].pod: a.gpus for a in (await stack.state()).allocations}
        assert pods["ml/a"] == [minor[1]]
        assert pods["ml/b"] == [minor[4]]


@pytest.mark.parametrize(
    ("annotation", "says"),
    [
        ("{not json", "not JSON"),
        (json.dumps({"gpu": [{"minor": 0}] * 10, "pad": "x" * 70_000}), "more than the 65536"),
        (json.dumps({"gpu": [{"minor": 99}]}), "GPU minor 99 is not on this node"),
        (json.dumps({"gpu": [{"minor": -1}]}), "gpu[0].minor -1 is out of range"),
        (json.dumps({"gpu": [{"minor": 2**40}]}), "out of range"),
        (json.dumps({"gpu": [{"minor": "1"}]}), "not an integer"),
        (json.dumps({"gpu": "minor 1"}), '"gpu" is not a list'),
        (json.dumps({"gpu": [{"minor": 1}, {"minor": 1}]}), "minor 1 decided twice"),
        (json.dumps({"gpu": [{"minor": 1, "resources": {CORE: "lots"}}]}), "not 1-100"),
        (json.dumps({"gpu": [{"minor": i} for i in range(200)]}), "200 GPU entries"),
        (json.dumps([1, 2]), "not a JSON object"),
        # Present but deciding nothing: refused, never a card gpulet picks (issue 23).
        (json.dumps({"gpu": []}), "decides no GPU"),
        (json.dumps({"gpu": None}), "decides no GPU"),
    ],
)
async def test_hostile_annotations_are_refused_clearly_and_crash_nothing(
    settings: Settings, tmp_path: Path, emu: KubeEmulator, annotation: str, says: str
) -> None:
    inventory = h100_inventory()
    config = handshake_settings(settings, tmp_path)
    async with allocator_stack(config, inventory=inventory) as stack:
        await synced(stack)
        await bound(stack, emu, "hostile", gpus(1), annotation)
        available = ids(stack, GPU)
        error = await rpc_error(stack.kubelet.preferred(GPU, [(available, [], 1)]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = error.details() or ""
        assert says in details
        assert "ml/hostile" in details
        assert len(details) < 2000
        error = await rpc_error(stack.kubelet.allocate(GPU, [[available[0]]]))
        assert says in (error.details() or "")
        await stack.wait_for(lambda: bool(events_for(emu, "hostile")), "the Event")
        # Everything still runs: the pod gone, the node's GPUs serve the next pod.
        await unbound(stack, emu, "hostile")
        await stack.kubelet.allocate(GPU, [[available[0]]])
        assert len((await stack.state()).allocations) == 1


async def test_after_an_allocator_restart_an_allocated_pod_is_not_matched_again(
    settings: Settings, tmp_path: Path, emu: KubeEmulator
) -> None:
    """The book's marks live in memory, the grants in the checkpoint: a pod still
    Pending (pulling its image) after the allocator restarts keeps its GPUs and is not
    taken for the next pod's call."""
    inventory = h100_inventory()
    minor = by_minor(inventory)
    config = handshake_settings(settings, tmp_path)
    async with allocator_stack(config, inventory=inventory) as stack:
        await synced(stack)
        await bound(stack, emu, "first", gpus(1), decision(5), at="2026-01-01T00:00:00Z")
        [hint] = await stack.kubelet.preferred(GPU, [(ids(stack, GPU), [], 1)])
        assert hint == [minor[5]]
        await stack.kubelet.allocate(GPU, [hint])
        await stack.stop_allocator()
        await stack.start_allocator()
        await synced(stack)
        await bound(stack, emu, "second", gpus(1), decision(2), at="2026-01-01T00:00:09Z")
        free = [u for u in ids(stack, GPU) if u != minor[5]]
        [hint] = await stack.kubelet.preferred(GPU, [(free, [], 1)])
        assert hint == [minor[2]]
        await stack.kubelet.allocate(GPU, [hint])
        pods = {a.grants[0].pod: a.gpus for a in (await stack.state()).allocations}
        assert pods == {"ml/first": [minor[5]], "ml/second": [minor[2]]}
