"""The mock's model of a GPU reset (mock_nvml/gpureset.py): what remediation by reset
relies on -- a new handle, fresh volatile counters, field 230 back to NONE (but not
after NODE_REBOOT), refused while a process holds the GPU, and the knobs that make a
reset fail, hang or come back degraded."""

from __future__ import annotations

import pynvml
import pytest

from gpulet_common.messages import MockInjectRequest
from gpulet_common.mock_nvml import ManualClock, MockNvml


def inject(mock: MockNvml, fault: str, gpu: int, **kw: object) -> None:
    reply = mock.inject(MockInjectRequest(fault=fault, gpu=gpu, **kw))  # type: ignore[arg-type]
    assert reply.applied, reply.detail


def test_reset_renews_handle_clears_volatile_ecc_and_recovery_action() -> None:
    mock = MockNvml("faults-demo", jitter=False, clock=ManualClock())
    mock.nvmlInit()
    bus = mock.scenario.gpus[3].bus_id
    old = mock.nvmlDeviceGetHandleByIndex(3)
    inject(mock, "ecc_dbe", 3, value=2)
    inject(mock, "recovery_action", 3, value=1)
    assert mock.nvmlDeviceGetTotalEccErrors(old, 1, 0) == 2
    mock.gpu_reset(bus)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        mock.nvmlDeviceGetUUID(old)
    new = mock.nvmlDeviceGetHandleByIndex(3)
    assert new is not old
    assert mock.nvmlDeviceGetUUID(new) == mock.scenario.gpus[3].uuid
    assert mock.nvmlDeviceGetTotalEccErrors(new, 1, 0) == 0  # volatile: fresh
    assert mock.nvmlDeviceGetTotalEccErrors(new, 1, 1) == 2  # aggregate: kept
    assert mock.recovery.field(3) == 0
    assert mock.resets_of(3) == 1


def test_reset_keeps_a_node_reboot_action() -> None:
    mock = MockNvml("faults-demo", jitter=False, clock=ManualClock())
    mock.nvmlInit()
    inject(mock, "recovery_action", 1, value=2)
    mock.gpu_reset(mock.scenario.gpus[1].bus_id.lower().replace("00000000:", "0000:"))
    assert mock.recovery.field(1) == 2


def test_a_process_holds_the_gpu_until_it_exits() -> None:
    clock = ManualClock()
    mock = MockNvml("dgx-h100", jitter=False, clock=clock)
    mock.nvmlInit()
    bus = mock.scenario.gpus[0].bus_id
    inject(mock, "process", 0, value=77, duration_s=5.0)
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    assert [p.pid for p in mock.nvmlDeviceGetComputeRunningProcesses(handle)] == [77]
    assert mock.nvmlDeviceGetComputeRunningProcesses(mock.nvmlDeviceGetHandleByIndex(1)) == []
    with pytest.raises(pynvml.NVMLError_InUse):
        mock.gpu_reset(bus)
    clock.advance(5.0)
    assert mock.nvmlDeviceGetComputeRunningProcesses(handle) == []
    mock.gpu_reset(bus)
    assert mock.resets_of(0) == 1


def test_unknown_bus_id_is_not_found() -> None:
    mock = MockNvml("dgx-h100", jitter=False, clock=ManualClock())
    mock.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotFound):
        mock.gpu_reset("0000:ee:00.0")
