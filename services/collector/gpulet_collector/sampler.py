"""Sampling every GPU so that one hung GPU never delays the others, at the least CPU.

GPUs are read by threads of a pool owned by the sampler (NVML calls block). One period
costs a single hop from the event loop to a coordinating worker thread: a hop per GPU
through the event loop would cost more than the NVML reads themselves.

The reads first run one after another in one pool thread: warm NVML reads take tens of
microseconds, and eight threads waking, taking the GIL in turn and handing results back
cost more CPU than the reads (measured with the mock's ``h100`` latency profile: 9.1 ms
of CPU per 8-GPU collection in parallel, 7.3 ms in order, the same wall time). If that
chain has not finished after :data:`FAN_OUT_AFTER_S` (a cold read, a slow-field batch,
a hung GPU), every GPU it has not started yet is handed to a thread of its own, so a
slow or hung GPU still delays the others by that much at most. NVML's GPU count is
read last in the same chain, or in a thread of its own once the reads fan out. The
coordinator waits at most ``call_timeout_s`` in all.

A read still running at the deadline is reported as ``error="timeout"`` and left to
finish in its pool thread; while it is stuck the GPU is not read again, so a GPU that
hangs for minutes holds exactly one thread, not one per period.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio

from gpulet_common.messages import GpuSample
from gpulet_common.nvml.errors import GpuLostError, NvmlCallError, NvmlUnavailable

log = logging.getLogger("gpulet.collector.sampler")

# Prefix of a sample's error when NVML as a whole went away (driver unloaded, library
# gone): the collector then tries to initialise NVML again.
NVML_UNAVAILABLE = "nvml_unavailable"

# How long the in-order chain may run before the GPUs it has not reached are read in
# parallel: a warm 8-GPU collection takes ~7 ms (h100 profile), a slow-field batch ~5 ms
# per GPU.
FAN_OUT_AFTER_S = 0.02


class ParallelSampler:
    def __init__(
        self,
        read: Callable[[int, bool], GpuSample],
        *,
        count: Callable[[], int] | None = None,
        call_timeout_s: float,
        worker_threads: int,
    ) -> None:
        self._read = read
        self._count = count
        self._call_timeout_s = call_timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=worker_threads, thread_name_prefix="nvml-sample"
        )
        self._stuck: dict[int, concurrent.futures.Future[GpuSample]] = {}
        self._lock = threading.Lock()

    def stuck(self) -> frozenset[int]:
        with self._lock:
            return frozenset(i for i, f in self._stuck.items() if not f.done())

    def _collect(
        self, index: int, uuid: str, future: concurrent.futures.Future[GpuSample]
    ) -> GpuSample:
        if not future.done():
            with self._lock:
                self._stuck[index] = future
            return GpuSample(uuid=uuid, index=index, timestamp=time.time(), error="timeout")
        try:
            return future.result()
        except GpuLostError:
            return GpuSample(uuid=uuid, index=index, timestamp=time.time(), error="lost")
        except NvmlUnavailable as exc:
            return GpuSample(
                uuid=uuid, index=index, timestamp=time.time(), error=f"{NVML_UNAVAILABLE}: {exc}"
            )
        except NvmlCallError as exc:
            return GpuSample(uuid=uuid, index=index, timestamp=time.time(), error=f"error: {exc}")

    def sample_blocking(
        self, gpus: list[tuple[int, str]], slow: bool = False
    ) -> tuple[int | None, list[GpuSample]]:
        """Read every ``(index, uuid)`` from a worker thread; ordered as given.

        ``slow`` asks the reads for the slow fields too (``read(index, slow)``).

        Also returns NVML's current GPU count (None when it could not be read in time),
        read alongside the samples so that hot-add and removal cost no extra hop.
        """
        with self._lock:
            stuck = {i for i, f in self._stuck.items() if not f.done()}
            self._stuck = {i: f for i, f in self._stuck.items() if i in stuck}
        order = [index for index, _ in gpus if index not in stuck]
        futures: dict[int, concurrent.futures.Future[GpuSample]] = {
            index: concurrent.futures.Future() for index in order
        }
        started: set[int] = set()
        claim = threading.Lock()

        def read(index: int) -> None:
            future = futures[index]
            try:
                future.set_result(self._read(index, slow))
            except BaseException as exc:  # handed to _collect, which maps NVML errors
                future.set_exception(exc)

        counted: concurrent.futures.Future[int] | None = None
        if self._count is not None:
            counted = concurrent.futures.Future()

        def count_gpus() -> None:
            fn = self._count
            if counted is None or fn is None:
                return
            try:
                counted.set_result(fn())
            except BaseException as exc:  # no count this period
                counted.set_exception(exc)

        def chain() -> None:
            for index in order:
                with claim:
                    if index in started:
                        continue
                    started.add(index)
                read(index)
            with claim:
                if counted is None or -1 in started:
                    return
                started.add(-1)
            count_gpus()

        deadline = time.monotonic() + self._call_timeout_s
        self._pool.submit(chain)
        waiting: list[concurrent.futures.Future[Any]] = [*futures.values()]
        if counted is not None:
            waiting.append(counted)
        _, pending = concurrent.futures.wait(
            waiting, timeout=min(FAN_OUT_AFTER_S, self._call_timeout_s)
        )
        if pending:
            with claim:
                rest = [index for index in order if index not in started]
                count_too = counted is not None and -1 not in started
                started.update(rest)
                started.add(-1)
            for index in rest:
                self._pool.submit(read, index)
            if count_too:
                self._pool.submit(count_gpus)
            concurrent.futures.wait(pending, timeout=max(deadline - time.monotonic(), 0.0))
        count: int | None = None
        if counted is not None and counted.done() and counted.exception() is None:
            count = counted.result()
        now = time.time()
        return count, [
            self._collect(index, uuid, futures[index])
            if index in futures
            else GpuSample(uuid=uuid, index=index, timestamp=now, error="timeout")
            for index, uuid in gpus
        ]

    async def sample(
        self, gpus: list[tuple[int, str]], slow: bool = False
    ) -> tuple[int | None, list[GpuSample]]:
        return await anyio.to_thread.run_sync(
            self.sample_blocking, gpus, slow, abandon_on_cancel=True
        )

    def close(self) -> None:
        # Stuck NVML calls cannot be interrupted; don't wait for them.
        self._pool.shutdown(wait=False, cancel_futures=True)
