"""Building blocks for the reporter's tests and bench: inventories, events, a running
reporter against a real nats-server and the Kubernetes API emulator."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio

from gpulet_common.bus import Bus
from gpulet_common.messages import (
    ActiveCondition,
    GpuHealth,
    GpuInfo,
    HealthEvent,
    HealthState,
    Inventory,
)
from gpulet_common.runtime import Runtime
from gpulet_common.settings import Settings
from gpulet_common.settings.nats import NatsSettings
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_reporter.service import ReporterService
from support.agent import runtime_for
from support.health_kv import health_bucket
from support.host import HIDDEN_DRIVER
from support.metrics import MetricsProbe

H100 = "NVIDIA H100 80GB HBM3"
H100_BYTES = 80 * 2**30
_event_ids = itertools.count(1)


def gpu_uuid(node: str, index: int) -> str:
    digest = hashlib.sha1(node.encode()).hexdigest()[:8]
    return f"GPU-{digest}-0000-0000-0000-{index:012d}"


def make_inventory(
    node: str,
    count: int = 8,
    *,
    name: str = H100,
    memory: int = H100_BYTES,
    driver: str | None = "550.54.15",
    cuda: str | None = "12.4",
    generation: int = 1,
) -> Inventory:
    gpus = [
        GpuInfo(
            uuid=gpu_uuid(node, i),
            index=i,
            minor=i,
            name=name,
            memory_total_bytes=memory,
            pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            numa_node=0 if i < count // 2 else 1,
        )
        for i in range(count)
    ]
    return Inventory(
        node=node,
        generation=generation,
        driver_version=driver,
        cuda_driver_version=cuda,
        gpus=gpus,
        nvml_backend="mock",
        published_at=time.time(),
    )


def health_event(
    node: str,
    uuid: str,
    *,
    healthy: bool,
    reason: str = "Xid79",
    message: str = "GPU has fallen off the bus",
    xid: int | None = 79,
    kind: Any = None,
    severity: Any = None,
    condition: str | None = None,
    observed_at: float | None = None,
) -> HealthEvent:
    """An event shaped like the health service's: a raise names its condition
    (``xid:79``), a recovery names the condition it ends."""
    if healthy:
        return HealthEvent(
            event_id=f"ev-{next(_event_ids)}",
            node=node,
            gpu_uuid=uuid,
            kind=kind or "recovered",
            severity=severity or "info",
            healthy=True,
            reason="condition ended",
            message="GPU recovered",
            condition=condition if condition is not None else (f"xid:{xid}" if xid else ""),
            observed_at=observed_at if observed_at is not None else time.time(),
        )
    return HealthEvent(
        event_id=f"ev-{next(_event_ids)}",
        node=node,
        gpu_uuid=uuid,
        kind=kind or "xid",
        severity=severity or "critical",
        healthy=False,
        reason=reason,
        message=message,
        xid=xid,
        condition=condition if condition is not None else (f"xid:{xid}" if xid else ""),
        observed_at=observed_at if observed_at is not None else time.time(),
    )


def health_state(node: str, faults: list[HealthEvent]) -> HealthState:
    """The health service's answer to a state query after ``faults`` were raised."""
    by_gpu: dict[str, list[ActiveCondition]] = {}
    for event in faults:
        by_gpu.setdefault(event.gpu_uuid, []).append(
            ActiveCondition(
                condition=event.condition,
                kind=event.kind,
                severity=event.severity,
                reason=event.reason,
                message=event.message,
                since=event.observed_at,
            )
        )
    return HealthState(
        node=node,
        gpus=[
            GpuHealth(gpu_uuid=uuid, healthy=False, conditions=conds)
            for uuid, conds in by_gpu.items()
        ],
        updated_at=time.time(),
    )


