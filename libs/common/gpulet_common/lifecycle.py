"""How services start, run and stop.

A service is an object with a ``name`` and an ``async run(task_status=...)`` that
calls ``task_status.started()`` once it is serving and then runs until cancelled.
:func:`run_services` starts each in the order given inside one task group, waits for
each to report started (so a later service can rely on an earlier one), and on SIGINT
or SIGTERM cancels the group. Services release their resources in ``finally`` blocks
under shielded, time-bounded scopes, which is what keeps shutdown under the 2 s budget.

No task outlives the group: there are no fire-and-forget tasks anywhere in gpulet.
"""

from __future__ import annotations

import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream

from gpulet_common.telemetry import StatusBoard

log = logging.getLogger("gpulet.lifecycle")

SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)

T = TypeVar("T")


class Service(Protocol):
    name: str

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = ...) -> None: ...


async def cancel_on_signals(
    scope: anyio.CancelScope,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Cancel ``scope`` on the first SIGINT or SIGTERM."""
    with anyio.open_signal_receiver(*SHUTDOWN_SIGNALS) as signals:
        task_status.started()
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            scope.cancel()
            return


async def _run_one(
    service: Service, status: StatusBoard, *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    status.set(service.name, "starting")
    try:
        await service.run(task_status=task_status)
    except anyio.get_cancelled_exc_class():
        status.set(service.name, "stopped")
        raise
    except Exception as exc:
        status.set(service.name, "failed", f"{type(exc).__name__}: {exc}")
        raise
    status.set(service.name, "stopped")


async def run_services(
    services: Sequence[Service],
    status: StatusBoard,
    *,
    handle_signals: bool = True,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run services until one fails, they all return, or a shutdown signal arrives."""
    async with anyio.create_task_group() as tg:
        if handle_signals:
            await tg.start(cancel_on_signals, tg.cancel_scope)
        for service in services:
            await tg.start(_run_one, service, status)
            current = status.get(service.name)
            if current is None or current.state == "starting":
                status.set(service.name, "ready")
        log.info("started: %s", ", ".join(s.name for s in services))
        freeze_startup_objects()
        task_status.started()


def freeze_startup_objects() -> None:
    """Move what start-up made (modules, settings, stubs) out of the collector's reach.

    A full garbage collection walks every tracked object; over the imports of an agent
    that paused the event loop 50 ms on a quiet machine and 90-270 ms under load, in the
    middle of a fault on its way to kubelet (bench/listandwatch_latency.py). Collecting
    once and freezing leaves later full collections only the objects made since.

    Once a process: frozen objects are never collected, so a process that starts
    services again and again (the test suite) must not freeze each start's objects,
    which would then outlive their services.
    """
    global _frozen
    if _frozen:
        return
    _frozen = True
    gc.collect()
    gc.freeze()


_frozen = False


async def idle_disabled(
    name: str,
    setting: str,
    status: StatusBoard,
    task_status: anyio.abc.TaskStatus[None],
) -> None:
    """Run a service that its settings switched off: ready, saying so, doing nothing.

    A disabled sidecar keeps running (and passing its probes) rather than exiting, so
    the pod does not crash-loop over a deliberate setting.
    """
    status.set(name, "ready", f"disabled ({setting} = false)")
    task_status.started()
    await anyio.sleep_forever()


async def repeat_every(
    interval_s: float,
    step: Callable[[], Awaitable[object]],
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Started at once; then ``step`` now and again ``interval_s`` after each one
    ends, until cancelled (a poll that must not overlap itself)."""
    task_status.started()
    while True:
        await step()
        await anyio.sleep(interval_s)


async def take_queued(
    receive: MemoryObjectReceiveStream[T],
    handle: Callable[[T], Awaitable[object]],
    most: int | None = None,
) -> bool:
    """Hand ``handle`` what is queued on ``receive`` now, without waiting (and without
    a checkpoint per item): at most ``most`` items (None: all). False once the stream
    has ended, so the caller stops."""
    taken = 0
    while most is None or taken < most:
        try:
            item = receive.receive_nowait()
        except anyio.WouldBlock:
            return True
        except anyio.EndOfStream:
            return False
        await handle(item)
        taken += 1
    return True
