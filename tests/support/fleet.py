"""A fleet on 127.0.0.1: a JetStream hub cluster and leaf nodes, from the shipped confs.

The hub servers run ``deploy/nats/fleet/hub.conf`` with an ``accounts.conf`` generated
by :class:`~gpulet_common.fleet.identity.IdentityStore` (the operator, accounts and
resolver, as ``gpulet fleet hub-config`` writes it); only addresses are changed
(loopback, free ports, routes to each other). Each leaf node runs
``deploy/nats/fleet-leaf.conf`` (node.conf with auth.conf and a leaf remote) with its
own ``.creds``; the two environment variables of that file are written in, since every
leaf has its own. Servers are real nats-servers; killing one is a SIGKILL.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import nats.errors
import nats.js.errors
from anyio.streams.memory import MemoryObjectSendStream

from gpulet_alerting import fleet_hub
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats, free_port
from gpulet_common.fleet.identity import IdentityStore, Role
from gpulet_common.messages import HealthEvent, MockInjectRequest
from gpulet_common.mock_nvml import MockNvml
from gpulet_common.runtime import Runtime
from gpulet_common.settings import Settings
from gpulet_common.settings.fleet import FleetSettings
from gpulet_common.settings.health import StreamSettings
from gpulet_common.settings.nats import NatsSettings
from gpulet_health.buffer import DiskBuffer
from gpulet_health.fleet_relay import FleetRelay, run_relay
from gpulet_health.publisher import HealthPublisher
from support.agent import agent_settings
from support.deploy import NATS_DIR, inbox_prefix, password_for

HUB_CONF = NATS_DIR / "fleet" / "hub.conf"
LEAF_CONF = NATS_DIR / "fleet-leaf.conf"


@dataclass
class HubServer:
    name: str
    directory: Path
    port: int
    cluster_port: int
    leaf_port: int
    server: EmbeddedNats | None = None

    def embedded(self) -> EmbeddedNats:
        return EmbeddedNats(
            state_dir=self.directory / "state",
            port=self.port,
            config_file=self.directory / "hub.conf",
            # JetStream and its store_dir are in hub.conf.
            jetstream=False,
        )

    async def start(self) -> None:
        self.server = self.embedded()
        await self.server.start()

    async def kill(self) -> None:
        if self.server is not None:
            await self.server.kill()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


@dataclass
class Hub:
    store: IdentityStore
    servers: list[HubServer]
    creds_dir: Path
    settings: FleetSettings = field(default_factory=FleetSettings)

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    @property
    def leaf_url(self) -> str:
        return f"nats-leaf://127.0.0.1:{self.servers[0].leaf_port}"

    def creds(self, role: Role, node: str = "") -> Path:
        """A credential file for the role (issued on first use)."""
        name = IdentityStore.user_name(role, node).replace("/", "-")
        path = self.creds_dir / f"{name}.creds"
        if not path.exists():
            path.write_text(self.store.issue(role, node=node).creds)
        return path

    def nats_settings(self, role: Role, **changes: object) -> NatsSettings:
        settings = NatsSettings(
            url=self.url,
            creds_file=str(self.creds(role)),
            inbox_prefix=f"_INBOX.{role}",
            connect_timeout_s=2,
            reconnect_wait_s=0.1,
            reconnect_max_wait_s=0.5,
        )
        return msgspec.structs.replace(settings, **changes)

    async def setup(self, *, timeout_s: float = 30.0) -> None:
        """Create the fleet stream and bucket once the cluster has a meta leader."""
        last: Exception | None = None
        async with Bus.connect(
            self.nats_settings("admin"), name="fleet-setup", max_initial_attempts=20
        ) as bus:
            with anyio.fail_after(timeout_s):
                for _ in range(int(timeout_s / 0.25)):
                    try:
                        await fleet_hub.ensure_fleet_stream(bus, self.settings)
                        await fleet_hub.ensure_fleet_bucket(bus, self.settings)
                        return
                    except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                        last = exc
                        await anyio.sleep(0.25)
        raise AssertionError(f"the hub never became ready: {last}")

    async def push_account(self) -> None:
        """Send the GPULET account JWT (revocations) to the hub, as `gpulet fleet push`."""
        from gpulet.fleet import push

        await push(self.nats_settings("sys"), self.store.account_jwt("GPULET"))


def _hub_conf(server: HubServer, peers: list[HubServer]) -> str:
    text = HUB_CONF.read_text()
    routes = "\n".join(f"    nats://127.0.0.1:{p.cluster_port}" for p in peers)
    replacements = {
        "server_name: $POD_NAME": f"server_name: {server.name}",
        "http_port: 8222": "",
        "store_dir: /data/jetstream": f'store_dir: "{server.directory / "state" / "js"}"',
        "  port: 6222": f"  host: 127.0.0.1\n  port: {server.cluster_port}",
        "  port: 7422": f"  host: 127.0.0.1\n  port: {server.leaf_port}",
    }
    for old, new in replacements.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    start = text.index("  routes: [")
    end = text.index("]", start)
    text = text[:start] + f"  routes: [\n{routes}\n  " + text[end:]
    if len(peers) == 1:
        # One server: no cluster (a cluster of one waits for peers that never come).
        start = text.index("cluster {")
        end = text.index("\n}\n", start) + 3
        text = text[:start] + text[end:]
    return text


@asynccontextmanager
async def running_hub(
    tmp_path: Path, *, servers: int = 3, settings: FleetSettings | None = None
) -> AsyncIterator[Hub]:
    store = IdentityStore(tmp_path / "store")
    store.init()
    creds_dir = tmp_path / "creds"
    creds_dir.mkdir(parents=True, exist_ok=True)
    members = [
        HubServer(
            name=f"hub-{i}",
            directory=tmp_path / f"hub-{i}",
            port=free_port(),
            cluster_port=free_port(),
            leaf_port=free_port(),
        )
        for i in range(servers)
    ]
    for member in members:
        member.directory.mkdir(parents=True, exist_ok=True)
        (member.directory / "hub.conf").write_text(_hub_conf(member, members))
        (member.directory / "accounts.conf").write_text(
            store.hub_accounts_conf(resolver_dir=str(member.directory / "jwt"))
        )
    hub = Hub(
        store=store,
        servers=members,
        creds_dir=creds_dir,
        settings=settings or FleetSettings(replicas=min(3, servers)),
    )
    try:
        for member in members:
            await member.start()
        await hub.setup()
        yield hub
    finally:
        with anyio.CancelScope(shield=True):
            for member in members:
                await member.stop()


@dataclass
class Leaf:
    node: str
    server: EmbeddedNats
    creds: Path

    @property
    def url(self) -> str:
        return self.server.url


def leaf_config(
    directory: Path,
    hub: Hub,
    creds: Path,
    *,
    leaf_urls: list[str] | None = None,
    mock: bool = False,
) -> Path:
    """The node's fleet-leaf.conf; ``mock`` takes mock/auth.conf (the mock overlay's:
    the services answer ``gpulet mock inject``) instead of auth.conf."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(NATS_DIR / "node.conf", directory / "node.conf")
    shutil.copy(NATS_DIR / ("mock" if mock else ".") / "auth.conf", directory / "auth.conf")
    text = LEAF_CONF.read_text()
    urls = leaf_urls or [f"nats-leaf://127.0.0.1:{s.leaf_port}" for s in hub.servers]
    url_list = ", ".join(f'"{u}"' for u in urls)
    for old, new in {
        "url: $GPULET_HUB_LEAF_URL": f"urls: [{url_list}]",
        "credentials: $GPULET_HUB_CREDS": f'credentials: "{creds}"',
    }.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (directory / "fleet-leaf.conf").write_text(text)
    return directory / "fleet-leaf.conf"


