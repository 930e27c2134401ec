"""Fleet scale on one machine: how many leaf nodes a hub holds and what they cost it.

Method
------
Everything is real and on 127.0.0.1: a hub of 3 nats-servers in one JetStream cluster
(``deploy/nats/fleet/hub.conf``, operator mode, the R3 stream ``GPU_FLEET``), and leaf
nats-servers that each log in with their own credential (``gpulet fleet creds``):

* ``--leaves`` **idle leaves**: a nats-server with only the leaf remote (no JetStream,
  no local users), the cheapest real leaf connection; they measure the hub's memory
  per leaf connection (the hub's RSS, summed over its 3 servers, after minus before,
  divided by the leaves) and the node-side RSS of a bare leaf server;
* ``--active`` **active nodes**: the full node path of ``deploy/nats/fleet-leaf.conf``
  (node.conf, the mock overlay's auth.conf, JetStream) and the node's real services on
  the **mock NVML** (tests/support/fleet.NodeServices: the collector and the health
  service with the fleet relay and status publisher, each as ``gpulet run`` starts it,
  its own user, its own mock, all in this process);
* a pull consumer on ``GPU_FLEET`` (what ``gpulet alerts --hub`` is), acking each event.

``--events`` faults are injected at ``--rate`` per second, spread over the active
nodes: each an XID sent to the node's mock NVML through its control plane (``gpulet
mock inject``), a different (GPU, XID) pair each time (the health service folds
repeats into one event), so at most 128 a node. **Fault-to-hub-consumer latency**: from
the moment the injection is sent to the moment the hub consumer fetched the event:
mock NVML event, the health service's event thread and rule engine, node stream, relay,
leaf connection, R3 commit on the hub, delivery. **Hub CPU per 1,000 events**: the hub
servers' CPU time (utime+stime from /proc, all 3 servers) during the storm, minus their
idle CPU rate over the same time with the same leaves connected, per 1,000 events.
Everything shares this machine's cores (2 here, with other work), so the latency and
CPU figures include contention; the memory figures do not depend on it.

Run: ``python bench/fleet.py [--leaves 200] [--active 10] [--events 1000] [--rate 28]``
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import nats.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import percentile, rss_mb, table

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, fetch_ready
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.settings.fleet import FleetSettings
from support.deploy import NATS_USERS, password_for, password_variable
from support.fleet import (
    MOCK_GPUS,
    Hub,
    NodeServices,
    fault_plan,
    running_hub,
    running_leaves,
    running_node_services,
)

FLEET = FleetSettings(replicas=3, relay_retry_initial_s=0.05, relay_retry_max_s=0.5)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def hub_pids(hub: Hub) -> list[int]:
    return [s.server.pid for s in hub.servers if s.server is not None and s.server.pid]


def hub_rss(hub: Hub) -> float:
    return sum(rss_mb(pid) for pid in hub_pids(hub))


def hub_cpu(hub: Hub) -> float:
    return sum(cpu_s(pid) for pid in hub_pids(hub))


async def start_idle_leaves(
    stack: AsyncExitStack, hub: Hub, root: Path, count: int, limit_s: float
) -> list[EmbeddedNats]:
    urls = ", ".join(f'"nats-leaf://127.0.0.1:{s.leaf_port}"' for s in hub.servers)
    leaves: list[EmbeddedNats] = []
    deadline = time.monotonic() + limit_s
    for i in range(count):
        if time.monotonic() > deadline:
            print(f"# stopped at {i} idle leaves: --start-limit {limit_s:g}s reached")
            break
        node = f"idle-{i:05d}"
        directory = root / node
        directory.mkdir(parents=True)
        creds = hub.creds("node", node)
        (directory / "leaf.conf").write_text(
            "leafnodes { remotes = [ { urls: [" + urls + f'], credentials: "{creds}" }} ] }}\n'
        )
        try:
            server = await stack.enter_async_context(
                EmbeddedNats(
                    state_dir=directory, config_file=directory / "leaf.conf", jetstream=False
                )
            )
        except (RuntimeError, OSError, TimeoutError) as exc:
            print(f"# stopped at {i} idle leaves: {exc}")
            break
        leaves.append(server)
    # Connected: each leaf logs its connection to the hub.
    for _ in range(600):
        connected = sum(
            "Leafnode connection created" in (s.state_dir / "nats-server.log").read_text()
            for s in leaves
        )
        if connected == len(leaves):
            break
        await anyio.sleep(0.1)
    return leaves


FaultKey = tuple[str, str, int]  # node, GPU uuid, XID


async def consume(
    hub: Hub,
    sent: dict[FaultKey, float],
    latencies: list[float],
    want: int,
    limit_s: float,
) -> None:
    # As `gpulet alerts --hub`: the alerts user, a durable pull consumer, explicit acks.
    async with Bus.connect(hub.nats_settings("alerts"), max_initial_attempts=5) as bus:
        sub = await bus.jetstream.pull_subscribe(
            subjects.FLEET_STREAM_SUBJECTS[0],
            durable="bench",
            stream=subjects.FLEET_STREAM,
            config=ConsumerConfig(
                durable_name="bench",
                deliver_policy=DeliverPolicy.NEW,
                ack_policy=AckPolicy.EXPLICIT,
                max_ack_pending=10000,
            ),
        )
        with anyio.move_on_after(limit_s):
            while len(latencies) < want:
                try:
                    msgs = await fetch_ready(sub, 256, 0.5)
                except (nats.errors.TimeoutError, TimeoutError):
                    continue
                now = time.time()
                for msg in msgs:
                    event = codec.HEALTH_EVENT.decode(msg.data)
                    at = sent.pop((event.node, event.gpu_uuid, event.xid or -1), None)
                    if at is not None:
                        latencies.append(now - at)
                    await msg.ack()


async def run(args: argparse.Namespace) -> int:
    for user in NATS_USERS:
        os.environ[password_variable(user)] = password_for(user)
    root = Path(tempfile.mkdtemp(prefix="gpulet-fleet-bench-"))
    rows: list[list[object]] = []
    async with (
        running_hub(root / "hub", servers=3, settings=FLEET) as hub,
        AsyncExitStack() as stack,
    ):
        await anyio.sleep(1.0)
        rss_before = hub_rss(hub)
        t0 = time.monotonic()
        idle = await start_idle_leaves(stack, hub, root / "idle", args.leaves, args.start_limit)
        start_s = time.monotonic() - t0
        await anyio.sleep(3.0)
        rss_after = hub_rss(hub)
        leaf_rss = sum(rss_mb(s.pid) for s in idle if s.pid) / max(1, len(idle))

        names = [f"active-{i:03d}" for i in range(args.active)]
        per_node = args.events // len(names)
        plan = fault_plan(per_node + 1)  # one more each for the warm-up
        leaves = await stack.enter_async_context(
            running_leaves(root / "active", hub, names, mock=True)
        )
        own_rss = rss_mb(os.getpid())
        nodes: list[NodeServices] = [
            await stack.enter_async_context(
                running_node_services(root / "active", leaves[n], FLEET)
            )
            for n in names
        ]
        uuids = {
            node.node: [(await node.health_mock()).slot_uuid(g) for g in range(MOCK_GPUS)]
            for node in nodes
        }
        services_rss = (rss_mb(os.getpid()) - own_rss) / len(names)
        active_rss = sum(rss_mb(leaves[n].server.pid) for n in names) / len(names)
        sent: dict[FaultKey, float] = {}
        latencies: list[float] = []

        async def inject(node: NodeServices, k: int) -> None:
            gpu, code = plan[k]
            sent[(node.node, uuids[node.node][gpu], code)] = time.time()
            await node.inject_xid(gpu, code)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, hub, sent, latencies, args.events + len(nodes), args.limit)
            await anyio.sleep(1.0)
            # Warm-up: one fault per node, so every relay and route is up.
            for node in nodes:
                await inject(node, per_node)
            for _ in range(300):
                if len(latencies) >= len(nodes):
                    break
                await anyio.sleep(0.1)
            latencies.clear()

            # Idle CPU rate of the hub with everything connected.
            c0, w0 = hub_cpu(hub), time.monotonic()
            await anyio.sleep(args.idle)
            idle_rate = (hub_cpu(hub) - c0) / (time.monotonic() - w0)

            c1, w1 = hub_cpu(hub), time.monotonic()
            interval = len(nodes) / args.rate
            for k in range(per_node):
                start = time.monotonic()
                async with anyio.create_task_group() as wave:
                    for node in nodes:
                        wave.start_soon(inject, node, k)
                await anyio.sleep(max(0.0, interval - (time.monotonic() - start)))
            want = per_node * len(nodes)
            for _ in range(int(args.limit / 0.05)):  # bounded: at most --limit seconds
                if len(latencies) >= want:
                    break
                await anyio.sleep(0.05)
            storm_s = time.monotonic() - w1
            storm_cpu = hub_cpu(hub) - c1
            tg.cancel_scope.cancel()

    got = len(latencies)
    net_cpu = max(0.0, storm_cpu - idle_rate * storm_s)
    leaves_total = len(idle) + args.active
    rows = [
        ["leaf nodes connected (idle + active)", f"{len(idle)} + {args.active} = {leaves_total}"],
        ["time to start the idle leaves", f"{start_s:.1f} s"],
        [
            "hub RSS (3 servers) before / after idle leaves",
            f"{rss_before:.0f} / {rss_after:.0f} MiB",
        ],
        [
            "hub memory per leaf connection",
            f"{(rss_after - rss_before) * 1024 / max(1, len(idle)):.0f} KiB",
        ],
        ["RSS of a bare leaf nats-server (node side)", f"{leaf_rss:.1f} MiB"],
        ["RSS of a full node nats-server (JetStream, auth)", f"{active_rss:.1f} MiB"],
        [
            "node services (collector + health, mock NVML) per node, in one process",
            f"{services_rss:.1f} MiB",
        ],
        ["events delivered / injected", f"{got} / {want} at {args.rate:g}/s"],
        ["fault-to-hub-consumer latency p50", f"{percentile(latencies, 50) * 1000:.1f} ms"],
        ["fault-to-hub-consumer latency p99", f"{percentile(latencies, 99) * 1000:.1f} ms"],
        ["hub idle CPU (all leaves connected)", f"{idle_rate * 100:.1f} % of a core"],
        ["hub CPU during the storm", f"{storm_cpu:.2f} s over {storm_s:.1f} s"],
        ["hub CPU per 1,000 events (net of idle)", f"{net_cpu / max(1, got) * 1000:.3f} s"],
    ]
    print(
        table("gpulet fleet: one machine, 3 hub servers, real leaf nodes", ["what", "value"], rows)
    )
    return 0 if got == want else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=200, help="idle leaf nodes to start")
    parser.add_argument("--active", type=int, default=10, help="nodes with the full event path")
    parser.add_argument("--events", type=int, default=3000, help="events to inject")
    parser.add_argument("--rate", type=float, default=300.0, help="events per second")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of idle CPU measurement")
    parser.add_argument("--limit", type=float, default=120.0, help="most seconds to wait")
    parser.add_argument(
        "--start-limit", type=float, default=300.0, help="most seconds to start idle leaves"
    )
    # The node services log each event they raise (WARNING for a fatal XID) and each
    # slow drain at shutdown: not what this table is about.
    logging.getLogger("gpulet").setLevel(logging.ERROR)
    sys.exit(anyio.run(run, parser.parse_args()))


if __name__ == "__main__":
    main()
