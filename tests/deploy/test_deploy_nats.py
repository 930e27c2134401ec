"""The NATS users and permissions of deploy/nats, loaded into a real nats-server.

Each service's user must be able to do its job (publish its data, answer its
requests, use its JetStream stream and bucket) and be refused everything else: above
all, publishing health events, answering allocation requests (subscribing to
``gpulet.allocator.*.>``), forging replies or reading the replies meant for another
user (each user reads only its own inboxes, ``_INBOX.<user>.>``, and gpulet's Bus
creates every inbox under ``nats.inbox_prefix``). A refused publish or subscribe is seen
twice: the server reports a permissions violation to the client, and the message never
reaches a subscriber that would have received it.

No test waits a fixed time for something to arrive or to stay away. "It arrived" is a
condition wait; "it did not arrive" is a causal barrier (:func:`settle`): the senders'
and then the receivers' PING/PONG round trips, after which the one server has routed
everything sent before and the receivers have read it, and the subscriptions' queues
drained. Across a leaf connection, a permitted marker sent after the refused messages
over the same route plays that part (its arrival proves the earlier ones would have
arrived first).

Both variants are checked: ``auth.conf`` (production) and ``mock/auth.conf``
(docker-compose and the mock overlay), which may only add the mock fault injection.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
import nats
import nats.errors
import nats.js.errors
import nats.micro
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from nats.micro.request import Request

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.codec import Codec
from gpulet_common.embedded_nats import EmbeddedNats, free_port
from gpulet_common.messages import GpuHealth, GpuSample, SampleBatch
from gpulet_common.nodeview import NodeView
from gpulet_common.settings.nats import NatsSettings
from support.deploy import (
    NATS_DIR,
    NATS_USERS,
    inbox_prefix,
    node_config,
    password_for,
    set_passwords,
)
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

NODE = "gpu-node-1.example"


@dataclass
class Conn:
    """A nats-py connection as one user, with the asynchronous errors it was sent."""

    user: str
    nc: NatsClient
    errors: list[str] = field(default_factory=list)

    def _violations(self) -> list[str]:
        return [e for e in self.errors if "permissions violation" in e.lower()]

    async def violations(self, *, at_least: int = 0) -> list[str]:
        """The permissions violations reported so far, waiting for ``at_least`` of them.

        A flush (PING/PONG) first, so the server has handled everything sent before;
        its -ERR for a refusal may still come after the PONG (measured: about 3 in
        100), hence the wait for an expected count.
        """
        await self.nc.flush(timeout=2)
        await wait_until(
            lambda: len(self._violations()) >= at_least,
            what=f"{at_least} permissions violation(s) for {self.user}",
        )
        return self._violations()

    async def refused(self, subject: str) -> bool:
        """Whether the server refused something on ``subject`` (waits up to 5 s for it)."""
        await self.nc.flush(timeout=2)
        # nats-py lower-cases the server's error text.
        try:
            await wait_until(
                lambda: any(subject.lower() in v for v in self._violations()),
                what=f"a refusal of {subject}",
            )
        except AssertionError:
            return False
        return True


@asynccontextmanager
async def connect(
    server: EmbeddedNats, user: str, password: str | None = None, *, prefix: str | None = None
) -> AsyncIterator[Conn]:
    """Connect as ``user``, with its own inbox prefix unless ``prefix`` is given."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        server.url,
        user=user,
        password=password if password is not None else password_for(user),
        error_cb=on_error,
        allow_reconnect=False,
        connect_timeout=2,
        inbox_prefix=inbox_prefix(user) if prefix is None else prefix,
    )
    try:
        yield Conn(user, nc, errors)
    finally:
        await nc.close()


def bus_settings(server: EmbeddedNats, user: str, **changes: str) -> NatsSettings:
    """A service's NATS settings, as its container gets them from the environment."""
    settings = NatsSettings(
        url=server.url,
        user=user,
        password=password_for(user),
        inbox_prefix=inbox_prefix(user),
        connect_timeout_s=2,
    )
    return msgspec.structs.replace(settings, **changes)