@asynccontextmanager
async def running_leaves(
    tmp_path: Path, hub: Hub, nodes: list[str], *, mock: bool = False
) -> AsyncIterator[dict[str, Leaf]]:
    """One leaf nats-server per node, each with its own credential."""
    async with AsyncExitStack() as stack:
        leaves: dict[str, Leaf] = {}
        for node in nodes:
            creds = hub.creds("node", node)
            conf = leaf_config(tmp_path / f"leaf-{node}" / "conf", hub, creds, mock=mock)
            server = await stack.enter_async_context(
                EmbeddedNats.running(
                    state_dir=tmp_path / f"leaf-{node}" / "state", config_file=conf
                )
            )
            leaves[node] = Leaf(node, server, creds)
        yield leaves


def fault_event(node: str, i: int, *, now: float) -> HealthEvent:
    """An injected fault as the rule engine reports one (XID 79 on one of 8 GPUs)."""
    return HealthEvent(
        event_id=f"{subjects.token(node)}-{i:06d}",
        node=node,
        gpu_uuid=f"GPU-{subjects.token(node)}-{i % 8}",
        gpu_index=i % 8,
        kind="xid",
        severity="critical",
        healthy=False,
        reason="XID 79: GPU has fallen off the bus",
        action="reset_gpu",
        xid=79,
        condition="xid:79",
        observed_at=now,
    )


