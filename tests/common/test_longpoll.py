"""follow_versions: the one client loop of the allocator's versioned long polls."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import anyio
import pytest

from gpulet_common.bus.longpoll import follow_versions
from gpulet_common.refusal import RequestTimeout

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class Reply:
    epoch: str
    version: int


async def test_new_replies_only_with_back_off_while_the_bus_fails() -> None:
    # What the server answers, in order: a failure, v1, v1 again (the poll's time ran
    # out), two failures, v2, then a new epoch at version 1.
    script: list[Reply | Exception] = [
        RequestTimeout("no answer"),
        Reply("a", 1),
        Reply("a", 1),
        RequestTimeout("no answer"),
        RequestTimeout("no answer"),
        Reply("a", 2),
        Reply("b", 1),
    ]
    asked: list[tuple[str, int]] = []
    seen: list[Reply] = []
    done = anyio.Event()

    async def ask(epoch: str, version: int) -> Reply:
        asked.append((epoch, version))
        if not script:
            done.set()
            await anyio.sleep_forever()
        answer = script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: follow_versions(
                    ask,
                    seen.append,
                    retry_s=0.01,
                    retry_max_s=0.02,
                    what="test",
                    log=logging.getLogger("test"),
                )
            )
            await done.wait()
            tg.cancel_scope.cancel()
    assert seen == [Reply("a", 1), Reply("a", 2), Reply("b", 1)]
    # Each request names the pair last seen.
    assert asked == [
        ("", 0),
        ("", 0),
        ("a", 1),
        ("a", 1),
        ("a", 1),
        ("a", 1),
        ("a", 2),
        ("b", 1),
    ]
