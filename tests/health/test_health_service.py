"""Every rule through the real health service, a real nats-server and the mock NVML.

Faults are injected into the mock; what is asserted is what a plain subscriber of
``gpu.health.*`` receives on its own connection.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, Refused
from gpulet_common.codec import GPU_HEALTH
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import HealthClearRequest, HealthStateRequest
from gpulet_common.runtime import NvmlHandle, NvmlProvider, Runtime
from gpulet_common.telemetry import StatusBoard
from gpulet_health.service import HealthService
from support.agent import agent_settings
from support.health_harness import health_node, on, samples_pass

pytestmark = pytest.mark.anyio


async def test_xid_fatal_sticky_app_xid_reported_and_supported_events_only(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        # Only what each GPU supports is registered; a GPU without events is fine.
        assert h.service.registered == {0: 0x400B, 1: 0x400B, 2: 0x400B, 3: 0x8, 4: 0}
        state = h.service.engine.state(0.0)
        assert all(g.healthy for g in state.gpus)
        assert len(state.gpus) == 5

        h.inject("xid", gpu=0, value=79)
        [fatal] = await h.log.wait_for(on(h, 0, "xid"))
        assert (fatal.healthy, fatal.severity, fatal.action, fatal.xid) == (
            False,
            "fatal",
            "reboot",
            79,
        )
        assert fatal.condition == "xid:79"
        assert fatal.node == h.node
        assert fatal.gpu_index == 0
        assert fatal.published_at >= fatal.observed_at > 0

        h.inject("xid", gpu=1, value=13)
        [app] = await h.log.wait_for(on(h, 1, "xid"))
        assert (app.healthy, app.severity, app.action, app.condition) == (
            True,
            "warning",
            "restart_app",
            "",
        )

        # XID-only GPU (older driver) reports too.
        h.inject("xid", gpu=3, value=48)
        [dbe_xid] = await h.log.wait_for(on(h, 3, "xid"))
        assert not dbe_xid.healthy
        assert dbe_xid.action == "reset_gpu"

        await samples_pass(h)
        assert not h.log.where(lambda e: e.kind in ("recovered", "cleared"))
        gpus = {g.gpu_uuid: g for g in h.service.engine.state(0.0).gpus}
        assert not gpus[h.uuid(0)].healthy
        assert gpus[h.uuid(0)].conditions[0].sticky
        assert gpus[h.uuid(1)].healthy
        assert gpus[h.uuid(4)].healthy
        # The per-GPU gauge the alert rules use: 0 for the unhealthy GPUs, 1 otherwise.
        assert h.probe.value("gpulet.gpu.healthy", UUID=h.uuid(0)) == 0
        assert h.probe.value("gpulet.gpu.healthy", UUID=h.uuid(3)) == 0
        assert h.probe.value("gpulet.gpu.healthy", UUID=h.uuid(1)) == 1
        assert h.probe.value("gpulet.gpu.conditions", UUID=h.uuid(0), kind="xid") == 1


async def test_operator_clear_by_request_reply(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        bus = h.runtime.bus
        clear = subjects.health_clear(h.node)
        h.inject("xid", gpu=2, value=95)
        h.inject("xid", gpu=2, value=74)
        await h.log.wait_for(on(h, 2, "xid"), count=2)

        reply = await bus.request(
            clear,
            HealthClearRequest(gpu="2", condition="xid:74", requested_by="alice"),
            codec.HEALTH_CLEAR_REQUEST,
            codec.HEALTH_STATE,
        )
        assert [c.condition for c in reply.gpus[0].conditions] == ["xid:95"]
        [cleared] = await h.log.wait_for(on(h, 2, "cleared", "xid:74"))
        assert not cleared.healthy
        assert "alice" in cleared.reason
        assert cleared.condition_kind == "xid"
        assert cleared.condition_severity == "critical"

        reply = await bus.request(
            clear, HealthClearRequest(gpu=h.uuid(2)), codec.HEALTH_CLEAR_REQUEST, codec.HEALTH_STATE
        )
        assert reply.gpus[0].healthy
        assert reply.gpus[0].conditions == []
        [cleared] = await h.log.wait_for(on(h, 2, "cleared", "xid:95"))
        assert cleared.healthy

        for request, code in [
            (HealthClearRequest(gpu="9"), "unknown_gpu"),
            (HealthClearRequest(gpu="GPU-nope"), "unknown_gpu"),
            (HealthClearRequest(gpu="2", condition="thermal"), "unknown_condition"),
            (HealthClearRequest(gpu=" "), "invalid_request"),
        ]:
            with pytest.raises(Refused) as info:
                await bus.request(clear, request, codec.HEALTH_CLEAR_REQUEST, codec.HEALTH_STATE)
            assert info.value.code == code, info.value
        raw = await bus.client.request(clear, b'{"gpu": 3}', timeout=2)
        assert raw.headers is not None
        assert raw.headers["Nats-Service-Error"].startswith("malformed_request: ")


async def test_ecc_uncorrectable_sticky_until_reset(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        await samples_pass(h, 2)  # the counters' baseline
        h.inject("ecc_dbe", gpu=1, value=2)
        [dbe] = await h.log.wait_for(on(h, 1, "ecc_uncorrectable"))
        assert (dbe.healthy, dbe.severity, dbe.action) == (False, "fatal", "reset_gpu")
        await samples_pass(h)
        # The counter rise confirmed the event: nothing more, no recovery.
        assert len(h.log.where(on(h, 1, "ecc_uncorrectable"))) == 1
        assert not h.log.where(on(h, 1, "recovered"))

        h.inject("reset", gpu=1)
        [recovered] = await h.log.wait_for(on(h, 1, "recovered", "ecc_uncorrectable"))
        assert recovered.healthy
        assert "reset observed" in recovered.reason


async def test_reset_clears_sticky_xid_with_the_ecc_baseline(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        await samples_pass(h, 2)
        h.inject("xid", gpu=0, value=48)
        h.inject("ecc_dbe", gpu=0)
        await h.log.wait_for(on(h, 0, "ecc_uncorrectable"))
        await samples_pass(h)
        h.inject("reset", gpu=0)
        ends = await h.log.wait_for(on(h, 0, "recovered"), count=2)
        assert {e.condition for e in ends} == {"xid:48", "ecc_uncorrectable"}
        assert ends[-1].healthy


async def test_sbe_rate_warning_and_recovery(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    overrides = ["health.ecc.sbe_rate_per_hour=7200", "health.ecc.sbe_window_s=1"]  # > 2 per s
    async with health_node(nats_server.url, tmp_path, overrides=overrides) as h:
        await samples_pass(h, 2)
        h.inject("ecc_sbe", gpu=0, value=1)
        await samples_pass(h)
        assert not h.log.where(on(h, 0, "ecc_correctable_rate"))  # 1 per s: fine
        h.inject("ecc_sbe", gpu=0, value=5)
        [warning] = await h.log.wait_for(on(h, 0, "ecc_correctable_rate"))
        assert warning.healthy
        assert warning.severity == "warning"
        assert warning.threshold == 7200
        [ok] = await h.log.wait_for(on(h, 0, "recovered", "ecc_correctable_rate"), within=4)
        assert ok.healthy


async def test_remap_pending_then_reset_and_remap_failure(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        h.inject("remap_pending", gpu=2, value=3)
        [pending] = await h.log.wait_for(on(h, 2, "remap_pending"))
        assert (pending.healthy, pending.action, pending.observed_value) == (False, "reset_gpu", 3)
        h.inject("remap_failure", gpu=1)
        [failure] = await h.log.wait_for(on(h, 1, "remap_failure"))
        assert (failure.healthy, failure.severity, failure.action) == (
            False,
            "fatal",
            "hardware_inspection",
        )
        h.inject("reset", gpu=2)
        [done] = await h.log.wait_for(on(h, 2, "recovered", "remap_pending"))
        assert done.healthy


async def test_thermal_unhealthy_then_recovers_after_n_samples_below_hysteresis(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        h.inject("temperature", gpu=1, value=99)
        [hot] = await h.log.wait_for(on(h, 1, "thermal"))
        assert (hot.healthy, hot.observed_value, hot.threshold, hot.severity) == (
            False,
            99,
            95,
            "critical",
        )
        h.inject("temperature", gpu=1, value=91)  # below 95, not below 95 - 5
        await samples_pass(h, 8)
        assert not h.log.where(on(h, 1, "recovered"))
        h.inject("temperature", gpu=1, value=85)
        [cool] = await h.log.wait_for(on(h, 1, "recovered", "thermal"))
        assert cool.healthy
        assert "3 consecutive samples" in cool.reason
        assert cool.condition_since == hot.observed_at


async def test_temperature_oscillating_around_the_threshold_does_not_flap(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        period = h.settings.collector.sample_period_s
        for i in range(30):  # ~ 30 samples: 97, 93, 97, 93, ...
            h.inject("temperature", gpu=0, value=97 if i % 2 == 0 else 93)
            await anyio.sleep(period)
        h.inject("temperature", gpu=0, value=None)
        await h.log.wait_for(on(h, 0, "recovered", "thermal"))
        await samples_pass(h, 4)
        thermal = h.log.where(
            lambda e: e.gpu_uuid == h.uuid(0) and "thermal" in (e.condition, e.kind)
        )
        assert [e.kind for e in thermal] == ["thermal", "recovered"], h.log.dump()


async def test_nvml_slowdown_and_shutdown_thresholds(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        h.inject("temperature", gpu=2, value=94)  # this GPU: slowdown 94, shutdown 97
        [slow] = await h.log.wait_for(on(h, 2, "thermal_slowdown"))
        assert (slow.healthy, slow.severity, slow.threshold) == (True, "warning", 94)
        h.inject("temperature", gpu=2, value=97)
        [shutdown] = await h.log.wait_for(on(h, 2, "thermal_shutdown"))
        assert (shutdown.healthy, shutdown.threshold) == (False, 97)
        await h.log.wait_for(on(h, 2, "thermal"))
        h.inject("temperature", gpu=2, value=None)
        ends = await h.log.wait_for(on(h, 2, "recovered"), count=3)
        assert {e.condition for e in ends} == {"thermal", "thermal_slowdown", "thermal_shutdown"}
        assert ends[-1].healthy


async def test_lost_gpu_unhealthy_and_removed_then_back(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        h.inject("lost", gpu=1)  # GpuUnavailable event
        [lost] = await h.log.wait_for(on(h, 1, "gpu_lost"))
        assert (lost.healthy, lost.severity, lost.action) == (False, "critical", "reboot")
        [removed] = await h.log.wait_for(on(h, 1, "gpu_removed"))
        assert not removed.healthy
        h.inject("lost", gpu=3)  # no GpuUnavailable: the event wait fails with GPU_IS_LOST
        await h.log.wait_for(on(h, 3, "gpu_lost"))
        await h.log.wait_for(on(h, 3, "gpu_removed"))
        h.inject("reset", gpu=1)
        await h.log.wait_for(on(h, 1, "recovered"), count=2)
        [back] = await h.log.wait_for(on(h, 1, "gpu_added"))
        assert back.healthy
        state = await h.runtime.bus.request(
            subjects.health_state(h.node),
            HealthStateRequest(gpu=h.uuid(3)),
            codec.HEALTH_STATE_REQUEST,
            codec.HEALTH_STATE,
        )
        assert not state.gpus[0].present
        assert not state.gpus[0].healthy


async def test_fall_off_bus_then_reset(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        h.inject("fall_off_bus", gpu=2)
        [xid] = await h.log.wait_for(on(h, 2, "xid"))
        assert xid.xid == 79
        assert not xid.healthy
        await h.log.wait_for(on(h, 2, "gpu_lost"))
        await h.log.wait_for(on(h, 2, "gpu_removed"))
        h.inject("reset", gpu=2)
        ends = await h.log.wait_for(on(h, 2, "recovered"), count=3)
        assert {e.condition for e in ends} == {"xid:79", "lost", "removed"}
        [added] = await h.log.wait_for(on(h, 2, "gpu_added"))
        assert added.healthy


async def test_hot_add_and_removal(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        h.inject("hot_add")
        new_uuid = h.mock.slot_uuid(5)
        [added] = await h.log.wait_for(lambda e: e.kind == "gpu_added" and e.gpu_uuid == new_uuid)
        assert added.healthy
        assert added.gpu_index == 5
        assert added.severity == "info"
        h.inject("remove", gpu=4)
        [gone] = await h.log.wait_for(on(h, 4, "gpu_removed"))
        assert not gone.healthy
        # The new GPU's events are watched too.
        h.inject("xid", gpu=5, value=79)
        await h.log.wait_for(lambda e: e.kind == "xid" and e.gpu_uuid == new_uuid)
        h.inject("hot_add", gpu=4)
        await h.log.wait_for(on(h, 4, "gpu_added"))
        await h.log.wait_for(on(h, 4, "recovered", "removed"))


async def test_repeats_are_deduplicated_with_a_count(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path, overrides=["health.dedup_window_s=1"]) as h:
        for _ in range(25):
            h.inject("xid", gpu=0, value=79)
            h.inject("xid", gpu=1, value=13)
        [first] = await h.log.wait_for(on(h, 0, "xid"))
        assert first.repeat_count == 1
        fatal = await h.log.wait_for(on(h, 0, "xid"), count=2, within=3)
        app = await h.log.wait_for(on(h, 1, "xid"), count=2, within=3)
        assert [e.repeat_count for e in fatal] == [1, 24]
        assert [e.repeat_count for e in app] == [1, 24]
        assert len({e.event_id for e in fatal + app}) == 4
        assert fatal[1].observed_at >= fatal[0].observed_at
        assert not fatal[1].healthy


async def test_nvml_vanishes_and_returns(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with health_node(nats_server.url, tmp_path, collector=False) as h:
        h.inject("nvml_vanish")
        down = await h.log.wait_for(lambda e: e.kind == "nvml_unavailable", count=5)
        assert not any(e.healthy for e in down)
        assert h.runtime.status.get("health").state == "degraded"  # type: ignore[union-attr]
        h.inject("nvml_return")
        await h.log.wait_for(
            lambda e: e.kind == "recovered" and e.condition == "nvml", count=5, within=5
        )
        # Events flow again after NVML came back.
        h.inject("xid", gpu=0, value=79)
        await h.log.wait_for(on(h, 0, "xid"))


async def test_state_query_kv_and_malformed_samples(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        bus = h.runtime.bus
        # Garbage on the samples subject is dropped, counted, and changes nothing.
        for bad in [b"{", b'{"node": 1}', b"[]"]:
            await bus.client.publish(subjects.samples(h.node), bad)
        h.inject("xid", gpu=0, value=79)
        await h.log.wait_for(on(h, 0, "xid"))
        state = await bus.request(
            subjects.health_state(h.node),
            HealthStateRequest(),
            codec.HEALTH_STATE_REQUEST,
            codec.HEALTH_STATE,
        )
        assert [g.gpu_index for g in state.gpus] == [0, 1, 2, 3, 4]
        assert [g.healthy for g in state.gpus] == [False, True, True, True, True]
        one = await bus.request(
            subjects.health_state(h.node),
            HealthStateRequest(gpu="0"),
            codec.HEALTH_STATE_REQUEST,
            codec.HEALTH_STATE,
        )
        assert one.gpus == state.gpus[:1]
        with pytest.raises(Refused) as info:
            await bus.request(
                subjects.health_state(h.node),
                HealthStateRequest(gpu="42"),
                codec.HEALTH_STATE_REQUEST,
                codec.HEALTH_STATE,
            )
        assert info.value.code == "unknown_gpu"
        # A late consumer reads the current state from the KV bucket.
        kv = await bus.jetstream.key_value(subjects.HEALTH_KV_BUCKET)
        key = subjects.health_kv_key(h.node, h.uuid(0))
        with anyio.fail_after(3):
            while True:
                entry = await kv.get(key)
                assert entry.value is not None
                health = GPU_HEALTH.decode(entry.value)
                if not health.healthy:
                    break
                await anyio.sleep(0.05)
        assert health.conditions[0].condition == "xid:79"
        assert h.probe.value("gpulet.bus.malformed_messages", type="SampleBatch") == 3


class NoNvml(NvmlProvider):
    """NVML that cannot be opened (as on a host without the driver), on any host."""

    async def get(self, *, retry: bool = False) -> NvmlHandle:
        return NvmlHandle(None, "NVML unavailable: test host without a driver", "none")


async def test_without_nvml_the_service_runs_degraded(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    settings = agent_settings(nats_server.url, tmp_path)
    async with (
        Bus.connect(settings.nats) as bus,
        anyio.create_task_group() as tg,
    ):
        rt = Runtime(settings=settings, bus=bus, status=StatusBoard(), nvml=NoNvml(settings.nvml))
        await tg.start(HealthService(rt).run)
        status = rt.status.get("health")
        assert status is not None
        assert status.state == "degraded"
        assert "NVML" in status.detail
        state = await rt.bus.request(
            subjects.health_state(settings.node_name),
            HealthStateRequest(),
            codec.HEALTH_STATE_REQUEST,
            codec.HEALTH_STATE,
        )
        assert state.gpus == []
        tg.cancel_scope.cancel()


async def test_shutdown_is_prompt(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    import time

    async with health_node(
        nats_server.url, tmp_path, overrides=["health.event_wait_timeout_ms=200"]
    ) as h:
        h.inject("xid", gpu=0, value=79)
        await h.log.wait_for(on(h, 0, "xid"))
        started = time.monotonic()
    # The NVML wait thread returns within one wait timeout; the whole node well
    # within the 2 s shutdown budget.
    assert time.monotonic() - started < 2.0


async def test_power_brake_warns_and_recovers_through_the_service(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        h.inject("clock_event", gpu=1, value=0x80)  # the node's power brake asserted
        [warn] = await h.log.wait_for(on(h, 1, "clock_slowdown"))
        assert (warn.severity, warn.healthy, warn.action) == ("warning", True, "operator_check")
        assert "HW power brake slowdown" in warn.reason
        h.inject("clock_event", gpu=1, value=0x4)  # back to the SW power cap alone
        [end] = await h.log.wait_for(on(h, 1, "recovered", "clock_slowdown"))
        assert end.healthy
        assert not h.log.where(on(h, 0, "clock_slowdown"))