@pytest.fixture(params=[False, True], ids=["production", "mock"])
async def secured(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[EmbeddedNats, bool]]:
    mock: bool = request.param
    set_passwords(monkeypatch)
    config = node_config(tmp_path, mock=mock)
    async with EmbeddedNats(state_dir=tmp_path / "nats", config_file=config) as server:
        yield server, mock


class Heard(list[Msg]):
    """What one subscription received so far, and the subscription (for :func:`settle`)."""

    def __init__(self, nc: NatsClient) -> None:
        super().__init__()
        self.nc = nc
        self.sub: Subscription | None = None

    @property
    def drained(self) -> bool:
        return self.sub is not None and self.sub.pending_msgs == 0


def _nc(conn: Conn | NatsClient) -> NatsClient:
    return conn.nc if isinstance(conn, Conn) else conn


async def listen(
    conn: Conn | NatsClient, subject: str, *, publishers: Sequence[Conn | NatsClient] = ()
) -> Heard:
    """Collect what ``subject`` receives from now on (a callback never loses one).

    The subscription is flushed before this returns, and then every connection in
    ``publishers`` makes a round trip too. The first alone is not enough: measured
    with nats-server 2.15.1 and nats-py, a message published right after another
    connection's flushed SUB was not delivered 4 to 7 times in 100; with the
    publisher's own PING/PONG after the subscriber's, 0 in 350.
    """
    heard = Heard(_nc(conn))

    async def collect(msg: Msg) -> None:
        heard.append(msg)  # no await: done as soon as nats-py takes it off the queue

    heard.sub = await heard.nc.subscribe(subject, cb=collect)
    await heard.nc.flush(timeout=2)
    for publisher in publishers:
        await _nc(publisher).flush(timeout=2)
    return heard


async def settle(senders: Sequence[Conn], heard: Sequence[Heard]) -> None:
    """Return once whatever ``senders`` published is in ``heard``, if it goes there at all.

    A causal barrier on one server, no fixed wait: a sender's PONG comes after the
    server routed all it published before (delivery is queued on the receivers'
    connections then); a receiver's PONG comes after those deliveries on its
    connection; a drained queue means the callbacks ran.
    """
    for sender in senders:
        await sender.nc.flush(timeout=2)
    for nc in {id(h.nc): h.nc for h in heard}.values():
        await nc.flush(timeout=2)
    await wait_until(lambda: all(h.drained for h in heard), what="deliveries handled")


async def request(conn: Conn, subject: str, data: bytes) -> Msg:
    # A responder's SUB was flushed before, but on a loaded machine give the server a
    # moment; a refused subscription still fails, as a NoRespondersError.
    for _ in range(20):
        try:
            return await conn.nc.request(subject, data, timeout=2)
        except nats.errors.NoRespondersError:
            await anyio.sleep(0.1)
    return await conn.nc.request(subject, data, timeout=2)


def _batch() -> SampleBatch:
    return SampleBatch(
        node=NODE,
        timestamp=1.0,
        samples=[GpuSample(uuid="GPU-a", index=0, timestamp=1.0, temperature_c=40)],
    )


async def test_clients_without_valid_credentials_are_refused(
    secured: tuple[EmbeddedNats, bool],
) -> None:
    server, _ = secured
    for user, password in [("", ""), ("collector", "wrong"), ("intruder", "pw-intruder")]:
        with pytest.raises((nats.errors.Error, OSError)):
            await nats.connect(
                server.url,
                user=user or None,
                password=password or None,
                allow_reconnect=False,
                connect_timeout=2,
                max_reconnect_attempts=0,
            )


async def test_collector_publishes_data_and_answers_inventory_requests(
    secured: tuple[EmbeddedNats, bool],
) -> None:
    server, _ = secured
    async with (
        connect(server, "collector") as collector,
        connect(server, "operator") as operator,
        connect(server, "reporter") as reporter,
    ):
        watch = await listen(operator, "gpu.>", publishers=[collector])
        await collector.nc.publish(subjects.samples(NODE), codec.SAMPLES.encode(_batch()))
        await collector.nc.publish(subjects.inventory(NODE), b"{}")

        async def answer(msg: Msg) -> None:
            await msg.respond(b"inventory")

        await collector.nc.subscribe(subjects.inventory_request(NODE), cb=answer)
        await collector.nc.flush()
        reply = await request(reporter, subjects.inventory_request(NODE), b"{}")
        assert reply.data == b"inventory"
        await wait_until(lambda: len(watch) >= 2, what="samples and inventory delivered")
        await settle([collector], [watch])
        got = sorted(m.subject for m in watch)
        assert got == sorted([subjects.samples(NODE), subjects.inventory(NODE)])
        assert await collector.violations() == []
        assert await reporter.violations() == []


