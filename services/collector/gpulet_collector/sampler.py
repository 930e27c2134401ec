"""Sampling every GPU in parallel so that one hung GPU never delays the others.

Each GPU is read by a thread of a pool owned by the sampler (NVML calls block). One
period costs a single hop from the event loop to a coordinating worker thread, which
fans the reads out to the pool and waits at most ``call_timeout_s`` for them: a hop per
GPU through the event loop would cost more than the NVML reads themselves.

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
        futures = {
            index: self._pool.submit(self._read, index, slow)
            for index, _ in gpus
            if index not in stuck
        }
        counted = self._pool.submit(self._count) if self._count is not None else None
        waiting: list[concurrent.futures.Future[Any]] = [*futures.values()]
        if counted is not None:
            waiting.append(counted)
        concurrent.futures.wait(waiting, timeout=self._call_timeout_s)
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
