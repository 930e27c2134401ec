"""A fleet of reporters against one Kubernetes API emulator: writes and staleness.

Run: ``python bench/reporter_fleet.py --nodes 1000 --duration 60``

What is real
------------
Per node, the reporter's own pieces: :class:`ReporterCore` (health view, intent,
debouncer), :class:`WriteLoop` and :class:`KubeWriter` with a
:class:`~gpulet_common.kubeapi.KubeClient` of its own (its own HTTP connection),
talking HTTP to the API emulator on 127.0.0.1 -- CRD validation, resourceVersions, the
Node objects -- exactly as in production. Settings are the production defaults (quiet
window 0.5 s, maximum delay 2 s, reconcile every 300 s) unless flags say otherwise.

What is simulated
-----------------
* **The bus.** Inputs are handed to each node's ``ReporterCore`` directly, as the
  service's NodeView does after reading a NATS message or a KV change; no
  nats-server, no 1000 connections.
* **The inputs, at realistic rates.** Every second each node receives its unchanged
  inventory (the collector's 1 Hz cadence) and, for each GPU with an active fault,
  its unchanged health state again. Health flaps arrive per node as a Poisson
  process (``--flap-rate`` per node-hour): one GPU raises an XID, as a burst of 1-10
  health states within 100 ms (repeats and a second, more severe XID), stays
  unhealthy 5-30 s and recovers.
* **The flap rate is raised** far above a real fleet's so that a one-minute run sees
  enough faults to measure latency. Writes are therefore reported per flap, and the
  writes per node-hour are extrapolated to realistic flap rates (0 writes without
  flaps is measured directly in the steady phase).

Measured
--------
* API writes (POST/PUT/PATCH) and reads, from the emulator's request log, in a steady
  phase (inputs at 1 Hz, no flaps) and in the flap phase.
* Fault-to-CR latency: from the first unhealthy event of a flap being handed to the
  core, to a **watch** on Devices (what koord-scheduler's informer sees) delivering
  the Device with that GPU unhealthy; likewise for recovery.
* Event-loop lag of the single process hosting everything (a 100 ms ticker's
  overshoot): it adds to every latency above and says how loaded the simulation is.

Anchors: koordlet rebuilds every 3 s and rewrites the Device of a node with an
unhealthy GPU on each rebuild (fresh condition timestamps); the Koordinator write-up
cites about 0.003 writes/s for 500 nodes, i.e. 0.0216 writes per node-hour.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio import watch as k8s_watch
from opentelemetry import metrics

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import percentile, rss_mb, table

from gpulet_common.kube import KubeConfig
from gpulet_common.kubeapi import KubeClient
from gpulet_common.messages import ActiveCondition, GpuHealth, Inventory
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_reporter.core import ReporterCore
from gpulet_reporter.desired import GROUP, PLURAL, VERSION
from gpulet_reporter.metrics import ReporterMetrics
from gpulet_reporter.writer import KubeWriter, NodeApi, WriteLoop
from support.kube_emulator import KubeEmulator
from support.reporter_harness import gpu_uuid, make_inventory

ANCHOR_WRITES_PER_NODE_HOUR = 0.003 / 500 * 3600
KOORDLET_PERIOD_S = 3.0
WRITE_METHODS = ("POST", "PUT", "PATCH")


@dataclass
class Expectation:
    healthy: bool
    since: float


@dataclass
class Results:
    fault_latency: list[float] = field(default_factory=list)
    recovery_latency: list[float] = field(default_factory=list)
    superseded: int = 0
    flaps: int = 0
    events: int = 0
    samples: int = 0
    unhealthy_seconds: float = 0.0
    lag: list[float] = field(default_factory=list)


class SimNode:
    """One node: the reporter's core and write loop, fed simulated inputs."""

    def __init__(
        self,
        name: str,
        api: Any,
        settings: ReporterSettings,
        gpus: int,
        expectations: dict[tuple[str, str], Expectation],
        results: Results,
    ) -> None:
        self.name = name
        self.api = api
        self.core = ReporterCore(name, settings)
        self.inventory: Inventory = make_inventory(name, gpus)
        self.metrics = ReporterMetrics(metrics.get_meter("bench"))
        self.writer = KubeWriter(NodeApi(api, name, settings, self.metrics))
        self.loop = WriteLoop(self.writer, self.core.debouncer, settings, self.metrics)
        self.faulted: dict[str, GpuHealth] = {}
        self._expect = expectations
        self._results = results

    @property
    def converged(self) -> bool:
        return (
            self.core.desired is not None
            and self.loop.applied == self.core.desired
            and not self.core.debouncer.pending
        )

    def _event(self, uuid: str, *, healthy: bool, xid: int, severity: str) -> GpuHealth:
        """The GPU's health state after one more fact, as the health service keeps it."""
        now = time.time()
        if healthy:
            return GpuHealth(gpu_uuid=uuid, updated_at=now)
        previous = self.faulted.get(uuid)
        conditions = list(previous.conditions) if previous is not None else []
        if all(c.condition != f"xid:{xid}" for c in conditions):
            conditions.append(
                ActiveCondition(
                    condition=f"xid:{xid}",
                    kind="xid",
                    severity=severity,  # type: ignore[arg-type]
                    reason=f"XID {xid}",
                    message="simulated fault",
                    since=now,
                )
            )
        return GpuHealth(gpu_uuid=uuid, healthy=False, conditions=conditions, updated_at=now)

    def feed(self, health: GpuHealth) -> None:
        self._results.events += 1
        if not health.healthy:
            self.faulted[health.gpu_uuid] = health
        self.core.on_health(health.gpu_uuid, health)

    async def tick(self, stop_at: float) -> None:
        """The 1 Hz inputs that change nothing."""
        await anyio.sleep(random.uniform(0, 1))
        while time.monotonic() < stop_at:
            self._results.samples += 1
            self.core.on_inventory(self.inventory)
            for event in list(self.faulted.values()):
                self.feed(event)  # a re-report of an active fault
            await anyio.sleep(1.0)

    async def flap(self, uuid: str) -> None:
        self._results.flaps += 1
        xid = random.choice((48, 63, 64, 74, 79, 94, 95))
        first = self._event(uuid, healthy=False, xid=xid, severity="critical")
        start = time.monotonic()
        key = (self.name, uuid)
        previous = self._expect.get(key)
        if previous is not None and previous.healthy:
            self._results.superseded += 1
        self._expect[key] = Expectation(healthy=False, since=start)
        self.feed(first)
        for _ in range(random.randint(0, 9)):  # the rest of the burst, within 100 ms
            await anyio.sleep(random.uniform(0, 0.011))
            worse = random.random() < 0.2
            event = self._event(
                uuid,
                healthy=False,
                xid=79 if worse else xid,
                severity="fatal" if worse else "critical",
            )
            self.feed(event)
        duration = random.uniform(5, 30)
        await anyio.sleep(duration)
        self._results.unhealthy_seconds += time.monotonic() - start
        del self.faulted[uuid]
        recovered = self._event(uuid, healthy=True, xid=xid, severity="info")
        current = self._expect.get(key)
        if current is not None and not current.healthy:
            # The fault never showed (coalesced with its own recovery): no sample.
            self._results.superseded += 1
        self._expect[key] = Expectation(healthy=True, since=time.monotonic())
        self.feed(recovered)

    async def flapper(self, rate_per_hour: float, stop_at: float, gpus: int) -> None:
        if rate_per_hour <= 0:
            return
        async with anyio.create_task_group() as tg:
            while True:
                gap = random.expovariate(rate_per_hour / 3600.0)
                if time.monotonic() + gap >= stop_at:
                    return
                await anyio.sleep(gap)
                healthy = [
                    gpu_uuid(self.name, i)
                    for i in range(gpus)
                    if gpu_uuid(self.name, i) not in self.faulted
                ]
                if healthy:
                    tg.start_soon(self.flap, random.choice(healthy))