async def test_collector_cannot_publish_health_forge_replies_or_serve_allocations(
    secured: tuple[EmbeddedNats, bool],
) -> None:
    server, _ = secured
    async with connect(server, "collector") as collector, connect(server, "operator") as operator:
        watch = await listen(operator, "gpu.health.*")
        inbox = await listen(operator, inbox_prefix("operator") + ".>", publishers=[collector])
        await collector.nc.publish(subjects.health(NODE), b'{"forged": true}')
        assert await collector.refused(subjects.health(NODE))
        # A reply subject nobody asked it to answer: forging a reply is refused.
        forged = inbox_prefix("operator") + ".test.1"
        await collector.nc.publish(forged, b"forged reply")
        assert await collector.refused(forged)
        await collector.nc.subscribe(subjects.allocator_prefix(NODE) + ".>")
        assert await collector.refused("gpulet.allocator")
        await collector.nc.publish("$JS.API.STREAM.DELETE.GPU_HEALTH", b"")
        assert await collector.refused("$JS.API.STREAM.DELETE.GPU_HEALTH")
        await settle([collector], [watch, inbox])
        assert watch == []
        assert inbox == []


@pytest.mark.parametrize("user", [u for u in NATS_USERS if u != "health"])
async def test_only_health_publishes_health_events(
    secured: tuple[EmbeddedNats, bool], user: str
) -> None:
    server, _ = secured
    async with connect(server, user) as conn, connect(server, "operator") as operator:
        watch = await listen(operator, "gpu.health.*", publishers=[conn])
        await conn.nc.publish(subjects.health(NODE), b"{}")
        assert await conn.refused(subjects.health(NODE))
        await settle([conn], [watch])
        assert watch == []


@pytest.mark.parametrize("user", [u for u in NATS_USERS if u != "allocator"])
async def test_only_the_allocator_answers_allocation_requests(
    secured: tuple[EmbeddedNats, bool], user: str
) -> None:
    server, _ = secured
    async with connect(server, user) as conn:
        await conn.nc.subscribe("gpulet.allocator.*.>")
        await conn.nc.subscribe(subjects.allocator_endpoint(NODE, "allocate"))
        violations = await conn.violations(at_least=2)
        assert len([v for v in violations if "gpulet.allocator" in v]) == 2, violations


