"""run_services freezes what start-up made, so later full collections skip it.

A full collection over an agent's imports paused the loop 50-270 ms in the middle of a
fault on its way to kubelet (bench/listandwatch_latency.py); see lifecycle.py.
"""

from __future__ import annotations

import gc
from functools import partial

import anyio
import anyio.abc
import pytest

from gpulet_common import lifecycle
from gpulet_common.lifecycle import run_services
from gpulet_common.telemetry import StatusBoard

pytestmark = pytest.mark.anyio


class _Idle:
    name = "idle"

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        await anyio.sleep_forever()


async def test_started_services_leave_startup_objects_frozen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    monkeypatch.setattr(lifecycle, "_frozen", False)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(partial(run_services, [_Idle()], StatusBoard(), handle_signals=False))
            assert gc.get_freeze_count() > 0
            tg.cancel_scope.cancel()
        # Once a process: a second start freezes nothing more.
        gc.unfreeze()
        async with anyio.create_task_group() as tg:
            await tg.start(partial(run_services, [_Idle()], StatusBoard(), handle_signals=False))
            assert gc.get_freeze_count() == 0
            tg.cancel_scope.cancel()
    finally:
        gc.unfreeze()
