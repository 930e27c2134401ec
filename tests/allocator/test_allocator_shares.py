"""Fractional shares through the real path: packing, limits, joining, oversubscription."""

from __future__ import annotations

import grpc
import grpc.aio
import msgspec
import pytest

from gpulet_common.messages import Inventory
from gpulet_common.settings import Settings
from gpulet_common.settings.allocator import CdiSettings, MpsSettings
from support import reference
from support.allocator_stack import (
    CORE,
    GPU,
    MEM,
    Stack,
    allocator_stack,
)

pytestmark = pytest.mark.anyio

GIB = 1024**3


def small_node(cards: int, memory_gib: int = 16) -> Inventory:
    """``cards`` GPUs on one PCIe switch; 16 GiB = 64 memory units each."""
    levels = [[10 if a != b else 0 for b in range(cards)] for a in range(cards)]
    return reference.inventory_from_matrix(
        "small", levels, memory_bytes=memory_gib * GIB, name="Tesla T4"
    )


class Kubelet:
    """Hands out device IDs the way kubelet does: each ID to one container at a time."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.used: set[str] = set()

    def take(self, resource: str, n: int) -> list[str]:
        free = [d.ID for d in self.stack.kubelet.devices(resource) if d.ID not in self.used]
        chosen = free[:n]
        self.used.update(chosen)
        return chosen

    async def allocate(self, resource: str, n: int) -> dict[str, str]:
        response = await self.stack.kubelet.allocate(resource, [self.take(resource, n)])
        return dict(response.container_responses[0].envs)

    async def refused(self, resource: str, n: int) -> grpc.aio.AioRpcError:
        chosen = self.take(resource, n)
        assert len(chosen) == n, "kubelet itself would not have the devices"
        try:
            await self.stack.kubelet.allocate(resource, [chosen])
        except grpc.aio.AioRpcError as exc:
            # Kubelet forgets the IDs of a failed allocation.
            self.used.difference_update(chosen)
            return exc
        raise AssertionError("the allocation succeeded")


async def check_invariants(stack: Stack) -> None:
    for gpu in (await stack.state()).gpus:
        assert gpu.cores_used <= 100, gpu
        assert gpu.memory_used <= gpu.memory_units, gpu


async def test_shares_are_packed_best_fit_with_mps_limits(settings: Settings) -> None:
    async with allocator_stack(settings, inventory=reference.nvlink_pairs_8()) as stack:
        k = Kubelet(stack)
        # Container A: 30 core units and 40 memory units (10 GiB), core first.
        a_core = await k.allocate(CORE, 30)
        a_mem = await k.allocate(MEM, 40)
        card = a_core["NVIDIA_VISIBLE_DEVICES"]
        assert a_mem["NVIDIA_VISIBLE_DEVICES"] == card
        assert a_core["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in a_core
        assert a_mem["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in a_mem
        assert a_core["GPULET_ALLOCATION_ID"] == a_mem["GPULET_ALLOCATION_ID"]

        # Container B, memory first: packed onto the same card (fewest free cores).
        b_mem = await k.allocate(MEM, 40)
        b_core = await k.allocate(CORE, 50)
        assert b_mem["NVIDIA_VISIBLE_DEVICES"] == b_core["NVIDIA_VISIBLE_DEVICES"] == card
        assert b_core["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"

        # Container C does not fit in the 20 core units left: another card.
        c_core = await k.allocate(CORE, 30)
        c_mem = await k.allocate(MEM, 8)
        assert c_core["NVIDIA_VISIBLE_DEVICES"] == c_mem["NVIDIA_VISIBLE_DEVICES"] != card

        # D fits in what is left on the first card.
        d_core = await k.allocate(CORE, 20)
        await k.allocate(MEM, 8)
        assert d_core["NVIDIA_VISIBLE_DEVICES"] == card

        state = await stack.state()
        first = next(g for g in state.gpus if g.uuid == card)
        assert (first.cores_used, first.memory_used) == (100, 88)
        assert len(first.shares) == 3
        assert len([a for a in state.allocations if a.kind == "share"]) == 4
        await check_invariants(stack)


async def test_oversubscription_is_refused(settings: Settings) -> None:
    inventory = small_node(2)
    first, second = (g.uuid for g in inventory.gpus)
    async with allocator_stack(settings, inventory=inventory) as stack:
        k = Kubelet(stack)
        for card in (first, second):
            assert (await k.allocate(CORE, 60))["NVIDIA_VISIBLE_DEVICES"] == card
            await k.allocate(MEM, 40)

        # Kubelet still counts 80 free core units, but no card has 60.
        error = await k.refused(CORE, 60)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (error.details() or "").startswith("insufficient_capacity:")
        assert "60 core units" in (error.details() or "")

        # 40 core units fit on the first card; 30 memory units (24 left) do not:
        # refused, naming the card the core half is on.
        assert (await k.allocate(CORE, 40))["NVIDIA_VISIBLE_DEVICES"] == first
        error = await k.refused(MEM, 30)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert first in (error.details() or "")
        assert "already placed its share" in (error.details() or "")

        # 40 + 20 fit on the second card exactly.
        assert (await k.allocate(CORE, 40))["NVIDIA_VISIBLE_DEVICES"] == second
        assert (await k.allocate(MEM, 20))["NVIDIA_VISIBLE_DEVICES"] == second

        await check_invariants(stack)
        assert [g.cores_used for g in (await stack.state()).gpus] == [100, 100]


async def test_a_card_holding_shares_is_not_offered_whole(settings: Settings) -> None:
    inventory = small_node(2)
    shared, other = (g.uuid for g in inventory.gpus)
    async with allocator_stack(settings, inventory=inventory) as stack:
        k = Kubelet(stack)
        envs = await k.allocate(CORE, 10)
        assert envs["NVIDIA_VISIBLE_DEVICES"] == shared  # the lower index, both untouched
        [preferred] = await stack.kubelet.preferred(GPU, [([shared, other], [], 1)])
        assert preferred == [other]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stack.kubelet.allocate(GPU, [[shared]])
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "not offered whole" in (refused.value.details() or "")
        # And a whole card takes no shares: the next share goes next to the first.
        await stack.kubelet.allocate(GPU, [[other]])
        again = await k.allocate(CORE, 10)
        assert again["NVIDIA_VISIBLE_DEVICES"] == shared


async def test_core_units_in_hundreds_are_whole_cards(settings: Settings) -> None:
    async with allocator_stack(settings, inventory=small_node(4)) as stack:
        k = Kubelet(stack)
        cores = await k.allocate(CORE, 200)
        cards = cores["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert len(cards) == 2
        assert not any(key.startswith("CUDA_MPS") for key in cores)
        [allocation] = (await stack.state()).allocations
        assert allocation.kind == "whole"
        assert sorted(allocation.gpus) == sorted(cards)

        # Memory next to whole cards is refused, whichever comes first (kubelet's order
        # is random, and a memory answer given first could not name the cards).
        error = await k.refused(MEM, 10)
        assert (error.details() or "").startswith("invalid_request:")
        assert "whole cards" in (error.details() or "")
        await k.allocate(MEM, 10)  # the window moved on: a memory-only share...
        error = await k.refused(CORE, 100)  # ...directly followed by whole cards
        assert "200" not in (error.details() or "")
        assert "whole cards" in (error.details() or "")

        error = await k.refused(CORE, 150)
        assert (error.details() or "").startswith("invalid_core_units:")


async def test_mps_pipe_and_cdi_names(settings: Settings) -> None:
    settings = msgspec.structs.replace(
        settings,
        allocator=msgspec.structs.replace(
            settings.allocator,
            mps=MpsSettings(pipe_directory="/run/nvidia/mps"),
            cdi=CdiSettings(enabled=True),
        ),
    )
    inventory = small_node(2)
    async with allocator_stack(settings, inventory=inventory) as stack:
        k = Kubelet(stack)
        response = await stack.kubelet.allocate(CORE, [k.take(CORE, 25)])
        [container] = response.container_responses
        card = container.envs["NVIDIA_VISIBLE_DEVICES"]
        assert container.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/run/nvidia/mps"
        assert [(m.container_path, m.host_path) for m in container.mounts] == [
            ("/run/nvidia/mps", "/run/nvidia/mps")
        ]
        assert [c.name for c in container.cdi_devices] == [f"nvidia.com/gpu={card}"]
        whole = await stack.kubelet.allocate(GPU, [[inventory.gpus[1].uuid]])
        assert [c.name for c in whole.container_responses[0].cdi_devices] == [
            f"nvidia.com/gpu={inventory.gpus[1].uuid}"
        ]