async def test_allocator_micro_service_answers_the_device_plugin(
    secured: tuple[EmbeddedNats, bool],
) -> None:
    server, _ = secured
    async with (
        connect(server, "allocator") as allocator,
        connect(server, "device-plugin") as plugin,
        connect(server, "operator") as operator,
        connect(server, "reporter") as reporter,
        connect(server, "collector") as collector,
    ):

        async def allocate(req: Request) -> None:
            await req.respond(b"granted:" + req.data)

        service = await nats.micro.add_service(
            allocator.nc, name="gpulet-allocator", version="0.1.0"
        )
        group = service.add_group(name=subjects.allocator_prefix(NODE))
        await group.add_endpoint(name="allocate", handler=allocate)

        async def state(req: Request) -> None:
            await req.respond(b"state")

        await group.add_endpoint(name="state", handler=state)

        async def reset(req: Request) -> None:
            await req.respond(b"reset")

        await group.add_endpoint(name="reset", handler=reset)

        async def held(req: Request) -> None:
            await req.respond(b"held")

        await group.add_endpoint(name=subjects.ALLOCATOR_HELD_ENDPOINT, handler=held)

        async def pods(req: Request) -> None:
            await req.respond(b"pods")

        await group.add_endpoint(name=subjects.ALLOCATOR_PODS_ENDPOINT, handler=pods)
        await allocator.nc.flush()

        subject = subjects.allocator_endpoint(NODE, "allocate")
        reply = await request(plugin, subject, b"gpu-0")
        assert reply.data == b"granted:gpu-0"
        # Discovery and stats, as `nats micro ls` would ask.
        info = await request(operator, "$SRV.INFO.gpulet-allocator", b"")
        assert msgspec.json.decode(info.data)["name"] == "gpulet-allocator"
        # The operator may read the allocator's state (`gpulet allocator state`)...
        answer = await request(operator, subjects.allocator_endpoint(NODE, "state"), b"{}")
        assert answer.data == b"state"
        # ...and accept a lost allocation record (`gpulet allocator reset --confirm`).
        answer = await request(operator, subjects.allocator_endpoint(NODE, "reset"), b"{}")
        assert answer.data == b"reset"
        # The reporter may ask which GPUs the device plugin holds (dra.mode both)...
        held_subject = subjects.allocator_endpoint(NODE, subjects.ALLOCATOR_HELD_ENDPOINT)
        answer = await request(reporter, held_subject, b"{}")
        assert answer.data == b"held"
        # The collector may ask which pods hold which GPU (its metric labels) and
        # nothing else of the allocator...
        pods_subject = subjects.allocator_endpoint(NODE, subjects.ALLOCATOR_PODS_ENDPOINT)
        answer = await request(collector, pods_subject, b"{}")
        assert answer.data == b"pods"
        await collector.nc.publish(held_subject, b"{}")
        assert await collector.refused("gpulet.allocator")
        # ...and read-only users cannot ask for allocations.
        for conn in (operator, reporter, collector):
            await conn.nc.publish(subject, b"gpu-1")
            assert await conn.refused("gpulet.allocator")
        await service.stop()
        assert await allocator.violations() == []
        assert await plugin.violations() == []


async def _keys(kv: KeyValue) -> list[str]:
    """``kv.keys()`` (the ordered consumer is what these rights must allow), asked again
    a bounded number of times: nats-py can end its listing before its callback ran on
    a loaded machine and answer NoKeysError for a bucket that holds keys (the services
    list keys from the stream's info instead: ``gpulet_common.bus.kv_keys``)."""
    for _ in range(9):
        try:
            return await kv.keys()
        except nats.js.errors.NoKeysError:
            await anyio.sleep(0.1)
    return await kv.keys()


