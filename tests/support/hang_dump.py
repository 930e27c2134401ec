"""A hang's stacks, written to a file before pytest-timeout ends the worker.

pytest-timeout's "thread" method prints every thread's stack to the worker's stderr
and exits it; under xdist that stderr is pytest's own capture file, so a hung worker
ended with nothing but "node down: Not properly terminated". This plugin arms a timer
per test, a little shorter than the test's timeout, that writes to
``$HANG_DUMP_DIR`` (default: the system temp dir) a file holding:

* every thread's Python stack (``faulthandler``);
* every task of every running asyncio loop, with its whole await chain (the frames of
  each coroutine a task is suspended in, down to the innermost ``await``): a hung
  shutdown shows here as the task that never finished, and what it waits for.

The path is also written to the worker's real stderr. Nothing happens to a test that
ends in time: the timer is cancelled. ``kill -USR1 <pid>`` of a pytest process writes
the same dump at once (``gpulet-hang-<worker>-<pid>-signal.txt``), to look at a test that
seems stuck before its timer fires.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Generator
from pathlib import Path
from types import CoroutineType, FrameType, GeneratorType
from typing import Any

import pytest

# Seconds before the test's own timeout at which the dump is written.
LEAD_S = 30.0


def _await_chain(coro: Any, depth: int = 0) -> list[str]:
    lines: list[str] = []
    while coro is not None and depth < 60:
        frame: FrameType | None = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines.append(
                f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
            )
        nxt = getattr(coro, "cr_await", None)
        if nxt is None:
            nxt = getattr(coro, "gi_yieldfrom", None)
        if isinstance(nxt, (CoroutineType, GeneratorType)) or hasattr(nxt, "cr_frame"):
            coro = nxt
        else:
            if nxt is not None:
                lines.append(f"    awaiting {nxt!r:.200}")
            break
        depth += 1
    return lines


def dump(path: Path, why: str) -> None:
    with path.open("w") as out:
        out.write(f"{why}\n{time.strftime('%Y-%m-%d %H:%M:%S')}\n\n## threads\n")
        out.flush()
        faulthandler.dump_traceback(out, all_threads=True)
        out.write("\n## asyncio tasks\n")
        loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]
        for loop in loops:
            if loop.is_closed():
                continue
            try:
                tasks = list(asyncio.all_tasks(loop))
            except RuntimeError:
                continue
            out.write(f"\n# loop {loop!r} running={loop.is_running()} tasks={len(tasks)}\n")
            for task in tasks:
                out.write(f"\n{task.get_name()} done={task.done()}\n")
                try:
                    out.write("\n".join(_await_chain(task.get_coro())) + "\n")
                except Exception:  # a diagnostic never raises
                    out.write(traceback.format_exc())


def _directory() -> Path:
    return Path(os.environ.get("HANG_DUMP_DIR", tempfile.gettempdir()))


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def pytest_configure(config: pytest.Config) -> None:
    def on_signal(_signum: int, _frame: object) -> None:
        path = _directory() / f"gpulet-hang-{_worker()}-{os.getpid()}-signal.txt"
        try:
            dump(path, "SIGUSR1")
        except Exception:  # a diagnostic never raises
            return

    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, on_signal)


def _timeout_of(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker and marker.args:
        return float(marker.args[0])
    if marker and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    value = item.config.getini("timeout")
    return float(value) if value else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, Any, None]:
    timeout = _timeout_of(item)
    timer: threading.Timer | None = None
    if timeout and timeout > 2 * LEAD_S:
        name = "".join(c if c.isalnum() else "_" for c in item.nodeid)[-120:]
        path = _directory() / f"gpulet-hang-{_worker()}-{os.getpid()}-{name}.txt"

        def fire() -> None:
            try:
                dump(path, f"{item.nodeid}: still running {timeout - LEAD_S:.0f}s in")
            except Exception:  # a diagnostic never raises
                return
            os.write(2, f"\ngpulet: hang dump written to {path}\n".encode())

        timer = threading.Timer(timeout - LEAD_S, fire)
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
