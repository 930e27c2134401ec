"""koord-scheduler's decisions on a MIG node never get a MIG-enabled GPU (issue 27).

The real allocator and device plugin over a real nats-server, the fake kubelet, and the
Kubernetes API emulator holding the pods as koord-scheduler's binding leaves them, on
the mock's ``a100-mig-mixed`` node: GPUs 0 and 1 MIG-enabled with MIG devices, GPU 2
MIG-enabled without instances, GPU 3 MIG disabled. Koordinator has no MIG model, so
its scheduler may still decide for a parent (from a Device CR written before the
layout changed, or by a bug): each such decision, whole or a share, is refused by
GetPreferredAllocation and Allocate with ``scheduler_decision`` and why (MIG enabled),
an Event on the pod, and nothing allocated; a decision for GPU 3 on the same node is
followed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import msgspec
import pytest

from gpulet_common.messages import Inventory
from gpulet_common.settings import Settings
from support.agent import mock_inventory
from support.allocator_stack import GPU, NODE, Stack, allocator_stack, ids, rpc_error
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
)
from support.kube_emulator import KubeEmulator, cluster_with_node

pytestmark = pytest.mark.anyio

MIG_1G = "nvidia.com/mig-1g.5gb"


@pytest.fixture
async def emu(tmp_path: Path) -> AsyncIterator[KubeEmulator]:
    async with cluster_with_node(NODE, tmp_path / "kubeconfig") as emulator:
        yield emulator


def a100() -> Inventory:
    return mock_inventory("a100-mig-mixed", NODE)


async def on_mig_node(stack: Stack, inventory: Inventory, resource: str, count: int) -> None:
    """Publish the MIG inventory and wait until kubelet lists ``count`` devices of
    ``resource`` (only GPU 3 is offered whole or shared). Under ``mixed`` the MIG
    resources appear with the inventory, and the plugin serves every resource anew:
    wait for the second registration of ``resource`` first."""
    await stack.publish_inventory(inventory)
    await stack.wait_allocator_ready()
    if stack.settings.allocator.mig_strategy == "mixed":
        await stack.kubelet.wait_registered(MIG_1G, timeout_s=10)
        await stack.kubelet.wait_registered(resource, count=2, timeout_s=10)
    await stack.kubelet.wait_devices(resource, lambda d: len(d) == count, timeout_s=5)
    await synced(stack)


async def refused_with_event(
    stack: Stack, emu: KubeEmulator, pod: str, call: object, parent: str
) -> None:
    error = await rpc_error(call)  # type: ignore[arg-type]
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = error.details() or ""
    assert "scheduler_decision" in details
    assert "MIG enabled" in details
    assert parent in details
    await stack.wait_for(lambda: bool(events_for(emu, pod)), f"the Event on {pod}")
    assert "MIG enabled" in events_for(emu, pod)[0]["message"]


def mixed(settings: Settings) -> Settings:
    allocator = msgspec.structs.replace(settings.allocator, mig_strategy="mixed")
    return msgspec.structs.replace(settings, allocator=allocator)


async def test_a_whole_gpu_decision_for_a_mig_enabled_gpu_is_refused(
    settings: Settings, tmp_path: Path, emu: KubeEmulator
) -> None:
    inventory = a100()
    parent, plain = inventory.gpus[0], inventory.gpus[3]
    config = mixed(handshake_settings(settings, tmp_path))
    async with allocator_stack(config, inventory=None) as stack:
        await on_mig_node(stack, inventory, GPU, 1)
        assert ids(stack, GPU) == [plain.uuid]
        await bound(stack, emu, "on-parent", gpus(1), decision(parent.minor or 0))
        await refused_with_event(
            stack,
            emu,
            "on-parent",
            stack.kubelet.preferred(GPU, [([plain.uuid], [], 1)]),
            parent.uuid,
        )
        error = await rpc_error(stack.kubelet.allocate(GPU, [[plain.uuid]]))
        assert "scheduler_decision" in (error.details() or "")
        assert (await stack.state()).allocations == []
        # A decision for the MIG-disabled GPU on the same node is followed.
        await bound(stack, emu, "on-plain", gpus(1), decision(plain.minor or 3))
        [answer] = (await stack.kubelet.allocate(GPU, [[plain.uuid]])).container_responses
        assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == plain.uuid
        [allocation] = (await stack.state()).allocations
        assert allocation.gpus == [plain.uuid]


async def test_a_share_decision_for_a_mig_enabled_gpu_is_refused(
    settings: Settings, tmp_path: Path, emu: KubeEmulator
) -> None:
    inventory = a100()
    parent = inventory.gpus[1]
    config = handshake_settings(settings, tmp_path, profile="koordinator")
    async with allocator_stack(config, inventory=None) as stack:
        await on_mig_node(stack, inventory, CORE, 100)
        # Kubelet only knows GPU 3's core and ratio IDs: the decision names the parent.
        await bound(
            stack, emu, "share", shares(30, 25), decision(parent.minor or 1, core=30, ratio=25)
        )
        await refused_with_event(
            stack, emu, "share", stack.kubelet.allocate(CORE, [ids(stack, CORE)[:30]]), parent.uuid
        )
        error = await rpc_error(stack.kubelet.allocate(RATIO, [ids(stack, RATIO)[:25]]))
        assert "scheduler_decision" in (error.details() or "")
        state = await stack.state()
        assert state.allocations == []
        assert all(g.cores_used == 0 for g in state.gpus)
