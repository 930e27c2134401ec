"""A recovery hold (NVML field 230) read back from the KV bucket after the health service
restarts: the field is read again with no XID to prompt it, and the hold ends on the
evidence its action calls for, read after the restart -- or stays, and says why."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import nats.js.errors
import pytest

from gpulet_common import codec, subjects
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import (
    GpuHealth,
    GpuInfo,
    GpuSample,
    HealthEvent,
    HealthState,
    HealthStateRequest,
    MockInjectRequest,
)
from gpulet_common.mock_nvml import MockNvml
from gpulet_common.settings.health import HealthSettings
from gpulet_health.cli import format_state
from gpulet_health.rules import RuleEngine
from support.health_harness import SCENARIO, HealthNode, health_node, on, samples_pass

NODE = "n1"
T0 = 1_700_000_000.0
GPU = "GPU-0"


def started(boot: str = "boot-a", before: list[GpuHealth] | None = None) -> RuleEngine:
    """An engine as the service starts one: the KV state read back, then the first scan."""
    e = RuleEngine(NODE, msgspec.convert({}, HealthSettings), boot_id=boot)
    e.restore(before or [])
    e.observe_inventory([GpuInfo(uuid=GPU, index=0, name="H100")], T0)
    return e


def restarted(e: RuleEngine) -> RuleEngine:
    """The same node after a restart of the service (the same boot): the KV state only."""
    wire = msgspec.json.encode(e.snapshot(GPU))  # through the bucket's JSON
    return started(e.boot_id, [msgspec.json.decode(wire, type=GpuHealth)])


def counters(e: RuleEngine, t: float, corrected: int) -> list[HealthEvent]:
    """A sample with the volatile ECC counters: going back shows a GPU reset."""
    sample = GpuSample(uuid=GPU, index=0, timestamp=t, ecc_volatile_corrected=corrected)
    return e.observe_sample(sample)


def held(e: RuleEngine, value: int = 1) -> RuleEngine:
    [raised] = e.observe_recovery_action(GPU, value, T0 + 1)
    assert (raised.condition, raised.healthy) == ("recovery_action", False)
    assert raised.recovery_action == e.gpus[GPU].recovery
    return e


def ended(events: list[HealthEvent]) -> HealthEvent:
    [back] = [ev for ev in events if ev.condition == "recovery_action"]
    assert (back.kind, back.healthy) == ("recovered", True)
    return back


def test_a_reset_hold_read_back_ends_on_a_reset_and_none_read_after_the_restart() -> None:
    e = restarted(held(started()))
    gpu = e.gpus[GPU]
    cond = gpu.conditions["recovery_action"]
    assert (cond.action, cond.restored, gpu.healthy) == ("reset_gpu", True, False)
    # The last reading is read back and shown, and the field is to be read again.
    assert gpu.recovery == "gpu_reset"
    assert e.snapshot(GPU).recovery_action == "gpu_reset"
    assert "recovery action (NVML field 230): gpu_reset" in format_state(e.state(T0 + 2))
    assert e.recovery_holds() == [0]
    # The reading after the restart: the same hold, nothing new.
    assert e.observe_recovery_action(GPU, 1, T0 + 3) == []
    # A reset (counters go back), then NONE: the hold ends, with no XID.
    assert counters(e, T0 + 4, 2) == []
    assert counters(e, T0 + 5, 0) == []
    assert "a GPU reset was seen" in cond.reason
    assert not gpu.healthy
    back = ended(e.observe_recovery_action(GPU, 0, T0 + 6))
    assert back.recovery_action == "none"
    assert "GPU reset was seen" in back.reason
    assert gpu.healthy
    assert e.recovery_holds() == []


def test_none_alone_after_a_restart_keeps_the_hold_and_says_why() -> None:
    """A reset while the service was down leaves no proof (the counters it compares
    start afresh): NONE read after the restart does not end the hold (fail closed); the
    reason says so, and one warning event; the next reset seen ends it."""
    e = restarted(held(started()))
    gpu = e.gpus[GPU]
    assert counters(e, T0 + 1.5, 2) == []
    assert e.observe_recovery_action(GPU, 0, T0 + 2) == []
    reason = gpu.conditions["recovery_action"].reason
    assert "reads NONE again, but no GPU reset has been seen" in reason
    assert "since gpulet restarted" in reason
    assert "`gpulet health clear`" in reason
    # The warning waits for two samples taken after the reading (either could show a
    # reset): one taken before it (in flight) is not counted.
    assert counters(e, T0 + 1.9, 2) == []
    assert e.observe_recovery_action(GPU, 0, T0 + 3) == []
    assert counters(e, T0 + 4, 2) == []
    [warned] = counters(e, T0 + 5, 2)
    assert (warned.kind, warned.severity, warned.condition) == ("xid", "warning", "")
    assert (warned.healthy, warned.recovery_action, warned.xid) == (False, "none", 154)
    assert "stays held after the restart" in warned.reason
    assert "since gpulet restarted" in warned.reason
    # Said once; samples with no reset change nothing.
    assert counters(e, T0 + 6, 2) == []
    assert e.observe_recovery_action(GPU, 0, T0 + 6) == []
    assert counters(e, T0 + 7, 2) == []
    assert counters(e, T0 + 7.5, 2) == []
    assert e.tick(T0 + 7.5) == []
    assert not gpu.healthy
    # The state read back again keeps the hold and its reason.
    again = restarted(e)
    assert "since gpulet restarted" in again.state(T0 + 7).gpus[0].conditions[0].reason
    # The reset, once seen, ends it (the field already reads NONE).
    assert "GPU reset was seen" in ended(counters(e, T0 + 8, 0)).reason
    assert gpu.healthy


def test_a_reading_read_back_is_no_evidence_and_a_reset_seen_is_kept() -> None:
    # NONE read before the restart, with no reset seen: the reading read back does not
    # end the hold when a reset is seen (the driver may have asked again meanwhile).
    e = held(started())
    assert e.observe_recovery_action(GPU, 0, T0 + 2) == []
    e = restarted(e)
    assert e.gpus[GPU].recovery == "none"
    assert counters(e, T0 + 3, 2) == []
    assert counters(e, T0 + 4, 0) == []
    assert not e.gpus[GPU].healthy
    ended(e.observe_recovery_action(GPU, 0, T0 + 5))
    # A reset seen before the restart, the field still asking: kept in the bucket, so
    # NONE after the restart ends the hold with no reset seen since.
    e = held(started())
    assert counters(e, T0 + 2, 2) == []
    assert counters(e, T0 + 3, 0) == []
    e = restarted(e)
    assert e.gpus[GPU].conditions["recovery_action"].reset_seen
    assert e.observe_recovery_action(GPU, 1, T0 + 4) == []
    ended(e.observe_recovery_action(GPU, 0, T0 + 5))


def test_other_holds_read_back() -> None:
    # DRAIN_P2P: NONE read after the restart is all it needs.
    e = restarted(held(started(), 3))
    assert e.recovery_holds() == [0]
    assert e.observe_recovery_action(GPU, 3, T0 + 2) == []
    ended(e.observe_recovery_action(GPU, 0, T0 + 3))
    # NODE_REBOOT in the same boot: NONE is not a reboot; a new boot id ends it.
    e = restarted(held(started(), 2))
    assert e.observe_recovery_action(GPU, 0, T0 + 2) == []
    assert not e.gpus[GPU].healthy
    rebooted = started("boot-b", [e.snapshot(GPU)])
    ended(rebooted.tick(T0 + 3))
    # A reading read back that no gpulet gives is not taken.
    odd = msgspec.structs.replace(e.snapshot(GPU), recovery_action="x" * 100)
    assert started(before=[odd]).gpus[GPU].recovery == ""


# --- end to end on the mock ---------------------------------------------------------------


async def kv_health(h: HealthNode, slot: int) -> GpuHealth | None:
    kv = await h.runtime.bus.key_value(subjects.HEALTH_KV_BUCKET)
    try:
        entry = await kv.get(subjects.health_kv_key(h.node, h.uuid(slot)))
    except nats.js.errors.KeyNotFoundError:
        return None
    return msgspec.json.decode(entry.value, type=GpuHealth) if entry.value else None


async def until_stored(h: HealthNode, slot: int, condition: str, action: str) -> None:
    """Until the KV bucket holds the GPU's condition and reading (bounded)."""
    with anyio.fail_after(10):
        while True:
            found = await kv_health(h, slot)
            if (
                found is not None
                and condition in [c.condition for c in found.conditions]
                and found.recovery_action == action
            ):
                return
            await anyio.sleep(0.02)  # the bucket is another service's: polled


