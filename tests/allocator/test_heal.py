"""Remediation by reset: the state machine (remediate/heal.py) on a real nats-server's
KV (remediate/heal_store.py), the mock NVML (remediate/nvml_port.py) and the mock
executor. The pods' side (evictions) and the node's side (quarantine, escalation) are
recorded at the machine's two ports; the eviction itself is the remediation loop's,
tested in test_remediation*.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from gpulet_allocator.service.remediate.heal import Healer, resettable
from gpulet_allocator.service.remediate.heal_events import register_gauge
from gpulet_allocator.service.remediate.heal_store import KvHealStore
from gpulet_allocator.service.remediate.nvml_port import NvmlGpu
from gpulet_allocator.service.remediate.reset_exec import MockExecutor
from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.heal import HEAL_KV_BUCKET, FaultHistory, HealRecord, HealState, heal_key
from gpulet_common.messages import MockInjectRequest
from gpulet_common.mock_nvml import ManualClock, MockNvml
from gpulet_common.mock_nvml.scenario import Scenario, load_scenario
from gpulet_common.remediation import Fault
from gpulet_common.settings import NatsSettings
from gpulet_common.settings.remediation import ResetSettings, RetireRule
from support.metrics import MetricsProbe

pytestmark = pytest.mark.anyio

NODE = "node-a"
EPOCH = 1.8e9
SETTLE = 30.0
IDLE = 60.0


@dataclass
class Pods:
    """The Evictions port: how many pods still hold each GPU."""

    left: dict[str, int] = field(default_factory=dict)

    async def holders_left(self, gpu_uuid: str) -> int:
        return self.left.get(gpu_uuid, 0)


@dataclass
class Node:
    """The Quarantine port, recorded."""

    calls: list[tuple[str, str, str]] = field(default_factory=list)
    verified: list[bool] = field(default_factory=list)

    async def hold(self, gpu_uuid: str, reason: str) -> None:
        self.calls.append(("hold", gpu_uuid, reason))

    async def release(self, gpu_uuid: str, last_reset: str, *, verified: bool = False) -> None:
        self.calls.append(("release", gpu_uuid, last_reset))
        self.verified.append(verified)

    async def escalate(self, gpu_uuid: str, reason: str) -> None:
        self.calls.append(("escalate", gpu_uuid, reason))

    async def retire(self, gpu_uuid: str, reason: str, history: FaultHistory) -> None:
        self.calls.append(("retire", gpu_uuid, f"{reason}; {history.summary()}"))

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]


class Crash(Exception):
    """The agent dies here."""


class CrashingStore(KvHealStore):
    """Dies right after writing ``after`` (the record is in the KV), or right before
    writing ``before`` (it is not)."""

    after: HealState | None = None
    before: HealState | None = None

    async def put(self, record: HealRecord, revision: int) -> int:
        if record.state == self.before:
            raise Crash(record.state)
        revision = await super().put(record, revision)
        if record.state == self.after:
            raise Crash(record.state)
        return revision


@dataclass
class Rig:
    mock: MockNvml
    mclock: ManualClock
    bus: Bus
    pods: Pods = field(default_factory=Pods)
    node: Node = field(default_factory=Node)
    settings: ResetSettings = field(
        default_factory=lambda: ResetSettings(executor="mock", settle_s=SETTLE, idle_timeout_s=IDLE)
    )
    executors: list[MockExecutor] = field(default_factory=list)
    new_faults: dict[str, list[str]] = field(default_factory=dict)

    def now(self) -> float:
        return EPOCH + self.mclock()

    async def store(self, cls: type[KvHealStore] = KvHealStore) -> KvHealStore:
        kv = await self.bus.key_value(HEAL_KV_BUCKET)
        return cls(kv, self.bus.jetstream, NODE)

    async def healer(self, store: KvHealStore | None = None) -> Healer:
        executor = MockExecutor(self.mock, timeout_s=5.0)
        self.executors.append(executor)
        return Healer(
            self.settings,
            store or await self.store(),
            NvmlGpu(self.mock),
            executor,
            self.pods,
            self.node,
            faults_since=lambda uuid, _t: self.new_faults.get(uuid, []),
            clock=self.now,
        )

    def inject(self, fault: str, gpu: int, **kw: Any) -> None:
        reply = self.mock.inject(MockInjectRequest(fault=fault, gpu=gpu, **kw))
        assert reply.applied, reply.detail

    def uuid(self, gpu: int) -> str:
        return self.mock.scenario.gpus[gpu].uuid

    def fault(self, gpu: int, xid: int = 79, action: str = "reboot") -> Fault:
        uuid = self.uuid(gpu)
        return Fault(
            gpu_uuid=uuid,
            gpu_index=gpu,
            device=uuid,
            condition=f"xid:{xid}",
            kind="xid",
            severity="fatal",
            action=action,
            xid=xid,
            mnemonic="GPU_HAS_FALLEN_OFF_THE_BUS" if xid == 79 else "",
            since=self.now(),
        )

    async def record(self, gpu: int) -> HealRecord:
        found, _ = await (await self.store()).get(self.uuid(gpu))
        assert found is not None
        return found

    async def drive(
        self, healer: Healer, faults: list[Fault], until: Callable[[HealRecord], bool], gpu: int
    ) -> HealRecord:
        """Passes, the clock moved to each pass's next look, until ``until`` holds."""
        for _ in range(200):
            at = await healer.run_pass(faults)
            record = await self.record(gpu)
            if until(record):
                return record
            step = (at - self.now()) if at is not None else 1.0
            self.mclock.advance(max(step, 0.001))
        pytest.fail(f"the machine never got there: {record.state} {record.steps}")


