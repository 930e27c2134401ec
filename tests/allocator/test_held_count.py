"""The allocations held (gauge, ``/readyz``) and the ``held`` long poll stay right
while the record changes, although the feeds read the record only when someone asks
or waits (:mod:`gpulet_allocator.service.held`, :mod:`.withheld`)."""

from __future__ import annotations

import anyio
import pytest

from gpulet_allocator import protocol as p
from gpulet_allocator.service.replies import Replies
from gpulet_allocator.service.withheld import WithheldFeed
from gpulet_common import codec
from gpulet_common.messages import HeldReply, HeldRequest
from gpulet_common.settings import Settings
from support import reference
from support.allocator_stack import GPU, Stack, allocator_stack, ids
from support.metrics import MetricsProbe

pytestmark = pytest.mark.anyio

GAUGE = "gpulet.allocator.allocations"


def held_now(stack: Stack) -> tuple[int, float, str]:
    """The count, the gauge and ``/readyz``'s line."""
    assert stack.allocator is not None
    status = stack.status.get("allocator")
    assert status is not None
    return stack.allocator.held_count.held, stack.metrics.value(GAUGE), status.detail


async def ask_held(stack: Stack, request: HeldRequest, timeout_s: float = 2.0) -> HeldReply:
    return await stack.ask(
        p.ENDPOINT_HELD, request, codec.HELD_REQUEST, codec.HELD_REPLY, timeout_s=timeout_s
    )


async def test_the_count_follows_allocate_release_and_restore(settings: Settings) -> None:
    async with allocator_stack(settings, inventory=reference.nvlink_pairs_8()) as stack:
        gpus = ids(stack, GPU)
        await stack.wait_for(lambda: held_now(stack)[2].startswith("8 GPUs"), "ready")
        assert held_now(stack) == (0, 0, "8 GPUs, 0 allocations")
        first = (await stack.kubelet.allocate(GPU, [gpus[:1]])).container_responses[0]
        await stack.kubelet.allocate(GPU, [gpus[1:2]])
        assert held_now(stack) == (2, 2, "8 GPUs, 2 allocations")
        allocation = first.annotations["gpulet.io/allocation"]
        await stack.ask(
            p.ENDPOINT_RELEASE,
            p.ReleaseRequest(allocation_ids=[allocation]),
            p.RELEASE_REQUEST,
            p.RELEASE_REPLY,
        )
        assert held_now(stack) == (1, 1, "8 GPUs, 1 allocations")
        # Restored from the checkpoint (its journal replayed): counted from the start.
        await stack.stop_allocator()
        await stack.start_allocator()
        await stack.wait_for(lambda: held_now(stack)[0] == 1, "the restored allocation")
        await stack.wait_for(lambda: held_now(stack)[2] == "8 GPUs, 1 allocations", "ready")
        # The probe sums both services' gauges: 1 left by the stopped one, 1 restored.
        assert held_now(stack)[1] == 2


async def test_the_held_feed_answers_changes_made_while_nobody_waited(
    settings: Settings,
) -> None:
    async with allocator_stack(settings, inventory=reference.nvlink_pairs_8()) as stack:
        gpus = ids(stack, GPU)
        first = await ask_held(stack, HeldRequest())
        assert first.held == {}
        # Nobody waits: the allocation only marks the feed stale...
        await stack.kubelet.allocate(GPU, [gpus[:1]])
        # ... and a long poll naming what it saw last is answered at once, changed.
        with anyio.fail_after(1.5):
            second = await ask_held(
                stack, HeldRequest(epoch=first.epoch, version=first.version, wait_s=30)
            )
        assert second.version == first.version + 1
        assert list(second.held) == [gpus[0]]

        # A long poll that waits is woken by the next change.
        async with anyio.create_task_group() as tg:
            replies: list[HeldReply] = []

            async def poll() -> None:
                replies.append(
                    await ask_held(
                        stack,
                        HeldRequest(epoch=second.epoch, version=second.version, wait_s=30),
                        timeout_s=10,
                    )
                )

            tg.start_soon(poll)
            assert stack.allocator is not None
            feed = stack.allocator.held
            await stack.wait_for(lambda: feed.waiting == 1, "the long poll to wait")
            await stack.kubelet.allocate(GPU, [gpus[1:2]])
            await stack.wait_for(lambda: bool(replies), "the long poll to be answered")
        assert replies[0].version == second.version + 1
        assert sorted(replies[0].held) == sorted(gpus[:2])


async def test_follow_reads_the_source_only_while_a_poll_waits() -> None:
    reads = 0
    value = 0

    def source() -> int:
        nonlocal reads
        reads += 1
        return value

    replies = Replies(MetricsProbe().meter, lambda: 1 << 20)
    feed: WithheldFeed[int] = WithheldFeed(
        replies,
        source,
        0,
        endpoint=p.ENDPOINT_HELD,
        request=codec.HELD_REQUEST,
        reply=lambda _e, _v, _x: b"",
    )
    for n in range(1, 50):
        value = n
        feed.follow()
    assert reads == 0
    feed.waiting = 1  # as a long poll does while it waits
    feed.follow()
    assert reads == 1