async def watch_devices(
    api: Any,
    since_rv: str,
    expectations: dict[tuple[str, str], Expectation],
    results: Results,
) -> None:
    """Like koord-scheduler's informer: watch Devices and time when each change lands."""
    custom = k8s_client.CustomObjectsApi(api)
    rv = since_rv
    while True:
        stream = k8s_watch.Watch().stream(
            custom.list_cluster_custom_object,
            GROUP,
            VERSION,
            PLURAL,
            resource_version=rv,
            timeout_seconds=3600,
        )
        async with stream:
            async for event in stream:
                obj = event["object"]
                rv = obj["metadata"]["resourceVersion"]
                node = obj["metadata"]["name"]
                now = time.monotonic()
                for entry in obj.get("spec", {}).get("devices", []):
                    key = (node, entry.get("id"))
                    want = expectations.get(key)
                    if want is not None and want.healthy == entry.get("health"):
                        latency = now - want.since
                        target = results.recovery_latency if want.healthy else results.fault_latency
                        target.append(latency)
                        del expectations[key]


async def lag_monitor(results: Results) -> None:
    while True:
        start = time.monotonic()
        await anyio.sleep(0.1)
        results.lag.append(max(0.0, time.monotonic() - start - 0.1))


def _writes(emu: KubeEmulator, start: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in list(emu.stats.log)[start:]:
        counts[record.method] = counts.get(record.method, 0) + 1
    return counts


async def wait_converged(nodes: list[SimNode], limit_s: float) -> float:
    start = time.monotonic()
    with anyio.move_on_after(limit_s):
        while not all(n.converged for n in nodes):  # noqa: ASYNC110
            await anyio.sleep(0.1)
    return time.monotonic() - start


def _ms(values: list[float], pct: float) -> str:
    return "-" if not values else f"{percentile(values, pct) * 1000:.0f}"


async def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    # The emulator's aiohttp server logs a watch the client closes at shutdown.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    # A thousand reporters each logging their retries would drown the report.
    logging.getLogger("gpulet.reporter").setLevel(logging.ERROR)
    settings = ReporterSettings(
        mode="cluster",
        quiet_window_s=args.quiet,
        max_delay_s=args.max_delay,
        reconcile_interval_s=args.reconcile,
        api_timeout_s=10.0,
    )
    results = Results()
    expectations: dict[tuple[str, str], Expectation] = {}
    cpu_start = time.process_time()
    async with KubeEmulator.running(max_watch_seconds=24 * 3600) as emu:
        configuration = k8s_client.Configuration()
        await k8s_config.load_kube_config_from_dict(
            emu.kubeconfig(), client_configuration=configuration
        )
        names = [f"gpu-node-{i:04d}" for i in range(args.nodes)]
        for name in names:
            emu.add_node(name, labels={"topology.kubernetes.io/zone": "z1"})
        apis = [KubeClient(KubeConfig(emu.url, token=emu.token or "")) for _ in names]
        watch_api = k8s_client.ApiClient(configuration)
        nodes = [
            SimNode(name, api, settings, args.gpus, expectations, results)
            for name, api in zip(names, apis, strict=True)
        ]
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lag_monitor, results)
                for node in nodes:
                    tg.start_soon(node.loop.run)
                # Warm-up: every reporter creates its Device and labels its Node.
                for node in nodes:
                    node.core.on_inventory(node.inventory)
                warm_s = await wait_converged(nodes, 600)
                warm_writes = _writes(emu, 0)
                print(
                    f"warm-up: {args.nodes} Devices created and Nodes labelled in {warm_s:.1f}s "
                    f"({sum(warm_writes.get(m, 0) for m in WRITE_METHODS)} writes)",
                    flush=True,
                )
                tg.start_soon(
                    watch_devices, watch_api, str(emu.resource_version), expectations, results
                )

                # Steady phase: 1 Hz inputs, no flaps.
                mark = len(emu.stats.log)
                committed = emu.stats.total_writes()
                steady_stop = time.monotonic() + args.steady
                async with anyio.create_task_group() as phase:
                    for node in nodes:
                        phase.start_soon(node.tick, steady_stop)
                steady = _writes(emu, mark)
                steady_committed = emu.stats.total_writes() - committed
                steady_samples = results.samples
                print(
                    f"steady: {args.steady:.0f}s, {steady_samples} samples, requests {steady}",
                    flush=True,
                )

                # Flap phase.
                if args.fault_ratio > 0:
                    emu.faults.fail_ratio(args.fault_ratio, (409, 429, 500), seed=1, retry_after=1)
                mark = len(emu.stats.log)
                committed = emu.stats.total_writes()
                lag_mark = len(results.lag)
                flap_start = time.monotonic()
                stop = flap_start + args.duration
                async with anyio.create_task_group() as phase:
                    for node in nodes:
                        phase.start_soon(node.tick, stop)
                        phase.start_soon(node.flapper, args.flap_rate, stop, args.gpus)
                # Flaps still open at the end ran past it; let the last writes land.
                await wait_converged(nodes, settings.max_delay_s + 30)
                emu.faults.clear()
                await anyio.sleep(0.5)
                flap_wall = time.monotonic() - flap_start
                flap = _writes(emu, mark)
                flap_committed = emu.stats.total_writes() - committed
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                for api in apis:
                    await api.close()
                await watch_api.close()  # the informer's kubernetes-asyncio client
    cpu_s = time.process_time() - cpu_start

    # -- report ----------------------------------------------------------------------
    n = args.nodes
    # Committed writes (what etcd and watchers pay for); write requests include the
    # ones the fault injector answered with an error.
    flap_writes = flap_committed
    steady_writes = steady_committed
    flap_requests = sum(flap.get(m, 0) for m in WRITE_METHODS)
    steady_requests = sum(steady.get(m, 0) for m in WRITE_METHODS)
    hours = flap_wall / 3600
    per_flap = flap_writes / results.flaps if results.flaps else float("nan")
    koordlet_writes = results.unhealthy_seconds / KOORDLET_PERIOD_S
    lags = results.lag[lag_mark:]
    print()
    print(
        table(
            f"Reporter fleet: {n} nodes x {args.gpus} GPUs, quiet {args.quiet}s, "
            f"max delay {args.max_delay}s, reconcile {args.reconcile:.0f}s"
            + (f", {args.fault_ratio:.0%} API faults" if args.fault_ratio else ""),
            [
                "phase",
                "seconds",
                "samples",
                "health events",
                "flaps",
                "writes",
                "write requests",
                "reads",
                "writes/node/h",
            ],
            [
                [
                    "steady (no flaps)",
                    f"{args.steady:.0f}",
                    steady_samples,
                    0,
                    0,
                    steady_writes,
                    steady_requests,
                    steady.get("GET", 0),
                    f"{steady_writes / n / (args.steady / 3600):.3f}" if args.steady else "-",
                ],
                [
                    "flaps",
                    f"{flap_wall:.0f}",
                    results.samples - steady_samples,
                    results.events,
                    results.flaps,
                    flap_writes,
                    flap_requests,
                    flap.get("GET", 0),
                    f"{flap_writes / n / hours:.2f}",
                ],
            ],
        )
    )
    print()
    print(
        table(
            "Change-to-CR latency (seen by a watch on Devices), ms",
            ["transition", "n", "p50", "p90", "p99", "max", "target p99"],
            [
                [
                    "GPU unhealthy",
                    len(results.fault_latency),
                    _ms(results.fault_latency, 50),
                    _ms(results.fault_latency, 90),
                    _ms(results.fault_latency, 99),
                    _ms(results.fault_latency, 100),
                    f"{(args.max_delay + 0.2) * 1000:.0f}",
                ],
                [
                    "GPU recovered",
                    len(results.recovery_latency),
                    _ms(results.recovery_latency, 50),
                    _ms(results.recovery_latency, 90),
                    _ms(results.recovery_latency, 99),
                    _ms(results.recovery_latency, 100),
                    "-",
                ],
                [
                    "event-loop lag",
                    len(lags),
                    _ms(lags, 50),
                    _ms(lags, 90),
                    _ms(lags, 99),
                    _ms(lags, 100),
                    "-",
                ],
            ],
        )
    )
    print()
    rows = []
    for rate in (0.0, 0.001, 0.01, 0.1):
        ours = rate * per_flap if rate else steady_writes / n / (args.steady / 3600 or 1)
        mean_unhealthy = results.unhealthy_seconds / results.flaps if results.flaps else 17.5
        koordlet = rate * mean_unhealthy / KOORDLET_PERIOD_S
        rows.append(
            [
                f"{rate:g}",
                f"{ours:.4f}",
                f"{koordlet:.4f}",
                f"{ANCHOR_WRITES_PER_NODE_HOUR:.4f}",
                f"{ours * 500 / 3600:.6f}",
            ]
        )
    print(
        table(
            "Writes per node-hour at realistic flap rates "
            f"({per_flap:.2f} writes per flap measured)",
            [
                "flaps/node/h",
                "gpulet",
                "koordlet model*",
                "anchor",
                "gpulet writes/s per 500 nodes",
            ],
            rows,
        )
    )
    mean_unhealthy = results.unhealthy_seconds / results.flaps if results.flaps else 0.0
    print(
        f"* one write per {KOORDLET_PERIOD_S:.0f} s rebuild while a GPU is unhealthy (fresh "
        f"condition timestamps), at this run's mean unhealthy time of {mean_unhealthy:.1f} s; "
        "a GPU that stays failed\n  costs koordlet 1200 writes an hour (it never marks "
        "recovery) and gpulet 1. Reads besides writes: 2 GETs per reconcile "
        f"= {2 * 3600 / args.reconcile if args.reconcile else 0:.0f} reads/node/h."
    )
    print()
    print(
        "writes: committed by the API server; write requests: including those answered "
        "with an injected error."
    )
    print(
        f"superseded expectations: {results.superseded}; open at end: {len(expectations)}; "
        f"koordlet model for this run's flaps: {koordlet_writes / n / hours:.2f} writes/node/h"
    )
    print(
        f"process: {cpu_s:.1f}s CPU, {rss_mb():.0f} MiB RSS, "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB peak"
    )
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=200, help="reporters (up to 1000)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of the flap phase")
    parser.add_argument("--steady", type=float, default=10.0, help="seconds of the steady phase")
    parser.add_argument(
        "--flap-rate", type=float, default=30.0, help="flaps per node per hour in the flap phase"
    )
    parser.add_argument("--quiet", type=float, default=0.5, help="quiet window (s)")
    parser.add_argument("--max-delay", type=float, default=2.0, help="maximum delay (s)")
    parser.add_argument("--reconcile", type=float, default=300.0, help="reconcile interval (s)")
    parser.add_argument(
        "--fault-ratio", type=float, default=0.0, help="share of API calls answered 409/429/500"
    )
    args = parser.parse_args()
    if not 1 <= args.nodes <= 5000:
        parser.error("--nodes must be between 1 and 5000")
    if math.isnan(args.duration) or args.duration <= 0:
        parser.error("--duration must be positive")
    sys.exit(anyio.run(run, args))


if __name__ == "__main__":
    main()
