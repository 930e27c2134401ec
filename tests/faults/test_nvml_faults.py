"""NVML hanging on one GPU, and NVML vanishing altogether.

* **A hung GPU** (every NVML call on it blocks for seconds): the collector keeps
  publishing a sample batch every period, the hung GPU's sample says
  ``error: "timeout"`` and the others are read as usual; the health service keeps
  turning the other GPUs' NVML events into health events at once, and the hung GPU is
  not called unhealthy for being slow. When the hang ends, the GPU is read again.
* **NVML vanishing** (the driver unloaded, the library gone) and coming back, in the
  two layouts gpulet runs in:

  - one process (``gpulet run``): collector and health service share one NVML;
  - sidecars: ``gpulet serve collector`` and ``gpulet serve health`` as their own processes, each
    with its own NVML (here: its own mock, both hit by one injection over NATS).

  The failure is reported (an ``nvml_unavailable`` event and an unhealthy GPU for
  each GPU, the health service ``degraded`` in its status, every sample an error),
  what does not need NVML keeps answering (health state, inventory requests), and
  everything recovers by itself once NVML is back: ``recovered`` events, samples
  without errors.

The figures are printed on ``FIGURES`` lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats, free_port
from gpulet_common.messages import (
    HealthEvent,
    HealthStateRequest,
    InventoryRequest,
    MockInjectRequest,
    SampleBatch,
)
from gpulet_common.mock_nvml import SCENARIO_DIR
from gpulet_common.settings.nats import NatsSettings
from support.faults import (
    component_state,
    running_sidecars,
    service_env,
    summary,
    wait_component,
)
from support.health_harness import NODE, health_node

pytestmark = pytest.mark.anyio

DGX = SCENARIO_DIR / "dgx-h100.toml"
GPUS = 8
HUNG = 2
PERIOD_S = 1.0  # the production sample period
CALL_TIMEOUT_S = 0.5  # the production NVML call timeout (nvml.call_timeout_s)
HANG_S = 3.5
EVENT_BOUND_S = 0.5  # an XID on a healthy GPU reaches a subscriber within this
RECOVERY_BOUND_S = 8.0  # NVML back -> everything recovered (back-off is at most 5 s)


@dataclass
class Samples:
    batches: list[tuple[float, SampleBatch]] = field(default_factory=list)

    def since(self, at: float) -> list[tuple[float, SampleBatch]]:
        return [(t, b) for t, b in self.batches if t >= at]

    def last(self) -> SampleBatch | None:
        return self.batches[-1][1] if self.batches else None


async def _follow_samples(
    url: str, samples: Samples, *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    async with (
        Bus.connect(NatsSettings(url=url), name="test-samples", max_initial_attempts=10) as bus,
        bus.subscribe(subjects.samples(NODE), codec.SAMPLES) as stream,
    ):
        await bus.flush()
        task_status.started()
        async for delivery in stream:
            samples.batches.append((time.monotonic(), delivery.value))


async def _wait(check: Any, within: float, what: str, step: float = 0.02) -> float:
    """Poll until ``check()``; returns the time it took."""
    started = time.monotonic()
    with anyio.move_on_after(within):
        while not check():  # noqa: ASYNC110 - the state lives in other tasks and processes
            await anyio.sleep(step)
    if not check():
        raise AssertionError(f"not within {within}s: {what}")
    return time.monotonic() - started


# --- a hung GPU ---------------------------------------------------------------------------


async def test_a_hung_gpu_does_not_hold_up_the_others(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    overrides = [f"collector.sample_period_s={PERIOD_S}", f"nvml.call_timeout_s={CALL_TIMEOUT_S}"]
    samples = Samples()
    async with (
        health_node(nats_server.url, tmp_path, overrides=overrides, scenario=DGX) as h,
        anyio.create_task_group() as tg,
    ):
        await tg.start(_follow_samples, nats_server.url, samples)
        await _wait(lambda: len(samples.batches) >= 2, 5, "two sample batches")
        hung_uuid = h.uuid(HUNG)

        hang_at = time.monotonic()
        h.inject("hang", gpu=HUNG, duration_s=HANG_S)
        # An XID on another GPU in the middle of the hang.
        await anyio.sleep(1.2)
        xid_at = time.monotonic()
        h.inject("xid", gpu=5, value=79)
        await h.log.wait_for(lambda e: e.xid == 79 and e.gpu_uuid == h.uuid(5), within=5)
        xid_latency = time.monotonic() - xid_at
        # A fault on the hung GPU itself still gets through (NVML events are not calls).
        h.inject("xid", gpu=HUNG, value=48)
        await h.log.wait_for(lambda e: e.xid == 48 and e.gpu_uuid == hung_uuid, within=5)

        hang_end = hang_at + HANG_S
        await anyio.sleep(max(0.0, hang_end - time.monotonic()))
        # Read again once the hang is over.
        back = await _wait(
            lambda: any(
                s.uuid == hung_uuid and s.error is None
                for t, b in samples.since(hang_end)
                for s in b.samples
            ),
            PERIOD_S * 3 + 1,
            "a good sample of the formerly hung GPU",
        )
        state = h.service.engine.state(time.time())
        sample_errors = h.probe.value("gpulet.collector.sample_errors")
        tg.cancel_scope.cancel()

    during = [(t, b) for t, b in samples.batches if hang_at + 0.05 < t < hang_end]
    gaps = [b[0] - a[0] for a, b in zip(samples.batches, samples.batches[1:], strict=False)]
    hang_gaps = [
        t2 - t1
        for (t1, _), (t2, _) in zip(samples.batches, samples.batches[1:], strict=False)
        if hang_at - PERIOD_S < t2 < hang_end + PERIOD_S
    ]
    figures = {
        "hang_s": HANG_S,
        "batches_during_hang": len(during),
        "max_gap_during_hang_s": max(hang_gaps),
        "max_gap_overall_s": max(gaps),
        "xid_latency_other_gpu_s": xid_latency,
        "hung_gpu_read_again_after_hang_s": back,
        "collector_sample_errors": sample_errors,
    }
    print(summary(figures))

    # A batch every period, the hang costing at most one call timeout.
    assert len(during) >= int(HANG_S / PERIOD_S) - 1, figures
    assert max(hang_gaps) <= PERIOD_S + CALL_TIMEOUT_S + 0.3, figures
    for _, batch in during:
        by_uuid = {s.uuid: s for s in batch.samples}
        assert len(by_uuid) == GPUS
        assert by_uuid[hung_uuid].error == "timeout"
        others = [s for u, s in by_uuid.items() if u != hung_uuid]
        assert all(s.error is None and s.temperature_c is not None for s in others), batch
    assert xid_latency <= EVENT_BOUND_S, figures
    healthy = {g.gpu_uuid: g.healthy for g in state.gpus}
    # Slow is not unhealthy; the XIDs are.
    assert healthy == {h.uuid(i): i not in (5, HUNG) for i in range(GPUS)}
    assert not h.log.where(lambda e: e.gpu_uuid == hung_uuid and e.kind != "xid")


# --- NVML vanishing: one process ----------------------------------------------------------


async def _ask_state(url: str) -> dict[str, Any]:
    async with Bus.connect(NatsSettings(url=url), name="test-ask", max_initial_attempts=5) as bus:
        state = await bus.request(
            subjects.health_state(NODE),
            HealthStateRequest(),
            codec.HEALTH_STATE_REQUEST,
            codec.HEALTH_STATE,
            timeout_s=2,
        )
        inventory = await bus.request(
            subjects.inventory_request(NODE),
            InventoryRequest(reason="test"),
            codec.INVENTORY_REQUEST,
            codec.INVENTORY,
            timeout_s=2,
        )
    return {
        "unhealthy": sum(1 for g in state.gpus if not g.healthy),
        "nvml_conditions": sum(
            1 for g in state.gpus if any(c.condition == "nvml" for c in g.conditions)
        ),
        "inventory_gpus": len(inventory.gpus),
    }


def _all_errors(batch: SampleBatch | None) -> bool:
    return batch is not None and len(batch.samples) == GPUS and all(s.error for s in batch.samples)


def _all_good(batch: SampleBatch | None) -> bool:
    return (
        batch is not None
        and len(batch.samples) == GPUS
        and all(s.error is None for s in batch.samples)
    )


def _events(log: list[HealthEvent], kind: str, condition: str = "nvml") -> set[str]:
    return {e.gpu_uuid for e in log if e.kind == kind and e.condition == condition}


async def test_nvml_vanishing_in_one_process_is_reported_and_recovers(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    samples = Samples()
    overrides = ["collector.sample_period_s=0.25"]
    async with (
        health_node(nats_server.url, tmp_path, overrides=overrides, scenario=DGX) as h,
        anyio.create_task_group() as tg,
    ):
        await tg.start(_follow_samples, nats_server.url, samples)
        await _wait(lambda: _all_good(samples.last()), 5, "good samples")
        gone_at = time.monotonic()
        h.inject("nvml_vanish")
        reported = await _wait(
            lambda: len(_events(h.log.events, "nvml_unavailable")) == GPUS,
            5,
            "an nvml_unavailable event for every GPU",
        )
        await _wait(lambda: _all_errors(samples.last()), 5, "samples saying NVML is gone")
        health_status = h.runtime.status.get("health")
        assert health_status is not None
        assert health_status.state == "degraded"
        assert "NVML" in health_status.detail
        # What needs no NVML keeps answering.
        while_gone = await _ask_state(nats_server.url)
        assert while_gone == {"unhealthy": GPUS, "nvml_conditions": GPUS, "inventory_gpus": GPUS}
        await anyio.sleep(max(0.0, gone_at + 3.0 - time.monotonic()))

        back_at = time.monotonic()
        h.inject("nvml_return")
        recovered = await _wait(
            lambda: len(_events(h.log.events, "recovered")) == GPUS,
            RECOVERY_BOUND_S,
            "a recovered event for every GPU",
        )
        samples_back = await _wait(
            lambda: _all_good(samples.last()), RECOVERY_BOUND_S, "good samples again"
        )
        after = await _ask_state(nats_server.url)
        health_status = h.runtime.status.get("health")
        tg.cancel_scope.cancel()

    print(
        summary(
            {
                "layout": "one-process",
                "outage_s": back_at - gone_at,
                "reported_after_s": reported,
                "health_recovered_after_return_s": recovered,
                "samples_recovered_after_return_s": samples_back,
            }
        )
    )
    assert after == {"unhealthy": 0, "nvml_conditions": 0, "inventory_gpus": GPUS}
    assert health_status is not None
    assert health_status.state == "ready"


# --- NVML vanishing: sidecars, each with its own NVML -------------------------------------


@pytest.fixture
def sidecar_dirs(tmp_path: Path) -> tuple[Path, Path]:
    logs = tmp_path / "logs"
    logs.mkdir()
    return tmp_path / "state", logs


async def test_nvml_vanishing_in_sidecars_is_reported_and_recovers(
    nats_server: EmbeddedNats, sidecar_dirs: tuple[Path, Path]
) -> None:
    state_dir, logs = sidecar_dirs
    ports = {"collector": free_port(), "health": free_port()}
    common = ["--nats", nats_server.url, "--state-dir", str(state_dir), "--node", NODE]
    env = service_env({"GPULET_NATS__RECONNECT_MAX_WAIT_S": "0.5"})
    samples = Samples()
    events: list[HealthEvent] = []
    with running_sidecars(logs, common, env) as sidecars:
        for name, extra in {
            "collector": ["--set", "collector.sample_period_s=0.25"],
            "health": [],
        }.items():
            sidecars.add(
                name, ["--nvml", "mock:dgx-h100", "--metrics-port", str(ports[name]), *extra]
            ).start()
        try:
            async with (
                Bus.connect(NatsSettings(url=nats_server.url), max_initial_attempts=10) as bus,
                bus.subscribe(subjects.health(NODE), codec.HEALTH_EVENT) as stream,
                anyio.create_task_group() as tg,
            ):

                async def follow_events() -> None:
                    async for delivery in stream:
                        events.append(delivery.value)  # noqa: PERF401 - as they come

                tg.start_soon(follow_events)
                await tg.start(_follow_samples, nats_server.url, samples)
                await _wait(lambda: _all_good(samples.last()), 30, "good samples", step=0.1)
                await wait_component(ports["health"], "health")

                async def inject(fault: str) -> None:
                    # Not a queue group: both processes apply it; the first reply answers.
                    reply = await bus.request(
                        subjects.mock_inject(NODE),
                        MockInjectRequest(fault=fault),
                        codec.MOCK_INJECT_REQUEST,
                        codec.MOCK_INJECT_REPLY,
                        timeout_s=5,
                    )
                    assert reply.applied, reply

                gone_at = time.monotonic()
                await inject("nvml_vanish")
                reported = await _wait(
                    lambda: len(_events(events, "nvml_unavailable")) == GPUS,
                    10,
                    "an nvml_unavailable event for every GPU",
                )
                await _wait(lambda: _all_errors(samples.last()), 5, "samples saying NVML is gone")
                assert (await component_state(ports["health"], "health")).startswith("degraded")
                assert (await _ask_state(nats_server.url))["nvml_conditions"] == GPUS
                await anyio.sleep(max(0.0, gone_at + 3.0 - time.monotonic()))

                back_at = time.monotonic()
                await inject("nvml_return")
                recovered = await _wait(
                    lambda: len(_events(events, "recovered")) == GPUS,
                    RECOVERY_BOUND_S,
                    "a recovered event for every GPU (health sidecar)",
                )
                health_state = await component_state(ports["health"], "health")
                figures: dict[str, Any] = {
                    "layout": "sidecars",
                    "outage_s": back_at - gone_at,
                    "reported_after_s": reported,
                    "health_recovered_after_return_s": recovered,
                }
                assert health_state.startswith("ready"), health_state
                # The collector, with an NVML of its own that nobody else re-opens,
                # must initialise it again by itself.
                try:
                    figures["collector_samples_recovered_after_return_s"] = await _wait(
                        lambda: _all_good(samples.last()),
                        RECOVERY_BOUND_S,
                        "good samples again from the collector sidecar",
                    )
                finally:
                    print(summary(figures))
                tg.cancel_scope.cancel()
        except BaseException:
            print(sidecars.dump())
            raise