async def test_health_owns_its_stream_and_bucket_and_alerts_reads_them(
    secured: tuple[EmbeddedNats, bool],
) -> None:
    """The JetStream calls of the real Bus, as the health service and alerts make them."""
    server, _ = secured

    async with (
        Bus.connect(bus_settings(server, "health"), max_initial_attempts=3) as health,
        connect(server, "alerts") as alerts,
        Bus.connect(bus_settings(server, "alerts"), max_initial_attempts=3) as alerts_bus,
        connect(server, "operator") as operator,
    ):
        await health.ensure_stream(
            subjects.HEALTH_STREAM,
            list(subjects.HEALTH_STREAM_SUBJECTS),
            max_age_s=3600,
            max_bytes=1 << 20,
            duplicate_window_s=60,
        )
        # Updating it (a restart with new limits) is allowed too.
        await health.ensure_stream(
            subjects.HEALTH_STREAM,
            list(subjects.HEALTH_STREAM_SUBJECTS),
            max_age_s=7200,
            max_bytes=1 << 20,
            duplicate_window_s=60,
        )
        live = await listen(operator, subjects.health(NODE), publishers=[health.client])
        seq = await health.js_publish(subjects.health(NODE), _batch(), codec.SAMPLES, msg_id="e-1")
        assert seq == 1
        await wait_until(lambda: len(live) >= 1, what="the event delivered live")
        await settle([], [live])
        assert [m.subject for m in live] == [subjects.health(NODE)]

        kv = await health.key_value(subjects.HEALTH_KV_BUCKET)
        key = subjects.health_kv_key(NODE, "GPU-a")
        await kv.put(key, b'{"healthy": false}')
        assert (await kv.get(key)).value == b'{"healthy": false}'
        assert await _keys(kv) == [key]  # a watch: an ordered consumer on KV_gpu_health

        # gpulet alerts: a durable consumer that resumes where it stopped, and KV reads,
        # through its Bus (replies and deliveries under _INBOX.alerts only).
        js = alerts_bus.jetstream
        sub = await js.pull_subscribe(
            "gpu.health.*", durable="gpulet-alerts", stream=subjects.HEALTH_STREAM
        )
        # A pull can come back empty on a loaded machine (its request expired before the
        # consumer was ready): pull again, a bounded number of times.
        msgs: list[Msg] = []
        for _ in range(10):
            try:
                msgs = await sub.fetch(1, timeout=2)
            except nats.errors.TimeoutError:
                continue
            if msgs:
                break
        assert [m.subject for m in msgs] == [subjects.health(NODE)]
        await msgs[0].ack_sync(timeout=2)
        alerts_kv = await js.key_value(subjects.HEALTH_KV_BUCKET)
        assert (await alerts_kv.get(key)).value == b'{"healthy": false}'
        assert await _keys(alerts_kv) == [key]
        assert await alerts.violations() == []
        assert alerts_bus.client.last_error is None
        assert health.client.last_error is None

        # What alerts must not do: write health or state, purge or delete the stream.
        # (Raw API publishes: refused requests would otherwise wait out a timeout.)
        for subject in (
            subjects.health(NODE),
            f"$KV.{subjects.HEALTH_KV_BUCKET}.{key}",
            f"$JS.API.STREAM.PURGE.{subjects.HEALTH_STREAM}",
            f"$JS.API.STREAM.DELETE.{subjects.HEALTH_STREAM}",
            f"$JS.API.CONSUMER.DELETE.{subjects.HEALTH_STREAM}.gpulet-alerts",
        ):
            await alerts.nc.publish(subject, b"{}")
            assert await alerts.refused(subject), subject
        # Nor may the health service itself delete or purge what it owns.
        for stream in (subjects.HEALTH_STREAM, "KV_" + subjects.HEALTH_KV_BUCKET):
            for verb in ("DELETE", "PURGE"):
                subject = f"$JS.API.STREAM.{verb}.{stream}"
                await health.client.publish(subject, b"")
                await health.flush()
        info = await health.jetstream.stream_info(subjects.HEALTH_STREAM)
        assert info.state.messages == 1
        assert (await kv.get(key)).value == b'{"healthy": false}'


# What each user's service asks, and who answers (the responders' own users).
REQUESTS: dict[str, list[str]] = {
    "health": [subjects.inventory_request(NODE)],
    "collector": [subjects.allocator_endpoint(NODE, subjects.ALLOCATOR_PODS_ENDPOINT)],
    "reporter": [subjects.inventory_request(NODE), subjects.health_state(NODE)],
    "allocator": [subjects.inventory_request(NODE), subjects.health_state(NODE)],
    "device-plugin": [
        subjects.allocator_endpoint(NODE, "allocate"),
        subjects.allocator_endpoint(NODE, "preferred"),
        # The DRA kubelet plugin's, when the device-plugin service hosts it
        # (dra.plugin_host = "device-plugin").
        subjects.allocator_endpoint(NODE, "reserve-claim"),
        subjects.allocator_endpoint(NODE, "release-claim"),
        subjects.inventory_request(NODE),
        subjects.health_state(NODE),
    ],
    "operator": [
        subjects.inventory_request(NODE),
        subjects.health_state(NODE),
        subjects.health_clear(NODE),
        subjects.allocator_endpoint(NODE, "state"),
        subjects.allocator_endpoint(NODE, "release"),
    ],
}
RESPONDERS = {
    subjects.inventory_request(NODE): "collector",
    subjects.health_state(NODE): "health",
    subjects.health_clear(NODE): "health",
    subjects.allocator_prefix(NODE) + ".>": "allocator",
}
REPLY_SUBJECT = Codec(str)


