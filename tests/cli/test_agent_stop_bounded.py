"""A stop is bounded even when NVML's shutdown hangs (a wedged driver)."""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

import anyio
import pytest

from gpulet.agent import NVML_CLOSE_S, run_agent
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.runtime import NvmlProvider
from support.agent import agent_settings

pytestmark = pytest.mark.anyio


async def test_a_hanging_nvml_shutdown_does_not_hold_the_stop(
    nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    released = threading.Event()
    entered = threading.Event()

    def hangs(_self: NvmlProvider) -> None:
        entered.set()
        released.wait(30)  # nvmlShutdown of a driver that no longer answers

    monkeypatch.setattr(NvmlProvider, "close", hangs)
    settings = agent_settings(nats_server.url, tmp_path / "state")
    agent = partial(run_agent, settings, ["collector"], embedded_nats=False, handle_signals=False)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(agent)
            started = time.monotonic()
            tg.cancel_scope.cancel()
        took = time.monotonic() - started
        assert entered.is_set()  # the shutdown was asked for
        assert took < NVML_CLOSE_S + 3.0, took  # not the 30 s the driver holds it
    finally:
        released.set()
