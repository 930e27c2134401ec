"""ParallelSampler: reads in order in one thread while they are quick, fans out when not."""

from __future__ import annotations

import threading
import time

import pytest

from gpulet_collector import sampler as sampler_module
from gpulet_collector.sampler import FAN_OUT_AFTER_S, ParallelSampler
from gpulet_common.messages import GpuSample

GPUS = [(i, f"GPU-{i}") for i in range(8)]


def test_quick_reads_run_in_order_in_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # A long fan-out delay: on a loaded machine the chain may be slow to be scheduled.
    monkeypatch.setattr(sampler_module, "FAN_OUT_AFTER_S", 5.0)
    threads: list[tuple[int, str]] = []

    def read(index: int, slow: bool) -> GpuSample:
        threads.append((index, threading.current_thread().name))
        return GpuSample(uuid=f"GPU-{index}", index=index, timestamp=time.time())

    sampler = ParallelSampler(read, count=lambda: 8, call_timeout_s=5.0, worker_threads=16)
    try:
        count, samples = sampler.sample_blocking(GPUS)
    finally:
        sampler.close()
    assert count == 8
    assert [s.uuid for s in samples] == [uuid for _, uuid in GPUS]
    assert all(s.error is None for s in samples)
    assert [i for i, _ in threads] == list(range(8))
    assert len({name for _, name in threads}) == 1


def test_a_hung_gpu_delays_the_others_by_the_fan_out_delay_only() -> None:
    release = threading.Event()
    threads: dict[int, str] = {}

    def read(index: int, slow: bool) -> GpuSample:
        threads[index] = threading.current_thread().name
        if index == 2:
            release.wait(30)
        return GpuSample(uuid=f"GPU-{index}", index=index, timestamp=time.time())

    timeout = 1.0
    sampler = ParallelSampler(read, call_timeout_s=timeout, worker_threads=16)
    try:
        begun = time.monotonic()
        _, samples = sampler.sample_blocking(GPUS)
        took = time.monotonic() - begun
        assert [s.error for s in samples] == [None, None, "timeout", None, None, None, None, None]
        # The coordinator waited for the hung read until its deadline, not longer; the
        # GPUs after it were read by other threads.
        assert FAN_OUT_AFTER_S <= took < timeout + 2.0
        assert threads[2] not in {threads[i] for i in range(3, 8)}
        # While it is stuck the GPU is not read again; the others are.
        assert sampler.stuck() == frozenset({2})
        threads.clear()
        _, samples = sampler.sample_blocking(GPUS)
        assert 2 not in threads
        assert [s.error for s in samples][2] == "timeout"
        assert all(s.error is None for i, s in enumerate(samples) if i != 2)
    finally:
        release.set()
        sampler.close()


def test_errors_are_mapped_per_gpu() -> None:
    from gpulet_common.nvml.errors import GpuLostError

    def read(index: int, slow: bool) -> GpuSample:
        if index == 1:
            raise GpuLostError(1, "GPU-1")
        return GpuSample(uuid=f"GPU-{index}", index=index, timestamp=time.time())

    sampler = ParallelSampler(read, call_timeout_s=5.0, worker_threads=4)
    try:
        _, samples = sampler.sample_blocking(GPUS[:3])
    finally:
        sampler.close()
    assert [s.error for s in samples] == [None, "lost", None]