async def state_of(h: HealthNode, slot: int) -> GpuHealth:
    state: HealthState = await h.runtime.bus.request(
        subjects.health_state(h.node),
        HealthStateRequest(gpu=str(slot)),
        codec.HEALTH_STATE_REQUEST,
        codec.HEALTH_STATE,
    )
    return state.gpus[0]


def r570(tmp_path: Path) -> Path:
    scenario = tmp_path / "r570.toml"
    scenario.write_text(f'base = "{SCENARIO}"\n[system]\ndriver_version = "570.86.10"\n')
    return scenario


def driver_asks(value: float, errors: float = 2) -> Callable[[MockNvml], None]:
    """The new process's mock: the driver still asks ``value``, with corrected ECC
    errors counted (so that a reset shows: the volatile counters go back)."""

    def prepare(mock: MockNvml) -> None:
        for fault, v in (("ecc_sbe", errors), ("recovery_action", value)):
            assert mock.inject(MockInjectRequest(gpu=0, fault=fault, value=v)).applied

    return prepare


async def raise_reset_hold(url: str, tmp_path: Path, scenario: Path) -> None:
    async with health_node(url, tmp_path, scenario=scenario) as h:
        h.inject("recovery_action", gpu=0, value=1)
        h.inject("xid", gpu=0, value=154)
        [hold] = await h.log.wait_for(on(h, 0, "xid", "recovery_action"))
        assert (hold.action, hold.recovery_action) == ("reset_gpu", "gpu_reset")
        await h.log.wait_for(lambda e: e.xid == 154 and e.kind == "xid" and e.condition == "")
        await until_stored(h, 0, "recovery_action", "gpu_reset")


