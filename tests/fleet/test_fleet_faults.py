"""The fleet under faults: nothing lost, nothing delivered twice to the alert sink.

Setup (all real processes on 127.0.0.1):

* a hub of 3 nats-servers in one JetStream cluster (deploy/nats/fleet/hub.conf),
  with the R3 stream GPU_FLEET and the fleet bucket;
* ``NODES`` leaf nats-servers (deploy/nats/fleet-leaf.conf with node.conf and
  auth.conf), each logged in to the hub with its own credential;
* on each node, the real health-event path: the health service's HealthPublisher
  (JetStream publish into the node's GPU_HEALTH) and the fleet relay (GPU_HEALTH ->
  hub, acked), as the node's ``health`` user. The faults are the events the rule
  engine emits for an XID 79; the NVML and rule engine are left out so that 20 nodes
  fit on a 2-core machine next to the servers (see docs/fleet.md);
* 2 ``gpulet alerts --hub`` processes sharing the durable consumer, posting each event
  to a webhook: the alert sink, which accepts an event id once and counts repeats.

The storm: ``FAULTS`` faults in four waves. After the first, the hub server leading
GPU_FLEET is SIGKILLed; after the second it is restarted; after the third, one alerts
replica is SIGKILLed; after the fourth it is restarted. Then: the sink accepted every
fault exactly once, and the stream holds every fault once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import pytest

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.settings.fleet import FleetSettings
from support.deploy import set_passwords
from support.fleet import Hub, fault_event, running_hub, running_leaves, running_node
from support.waiting import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

NODES = int(os.environ.get("FLEET_STORM_NODES", "20"))
FAULTS = int(os.environ.get("FLEET_STORM_FAULTS", "2000"))
WAVES = 4
ACK_WAIT_S = 3.0
FLEET = FleetSettings(
    replicas=3,
    relay_retry_initial_s=0.05,
    relay_retry_max_s=0.5,
    relay_timeout_s=2.0,
    alerts_ack_wait_s=ACK_WAIT_S,
)


class Sink:
    """The alert sink: a webhook receiver that keys on event_id."""

    def __init__(self) -> None:
        self.accepted: set[str] = set()
        self.received = 0
        self.repeats = 0
        self._lock = threading.Lock()

    def take(self, body: bytes) -> None:
        event_id = json.loads(body)["event_id"]
        with self._lock:
            self.received += 1
            if event_id in self.accepted:
                self.repeats += 1
            else:
                self.accepted.add(event_id)


@contextmanager
def webhook(sink: Sink) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            sink.take(body)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class AlertsReplica:
    def __init__(self, name: str, hub: Hub, url: str, log_dir: Path) -> None:
        self.name = name
        self._command = [
            sys.executable,
            "-m",
            "gpulet",
            "alerts",
            "--hub",
            "--no-stdout",
            "--webhook",
            url,
            "--nats",
            hub.url,
            "--set",
            f"nats.creds_file={hub.creds('alerts')}",
            "--set",
            "nats.inbox_prefix=_INBOX.alerts",
            "--set",
            "nats.reconnect_wait_s=0.1",
            "--set",
            "nats.reconnect_max_wait_s=0.5",
            "--set",
            f"fleet.alerts_ack_wait_s={ACK_WAIT_S}",
            "--set",
            "health.alerts.retry_initial_s=0.1",
            "--log-level",
            "warning",
        ]
        self._log = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self._log.open("ab") as log:
            # Not the nats-servers' password variables (GPULET_*), which gpulet would
            # read as settings.
            env = {k: v for k, v in os.environ.items() if not k.startswith("GPULET_")}
            self.process = subprocess.Popen(
                self._command, stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


@pytest.fixture
async def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Hub]:
    set_passwords(monkeypatch)
    async with running_hub(tmp_path, servers=3, settings=FLEET) as running:
        yield running


async def _consumer_waiting(admin: Bus, replicas: int) -> bool:
    try:
        info = await admin.jetstream.consumer_info(subjects.FLEET_STREAM, FLEET.alerts_durable)
    except Exception:
        return False
    return (info.num_waiting or 0) >= replicas


async def _wait_async(predicate: object, *, timeout_s: float, what: str) -> None:
    assert callable(predicate)
    for _ in range(int(timeout_s / 0.25)):
        if await predicate():
            return
        await anyio.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def test_every_fault_reaches_the_sink_once_through_hub_and_replica_crashes(
    hub: Hub, tmp_path: Path
) -> None:
    nodes = [f"gpu-node-{i:02d}.example" for i in range(NODES)]
    per_node = FAULTS // NODES
    total = per_node * NODES
    sink = Sink()
    now = time.time()
    started = time.monotonic()
    timeline: list[str] = []

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - started:6.1f}s {what}")

    with webhook(sink) as url:
        replicas = [AlertsReplica(f"alerts-{i}", hub, url, tmp_path) for i in range(2)]
        try:
            for replica in replicas:
                replica.start()
            async with Bus.connect(hub.nats_settings("admin"), max_initial_attempts=5) as admin:
                await _wait_async(
                    lambda: _consumer_waiting(admin, 2), timeout_s=60, what="2 alerts replicas"
                )
                mark("2 alerts replicas pulling")
                async with running_leaves(tmp_path, hub, nodes) as leaves:
                    mark(f"{NODES} leaf nodes up")
                    async with anyio.create_task_group() as tg:
                        fleet_nodes = [
                            await tg.start(_node_task, tmp_path, leaves[node]) for node in nodes
                        ]

                        async def wave(k: int) -> None:
                            lo, hi = k * per_node // WAVES, (k + 1) * per_node // WAVES
                            for fn in fleet_nodes:
                                await fn.inject(
                                    [fault_event(fn.node, i, now=now) for i in range(lo, hi)]
                                )
                            mark(f"wave {k + 1}: faults {lo}..{hi - 1} of every node injected")

                        await wave(0)
                        # Kill while events flow: some relayed, most still on the way.
                        await wait_until(
                            lambda: sum(fn.relay.relayed for fn in fleet_nodes) >= total // 16,
                            timeout_s=60,
                            interval_s=0.05,
                            what="the first relayed faults",
                        )
                        info = await admin.jetstream.stream_info(subjects.FLEET_STREAM)
                        leader = info.cluster.leader if info.cluster else None
                        victim = next(s for s in hub.servers if s.name == leader)
                        await victim.kill()
                        mark(f"SIGKILL {victim.name} (GPU_FLEET leader)")
                        await wave(1)
                        await victim.start()
                        mark(f"restarted {victim.name}")
                        await wave(2)
                        # Kill a replica that is busy delivering.
                        await wait_until(
                            lambda: len(sink.accepted) >= total // 3,
                            timeout_s=120,
                            interval_s=0.05,
                            what="a third of the faults at the sink",
                        )
                        replicas[0].kill()
                        mark("SIGKILL alerts-0")
                        await wave(3)
                        replicas[0].start()
                        mark("restarted alerts-0")

                        await wait_until(
                            lambda: sum(fn.relay.relayed for fn in fleet_nodes) >= total,
                            timeout_s=180,
                            interval_s=0.25,
                            what="every fault relayed to the hub",
                        )
                        mark("every fault stored on the hub")
                        await wait_until(
                            lambda: len(sink.accepted) >= total,
                            timeout_s=120,
                            interval_s=0.25,
                            what=f"the sink to accept {total} faults",
                        )
                        mark("every fault at the sink")
                        tg.cancel_scope.cancel()
                info = await admin.jetstream.stream_info(subjects.FLEET_STREAM)
                stored = []
                for seq in range(info.state.first_seq, info.state.last_seq + 1):
                    msg = await admin.jetstream.get_msg(subjects.FLEET_STREAM, seq, direct=False)
                    stored.append(codec.HEALTH_EVENT.decode(msg.data or b"").event_id)
        finally:
            for replica in replicas:
                replica.stop()
    expected = {f"{subjects.token(n)}-{i:06d}" for n in nodes for i in range(per_node)}
    report = (
        f"{NODES} nodes, {total} faults; sink received {sink.received} "
        f"(repeats absorbed by event_id: {sink.repeats}); stream {len(stored)}; "
        f"relay retries/duplicates at hub: "
        f"{sum(fn.relay.duplicates for fn in fleet_nodes)}\n" + "\n".join(timeline)
    )
    print(report)
    assert sink.accepted == expected, report
    assert len(stored) == total, report
    assert set(stored) == expected, report


async def _node_task(
    tmp_path: Path,
    leaf: object,
    *,
    task_status: anyio.abc.TaskStatus[object] = anyio.TASK_STATUS_IGNORED,
) -> None:
    async with running_node(tmp_path, leaf, FLEET) as node:  # type: ignore[arg-type]
        task_status.started(node)
        await anyio.sleep_forever()
