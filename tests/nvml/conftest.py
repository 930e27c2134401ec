"""Fixtures of the NVML tests: a mock NVML on a manual clock, and an adapter over it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gpulet_common.mock_nvml import ManualClock, MockNvml
from gpulet_common.nvml import NvmlAdapter

MockFactory = Callable[..., tuple[NvmlAdapter, MockNvml]]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def open_mock(clock: ManualClock) -> Iterator[MockFactory]:
    """open_mock("t4") -> (initialised adapter, mock); no jitter, manual clock."""
    mocks: list[MockNvml] = []

    def factory(
        scenario: object = "dgx-h100", *, jitter: bool = False, real_clock: bool = False
    ) -> tuple[NvmlAdapter, MockNvml]:
        mock = MockNvml(scenario, jitter=jitter, clock=None if real_clock else clock)  # type: ignore[arg-type]
        mocks.append(mock)
        adapter = NvmlAdapter(mock, backend="mock")
        adapter.init()
        return adapter, mock

    yield factory
    for mock in mocks:
        # Releases any call still blocked on a hung GPU or an event wait.
        mock.close()
