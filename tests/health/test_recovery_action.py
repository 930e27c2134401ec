"""The driver's recovery action (NVML field 230) on the mock, and the return to service
it governs in the rule engine: on evidence, never on a timer."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import GpuInfo, HealthEvent, MockInjectRequest
from gpulet_common.mock_nvml import MockNvml
from gpulet_common.mock_nvml.scenario import scenario_from_toml
from gpulet_common.settings.health import HealthSettings
from gpulet_health import recovery
from gpulet_health.rules import RuleEngine
from support.health_harness import SCENARIO, health_node, on, samples_pass

NODE = "n1"
T0 = 1_700_000_000.0
R570 = '[system]\ndriver_version = "570.86.10"\n[[gpus]]\nname = "NVIDIA H100 80GB HBM3"\n'
R550 = '[system]\ndriver_version = "550.54.15"\n[[gpus]]\nname = "NVIDIA H100 80GB HBM3"\n'


def mock(toml: str = R570) -> MockNvml:
    nvml = MockNvml(scenario_from_toml(toml))
    nvml.nvmlInit()
    return nvml


def inject(nvml: MockNvml, fault: str, value: float | None = None) -> bool:
    return nvml.inject(MockInjectRequest(gpu=0, fault=fault, value=value)).applied


def engine(boot: str = "boot-a") -> RuleEngine:
    e = RuleEngine(NODE, msgspec.convert({}, HealthSettings), boot_id=boot)
    e.observe_inventory([GpuInfo(uuid="GPU-0", index=0, name="H100")], T0)
    return e


def read_into(e: RuleEngine, nvml: MockNvml, t: float) -> list[HealthEvent]:
    return e.observe_recovery_action("GPU-0", recovery.read(nvml, 0), t)


def test_the_mock_models_the_field_on_r570_and_not_before() -> None:
    nvml = mock()
    assert recovery.read(nvml, 0) == 0
    assert inject(nvml, "recovery_action", 1)
    assert recovery.read(nvml, 0) == 1
    assert inject(nvml, "reset")
    assert recovery.read(nvml, 0) == 0  # the reset the driver asked for is done
    assert inject(nvml, "recovery_action", 2)
    assert inject(nvml, "reset")
    assert recovery.read(nvml, 0) == 2  # a node reboot is not done by a GPU reset
    assert not inject(nvml, "recovery_action", 1.5)
    old = mock(R550)
    assert recovery.read(old, 0) is None
    assert not inject(old, "recovery_action", 1)


def test_gpu_reset_holds_the_gpu_until_a_reset_is_seen_and_the_field_reads_none() -> None:
    nvml, e = mock(), engine()
    gpu = e.gpus["GPU-0"]
    assert read_into(e, nvml, T0) == []  # NONE: nothing to hold
    inject(nvml, "recovery_action", 1)
    [held] = read_into(e, nvml, T0 + 1)
    assert (held.condition, held.action, held.healthy) == ("recovery_action", "reset_gpu", False)
    # An XID now carries the action.
    [xid] = e.observe_xid("GPU-0", 79, T0 + 2)
    assert xid.recovery_action == "gpu_reset"
    # The field reading NONE is not enough without a reset seen (a stale reading)...
    assert e.observe_recovery_action("GPU-0", 0, T0 + 3) == []
    assert not gpu.healthy
    assert read_into(e, nvml, T0 + 4) == []  # it asks again
    # ...and a reset seen is not enough while the field still asks for one.
    e.reset_observed(gpu, T0 + 5, "test: volatile ECC counters went back")  # ends xid:79
    assert "recovery_action" in gpu.conditions
    assert read_into(e, nvml, T0 + 5) == []
    assert "recovery_action" in gpu.conditions
    inject(nvml, "reset")
    [back] = read_into(e, nvml, T0 + 6)
    assert (back.kind, back.condition, back.healthy) == ("recovered", "recovery_action", True)
    assert "GPU reset was seen" in back.reason
    assert gpu.healthy


def test_a_reset_seen_after_the_field_read_none_ends_the_hold() -> None:
    """The other order: the NVML event thread reads NONE right after the reset, before
    the samples that show the reset are taken in (and it reads the field no more once
    it reads NONE): the reset, when it is seen, ends the hold."""
    nvml, e = mock(), engine()
    gpu = e.gpus["GPU-0"]
    inject(nvml, "recovery_action", 1)
    [held] = read_into(e, nvml, T0)
    assert held.action == "reset_gpu"
    inject(nvml, "reset")
    assert read_into(e, nvml, T0 + 1) == []  # NONE: still waiting for the reset
    assert not gpu.healthy
    why = "test: volatile ECC counters went back"
    [back] = e._dedup.apply(e.reset_observed(gpu, T0 + 2, why))
    assert (back.kind, back.condition, back.healthy) == ("recovered", "recovery_action", True)
    assert "GPU reset was seen" in back.reason
    assert gpu.healthy
    # A reboot's hold is not ended by a reset, whatever the field read before.
    inject(nvml, "recovery_action", 2)
    [reboot] = read_into(e, nvml, T0 + 3)
    assert reboot.action == "reboot"
    gpu.recovery = "none"
    assert e.reset_observed(gpu, T0 + 4, why) == []
    assert not gpu.healthy


def test_node_reboot_holds_the_gpu_until_the_boot_id_changes() -> None:
    nvml, e = mock(), engine("boot-a")
    inject(nvml, "recovery_action", 2)
    [held] = read_into(e, nvml, T0)
    assert held.action == "reboot"
    gpu = e.gpus["GPU-0"]
    e.reset_observed(gpu, T0 + 1, "test")
    inject(nvml, "reset")
    assert read_into(e, nvml, T0 + 2) == []
    assert e.tick(T0 + 3) == []
    assert not gpu.healthy
    # The agent restarts in the same boot: still held.
    same = engine("boot-a")
    same.restore([e.snapshot("GPU-0")])
    assert same.tick(T0 + 4) == []
    assert not same.gpus["GPU-0"].healthy
    # After a reboot the state read back ends at once.
    rebooted = engine("boot-b")
    rebooted.restore([e.snapshot("GPU-0")])
    [back] = [ev for ev in rebooted.tick(T0 + 5) if ev.condition == "recovery_action"]
    assert back.kind == "recovered"
    assert "boot id boot-a -> boot-b" in back.reason
    assert rebooted.gpus["GPU-0"].healthy


def test_none_lets_the_gpu_return() -> None:
    nvml, e = mock(), engine()
    read_into(e, nvml, T0)
    [event] = e.observe_xid("GPU-0", 13, T0 + 1)
    assert (event.recovery_action, event.healthy) == ("none", True)
    # DRAIN_P2P needs no reset: NONE again lets the GPU back.
    inject(nvml, "recovery_action", 3)
    [held] = read_into(e, nvml, T0 + 2)
    assert held.action == "operator_check"
    inject(nvml, "recovery_action", 0)
    [back] = read_into(e, nvml, T0 + 3)
    assert back.kind == "recovered"
    assert e.gpus["GPU-0"].healthy


def test_xid_154_in_the_kernel_log_is_the_same_signal() -> None:
    e = engine()
    detail = "pid=1, name=x, GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)"
    out = e.observe_xid("GPU-0", 154, T0, seen_in="from the kernel log", detail=detail)
    held = [ev for ev in out if ev.condition == "recovery_action"]
    assert [(ev.action, ev.healthy) for ev in held] == [("reset_gpu", False)]
    assert recovery.from_xid_154("nothing here") is None


def test_drivers_without_the_field_keep_todays_behaviour_and_say_so() -> None:
    old, e = mock(R550), engine()
    assert read_into(e, old, T0) == []
    [raised] = e.observe_xid("GPU-0", 79, T0 + 1)
    assert raised.recovery_action == ""
    assert "reports no recovery action" in raised.message
    gpu = e.gpus["GPU-0"]
    [ended] = e._dedup.apply(e.reset_observed(gpu, T0 + 2, "test"))
    assert (ended.condition, ended.kind) == ("xid:79", "recovered")
    assert gpu.healthy
    # An unknown value escalates: held like a reboot.
    assert recovery.kind(recovery.action_name(99)) == "reboot"


@pytest.mark.anyio
async def test_the_service_reads_the_action_with_an_xid_and_holds_the_gpu_until_reset(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """End to end on the mock (an R570 driver): the XID event's read of field 230 raises
    the hold; a GPU reset seen and the field back to NONE (read again every
    device_poll_s, no event comes with it) end it, whichever of the two is taken in
    first (under load the reading often comes before the samples that show the reset)."""
    scenario = tmp_path / "r570.toml"
    scenario.write_text(f'base = "{SCENARIO}"\n[system]\ndriver_version = "570.86.10"\n')
    async with health_node(nats_server.url, tmp_path, scenario=scenario) as h:
        h.inject("ecc_sbe", gpu=0, value=2)  # a reset then shows: volatile counters go back
        await samples_pass(h)
        h.inject("recovery_action", gpu=0, value=1)
        h.inject("xid", gpu=0, value=154)
        [held] = await h.log.wait_for(on(h, 0, "xid", "recovery_action"))
        assert (held.action, held.healthy) == ("reset_gpu", False)
        [xid] = await h.log.wait_for(lambda e: e.xid == 154 and e.condition == "")
        assert xid.recovery_action == "gpu_reset"
        h.inject("reset", gpu=0)
        [back] = await h.log.wait_for(on(h, 0, "recovered", "recovery_action"), within=10)
        assert back.healthy
        assert "GPU reset was seen" in back.reason
