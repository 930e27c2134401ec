"""The hang dump (tests/support/hang_dump.py) names the task that waits, and where."""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from support.hang_dump import dump

pytestmark = pytest.mark.anyio


async def _waits_for_ever(event: anyio.Event) -> None:
    await event.wait()


async def test_dump_shows_each_task_and_its_innermost_await(tmp_path: Path) -> None:
    path = tmp_path / "hang.txt"
    event = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_waits_for_ever, event, name="the-stuck-one")
        await anyio.lowlevel.checkpoint()
        await anyio.to_thread.run_sync(dump, path, "why")
        event.set()
    text = path.read_text()
    assert text.startswith("why\n")
    assert "## threads" in text
    assert "## asyncio tasks" in text
    stuck = text.split("the-stuck-one", 1)[1].split("\n\n", 1)[0]
    assert "in _waits_for_ever" in stuck
    assert "in wait" in stuck  # anyio.Event.wait, the await it is suspended in
