"""Running the real health service in tests: real nats-server, mock NVML, plain subscriber.

``HealthNode`` starts the collector (short sample period) and the health service on a
Runtime whose NVML is a :class:`MockNvml` playing ``tests/health/scenarios/health-node.toml``,
and subscribes to ``gpu.health.*`` on a *separate* NATS connection, as an alerting
system would. Faults are injected through the mock (MockNvml.inject).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc

from gpulet_collector.service import CollectorService
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.messages import HealthEvent, MockInjectRequest
from gpulet_common.mock_nvml import MockNvml
from gpulet_common.runtime import Runtime
from gpulet_common.settings import Settings
from gpulet_common.settings.nats import NatsSettings
from gpulet_health.service import HealthService
from support.agent import agent_settings, mock_adapter, runtime_for
from support.metrics import MetricsProbe
from support.waiting import wait_until

SCENARIOS = Path(__file__).resolve().parent.parent / "health" / "scenarios"
SCENARIO = SCENARIOS / "health-node.toml"
NODE = "gpu-node-1.example.com"


class GatedClock:
    """The mock's clock: stands at 0 until started, so a scenario's timeline begins
    when the service is ready, however long starting took."""

    def __init__(self) -> None:
        self._started: float | None = None

    def start(self) -> None:
        self._started = time.monotonic()

    def __call__(self) -> float:
        return 0.0 if self._started is None else time.monotonic() - self._started


@dataclass
class EventLog:
    """Every event the plain subscriber received, in arrival order."""

    events: list[HealthEvent] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)
    _changed: anyio.Event = field(default_factory=anyio.Event)

    def add(self, event: HealthEvent) -> None:
        self.events.append(event)
        self.received_at.append(time.time())
        self._changed.set()
        self._changed = anyio.Event()

    def where(self, pred: Callable[[HealthEvent], bool]) -> list[HealthEvent]:
        return [e for e in self.events if pred(e)]

    async def wait_for(
        self, pred: Callable[[HealthEvent], bool], *, within: float = 3.0, count: int = 1
    ) -> list[HealthEvent]:
        with anyio.fail_after(within):
            while True:
                found = self.where(pred)
                if len(found) >= count:
                    return found
                await self._changed.wait()

    def dump(self) -> str:
        return "\n".join(
            json.dumps(
                {
                    "kind": e.kind,
                    "gpu": e.gpu_index,
                    "cond": e.condition,
                    "healthy": e.healthy,
                    "sev": e.severity,
                    "n": e.repeat_count,
                    "reason": e.reason,
                }
            )
            for e in self.events
        )


@dataclass
class HealthNode:
    runtime: Runtime
    service: HealthService
    mock: MockNvml
    log: EventLog
    probe: MetricsProbe
    settings: Settings

    def inject(
        self,
        fault: str,
        gpu: int | None = None,
        value: float | None = None,
        duration_s: float | None = None,
    ) -> str:
        reply = self.mock.inject(
            MockInjectRequest(gpu=gpu, fault=fault, value=value, duration_s=duration_s)
        )
        assert reply.applied, reply.detail
        return reply.detail

    def uuid(self, slot: int) -> str:
        return self.mock.slot_uuid(slot)

    @property
    def node(self) -> str:
        return self.settings.node_name


async def _subscribe(url: str, log: EventLog, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    async with (
        Bus.connect(
            NatsSettings(url=url, reconnect_wait_s=0.05, reconnect_max_wait_s=0.25),
            name="test-alerting",
        ) as bus,
        bus.subscribe(subjects.HEALTH_WILDCARD, codec.HEALTH_EVENT) as stream,
    ):
        await bus.flush()
        task_status.started()
        async for delivery in stream:
            log.add(delivery.value)


async def until(check: Callable[[], bool], *, within: float = 3.0, step: float = 0.02) -> None:
    """Wait (polling, bounded) until ``check()`` is true; TimeoutError otherwise."""
    with anyio.fail_after(within):
        while True:
            if check():
                return
            await anyio.sleep(step)


def health_settings(nats_url: str, tmp_path: Path, overrides: list[str] | None = None) -> Settings:
    return agent_settings(
        nats_url,
        tmp_path / "state",
        node=NODE,
        overrides=[
            f"nvml.scenario={SCENARIO}",
            "collector.sample_period_s=0.05",
            "health.tick_s=0.1",
            "health.device_poll_s=0.1",
            "health.event_wait_timeout_ms=50",
            *(overrides or []),
        ],
    )


@asynccontextmanager
async def health_node(
    nats_url: str,
    tmp_path: Path,
    *,
    overrides: list[str] | None = None,
    collector: bool = True,
    subscriber: bool = True,
    scenario: Path = SCENARIO,
    prepare: Callable[[MockNvml], object] | None = None,
) -> AsyncIterator[HealthNode]:
    """The service running; a scenario's timeline clock starts once it is ready.

    ``prepare`` gets the mock before anything starts (a GPU lost before the agent).
    """
    settings = health_settings(nats_url, tmp_path, overrides)
    clock = GatedClock()
    adapter, mock = mock_adapter(str(scenario), clock=clock)
    if prepare is not None:
        prepare(mock)
    probe = MetricsProbe()
    log = EventLog()
    try:
        async with (
            runtime_for(settings, adapter=adapter, meter=probe.meter) as rt,
            anyio.create_task_group() as tg,
        ):
            if subscriber:
                await tg.start(_subscribe, nats_url, log)
            service = HealthService(rt)
            if collector:
                await tg.start(CollectorService(rt).run)
            await tg.start(service.run)
            clock.start()
            yield HealthNode(rt, service, mock, log, probe, settings)
            tg.cancel_scope.cancel()
    finally:
        mock.close()


def on(
    h: HealthNode, slot: int, kind: str, condition: str | None = None
) -> Callable[[HealthEvent], bool]:
    """Events of one kind (and condition) on the GPU in scenario slot ``slot``."""
    uuid = h.uuid(slot)

    def pred(e: HealthEvent) -> bool:
        return (
            e.gpu_uuid == uuid
            and e.kind == kind
            and (condition is None or e.condition == condition)
        )

    return pred


async def samples_pass(h: HealthNode, n: int = 4) -> None:
    """Wait until the service has taken in ``n`` more sample batches.

    A condition on the runtime bus's count of decoded batches, not a pause: on a
    busy machine a pause lets fewer samples through than it promises. The count
    rises as a batch is decoded, before the service handles it, hence one more.
    """

    def received() -> float:
        return h.probe.value("gpulet.bus.messages_received", type="SampleBatch")

    target = received() + n + 1
    await wait_until(
        lambda: received() >= target,
        timeout_s=5 + 20 * n * h.settings.collector.sample_period_s,
        what=f"{n} more sample batches taken in",
    )