@pytest.mark.anyio
async def test_a_hold_read_back_ends_on_a_reset_and_none_with_no_xid(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """The hold is raised, the service stops; a new one starts on the same KV bucket and
    state directory (the driver still asking GPU_RESET); a reset sets the field back to
    NONE and no XID comes: the restarted service reads the field again by itself."""
    scenario = r570(tmp_path)
    await raise_reset_hold(nats_server.url, tmp_path, scenario)
    async with health_node(
        nats_server.url, tmp_path, scenario=scenario, prepare=driver_asks(1)
    ) as h:
        before = await state_of(h, 0)
        assert (before.healthy, before.recovery_action) == (False, "gpu_reset")
        assert [c.condition for c in before.conditions] == ["recovery_action"]
        await samples_pass(h)  # the counters' baseline in this run
        h.inject("reset", gpu=0)
        [back] = await h.log.wait_for(on(h, 0, "recovered", "recovery_action"), within=10)
        assert (back.healthy, back.recovery_action) == (True, "none")
        assert "GPU reset was seen" in back.reason
        # No XID, and no warning that it stays held: the samples showed the reset.
        assert not h.log.where(lambda e: e.kind == "xid")
        after = await state_of(h, 0)
        assert (after.healthy, after.recovery_action, after.conditions) == (True, "none", [])


@pytest.mark.anyio
async def test_a_hold_read_back_stays_on_none_alone_and_ends_on_the_next_reset(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """The GPU was reset while the service was down (the field reads NONE at start):
    that cannot be proven, so the hold stays and says why; a reset seen ends it."""
    scenario = r570(tmp_path)
    await raise_reset_hold(nats_server.url, tmp_path, scenario)
    async with health_node(
        nats_server.url, tmp_path, scenario=scenario, prepare=driver_asks(0)
    ) as h:
        [warned] = await h.log.wait_for(
            lambda e: e.gpu_uuid == h.uuid(0) and "stays held after the restart" in e.reason,
            within=10,
        )
        assert (warned.severity, warned.healthy, warned.recovery_action) == (
            "warning",
            False,
            "none",
        )
        await samples_pass(h)
        held_now = await state_of(h, 0)
        assert not held_now.healthy
        assert "since gpulet restarted" in held_now.conditions[0].reason
        assert not h.log.where(on(h, 0, "recovered", "recovery_action"))
        h.inject("reset", gpu=0)
        [back] = await h.log.wait_for(on(h, 0, "recovered", "recovery_action"), within=10)
        assert back.healthy
