"""Durability: JetStream replay, the disk buffer across a nats-server restart, overflow,
and the state surviving a restart of the service."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from nats.js.api import DeliverPolicy

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import HealthEvent, HealthStateRequest
from gpulet_common.settings.nats import NatsSettings
from gpulet_health.buffer import DiskBuffer
from gpulet_health.kv import StateStore
from support.health_harness import health_node, until

pytestmark = pytest.mark.anyio


async def stream_events(url: str, want: int, *, within: float = 10.0) -> list[HealthEvent]:
    """Every event in the GPU_HEALTH stream, oldest first (waits for ``want`` of them)."""
    async with Bus.connect(NatsSettings(url=url), max_initial_attempts=20) as bus:
        js = bus.jetstream
        sub = await js.subscribe(
            subjects.HEALTH_WILDCARD,
            stream=subjects.HEALTH_STREAM,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        events: list[HealthEvent] = []
        with anyio.move_on_after(within):
            async for msg in sub.messages:
                events.append(codec.HEALTH_EVENT.decode(msg.data))
                if len(events) >= want:
                    break
        await sub.unsubscribe()
        return events


async def test_late_consumer_replays_from_the_stream_and_ids_deduplicate(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path, subscriber=False, collector=False) as h:
        for code in (79, 48, 13):
            h.inject("xid", gpu=0, value=code)
        await until(lambda: h.service.publisher.published_count >= 3)
        events = await stream_events(nats_server.url, 3)
        assert [e.xid for e in events] == [79, 48, 13]
        # A re-publish of the same event (as the disk buffer does after an outage) is
        # dropped by JetStream thanks to Nats-Msg-Id = <node>:<event_id>.
        bus = h.runtime.bus
        info = await bus.jetstream.stream_info(subjects.HEALTH_STREAM)
        await bus.js_publish(
            subjects.health(h.node),
            events[0],
            codec.HEALTH_EVENT,
            msg_id=subjects.event_msg_id(h.node, events[0].event_id),
        )
        after = await bus.jetstream.stream_info(subjects.HEALTH_STREAM)
        assert after.state.messages == info.state.messages == 3
        assert info.config.max_age == h.settings.health.stream.max_age_s
        assert info.config.duplicate_window == h.settings.health.stream.duplicate_window_s


async def test_nats_restart_during_a_fault_storm_loses_nothing(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    total = 150
    async with health_node(nats_server.url, tmp_path, collector=False) as h:

        async def storm() -> None:
            for i in range(total):
                # Distinct unknown XIDs: each one a new condition, never folded.
                h.inject("xid", gpu=i % 3, value=1000 + i)
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(storm)
            await anyio.sleep(0.3)
            await nats_server.stop()
            await anyio.sleep(0.6)
            await nats_server.start()
        await until(
            lambda: h.service.publisher.published_count >= total and not h.service.buffer.pending,
            within=10,
        )
        assert h.probe.value("gpulet.health.events_buffered") > 0  # the disk was used
        assert h.probe.value("gpulet.health.events_dropped") == 0
        events = await stream_events(nats_server.url, total)
        codes = [e.xid for e in events if e.kind == "xid"]
        assert codes == [1000 + i for i in range(total)]  # all of them, once, in order
        assert len({e.event_id for e in events}) == len(events)
        # The plain subscriber missed the outage but got everything published after it.
        await h.log.wait_for(lambda e: e.xid == 1000 + total - 1)


async def test_buffer_overflow_is_reported(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    overrides = ["health.buffer.max_events=5"]
    async with health_node(nats_server.url, tmp_path, overrides=overrides, collector=False) as h:
        h.inject("xid", gpu=0, value=79)
        await h.log.wait_for(lambda e: e.xid == 79)
        await nats_server.stop()
        await until(lambda: not h.runtime.bus.is_connected)
        for i in range(8):
            h.inject("xid", gpu=1, value=2000 + i)
        await until(lambda: h.probe.value("gpulet.health.events_dropped") >= 3)
        assert h.service.buffer.pending == 5
        await nats_server.start()
        # (The plain subscriber may still be reconnecting: read the stream.)
        events = await stream_events(nats_server.url, 7)
        assert [e.xid for e in events[:6]] == [79, 2000, 2001, 2002, 2003, 2004]
        overflow = events[6]
        assert overflow.kind == "buffer_overflow"
        assert overflow.gpu_uuid == ""
        assert overflow.observed_value == 3
        assert "dropped" in overflow.reason
        await until(lambda: h.service.buffer.overflow is None)


async def test_restart_keeps_sticky_conditions(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with health_node(nats_server.url, tmp_path) as h:
        h.inject("xid", gpu=0, value=79)
        await h.log.wait_for(lambda e: e.xid == 79)
        h.inject("temperature", gpu=1, value=99)
        await h.log.wait_for(lambda e: e.kind == "thermal")
        await until(lambda: h.service.store.writes >= 2 and not h.service.engine.take_dirty())
        await anyio.sleep(0.2)
    # A new process: fresh mock (GPU 1 is cool again), same NATS and state directory.
    async with health_node(nats_server.url, tmp_path) as h2:
        state = await h2.runtime.bus.request(
            subjects.health_state(h2.node),
            HealthStateRequest(gpu="0"),
            codec.HEALTH_STATE_REQUEST,
            codec.HEALTH_STATE,
        )
        assert [c.condition for c in state.gpus[0].conditions] == ["xid:79"]
        assert not state.gpus[0].healthy
        # The level condition recovers from the new samples; the sticky one stays.
        [cool] = await h2.log.wait_for(lambda e: e.kind == "recovered" and e.condition == "thermal")
        assert cool.gpu_uuid == h2.uuid(1)
        assert not h2.log.where(lambda e: e.kind == "xid")


async def test_events_queued_at_shutdown_are_kept_and_published_next_start(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with health_node(nats_server.url, tmp_path, collector=False, subscriber=False) as h:
        for i in range(60):
            h.inject("xid", gpu=i % 3, value=4000 + i)
        # Leave while the service is still publishing: no waiting here on purpose.
        await until(lambda: h.probe.value("gpulet.health.events") >= 10)
    produced = int(h.probe.value("gpulet.health.events"))
    published = h.service.publisher.published_count
    assert produced >= 10
    on_disk = DiskBuffer(
        tmp_path / "state" / "health-buffer",
        max_bytes=1 << 30,
        max_events=1 << 20,
        segment_bytes=1 << 20,
    )
    on_disk.open()
    kept = on_disk.pending
    on_disk.close()
    print(f"produced {produced}, published {published}, kept on disk {kept}")
    assert published + kept >= produced  # nothing produced went missing
    async with health_node(nats_server.url, tmp_path, collector=False, subscriber=False) as h2:
        await until(lambda: h2.service.buffer.pending == 0, within=5)
    events = await stream_events(nats_server.url, produced)
    codes = [e.xid or 0 for e in events if e.kind == "xid"]
    assert len(codes) == produced
    assert codes == sorted(codes)  # in order
    assert len(set(codes)) == produced  # once each


async def test_an_unreadable_previous_state_is_retried_then_said(tmp_path: Path) -> None:
    """Starting without the previous state would forget a fatal XID: the service keeps
    trying to read it, and says so when it could not (here: no JetStream at all)."""
    async with (
        EmbeddedNats.running(state_dir=tmp_path / "nats", port=0, jetstream=False) as no_jetstream,
        health_node(
            no_jetstream.url,
            tmp_path,
            overrides=["health.stream.restore_timeout_s=0.5"],
            subscriber=False,
        ) as h,
    ):
        store = StateStore(h.runtime.bus, h.node, history=1, timeout_s=0.2)
        started = anyio.current_time()
        assert await store.load(within_s=0.3) is None
        assert anyio.current_time() - started >= 0.1  # it retried before giving up
        await until(
            lambda: (s := h.runtime.status.get("health")) is not None and s.state == "degraded",
            within=10,
        )
        status = h.runtime.status.get("health")
        assert status is not None
        assert "previous health state" in status.detail