async def test_consumers_read_the_health_bucket_and_cannot_write_it(
    secured: tuple[EmbeddedNats, bool],
) -> None:
    """The reporter, the allocator and the device plugin follow each GPU's health
    through a NodeView (a watch on the gpu_health bucket); none may write the bucket,
    so the state they trust is the health service's alone. They may not subscribe to
    the health events either: they have no use for them."""
    server, _ = secured
    key = subjects.health_kv_key(NODE, "GPU-a")
    sick = GpuHealth(gpu_uuid="GPU-a", healthy=False, updated_at=1.0)
    async with Bus.connect(bus_settings(server, "health"), max_initial_attempts=3) as health:
        kv = await health.key_value(subjects.HEALTH_KV_BUCKET)
        await kv.put(key, codec.GPU_HEALTH.encode(sick))
        for user in ("reporter", "allocator", "device-plugin"):
            async with (
                Bus.connect(bus_settings(server, user), max_initial_attempts=3) as bus,
                connect(server, user) as raw,
                anyio.create_task_group() as tg,
            ):
                view = NodeView(bus, NODE, retry_s=0.1, who=user)
                await tg.start(view.run)
                with anyio.fail_after(5):
                    await view.health_seen.wait()
                assert view.health("GPU-a") == sick, user
                assert not view.healthy("GPU-a")
                forged = f"$KV.{subjects.HEALTH_KV_BUCKET}.{key}"
                await raw.nc.publish(forged, b'{"gpu_uuid": "GPU-a", "healthy": true}')
                assert await raw.refused(forged), user
                # Least privilege: they read state, not the event stream.
                await raw.nc.subscribe(subjects.health(NODE))
                assert await raw.refused(subjects.health(NODE)), user
                tg.cancel_scope.cancel()
            assert bus.client.last_error is None, (user, bus.client.last_error)
        assert (await kv.get(key)).value == codec.GPU_HEALTH.encode(sick)


async def test_every_requester_gets_its_replies_in_its_own_inbox(
    secured: tuple[EmbeddedNats, bool],
) -> None:
    """Each service's requests, made by a Bus with its settings, are answered in its inbox.

    The responders answer with the reply subject they saw, so the test sees both ends:
    the request went out with the requester's own prefix, and the reply came back.
    """
    server, _ = secured
    async with AsyncExitStack() as stack:
        responders = [
            await stack.enter_async_context(connect(server, u))
            for u in ("collector", "health", "allocator")
        ]
        by_user = {c.user: c for c in responders}
        for subject, user in RESPONDERS.items():

            async def answer(msg: Msg) -> None:
                await msg.respond(REPLY_SUBJECT.encode(msg.reply))

            await by_user[user].nc.subscribe(subject, cb=answer)
        for conn in responders:
            await conn.nc.flush(timeout=2)
        for user, requests in REQUESTS.items():
            async with Bus.connect(bus_settings(server, user), max_initial_attempts=3) as bus:
                for subject in requests:
                    reply = await bus.request(subject, "{}", REPLY_SUBJECT, REPLY_SUBJECT)
                    assert reply.startswith(inbox_prefix(user) + "."), (user, subject, reply)
                assert bus.client.last_error is None, (user, bus.client.last_error)
        for conn in responders:
            assert await conn.violations() == []


async def test_no_user_reads_the_replies_meant_for_another(
    secured: tuple[EmbeddedNats, bool],
) -> None:
    server, _ = secured
    async with AsyncExitStack() as stack:
        conns = {u: await stack.enter_async_context(connect(server, u)) for u in NATS_USERS}
        overheard: list[Heard] = []
        for user, conn in conns.items():
            others = [inbox_prefix(u) + ".>" for u in NATS_USERS if u != user]
            attempts = ["_INBOX.>", "_INBOX.*.>", "_INBOX.*", *others]
            overheard.extend([await listen(conn, subject) for subject in attempts])
            violations = await conn.violations(at_least=len(attempts))
            assert len(violations) == len(attempts), (user, violations)
            for subject in attempts:
                quoted = f'"{subject.lower()}"'
                assert any(quoted in v for v in violations), (user, subject, violations)

        # Real traffic meanwhile: the device plugin asks the allocator, the reporter
        # asks the health service for the state.
        async def answer(msg: Msg) -> None:
            await msg.respond(b"private")

        await conns["allocator"].nc.subscribe(subjects.allocator_prefix(NODE) + ".>", cb=answer)
        await conns["health"].nc.subscribe(subjects.health_state(NODE), cb=answer)
        await conns["allocator"].nc.flush(timeout=2)
        await conns["health"].nc.flush(timeout=2)
        plugin_reply = await request(
            conns["device-plugin"], subjects.allocator_endpoint(NODE, "allocate"), b"{}"
        )
        reporter_reply = await request(conns["reporter"], subjects.health_state(NODE), b"{}")
        assert plugin_reply.data == reporter_reply.data == b"private"
        await settle(list(conns.values()), overheard)
        assert [m for got in overheard for m in got] == []

        # A client of a service user that keeps the default prefix gets no reply: its
        # inbox subscription is refused (and the request times out).
        async with connect(server, "reporter", prefix="_INBOX") as stray:
            with pytest.raises(nats.errors.TimeoutError):
                await stray.nc.request(subjects.health_state(NODE), b"{}", timeout=0.3)
            assert await stray.refused("_INBOX.")