def r570(name: str) -> Scenario:
    """A scenario on an R570 driver (field 230), with no timeline playing."""
    scenario = load_scenario(name)
    system = msgspec.structs.replace(scenario.system, driver_version="570.86.10")
    return msgspec.structs.replace(scenario, system=system, timeline=[])


@pytest.fixture
async def rig(nats_server: EmbeddedNats) -> AsyncIterator[Rig]:
    clock = ManualClock()
    mock = MockNvml(r570("dgx-h100"), jitter=False, clock=clock)
    mock.nvmlInit()
    async with Bus.connect(NatsSettings(url=nats_server.url), name="heal") as bus:
        yield Rig(mock=mock, mclock=clock, bus=bus)


def ended(record: HealRecord) -> bool:
    return record.state in ("returned", "escalated", "retired")


async def test_xid_79_quarantine_evict_idle_reset_verify_return(rig: Rig) -> None:
    uuid = rig.uuid(3)
    rig.inject("xid", 3, value=79)
    rig.inject("ecc_dbe", 3)
    rig.inject("process", 3, value=4711, duration_s=20.0)
    rig.pods.left[uuid] = 1
    healer = await rig.healer()
    fault = rig.fault(3)
    record = await rig.drive(healer, [fault], lambda r: r.state == "evicting", 3)
    # Quarantined at once, before any pod left; the baseline read.
    assert rig.node.kinds() == ["hold"]
    assert record.baseline is not None
    assert record.baseline.link_width == 16
    rig.mclock.advance(5.0)
    assert (await rig.record(3)).state == "evicting"  # a pod still holds it
    rig.pods.left[uuid] = 0
    record = await rig.drive(healer, [fault], lambda r: r.state == "verifying", 3)
    # The reset waited for process 4711 to exit (20 s of mock time).
    assert rig.mclock() >= 20.0
    assert rig.mock.resets_of(3) == 1
    settle_from = rig.now()
    record = await rig.drive(healer, [fault], ended, 3)
    assert record.state == "returned", record.steps
    assert rig.now() - settle_from >= SETTLE  # the settle window was waited out
    assert [s.split("@")[0] for s in record.steps] == [
        "quarantined",
        "evicting",
        "waiting_idle",
        "resetting",
        "verifying",
        "returned",
    ]
    assert rig.node.kinds() == ["hold", "release"]
    assert rig.node.verified == [True]  # the health service is told: its clear
    assert "xid:79" in rig.node.calls[-1][2]  # gpulet.io/last-reset: time and cause
    assert record.last_reset == rig.node.calls[-1][2]
    assert record.last_reset.startswith("2027-")  # EPOCH + mock time, RFC 3339
    assert rig.mock.nvmlDeviceGetTotalEccErrors(rig.mock.nvmlDeviceGetHandleByIndex(3), 1, 0) == 0
    # The same (lingering) condition does not start a second machine.
    await healer.run_pass([fault])
    assert rig.mock.resets_of(3) == 1
    assert (await rig.record(3)).state == "returned"
    # Other GPUs untouched.
    assert all(rig.mock.resets_of(g) == 0 for g in range(8) if g != 3)


