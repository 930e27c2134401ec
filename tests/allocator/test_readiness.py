"""Readiness tells the truth about allocating (issue 23, finding 4).

``/readyz`` reads the status board: the allocator is ``blocked`` (503) while its
checkpoint cannot be written, since every Allocate is then refused
(``checkpoint_failed``), and ready again once it can; its detail counts the
allocations held now, not at the last inventory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest

from gpulet_common.settings import Settings
from support import reference
from support.allocator_stack import GPU, Stack, allocator_stack, ids, rpc_error

pytestmark = pytest.mark.anyio


def allocator_status(stack: Stack) -> tuple[str, str]:
    status = stack.status.get("allocator")
    assert status is not None
    return status.state, status.detail


async def test_readiness_follows_the_checkpoint_and_counts_allocations(
    settings: Settings,
) -> None:
    async with allocator_stack(settings, inventory=reference.nvlink_pairs_8()) as stack:
        gpus = ids(stack, GPU)
        await stack.wait_for(lambda: allocator_status(stack)[0] == "ready", "ready")
        await stack.kubelet.allocate(GPU, [gpus[:1]])
        await stack.wait_for(
            lambda: allocator_status(stack) == ("ready", "8 GPUs, 1 allocations"),
            "the status to count the allocation",
        )

        # The state dir becomes unusable (as root, a mode would not stop the writes):
        # the directory of the checkpoint is replaced by a file.
        directory = Path(settings.state_dir) / "allocator"
        aside = directory.with_name("allocator.aside")
        directory.rename(aside)
        directory.write_text("not a directory")
        await stack.wait_for(lambda: allocator_status(stack)[0] == "blocked", "not ready")
        assert not stack.status.ready
        assert "checkpoint" in allocator_status(stack)[1]
        error = await rpc_error(stack.kubelet.allocate(GPU, [gpus[1:2]]))
        assert error.code() == grpc.StatusCode.INTERNAL
        assert "checkpoint_failed" in (error.details() or "")
        assert not stack.status.ready

        directory.unlink()
        aside.rename(directory)
        await stack.wait_for(
            lambda: allocator_status(stack) == ("ready", "8 GPUs, 1 allocations"),
            "ready again",
        )
        await stack.kubelet.allocate(GPU, [gpus[1:2]])
        await stack.wait_for(
            lambda: allocator_status(stack) == ("ready", "8 GPUs, 2 allocations"),
            "the second allocation counted",
        )
        shutil.rmtree(aside, ignore_errors=True)