def fast_settings(**overrides: Any) -> ReporterSettings:
    """Timings scaled down for tests (the real defaults are 0.5 s / 2 s / 300 s).

    The node condition is off unless a test asks for it (``node_condition=True``):
    the tests that count the Device's and labels' writes stand in for the health
    service with KV entries only, and nothing here answers its state request."""
    values: dict[str, Any] = {
        "mode": "cluster",
        "node_condition": False,
        "quiet_window_s": 0.05,
        "max_delay_s": 0.2,
        "reconcile_interval_s": 0.0,
        "api_timeout_s": 2.0,
        "backoff_base_s": 0.02,
        "backoff_max_s": 0.2,
        "retry_after_max_s": 2.0,
        "request_retry_s": 0.2,
    }
    values.update(overrides)
    return ReporterSettings(**values)


class HeldClock:
    """A monotonic clock that stands still until the test moves it: the reporter's
    debouncer on it releases nothing until :meth:`advance` passes the due time, so a
    burst is one burst however slowly a loaded machine delivers it."""

    def __init__(self) -> None:
        # A whole number of seconds: steps that are binary fractions (0.25, 0.125) then
        # add up exactly, so "the clock is at the due time" is exact, not one ulp short.
        self.now = float(int(time.monotonic()))

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class RunningReporter:
    service: ReporterService
    bus: Bus
    runtime: Runtime
    probe: MetricsProbe


@asynccontextmanager
async def running_reporter(
    nats_url: str,
    tmp_path: Path,
    node: str,
    reporter: ReporterSettings,
    *,
    nvml_backend: Literal["auto", "nvml", "mock"] = "auto",
    env: dict[str, str] | None = None,
    sa_dir: Path | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[RunningReporter]:
    """The reporter service; ``env`` and ``sa_dir`` are its in-cluster environment (the
    service-account directory, ``/var/run/secrets/kubernetes.io/serviceaccount`` in a
    pod), absent unless given; ``clock`` its debouncer's and Device loop's."""
    settings = Settings(
        node_name=node,
        state_dir=str(tmp_path / "state"),
        nats=NatsSettings(url=nats_url),
        reporter=reporter,
    )
    settings.nvml.backend = nvml_backend
    settings.nvml.library = HIDDEN_DRIVER  # never the host's GPUs, whatever it has
    probe = MetricsProbe()
    async with runtime_for(settings, meter=probe.meter) as runtime:
        bus = runtime.bus
        service = ReporterService(
            runtime, env=env or {}, sa_dir=sa_dir or tmp_path / "no-service-account", clock=clock
        )
        await health_bucket(bus)  # as a running health service would have it
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            try:
                yield RunningReporter(service, bus, runtime, probe)
            finally:
                tg.cancel_scope.cancel()


async def wait_until(
    predicate: Callable[[], bool], within: float = 5.0, interval: float = 0.01
) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``within`` seconds.

    Polling, not an event: the state lives in an HTTP server and in other tasks."""
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(interval)


def koordlet_foreign_devices() -> list[dict[str, Any]]:
    """``spec.devices`` entries koordlet reports beside the GPUs: an RDMA NIC with two
    virtual-function groups and an FPGA, shaped as koordlet's ``states_device_linux.go``
    writes them (key order included)."""
    return [
        {
            "type": "rdma",
            "id": "0000:1f:00.0",
            "minor": 0,
            "health": True,
            "resources": {"koordinator.sh/rdma": "100"},
            "topology": {
                "socketID": 0,
                "nodeID": 0,
                "pcieID": "pci0000:1d",
                "busID": "0000:1f:00.0",
            },
            "labels": {"type": "PF", "vendor": "15b3"},
            "vfGroups": [
                {
                    "labels": {"type": "general"},
                    "vfs": [
                        {"minor": 0, "busID": "0000:1f:00.2"},
                        {"minor": 1, "busID": "0000:1f:00.3"},
                    ],
                },
                {"labels": {"type": "storage"}, "vfs": [{"minor": 2, "busID": "0000:1f:00.4"}]},
            ],
        },
        {
            "type": "fpga",
            "id": "fpga-0000:af:00.0",
            "minor": 0,
            "health": True,
            "resources": {"koordinator.sh/fpga": "100"},
        },
    ]
