"""Sampling every GPU in parallel so that one hung GPU never delays the others.

Each GPU is read in a worker thread (NVML calls block). A read that takes longer than
``call_timeout_s`` is abandoned for this period and reported as ``error="timeout"``;
while that thread is still stuck the GPU is not read again, so a GPU that hangs for
minutes holds exactly one thread, not one per period.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import anyio

from gpulet_common.messages import GpuSample
from gpulet_common.nvml.errors import GpuLostError, NvmlCallError, NvmlUnavailable

log = logging.getLogger("gpulet.collector.sampler")


class ParallelSampler:
    def __init__(
        self,
        read: Callable[[int], GpuSample],
        *,
        call_timeout_s: float,
        worker_threads: int,
    ) -> None:
        self._read = read
        self._call_timeout_s = call_timeout_s
        self._limiter = anyio.CapacityLimiter(worker_threads)
        self._stuck: set[int] = set()
        self._stuck_lock = threading.Lock()

    def stuck(self) -> frozenset[int]:
        with self._stuck_lock:
            return frozenset(self._stuck)

    def _read_tracked(self, index: int) -> GpuSample:
        with self._stuck_lock:
            self._stuck.add(index)
        try:
            return self._read(index)
        finally:
            with self._stuck_lock:
                self._stuck.discard(index)

    async def _sample_one(self, index: int, uuid: str, results: dict[int, GpuSample]) -> None:
        try:
            with anyio.move_on_after(self._call_timeout_s):
                results[index] = await anyio.to_thread.run_sync(
                    self._read_tracked, index, abandon_on_cancel=True, limiter=self._limiter
                )
                return
            results[index] = GpuSample(
                uuid=uuid, index=index, timestamp=time.time(), error="timeout"
            )
        except GpuLostError:
            results[index] = GpuSample(uuid=uuid, index=index, timestamp=time.time(), error="lost")
        except (NvmlCallError, NvmlUnavailable) as exc:
            results[index] = GpuSample(
                uuid=uuid, index=index, timestamp=time.time(), error=f"error: {exc}"
            )

    async def sample(self, gpus: list[tuple[int, str]]) -> list[GpuSample]:
        """Read every ``(index, uuid)``; the result is ordered by index."""
        results: dict[int, GpuSample] = {}
        stuck = self.stuck()
        async with anyio.create_task_group() as tg:
            for index, uuid in gpus:
                if index in stuck:
                    results[index] = GpuSample(
                        uuid=uuid, index=index, timestamp=time.time(), error="timeout"
                    )
                else:
                    tg.start_soon(self._sample_one, index, uuid, results)
        return [results[i] for i, _ in gpus]