@dataclass
class FleetNode:
    """A node's health-event path, for real: the health service's HealthPublisher
    (JetStream publish into the node's GPU_HEALTH, disk buffer when that fails) and
    the fleet relay to the hub, each on its own connection to the node's leaf server
    as the ``health`` user. Events are what the rule engine would emit."""

    node: str
    send: MemoryObjectSendStream[HealthEvent]
    publisher: HealthPublisher
    relay: FleetRelay

    async def inject(self, events: list[HealthEvent]) -> None:
        for event in events:
            await self.send.send(event)


@asynccontextmanager
async def running_node(
    tmp_path: Path, leaf: Leaf, fleet: FleetSettings
) -> AsyncIterator[FleetNode]:
    from opentelemetry import metrics

    settings = NatsSettings(
        url=leaf.url,
        user="health",
        password=password_for("health"),
        inbox_prefix=inbox_prefix("health"),
        connect_timeout_s=2,
        reconnect_wait_s=0.1,
        reconnect_max_wait_s=0.5,
    )
    meter = metrics.get_meter("fleet-test")
    stream = StreamSettings()
    buffer = DiskBuffer(
        tmp_path / f"buffer-{leaf.node}",
        max_bytes=64 << 20,
        max_events=100_000,
        segment_bytes=1 << 20,
    )
    buffer.open()
    send, receive = anyio.create_memory_object_stream[HealthEvent](1024)
    try:
        async with Bus.connect(
            settings, name=f"health-{leaf.node}", max_initial_attempts=10
        ) as bus:

            async def ensure() -> None:
                await bus.ensure_stream(
                    subjects.HEALTH_STREAM,
                    list(subjects.HEALTH_STREAM_SUBJECTS),
                    max_age_s=stream.max_age_s,
                    max_bytes=stream.max_bytes,
                    duplicate_window_s=stream.duplicate_window_s,
                )

            await ensure()
            publisher = HealthPublisher(
                bus,
                leaf.node,
                buffer,
                publish_timeout_s=stream.publish_timeout_s,
                ensure_stream=ensure,
                meter=meter,
            )
            async with anyio.create_task_group() as tg:
                await tg.start(publisher.run, receive)
                relay = await tg.start(run_relay, settings, leaf.node, fleet, meter)
                async with send:
                    yield FleetNode(leaf.node, send, publisher, relay)
                tg.cancel_scope.cancel()
    finally:
        buffer.close()


# --- a node's real services: collector and health on the mock NVML ------------------

# The light settings of the fault test and the bench: many nodes share a few cores.
# Every fault travels the NVML event path, which these do not slow down.
LIGHT_NODE_SETTINGS = (
    "collector.sample_period_s=5",
    "health.tick_s=1",
    "health.device_poll_s=5",
    "health.event_wait_timeout_ms=500",
    "health.kmsg.enabled=false",
    "collector.pod_labels=false",
)


MOCK_GPUS = 8  # GPUs of the dgx-h100 mock scenario, which the nodes play


