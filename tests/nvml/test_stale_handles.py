"""Handles of a previous enumeration (issue 28): a GPU that went and came back.

The mock gives a GPU that comes back a new handle; the old one answers
INVALID_ARGUMENT, and its event registrations are void. The adapter's cached handles
must follow without a restart.
"""

from __future__ import annotations

import pytest

from gpulet_common.mock_nvml import MockNvml
from gpulet_common.mock_nvml.faultspec import FaultSpec, check_fault
from gpulet_common.nvml.adapter import EVENT_XID, NvmlAdapter


def _node() -> tuple[NvmlAdapter, MockNvml]:
    mock = MockNvml("dgx-h100", jitter=False)
    adapter = NvmlAdapter(mock, backend="mock")
    adapter.init()
    return adapter, mock


def test_a_returned_gpu_has_a_new_handle_and_a_new_index() -> None:
    _, mock = _node()
    old = mock.nvmlDeviceGetHandleByIndex(1)
    uuid = mock.slot_uuid(1)
    assert mock.apply(FaultSpec(fault="remove", gpu=1))[0]
    ok, detail = mock.apply(FaultSpec(fault="hot_add", gpu=1, value=1))
    assert ok, detail
    assert "index 7" in detail
    count = mock.nvmlDeviceGetCount()
    new = mock.nvmlDeviceGetHandleByIndex(count - 1)
    assert new is not old
    assert mock.nvmlDeviceGetUUID(new) == uuid
    assert mock.nvmlDeviceGetUUID(mock.nvmlDeviceGetHandleByIndex(1)) == mock.slot_uuid(2)
    with pytest.raises(mock.NVMLError_InvalidArgument):
        mock.nvmlDeviceGetUUID(old)
    # In its place (no value): the same index, still a new handle.
    assert mock.apply(FaultSpec(fault="remove", gpu=2))[0]
    assert mock.apply(FaultSpec(fault="hot_add", gpu=2))[0]
    assert mock.nvmlDeviceGetUUID(mock.nvmlDeviceGetHandleByIndex(1)) == mock.slot_uuid(2)
    assert check_fault(FaultSpec(fault="hot_add", value=1), 8, live=True) is not None
    assert check_fault(FaultSpec(fault="hot_add", gpu=1, value=2), 8, live=True) is not None


def test_a_sample_through_a_stale_cached_handle_reads_the_gpu_now_at_that_index() -> None:
    adapter, mock = _node()
    assert adapter.sample(1).uuid == mock.slot_uuid(1)  # handle cached
    mock.apply_together(
        FaultSpec(fault="remove", gpu=1), FaultSpec(fault="hot_add", gpu=1, value=1)
    )
    sample = adapter.sample(1)
    assert (sample.uuid, sample.error) == (mock.slot_uuid(2), None)
    moved = adapter.sample(7)
    assert (moved.uuid, moved.error) == (mock.slot_uuid(1), None)


def test_events_are_registered_through_a_fresh_handle() -> None:
    adapter, mock = _node()
    adapter.uuid_of(1)  # handle cached
    mock.apply_together(FaultSpec(fault="remove", gpu=1), FaultSpec(fault="hot_add", gpu=1))
    event_set = adapter.create_event_set()
    assert adapter.register_events(event_set, 1, EVENT_XID) == EVENT_XID
    assert mock.apply(FaultSpec(fault="xid", gpu=1, value=79))[0]
    event = adapter.wait_event(event_set, 100)
    assert event is not None
    assert (event.gpu_uuid, event.xid) == (mock.slot_uuid(1), 79)
    adapter.free_event_set(event_set)


def test_a_registration_made_before_the_return_is_void() -> None:
    adapter, mock = _node()
    event_set = adapter.create_event_set()
    assert adapter.register_events(event_set, 1, EVENT_XID) == EVENT_XID
    mock.apply_together(FaultSpec(fault="remove", gpu=1), FaultSpec(fault="hot_add", gpu=1))
    assert mock.apply(FaultSpec(fault="xid", gpu=1, value=79))[1].endswith(
        "(delivered to 0 event sets)"
    )
    adapter.free_event_set(event_set)