async def test_reset_that_fails_escalates_and_stays_quarantined(rig: Rig) -> None:
    rig.inject("reset_fail", 3)
    record = await rig.drive(await rig.healer(), [rig.fault(3)], ended, 3)
    assert record.state == "escalated"
    assert "the reset failed" in record.detail
    assert rig.node.kinds() == ["hold", "escalate"]
    history, _ = await (await rig.store()).history(rig.uuid(3))
    assert [e.kind for e in history.entries] == ["fault", "reset_failed"]


async def test_reset_that_hangs_escalates(rig: Rig) -> None:
    rig.inject("reset_hang", 3, duration_s=30.0)
    rig.settings = ResetSettings(executor="mock", settle_s=SETTLE, idle_timeout_s=IDLE)
    healer = await rig.healer()
    healer.executor = MockExecutor(rig.mock, timeout_s=0.2)
    record = await rig.drive(healer, [rig.fault(3)], ended, 3)
    assert record.state == "escalated"
    assert "hung" in record.detail
    rig.mock.close()  # wakes the abandoned reset thread


async def test_verify_that_fails_escalates(rig: Rig) -> None:
    rig.inject("reset_degrade", 3, value=8)
    record = await rig.drive(await rig.healer(), [rig.fault(3)], ended, 3)
    assert record.state == "escalated"
    assert "link_width 16 -> 8" in record.detail
    assert rig.mock.resets_of(3) == 1
    assert "release" not in rig.node.kinds()


async def test_new_fault_within_settle_window_fails_verify(rig: Rig) -> None:
    healer = await rig.healer()
    await rig.drive(healer, [rig.fault(3)], lambda r: r.state == "verifying", 3)
    rig.new_faults[rig.uuid(3)] = ["xid:79"]
    record = await rig.drive(healer, [rig.fault(3)], ended, 3)
    assert record.state == "escalated"
    assert "new fault xid:79" in record.detail


async def test_process_that_never_exits_escalates_with_its_pid(rig: Rig) -> None:
    rig.inject("process", 3, value=31337)
    record = await rig.drive(await rig.healer(), [rig.fault(3)], ended, 3)
    assert record.state == "escalated"
    assert record.pids == [31337]
    assert "PIDs 31337" in record.detail
    assert rig.mock.resets_of(3) == 0
    assert rig.executors[0].calls == []


async def test_node_reboot_action_escalates_without_reset(rig: Rig) -> None:
    rig.inject("recovery_action", 3, value=2)
    record = await rig.drive(await rig.healer(), [rig.fault(3)], ended, 3)
    assert record.state == "escalated"
    assert "field 230" in record.detail
    assert rig.executors[0].calls == []
    assert rig.node.kinds() == ["hold", "escalate"]


