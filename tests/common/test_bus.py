from __future__ import annotations

import time

import anyio
import msgspec
import pytest
from nats.aio.msg import Msg

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, Delivery, NoResponders, Refused, RequestTimeout
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import Ack, GpuSample, InventoryRequest, SampleBatch
from gpulet_common.settings.nats import NatsSettings
from support.metrics import MetricsProbe
from support.waiting import wait_until

pytestmark = pytest.mark.anyio


# Subscribers check timestamps against their clock: a sample of this test run.
NOW = time.time()


def _batch(node: str = "n1") -> SampleBatch:
    return SampleBatch(
        node=node,
        timestamp=NOW,
        samples=[GpuSample(uuid="GPU-a", index=0, timestamp=NOW, temperature_c=40)],
    )


async def test_typed_publish_subscribe_and_trace_headers(nats_server: EmbeddedNats) -> None:
    settings = NatsSettings(url=nats_server.url)
    async with (
        Bus.connect(settings) as bus,
        bus.subscribe(subjects.samples("n1.example"), codec.SAMPLES) as stream,
    ):
        await bus.publish(subjects.samples("n1.example"), _batch("n1.example"), codec.SAMPLES)
        with anyio.fail_after(2):
            delivery = await anext(aiter(stream))
    assert delivery.value == _batch("n1.example")
    assert delivery.subject == "gpu.samples.n1_example"
    assert "traceparent" in delivery.headers


