"""The allocator's read of its Node's time-slicing label, against the API emulator.

The follower must see the label after a LIST, every change through the WATCH, an
absent label and a deleted Node as None, and survive an API server that fails: it
retries with back-off, says why (``problem``), and never raises.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from gpulet_allocator.service.node_label import NodeLabelFollower
from gpulet_common.settings.allocator import HandshakeSettings
from support.kube_emulator import NODES, KubeEmulator, cluster_with_node

pytestmark = pytest.mark.anyio

NODE = "node-ts"
KEY = "gpulet.io/sharing.config"


@pytest.fixture
async def emu(tmp_path: Path) -> AsyncIterator[KubeEmulator]:
    async with cluster_with_node(NODE, tmp_path / "kubeconfig") as emulator:
        yield emulator


class Seen:
    """The values the follower reported, and a wait for the next one."""

    def __init__(self) -> None:
        self.values: list[str | None] = []
        self._changed = anyio.Event()

    def append(self, value: str | None) -> None:
        self.values.append(value)
        self._changed.set()
        self._changed = anyio.Event()

    async def until(self, value: str | None, what: str) -> None:
        with anyio.fail_after(10):
            while not self.values or self.values[-1] != value:
                await self._changed.wait()
        assert self.values[-1] == value, what


async def test_the_label_is_followed_through_failures(emu: KubeEmulator, tmp_path: Path) -> None:
    settings = HandshakeSettings(
        kubeconfig=str(tmp_path / "kubeconfig"), api_timeout_s=2.0, watch_timeout_s=2.0
    )
    emu.add_node(NODE, labels={KEY: "four"})
    # The first two LISTs fail: the follower says why and tries again.
    emu.faults.fail_next(2, 500, method="GET", path=f"/api/v1/{NODES}")
    problems: list[str] = []
    seen = Seen()
    follower = NodeLabelFollower(
        NODE, KEY, settings, seen.append, on_problem=lambda: problems.append(follower.problem)
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(follower.run)
        await seen.until("four", "the label after the failed lists")
        assert problems[0].startswith(f"node label {KEY} not read")
        assert follower.problem == ""
        # Changed, removed, too long, not a string: each read as the API has it.
        emu.add_node(NODE, labels={KEY: "two"})
        await seen.until("two", "a changed label")
        emu.add_node(NODE, labels={"other": "x"})
        await seen.until(None, "a removed label")
        emu.add_node(NODE, labels={KEY: "x" * 200})
        await seen.until("x" * 63, "a label value cut to 63 characters")
        emu.delete_object(NODES, NODE)
        await seen.until(None, "a deleted Node")
        emu.add_node(NODE, labels={KEY: "four"})
        await seen.until("four", "the Node back")
        tg.cancel_scope.cancel()


async def test_without_the_right_to_watch_nodes_the_label_is_read_by_get(
    emu: KubeEmulator, tmp_path: Path
) -> None:
    """The base RBAC grants GET of Nodes, not LIST/WATCH (least privilege): a 403 on the
    LIST turns the follower to a GET of its own Node every ``poll_s``; changes still
    arrive, without a restart."""
    settings = HandshakeSettings(
        kubeconfig=str(tmp_path / "kubeconfig"), api_timeout_s=2.0, watch_timeout_s=2.0
    )
    emu.add_node(NODE, labels={KEY: "four"})
    # Every LIST/WATCH of the collection is forbidden; a GET of the Node is not.
    emu.faults.fail_next(10_000, 403, method="GET", path=f"/api/v1/{NODES}$")
    seen = Seen()
    follower = NodeLabelFollower(NODE, KEY, settings, seen.append, poll_s=0.05)
    async with anyio.create_task_group() as tg:
        tg.start_soon(follower.run)
        await seen.until("four", "the label read by GET")
        assert follower.polling
        emu.add_node(NODE, labels={KEY: "two"})
        await seen.until("two", "a changed label, at the next GET")
        emu.delete_object(NODES, NODE)
        await seen.until(None, "a deleted Node (404) reads as no label")
        assert follower.problem == ""
        tg.cancel_scope.cancel()