async def test_fault_no_reset_cures_escalates(rig: Rig) -> None:
    fault = rig.fault(3, xid=48, action="hardware_inspection")
    assert not resettable(fault)
    record = await rig.drive(await rig.healer(), [fault], ended, 3)
    assert record.state == "escalated"
    assert rig.executors[0].calls == []


@pytest.mark.parametrize(
    ("after", "before", "resets", "end"),
    [
        ("quarantined", None, 1, "returned"),
        ("evicting", None, 1, "returned"),
        ("waiting_idle", None, 1, "returned"),
        # Dead after writing "resetting", before the reset ran: the GPU still asks for
        # a reset (field 230), so the verify fails -- and no second reset is tried.
        ("resetting", None, 0, "escalated"),
        # Dead after the reset ran, before "verifying" was written: verified, once.
        (None, "verifying", 1, "returned"),
        ("verifying", None, 1, "returned"),
    ],
)
async def test_restart_in_every_state_resumes_and_never_resets_twice(
    rig: Rig, after: HealState | None, before: HealState | None, resets: int, end: str
) -> None:
    rig.inject("recovery_action", 3, value=1)  # GPU_RESET, until a reset clears it
    store = await rig.store(CrashingStore)
    assert isinstance(store, CrashingStore)
    store.after, store.before = after, before
    first = await rig.healer(store)
    with pytest.raises(Crash):
        await rig.drive(first, [rig.fault(3)], ended, 3)
    # A new agent (a new healer, a new store object) on the same KV.
    second = await rig.healer()
    record = await rig.drive(second, [rig.fault(3)], ended, 3)
    assert record.state == end, record.steps
    assert rig.mock.resets_of(3) == resets
    ran = 0 if after == "resetting" else 1
    assert first.resets_started + second.resets_started == ran
    assert sum(len(e.calls) for e in rig.executors) == ran
    assert second.resets_started == 0 or after in ("quarantined", "evicting", "waiting_idle")


async def test_repeat_offender_is_retired_until_cleared(rig: Rig) -> None:
    healer = await rig.healer()
    for _ in range(2):
        record = await rig.drive(healer, [rig.fault(3)], ended, 3)
        assert record.state == "returned"
        rig.mclock.advance(3600.0)
    # The third fatal fault within 24 h.
    record = await rig.drive(healer, [rig.fault(3)], ended, 3)
    assert record.state == "retired"
    assert "RMA candidate: 3 fatal faults" in record.detail
    assert "xid:79" in record.last_reset  # the last reset, kept by the next machine
    assert rig.mock.resets_of(3) == 2
    assert rig.node.kinds()[-2:] == ["hold", "retire"]
    assert "2 reset(s)" in rig.node.calls[-1][2]
    # Out of service across restarts, and new faults do not start a machine.
    rig.mclock.advance(10.0)
    again = await rig.healer()
    await again.run_pass([rig.fault(3)])
    assert (await rig.record(3)).state == "retired"
    assert rig.mock.resets_of(3) == 2
    # `gpulet health clear --retired` clears the history's flag: returned.
    store = await rig.store()
    history, revision = await store.history(rig.uuid(3))
    assert history.retired
    history.retired = False
    await store.put_history(history, revision)
    await again.run_pass([])
    assert (await rig.record(3)).state == "returned"
    assert rig.node.kinds()[-1] == "release"


async def test_two_failed_resets_retire(rig: Rig) -> None:
    rig.settings = ResetSettings(
        executor="mock", settle_s=SETTLE, idle_timeout_s=IDLE, retire=RetireRule(faults=0)
    )
    healer = await rig.healer()
    rig.inject("reset_fail", 3, value=2)
    record = await rig.drive(healer, [rig.fault(3)], ended, 3)
    assert record.state == "escalated"
    # An operator clears the escalation (a reboot would): the next fault fails again.
    store = await rig.store()
    _, revision = await store.get(rig.uuid(3))
    await store.put(HealRecord(gpu_uuid=rig.uuid(3), state="returned"), revision)
    rig.mclock.advance(1.0)
    record = await rig.drive(healer, [rig.fault(3)], ended, 3)
    assert record.state == "retired"
    assert "2 failed resets" in record.detail