async def test_malformed_messages_are_counted_logged_and_dropped(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    probe = MetricsProbe()
    async with Bus.connect(NatsSettings(url=nats_server.url), meter=probe.meter) as bus:
        subject = subjects.samples("n1")
        async with bus.subscribe(subject, codec.SAMPLES) as stream:
            for bad in [b"not json", b'{"node": 3}', b"[]", b'{"node":"n1"}', b"\xff\xfe"]:
                await bus.client.publish(subject, bad)
            await bus.publish(subject, _batch(), codec.SAMPLES)
            with anyio.fail_after(2):
                delivery = await anext(aiter(stream))
    assert delivery.value == _batch()  # the good one after five bad ones
    assert probe.value("gpulet.bus.malformed_messages", type="SampleBatch") == 5
    assert "dropped malformed SampleBatch" in caplog.text


async def test_request_reply_with_errors(nats_server: EmbeddedNats) -> None:
    async def handler(request: Delivery[InventoryRequest]) -> Ack:
        if request.value.reason == "reject":
            raise Refused("invalid_request", "reason must not be reject")
        if request.value.reason == "crash":
            raise RuntimeError("boom")
        return Ack(detail=request.value.reason)

    async with (
        Bus.connect(NatsSettings(url=nats_server.url)) as bus,
        anyio.create_task_group() as tg,
    ):
        await tg.start(bus.serve, "svc.test", handler, codec.INVENTORY_REQUEST, codec.ACK)
        ok = await bus.request(
            "svc.test", InventoryRequest(reason="hi"), codec.INVENTORY_REQUEST, codec.ACK
        )
        assert ok.detail == "hi"
        with pytest.raises(Refused) as info:
            await bus.request(
                "svc.test", InventoryRequest(reason="reject"), codec.INVENTORY_REQUEST, codec.ACK
            )
        assert info.value.code == "invalid_request"
        with pytest.raises(Refused) as info:
            await bus.request(
                "svc.test", InventoryRequest(reason="crash"), codec.INVENTORY_REQUEST, codec.ACK
            )
        assert info.value.code == "internal"
        assert "boom" in info.value.message
        reply = await bus.client.request("svc.test", b"{bad", timeout=2)
        assert reply.headers is not None
        # nats.micro's convention: the status in the headers, the code in the body.
        assert reply.headers["Nats-Service-Error-Code"] == "400"
        assert reply.headers["Nats-Service-Error"].startswith("malformed_request: ")
        assert codec.ERROR_REPLY.decode(reply.data).code == "malformed_request"
        with pytest.raises(NoResponders):
            await bus.request(
                "nobody.home", InventoryRequest(), codec.INVENTORY_REQUEST, codec.ACK, timeout_s=0.3
            )
        tg.cancel_scope.cancel()


async def test_jetstream_dedup_and_kv(nats_server: EmbeddedNats) -> None:
    async with Bus.connect(NatsSettings(url=nats_server.url)) as bus:
        await bus.ensure_stream("TEST", ["t.>"], max_age_s=60, max_bytes=1 << 20)
        first = await bus.js_publish("t.a", _batch(), codec.SAMPLES, msg_id="same")
        second = await bus.js_publish("t.a", _batch(), codec.SAMPLES, msg_id="same")
        assert first == second  # de-duplicated by message id
        info = await bus.jetstream.stream_info("TEST")
        assert info.state.messages == 1
        kv = await bus.key_value("test_bucket")
        await kv.put("k", codec.SAMPLES.encode(_batch()))
        entry = await kv.get("k")
        assert entry.value is not None
        assert codec.SAMPLES.decode(entry.value) == _batch()


async def test_connect_gives_up_after_bounded_attempts() -> None:
    from gpulet_common.bus import BusError
    from gpulet_common.embedded_nats import free_port

    settings = NatsSettings(
        url=f"nats://127.0.0.1:{free_port()}", connect_timeout_s=0.2, reconnect_wait_s=0.05
    )
    with anyio.fail_after(5), pytest.raises(BusError, match="cannot connect"):
        async with Bus.connect(settings, max_initial_attempts=2):
            pass


async def test_reconnects_after_server_restart(nats_server: EmbeddedNats) -> None:
    settings = NatsSettings(url=nats_server.url, reconnect_wait_s=0.05, reconnect_max_wait_s=0.2)
    async with Bus.connect(settings) as bus:
        await nats_server.stop()
        await wait_until(lambda: not bus.is_connected, timeout_s=3, what="disconnect")
        await nats_server.start()
        await wait_until(lambda: bus.is_connected, timeout_s=5, what="reconnect")
        async with bus.subscribe("after.restart", codec.SAMPLES) as stream:
            await bus.publish("after.restart", _batch(), codec.SAMPLES)
            with anyio.fail_after(2):
                assert (await anext(aiter(stream))).value == _batch()


def test_codec_rejects_wrong_types() -> None:
    with pytest.raises(msgspec.ValidationError):
        codec.SAMPLES.decode(b'{"node": "n", "timestamp": "yesterday"}')


async def test_a_request_on_a_lost_connection_is_a_timeout_not_a_crash(
    nats_server: EmbeddedNats,
) -> None:
    async with Bus.connect(NatsSettings(url=nats_server.url)) as bus:
        await bus.client.close()
        with pytest.raises(RequestTimeout, match="ConnectionClosedError"):
            await bus.request("any.thing", InventoryRequest(), codec.INVENTORY_REQUEST, codec.ACK)


async def test_refusals_are_bounded_in_size(nats_server: EmbeddedNats) -> None:
    async def handler(request: Delivery[InventoryRequest]) -> Ack:
        raise Refused("invalid_request", "unknown: " + request.value.reason)

    huge = "x" * 60_000  # under limits.request_max_bytes, far over a refusal's bound
    async with (
        Bus.connect(NatsSettings(url=nats_server.url)) as bus,
        anyio.create_task_group() as tg,
    ):
        await tg.start(bus.serve, "svc.bounded", handler, codec.INVENTORY_REQUEST, codec.ACK)
        with pytest.raises(Refused) as info:
            await bus.request(
                "svc.bounded", InventoryRequest(reason=huge), codec.INVENTORY_REQUEST, codec.ACK
            )
        tg.cancel_scope.cancel()
    assert info.value.code == "invalid_request"
    assert len(info.value.message) < 1100


async def test_every_inbox_uses_the_configured_prefix(nats_server: EmbeddedNats) -> None:
    """Requests, JetStream and KV API calls, pull fetches and KV watches: all replies and
    deliveries come under nats.inbox_prefix, so a server can confine a user to its own."""
    prefix = "_INBOX.unit-test"
    assert NatsSettings().inbox_prefix == "_INBOX"
    seen: list[tuple[str, str, bytes]] = []

    async def spy(msg: Msg) -> None:
        seen.append((msg.subject, msg.reply, msg.data))

    async def handler(request: Delivery[InventoryRequest]) -> Ack:
        return Ack(detail=request.reply)

    async with (
        Bus.connect(NatsSettings(url=nats_server.url)) as observer,
        Bus.connect(NatsSettings(url=nats_server.url, inbox_prefix=prefix)) as bus,
        anyio.create_task_group() as tg,
    ):
        await observer.client.subscribe("$JS.API.>", cb=spy)
        await tg.start(observer.serve, "svc.prefix", handler, codec.INVENTORY_REQUEST, codec.ACK)
        await observer.flush()
        ack = await bus.request(
            "svc.prefix", InventoryRequest(), codec.INVENTORY_REQUEST, codec.ACK
        )
        assert ack.detail.startswith(prefix + ".")
        await bus.ensure_stream("PFX", ["pfx.>"], max_age_s=60, max_bytes=1 << 20)
        await bus.js_publish("pfx.a", _batch(), codec.SAMPLES)
        sub = await bus.jetstream.pull_subscribe("pfx.>", durable="d", stream="PFX")
        assert len(await sub.fetch(1, timeout=2)) == 1
        kv = await bus.key_value("pfx_bucket")
        await kv.put("k", b"v")
        assert await kv.keys() == ["k"]  # a watch: an ordered push consumer
        await observer.flush()
        tg.cancel_scope.cancel()
    api_calls = [(subject, reply) for subject, reply, _ in seen if reply]
    assert any(s.startswith("$JS.API.CONSUMER.MSG.NEXT.") for s, _ in api_calls)
    assert [c for c in api_calls if not c[1].startswith(prefix + ".")] == []
    delivers = [
        msgspec.json.decode(data)["config"]["deliver_subject"]
        for subject, _, data in seen
        if subject.startswith("$JS.API.CONSUMER.CREATE.KV_pfx_bucket")
    ]
    assert delivers
    assert all(d.startswith(prefix + ".") for d in delivers), delivers


async def test_leaving_after_the_server_went_away_raises_nothing(
    nats_server: EmbeddedNats,
) -> None:
    """A pod's containers all get SIGTERM at once: NATS may be gone before a service
    closes its connection, and closing must then still end cleanly. nats-py's close
    writes out what it buffered while reconnecting and raised ConnectionResetError on
    the lost connection: the allocator exited 1 when the pod stopped."""
    settings = NatsSettings(url=nats_server.url, reconnect_wait_s=0.05, reconnect_max_wait_s=0.2)
    for wait_for_disconnect in (True, False, True, False):
        if not nats_server.is_running:
            await nats_server.start()
        with anyio.fail_after(10):
            async with Bus.connect(settings) as bus:
                await nats_server.stop()
                if wait_for_disconnect:
                    await wait_until(lambda: not bus.is_connected, timeout_s=3, what="disconnect")
                # Buffered while the client reconnects: written out on close.
                await bus.client.publish("any.thing", b"late")
        assert bus.client.is_closed
