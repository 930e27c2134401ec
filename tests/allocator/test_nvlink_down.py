"""An NVLink going down, through the running services (issue 15).

The real collector reads a mock node of four GPUs; the real allocator and device
plugin answer the fake kubelet's GetPreferredAllocation over gRPC; faults go in
through the mock control endpoint over NATS, as ``gpulet mock inject`` sends them.
GPUs 0 and 1 are the best NVLink pair (four links), 2 and 3 the next (two links), and
0-2 and 1-3 have one link each. When three of the four links between 0 and 1 go down,
the published inventory says so (one link up, three down) and a 2-GPU request gets
GPUs 2 and 3; when the links come back, it gets 0 and 1 again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import msgspec
import pytest

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.messages import Inventory, MockInjectReply, MockInjectRequest
from gpulet_common.mock_nvml import MockNvml, scenario_from_toml
from gpulet_common.nvml.adapter import NvmlAdapter
from gpulet_common.settings import Settings
from gpulet_common.settings.collector import CollectorSettings
from support.allocator_stack import GPU, Stack, allocator_stack, eventually, ids

pytestmark = pytest.mark.anyio

FOUR_GPUS = """
base = "nvlink-pairs-8gpu"
description = "4 V100s: 0-1 four NVLinks, 2-3 two, 0-2 and 1-3 one; one PCIe switch"
jitter = false

[[gpus]]
bus_id = "00000000:06:00.0"
[[gpus]]
bus_id = "00000000:07:00.0"
[[gpus]]
bus_id = "00000000:0A:00.0"
[[gpus]]
bus_id = "00000000:0B:00.0"

[topology]
default_level = "SINGLE"
groups = []
nvlinks_default = 0
nvlinks = [
  { gpus = [0, 1], links = 4 },
  { gpus = [2, 3], links = 2 },
  { gpus = [0, 2], links = 1 },
  { gpus = [1, 3], links = 1 },
]
"""


def pair(inventory: Inventory, a: int, b: int) -> tuple[int, int]:
    """(NVLinks up, NVLinks down) between the GPUs of NVML index a and b, as a says."""
    gpu = next(g for g in inventory.gpus if g.index == a)
    link = next(p for p in gpu.topology if p.peer_index == b)
    return link.nvlinks, link.nvlinks_down


class Inventories:
    """The inventories the collector publishes, newest last."""

    def __init__(self) -> None:
        self.seen: list[Inventory] = []

    @property
    def last(self) -> Inventory:
        return self.seen[-1]

    async def follow(self, bus: Bus, node: str, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with bus.subscribe(subjects.inventory(node), codec.INVENTORY) as stream:
            await bus.flush()
            task_status.started()
            async for delivery in stream:
                self.seen.append(delivery.value)


async def inject(stack: Stack, request: MockInjectRequest) -> MockInjectReply:
    reply = await stack.bus.request(
        subjects.mock_inject(stack.node),
        request,
        codec.MOCK_INJECT_REQUEST,
        codec.MOCK_INJECT_REPLY,
        timeout_s=2.0,
    )
    assert reply.applied, reply.detail
    return reply


async def preferred_pair(stack: Stack, index: dict[str, int]) -> list[int]:
    [chosen] = await stack.kubelet.preferred(GPU, [(ids(stack, GPU), [], 2)])
    return sorted(index[u] for u in chosen)


@pytest.fixture
async def node(settings: Settings) -> AsyncIterator[tuple[Stack, Inventories, dict[str, int]]]:
    settings = msgspec.structs.replace(
        settings,
        collector=CollectorSettings(
            sample_period_s=0.05,
            slow_period_s=0.1,
            # A link coming back moves no error counter: seen within this period.
            nvlink_state_period_s=0.3,
            dcgm_metrics=False,
        ),
    )
    mock = MockNvml(scenario_from_toml(FOUR_GPUS), jitter=False)
    adapter = NvmlAdapter(mock, backend="mock")
    adapter.init()
    inventories = Inventories()
    async with (
        allocator_stack(
            settings,
            inventory=None,
            start_allocator=False,
            start_plugin=False,
            stand_in_collector=False,
        ) as stack,
        anyio.create_task_group() as tg,
    ):
        await tg.start(inventories.follow, stack.bus, stack.node)
        await stack.start_collector(adapter)
        await stack.start_allocator()
        await stack.wait_allocator_ready()
        await stack.start_plugin()
        await stack.kubelet.wait_registered(GPU, timeout_s=5)
        await stack.kubelet.wait_devices(GPU, lambda d: len(d) == 4, timeout_s=5)
        index = {g.uuid: g.index for g in inventories.last.gpus}
        yield stack, inventories, index
        tg.cancel_scope.cancel()
    adapter.shutdown()


async def test_nvlink_down_changes_the_topology_and_the_preferred_pair(
    node: tuple[Stack, Inventories, dict[str, int]],
) -> None:
    stack, inventories, index = node
    first = inventories.last
    assert pair(first, 0, 1) == pair(first, 1, 0) == (4, 0)
    assert pair(first, 2, 3) == (2, 0)
    assert await preferred_pair(stack, index) == [0, 1]

    # Three of the four links between GPU 0 and GPU 1 go down (GPU 0's links 0-2).
    for link in (0, 1, 2):
        await inject(stack, MockInjectRequest(fault="nvlink_down", gpu=0, value=link))
    await eventually(
        lambda: _true(pair(inventories.last, 0, 1) == (1, 3)),
        "the inventory to show three links between GPU 0 and GPU 1 down",
    )
    down = inventories.last
    assert pair(down, 1, 0) == (1, 3)
    assert down.gpus[0].nvlinks_down == [0, 1, 2]
    assert pair(down, 2, 3) == (2, 0)  # the other pairs are untouched
    assert pair(down, 0, 2) == (1, 0)
    assert down.generation > first.generation
    uuids = {i: u for u, i in index.items()}
    await eventually(
        lambda: _true(links_counted(stack, uuids[0], uuids[1]) == 1),
        "the allocator to count one link between GPU 0 and GPU 1",
    )
    assert await preferred_pair(stack, index) == [2, 3]

    # The links come back: the topology and the preferred pair are restored.
    await inject(stack, MockInjectRequest(fault="nvlink_up", gpu=0))
    await eventually(
        lambda: _true(pair(inventories.last, 0, 1) == (4, 0)),
        "the inventory to show the four links up again",
    )
    assert inventories.last.gpus[0].nvlinks_down == []
    assert inventories.last.gpus[0].nvlinks_up == first.gpus[0].nvlinks_up
    await eventually(
        lambda: _true(links_counted(stack, uuids[0], uuids[1]) == 4),
        "the allocator to count four links again",
    )
    assert await preferred_pair(stack, index) == [0, 1]


async def _true(value: bool) -> bool:
    return value


def links_counted(stack: Stack, a: str, b: str) -> int:
    """The NVLinks between two GPUs in the allocator's topology (what it scores)."""
    assert stack.allocator is not None
    return stack.allocator.core.ledger.topology.nvlink_count(a, b)