async def test_mock_fault_injection_only_in_the_mock_config(
    secured: tuple[EmbeddedNats, bool],
) -> None:
    server, mock = secured
    subject = subjects.mock_inject(NODE)
    async with (
        connect(server, "collector") as collector,
        connect(server, "health") as health,
        connect(server, "operator") as operator,
    ):
        seen: list[str] = []

        async def answer(msg: Msg) -> None:
            seen.append(msg.subject)
            await msg.respond(b'{"applied": true}')

        await collector.nc.subscribe(subject, cb=answer)
        await health.nc.subscribe(subject, cb=answer)
        if mock:
            await collector.nc.flush()
            await health.nc.flush()
            reply = await request(operator, subject, b"{}")
            assert reply.data == b'{"applied": true}'
            # Every mock process sees the fault, not just the one that answered.
            await wait_until(lambda: len(seen) == 2, what="both mock processes saw it")
            assert await collector.violations() == []
        else:
            assert await collector.refused(subject)
            assert await health.refused(subject)
            await operator.nc.publish(subject, b"{}")
            assert await operator.refused(subject)
            assert seen == []


def _significant(path: Path) -> list[str]:
    return [
        ln for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]


def test_mock_auth_is_production_plus_mock_injection_only() -> None:
    production = _significant(NATS_DIR / "auth.conf")
    mock = _significant(NATS_DIR / "mock" / "auth.conf")
    added = [ln for ln in mock if "gpulet.mock.inject" in ln]
    assert [ln for ln in mock if "gpulet.mock.inject" not in ln] == production
    assert len(added) == 3  # collector and health subscribe, operator publishes
    assert not any("gpulet.mock" in ln for ln in production)


def test_passwords_come_from_the_environment_only() -> None:
    for path in (NATS_DIR / "auth.conf", NATS_DIR / "mock" / "auth.conf"):
        passwords = re.findall(r"password:\s*(\S+)", path.read_text())
        assert len(passwords) == len(NATS_USERS)
        assert all(p.startswith("$GPULET_NATS_") for p in passwords), passwords