async def test_unreadable_record_keeps_the_gpu_out_and_never_resets(rig: Rig) -> None:
    kv = await rig.bus.key_value(HEAL_KV_BUCKET)
    await kv.put(heal_key(NODE, rig.uuid(3)), b'{"gpu_uuid": 7')
    healer = await rig.healer()
    await healer.run_pass([rig.fault(3)])
    record = await rig.record(3)
    assert record.state == "escalated"
    assert "not trusted" in record.detail
    assert rig.executors[0].calls == []


async def test_gpu_with_direct_nvlink_peers_escalates(nats_server: EmbeddedNats) -> None:
    clock = ManualClock()
    mock = MockNvml(r570("nvlink-pairs-8gpu"), jitter=False, clock=clock)
    mock.nvmlInit()
    async with Bus.connect(NatsSettings(url=nats_server.url), name="heal") as bus:
        rig = Rig(mock=mock, mclock=clock, bus=bus)
        record = await rig.drive(await rig.healer(), [rig.fault(0)], ended, 0)
    assert record.state == "escalated"
    assert "NVLink peers" in record.detail
    assert mock.resets_of(0) == 0


async def test_dry_run_step_of_each_fault(rig: Rig) -> None:
    healer = await rig.healer()
    assert await healer.step_of(rig.fault(3)) == (
        "would quarantine",
        "then evict, wait idle, reset, verify",
    )
    inspect = rig.fault(3, xid=48, action="hardware_inspection")
    assert (await healer.step_of(inspect))[0] == "would quarantine and escalate"
    rig.inject("process", 3, value=99)
    await healer.run_pass([rig.fault(3)])
    assert (await healer.step_of(rig.fault(3)))[0] == "waiting_idle"
    assert rig.mock.resets_of(3) == 0  # the dry run changed nothing


async def test_escalated_and_retired_gpus_are_on_the_gauge(rig: Rig) -> None:
    probe = MetricsProbe()
    healer = await rig.healer()
    register_gauge(probe.meter, NODE, lambda: healer.out_of_service)
    rig.inject("reset_fail", 3)
    await rig.drive(healer, [rig.fault(3)], ended, 3)
    escalated = probe.value(
        "gpulet.allocator.remediation.gpu_state", UUID=rig.uuid(3), state="escalated"
    )
    assert escalated == 1
    # A GPU back in service leaves the gauge.
    await rig.drive(healer, [rig.fault(1)], ended, 1)
    assert rig.uuid(1) not in healer.out_of_service
    assert rig.uuid(3) in healer.out_of_service


async def test_an_escalated_gpu_waits_for_the_reboot_it_asked_for(rig: Rig) -> None:
    boot = ["boot-1"]
    healer = await rig.healer()
    healer._boot_id = lambda: boot[0]
    rig.inject("reset_fail", 3)
    record = await rig.drive(healer, [rig.fault(3)], ended, 3)
    assert (record.state, record.boot_id) == ("escalated", "boot-1")
    # Restarts of the agent within the same boot keep it out.
    again = await rig.healer()
    again._boot_id = lambda: boot[0]
    await again.run_pass([rig.fault(3)])
    assert (await rig.record(3)).state == "escalated"
    # The node rebooted: the GPU is back (no reset recorded: none passed).
    boot[0] = "boot-2"
    await again.run_pass([])
    record = await rig.record(3)
    assert record.state == "returned"
    assert "the node rebooted" in record.detail
    assert record.last_reset == ""
    assert rig.node.verified == [False]  # no reset to tell the health service of
    history, _ = await (await rig.store()).history(rig.uuid(3))
    assert [e.kind for e in history.entries] == ["fault", "reset_failed"]