def fault_plan(count: int) -> list[tuple[int, int]]:
    """``count`` faults for one node, as (GPU, XID): distinct pairs over the XIDs of the
    catalogue. The health service folds a repeat of the same XID on the same GPU into
    one event (``health.dedup_window_s``), so distinct pairs are distinct events."""
    from gpulet_health.catalogue import BUILTIN_XIDS

    codes = sorted(BUILTIN_XIDS)
    most = MOCK_GPUS * len(codes)
    if count > most:
        raise ValueError(f"at most {most} distinct faults a node ({count} asked)")
    return [(i % MOCK_GPUS, codes[i // MOCK_GPUS]) for i in range(count)]


@dataclass
class NodeServices:
    """One node's gpulet services, as the DaemonSet runs them: the collector and the
    health service (with the fleet relay and status publisher), each started by
    ``gpulet run``'s :func:`~gpulet.agent.run_agent` with its own NATS connection to
    the node's leaf server as its own user, and its own mock NVML playing the same
    scenario, as each container has. Faults go in through the mock's control plane
    (``gpulet mock inject``: ``gpulet.mock.inject.<node>``, answered by both mocks),
    sent by the node's ``operator`` user."""

    node: str
    leaf: Leaf
    runtimes: dict[str, Runtime]
    operator: Bus

    async def inject_xid(self, gpu: int, code: int, *, timeout_s: float = 10.0) -> None:
        reply = await self.operator.request(
            subjects.mock_inject(self.node),
            MockInjectRequest(gpu=gpu, fault="xid", value=float(code)),
            codec.MOCK_INJECT_REQUEST,
            codec.MOCK_INJECT_REPLY,
            timeout_s=timeout_s,
        )
        assert reply.applied, reply.detail

    async def health_mock(self) -> MockNvml:
        handle = await self.runtimes["health"].nvml.get()
        mock = getattr(handle.adapter, "module", None)
        assert isinstance(mock, MockNvml), mock
        return mock


def node_service_settings(
    leaf: Leaf, state_dir: Path, user: str, fleet: FleetSettings, overrides: list[str]
) -> Settings:
    settings = agent_settings(
        leaf.url,
        state_dir,
        node=leaf.node,
        overrides=[
            f"nats.user={user}",
            f"nats.password={password_for(user)}",
            f"nats.inbox_prefix={inbox_prefix(user)}",
            "nats.connect_timeout_s=2",
            *LIGHT_NODE_SETTINGS,
            *overrides,
        ],
    )
    # The fleet settings as components/nats-fleet sets them: relay and status on.
    settings.fleet = msgspec.structs.replace(fleet, relay_enabled=True, status_enabled=True)
    return settings


@asynccontextmanager
async def running_node_services(
    tmp_path: Path,
    leaf: Leaf,
    fleet: FleetSettings,
    *,
    scenario: str = "dgx-h100",
    overrides: list[str] | None = None,
) -> AsyncIterator[NodeServices]:
    """The node's collector and health service running on ``leaf`` (a mock leaf: see
    :func:`running_leaves`), each in its own task group like a container."""
    from gpulet.agent import run_agent

    state_dir = tmp_path / f"node-{leaf.node}" / "state"
    state_dir.mkdir(parents=True, exist_ok=True)
    operator = NatsSettings(
        url=leaf.url,
        user="operator",
        password=password_for("operator"),
        inbox_prefix=inbox_prefix("operator"),
        connect_timeout_s=2,
        reconnect_wait_s=0.1,
        reconnect_max_wait_s=0.5,
    )
    async with (
        Bus.connect(operator, name=f"operator-{leaf.node}", max_initial_attempts=10) as op,
        anyio.create_task_group() as tg,
    ):
        runtimes: dict[str, Runtime] = {}
        for user in ("collector", "health"):
            settings = node_service_settings(
                leaf,
                state_dir,
                user,
                fleet,
                [f"nvml.scenario={scenario}", *(overrides or [])],
            )
            runtimes[user] = await tg.start(
                partial(run_agent, settings, [user], embedded_nats=False, handle_signals=False)
            )
            # The mock control subscription is on the server before any injection.
            await runtimes[user].bus.flush()
        yield NodeServices(leaf.node, leaf, runtimes, op)
        tg.cancel_scope.cancel()


@asynccontextmanager
async def running_fleet_nodes(
    tmp_path: Path, leaves: list[Leaf], fleet: FleetSettings, **kwargs: Any
) -> AsyncIterator[list[NodeServices]]:
    """:func:`running_node_services` for each leaf; started one after another, stopped
    all at once (each stop drains its connections, which takes a moment)."""

    async def hold(leaf: Leaf, *, task_status: anyio.abc.TaskStatus[NodeServices]) -> None:
        async with running_node_services(tmp_path, leaf, fleet, **kwargs) as node:
            task_status.started(node)
            await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        yield [await tg.start(hold, leaf) for leaf in leaves]
        tg.cancel_scope.cancel()