async def test_leaf_node_exports_gpu_data_and_keeps_control_traffic_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """node (leaf.conf) -> hub (hub.conf): fleet-wide gpu.health.* subscribers work."""
    set_passwords(monkeypatch, (*NATS_USERS, "leaf", "fleet"))
    leaf_port = free_port()
    hub_dir = tmp_path / "hub-conf"
    hub_dir.mkdir()
    hub_text = (NATS_DIR / "hub.conf").read_text()
    # The test's own leaf port, and a publisher on the hub to try imports with.
    hub_text = hub_text.replace("port: 7422", f"host: 127.0.0.1\n  port: {leaf_port}")
    hub_text = hub_text.replace(
        "    users = [\n",
        "    users = [\n      { user: hubwriter, password: hubwriter }\n",
        1,
    )
    (hub_dir / "hub.conf").write_text(hub_text)
    monkeypatch.setenv(
        "GPULET_NATS_LEAF_URL",
        f"nats-leaf://gpulet-leaf:{password_for('leaf')}@127.0.0.1:{leaf_port}",
    )
    node_conf = node_config(tmp_path, mock=False)
    async with (
        EmbeddedNats(
            state_dir=tmp_path / "hub", config_file=hub_dir / "hub.conf", jetstream=False
        ) as hub,
        EmbeddedNats(
            state_dir=tmp_path / "node", config_file=node_conf.parent / "leaf.conf"
        ) as node,
        connect(hub, "fleet") as fleet,
        connect(hub, "hubwriter", "hubwriter") as hubwriter,
        connect(node, "health") as health,
        connect(node, "collector") as collector,
        connect(node, "reporter") as reporter,
        connect(node, "device-plugin") as plugin,
        connect(node, "allocator") as allocator,
    ):
        fleet_health = await fleet.nc.subscribe("gpu.health.*")
        hub_all = await listen(hubwriter, ">", publishers=[collector])
        await fleet.nc.flush()
        # The leaf connection and the interest across it take a moment to form.
        with anyio.fail_after(10):
            while True:
                await health.nc.publish(subjects.health(NODE), b"event")
                try:
                    msg = await fleet_health.next_msg(timeout=0.2)
                    break
                except nats.errors.TimeoutError:
                    continue
        assert msg.subject == subjects.health(NODE)
        # Control traffic stays on the node. The node forwards to the hub over one leaf
        # connection, in order: a sample published after the control messages (each
        # flushed, so the node has handled it) arrives after them, had they crossed.
        await plugin.nc.publish(subjects.allocator_endpoint(NODE, "allocate"), b"req")
        await plugin.nc.flush(timeout=2)
        await reporter.nc.publish(subjects.health_state(NODE), b"req")
        await reporter.nc.flush(timeout=2)
        await collector.nc.publish(subjects.samples(NODE), b"sample")
        await wait_until(
            lambda: any(m.subject == subjects.samples(NODE) for m in hub_all),
            timeout_s=10,
            what="the sample on the hub",
        )
        await settle([], [hub_all])
        seen = {m.subject for m in hub_all}
        assert not any(s.startswith(("gpulet.", "$JS", "_INBOX")) for s in seen), seen

        # Control traffic from the hub never reaches the node: nobody there can ask
        # the allocator for GPUs or clear a GPU's health. The markers: GPU data (which
        # may cross from the hub) that each of those users may read, on the same node
        # connections, sent after the control messages over the same route; once
        # they are in, the control messages would be too.
        allocations = await listen(allocator, subjects.allocator_prefix(NODE) + ".>")
        clears = await listen(health, subjects.health_clear(NODE))
        markers = [
            await listen(allocator, "gpu.inventory.marker"),
            await listen(health, "gpu.samples.marker", publishers=[hubwriter]),
        ]
        for _ in range(50):  # until the markers' interest has crossed the leaf
            await hubwriter.nc.publish(subjects.allocator_endpoint(NODE, "allocate"), b"req")
            await hubwriter.nc.publish(subjects.health_clear(NODE), b"req")
            await hubwriter.nc.publish("gpu.inventory.marker", b"marker")
            await hubwriter.nc.publish("gpu.samples.marker", b"marker")
            await hubwriter.nc.flush(timeout=2)
            try:
                await wait_until(lambda: all(markers), timeout_s=0.2, what="markers")
                break
            except AssertionError:
                continue
        else:
            raise AssertionError("the markers never crossed from the hub to the node")
        await settle([], [allocations, clears, *markers])
        assert allocations == []
        assert clears == []


def test_nats_server_accepts_every_shipped_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    from gpulet_common.embedded_nats import nats_server_binary

    set_passwords(monkeypatch, (*NATS_USERS, "leaf", "fleet"))
    monkeypatch.setenv("GPULET_NATS_LEAF_URL", "nats-leaf://gpulet-leaf:x@127.0.0.1:7422")
    for mock in (False, True):
        conf = node_config(tmp_path / str(mock), mock=mock)
        for name in ("node.conf", "leaf.conf"):
            result = subprocess.run(
                [nats_server_binary(), "-t", "-c", str(conf.parent / name)],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
            assert result.returncode == 0, result.stderr
    shutil.copy(NATS_DIR / "hub.conf", tmp_path / "hub.conf")
    result = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(tmp_path / "hub.conf")],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert result.returncode == 0, result.stderr
