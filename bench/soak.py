"""Soak: 100 mock GPUs sampled at 10 Hz for 10 minutes -- RSS growth, CPU, lost events, lag.

A bench, not CI (``bench/run_all.py`` leaves it out). Targets (issue): RSS growth under
5 MB over the run, no health event lost.

Method
------
* **Node.** A scenario generated as TOML (``base = "dgx-h100"``: its GPU defaults --
  H100 80 GB, ECC, remapping, thresholds -- and ``--gpus`` ``[[gpus]]`` tables split
  over two NUMA nodes, topology at the default level ``SYSTEM``), written to a
  temporary file. The NVSwitch fabric of the base is switched off: with 18 NVLinks per
  pair a 100-GPU inventory is 999 KB, a hair under NATS's 1 MiB ``max_payload``
  (without: 870 KB). Its timeline heats one GPU every minute (from 34 C to 96 C in
  10 s, held 10 s, back in 10 s), across the slowdown (94 C) and the 95 C alert.
* **Agent.** ``python -m gpulet run --only collector,health,reporter,allocator --nvml
  mock:<file> --set collector.sample_period_s=<1/hz>`` as its own process (so its RSS
  and CPU are its own) against a nats-server started here; the reporter runs offline
  (mock NVML), the allocator without kubelet. Logging at ``warning``.
* **Bench side** (this process, its own NATS connection): a plain subscriber of
  ``gpu.samples.<node>`` and one of ``gpu.health.*``, and an injector that sends one
  XID every ``1/--xid-rate`` s through ``gpulet.mock.inject.<node>`` (what ``gpulet
  mock inject`` does), each to the next GPU, with an XID number chosen so that no
  (GPU, XID) pair repeats within the health service's 60 s de-duplication window:
  every injection must give exactly one event.
* **Window.** ``--warmup`` (30 s) after the agent is ready, then ``--minutes``.
  Injection runs during the window; afterwards the subscribers get 5 s to drain.

Measures
--------
* RSS of the agent (``/proc/<pid>/status``) at the window's start and end, the growth,
  the maximum, and a least-squares slope over the samples taken every 5 s.
* CPU: agent (and nats-server, and this bench process) CPU time / wall, in % of one
  core, over the window.
* Health: XIDs injected (and accepted by the mock), XID events received (matched on
  GPU index and XID), lost = injected - received; injection-to-receipt latency; the
  thermal ramps that raised a thermal condition and recovered.
* Samples: batches received vs expected (window x hz), incomplete batches, the gap
  between consecutive batch timestamps (and how many exceed 1.5 periods); bus lag =
  receipt time - ``SampleBatch.timestamp`` (taken when the collection ends, just
  before publishing) and sample age = receipt time - the oldest per-GPU ``timestamp``
  of the batch (the read included).

Run: ``python bench/soak.py [--minutes 10] [--gpus 100] [--hz 10] [--json FILE]``;
``--agent-set SECTION.KEY=VALUE`` passes a setting to the agent (to try a change).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from nats.aio.msg import Msg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import percentile, rss_mb, table

from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, BusError
from gpulet_common.embedded_nats import EmbeddedNats, free_port
from gpulet_common.messages import MockInjectRequest
from gpulet_common.settings.nats import NatsSettings

NODE = "soak-node"
# XIDs injected in turn: critical ones (sticky conditions), application ones (reports)
# and some the catalogue does not list (treated as critical).
XIDS = (48, 63, 64, 74, 79, 92, 94, 95, 119, 13, 31, 43)
DEDUP_WINDOW_S = 60.0
RAMP = {"from": 34, "to": 96, "ramp_s": 10.0, "hold_s": 10.0, "back_s": 10.0}
RAMP_EVERY_S = 60.0
RAMP_FIRST_S = 20.0
DRAIN_S = 5.0
READY_TIMEOUT_S = 120.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- the scenario -------------------------------------------------------------------------


def ramp_times(seconds: float) -> list[float]:
    """Mock-clock times at which a temperature ramp starts."""
    count = max(0, math.ceil((seconds - RAMP_FIRST_S) / RAMP_EVERY_S))
    return [RAMP_FIRST_S + k * RAMP_EVERY_S for k in range(count)]


def ramp_gpu(k: int, gpus: int) -> int:
    return (k * 37) % gpus


def scenario_toml(gpus: int, seconds: float) -> str:
    """``gpus`` H100s on top of dgx-h100, temperature ramps until ``seconds``."""
    lines = [
        'base = "dgx-h100"',
        f'description = "soak: {gpus} mock H100s, one temperature ramp a minute"',
        "seed = 2024",
        "",
        "[gpu_defaults]",
        "nvswitch_links = 0",
        "",
        "[topology]",
        'default_level = "SYSTEM"',
        "groups = []",
    ]
    for slot in range(gpus):
        numa = slot * 2 // gpus
        lines += ["", "[[gpus]]", f"numa_node = {numa}"]
    for k, at in enumerate(ramp_times(seconds)):
        lines += [
            "",
            "[[timeline]]",
            f"at = {at}",
            'fault = "temperature"',
            f"gpu = {ramp_gpu(k, gpus)}",
            f"from = {RAMP['from']}",
            f"value = {RAMP['to']}",
            f"ramp_s = {RAMP['ramp_s']}",
            f"duration_s = {RAMP['hold_s']}",
            f"back_s = {RAMP['back_s']}",
        ]
    return "\n".join(lines) + "\n"


# --- the agent process ----------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as stat:
        # The command may hold spaces; the fields after it are space separated.
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def scrape(port: int) -> dict[str, float]:
    """The agent's /metrics as {"name{labels}": value} (counters and gauges)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def metric_sum(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.split("{", 1)[0] == prefix)


# --- what the bench side sees -----------------------------------------------------------------


@dataclass
class Observed:
    gpus: int
    # Sample batches: (receipt time, batch timestamp, oldest sample timestamp, samples).
    batches: list[tuple[float, float, float, int]] = field(default_factory=list)
    # XID events: (gpu index, xid) -> first receipt time; and every event kind seen.
    xid_events: dict[tuple[int, int], float] = field(default_factory=dict)
    xid_duplicates: int = 0
    thermal_raised: set[int] = field(default_factory=set)
    thermal_recovered: set[int] = field(default_factory=set)
    kinds: dict[str, int] = field(default_factory=dict)
    health_events: int = 0
    malformed: int = 0
    # Injections: (gpu slot, xid) -> send time; refusals by the mock.
    injected: dict[tuple[int, int], float] = field(default_factory=dict)
    inject_failed: int = 0
    counting: bool = False

    def on_samples(self, msg: Msg) -> None:
        now = time.time()
        try:
            batch = codec.SAMPLES.decode(msg.data)
        except ValueError:
            self.malformed += 1
            return
        if not self.counting:
            return
        oldest = min((s.timestamp for s in batch.samples), default=batch.timestamp)
        self.batches.append((now, batch.timestamp, oldest, len(batch.samples)))

    def on_health(self, msg: Msg) -> None:
        now = time.time()
        try:
            event = codec.HEALTH_EVENT.decode(msg.data)
        except ValueError:
            self.malformed += 1
            return
        self.health_events += 1
        self.kinds[event.kind] = self.kinds.get(event.kind, 0) + 1
        index = event.gpu_index if event.gpu_index is not None else -1
        if event.kind == "xid" and event.xid is not None:
            key = (index, event.xid)
            if key in self.xid_events:
                self.xid_duplicates += 1
            else:
                self.xid_events[key] = now
        elif event.kind in ("thermal", "thermal_slowdown"):
            self.thermal_raised.add(index)
        elif event.kind == "recovered" and (event.condition_kind or "").startswith("thermal"):
            self.thermal_recovered.add(index)


async def inject_xids(bus: Bus, obs: Observed, rate: float, until: float) -> None:
    """One XID every 1/rate s to the next GPU, drift-free, until ``until`` (monotonic)."""
    period = 1.0 / rate
    n = 0
    next_tick = time.monotonic()
    while next_tick < until:
        slot = n % obs.gpus
        xid = XIDS[(n // obs.gpus) % len(XIDS)]
        request = MockInjectRequest(gpu=slot, fault="xid", value=float(xid))
        sent = time.time()
        try:
            reply = await bus.request(
                subjects.mock_inject(NODE),
                request,
                codec.MOCK_INJECT_REQUEST,
                codec.MOCK_INJECT_REPLY,
                timeout_s=2.0,
            )
        except BusError:
            obs.inject_failed += 1
        else:
            if reply.applied:
                obs.injected[(slot, xid)] = sent
            else:
                obs.inject_failed += 1
        n += 1
        next_tick += period
        await anyio.sleep(max(0.0, next_tick - time.monotonic()))


# --- the run ------------------------------------------------------------------------------------


@dataclass
class Run:
    args: argparse.Namespace
    obs: Observed
    rss: list[tuple[float, float]] = field(default_factory=list)
    window_s: float = 0.0
    agent_cpu_s: float = 0.0
    nats_cpu_s: float = 0.0
    bench_cpu_s: float = 0.0
    metrics_start: dict[str, float] = field(default_factory=dict)
    metrics_end: dict[str, float] = field(default_factory=dict)
    ramps: list[tuple[float, int]] = field(default_factory=list)
    mock_started: float = 0.0


async def track_rss(pid: int, run: Run, every_s: float) -> None:
    while True:
        run.rss.append((time.monotonic(), rss_mb(pid)))
        await anyio.sleep(every_s)


async def progress(run: Run, agent_pid: int, start: float, every_s: float) -> None:
    cpu0 = cpu_seconds(agent_pid)
    while True:
        await anyio.sleep(every_s)
        elapsed = time.monotonic() - start
        cpu = (cpu_seconds(agent_pid) - cpu0) / elapsed * 100
        print(
            f"[{elapsed:5.0f} s] RSS {rss_mb(agent_pid):6.1f} MB, CPU {cpu:5.1f} %, "
            f"batches {len(run.obs.batches)}, XIDs {len(run.obs.injected)} injected / "
            f"{len(run.obs.xid_events)} seen, health events {run.obs.health_events}",
            flush=True,
        )


def agent_command(args: argparse.Namespace, scenario: Path, state: Path, url: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gpulet",
        "run",
        "--only",
        "collector,health,reporter,allocator",
        "--node",
        NODE,
        "--nvml",
        f"mock:{scenario}",
        "--nats",
        url,
        "--state-dir",
        str(state),
        "--metrics-port",
        str(args.metrics_port),
        "--log-level",
        "warning",
        "--set",
        f"collector.sample_period_s={1.0 / args.hz}",
        *(arg for setting in args.agent_set for arg in ("--set", setting)),
    ]


async def soak(args: argparse.Namespace, tmp: Path) -> Run:
    window_s = args.minutes * 60.0
    total_s = args.warmup + window_s + 60.0  # the timeline outlives the run
    scenario = tmp / f"soak-{args.gpus}gpu.toml"
    scenario.write_text(scenario_toml(args.gpus, total_s))
    obs = Observed(gpus=args.gpus)
    run = Run(args=args, obs=obs)
    async with EmbeddedNats(state_dir=tmp / "nats") as server:
        nats_pid = server._process.pid if server._process is not None else None
        log_path = tmp / "agent.log"
        with log_path.open("wb") as log:
            mock_started = time.monotonic()
            agent = await anyio.open_process(
                agent_command(args, scenario, tmp / "state", server.url),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            await _measure(args, run, agent, server.url, nats_pid, mock_started)
        finally:
            with anyio.CancelScope(shield=True):
                agent.terminate()
                with anyio.move_on_after(15):
                    await agent.wait()
                if agent.returncode is None:
                    agent.kill()
                    await agent.wait()
        errors = [
            line
            for line in log_path.read_text(errors="replace").splitlines()
            if " ERROR " in line or "Traceback" in line
        ]
        if errors:
            print(f"agent log ({log_path}) has {len(errors)} error line(s), first:", errors[0])
    return run


async def _measure(
    args: argparse.Namespace,
    run: Run,
    agent: anyio.abc.Process,
    url: str,
    nats_pid: int | None,
    mock_started: float,
) -> None:
    obs = run.obs
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not await anyio.to_thread.run_sync(ready, args.metrics_port):
        if agent.returncode is not None:
            raise RuntimeError(f"the agent exited with {agent.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agent was not ready within {READY_TIMEOUT_S:.0f} s")
        await anyio.sleep(0.5)
    print(f"agent ready after {time.monotonic() - mock_started:.1f} s", flush=True)
    async with Bus.connect(NatsSettings(url=url), name="soak-bench") as bus:
        nc = bus.client
        samples_sub = await nc.subscribe(
            subjects.samples(NODE), cb=_callback(obs.on_samples), pending_msgs_limit=100_000
        )
        health_sub = await nc.subscribe(
            "gpu.health.*", cb=_callback(obs.on_health), pending_msgs_limit=100_000
        )
        await bus.flush()
        print(f"warm-up {args.warmup:.0f} s", flush=True)
        await anyio.sleep(args.warmup)

        window_s = args.minutes * 60.0
        pid = agent.pid
        start = time.monotonic()
        run.metrics_start = await anyio.to_thread.run_sync(scrape, args.metrics_port)
        cpu0 = cpu_seconds(pid)
        nats0 = cpu_seconds(nats_pid) if nats_pid else 0.0
        bench0 = time.process_time()
        obs.counting = True
        async with anyio.create_task_group() as tg:
            tg.start_soon(track_rss, pid, run, 5.0)
            tg.start_soon(progress, run, pid, start, args.progress_s)
            await inject_xids(bus, obs, args.xid_rate, start + window_s)
            await anyio.sleep(max(0.0, start + window_s - time.monotonic()))
            obs.counting = False
            run.window_s = time.monotonic() - start
            run.agent_cpu_s = cpu_seconds(pid) - cpu0
            run.nats_cpu_s = (cpu_seconds(nats_pid) - nats0) if nats_pid else float("nan")
            run.bench_cpu_s = time.process_time() - bench0
            run.rss.append((time.monotonic(), rss_mb(pid)))
            tg.cancel_scope.cancel()
        run.metrics_end = await anyio.to_thread.run_sync(scrape, args.metrics_port)
        # Events of the last injections may still be on their way.
        await anyio.sleep(DRAIN_S)
        await samples_sub.unsubscribe()
        await health_sub.unsubscribe()
        if agent.returncode is not None:
            raise RuntimeError(f"the agent exited with {agent.returncode} during the run")
    # Ramps that started and ended inside the window (mock clock = agent start).
    first = start - mock_started
    last = first + window_s - sum(RAMP[k] for k in ("ramp_s", "hold_s", "back_s")) - 5
    run.ramps = [
        (at, ramp_gpu(k, args.gpus))
        for k, at in enumerate(ramp_times(first + window_s + 60))
        if first <= at <= last
    ]


def _callback(fn: Any) -> Any:
    async def cb(msg: Msg) -> None:
        fn(msg)

    return cb


# --- the report -----------------------------------------------------------------------------------


def slope_mb_per_min(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return float("nan")
    t0 = points[0][0]
    xs = [(t - t0) / 60 for t, _ in points]
    ys = [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def report(run: Run) -> dict[str, Any]:
    args, obs = run.args, run.obs
    window = run.window_s
    rss_start = run.rss[0][1] if run.rss else float("nan")
    rss_end = run.rss[-1][1] if run.rss else float("nan")
    rss_max = max((r for _, r in run.rss), default=float("nan"))
    expected = math.floor(window * args.hz)
    received = len(obs.batches)
    incomplete = sum(1 for *_, n in obs.batches if n != args.gpus)
    lags = [(r - ts) * 1e3 for r, ts, _, _ in obs.batches]
    ages = [(r - oldest) * 1e3 for r, _, oldest, _ in obs.batches]
    stamps = sorted(ts for _, ts, _, _ in obs.batches)
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]
    period_ms = 1000 / args.hz
    late = sum(1 for g in gaps if g > 1.5 * period_ms)
    missing = [k for k in obs.injected if k not in obs.xid_events]
    latencies = [
        (obs.xid_events[k] - sent) * 1e3 for k, sent in obs.injected.items() if k in obs.xid_events
    ]
    ramp_gpus = [g for _, g in run.ramps]
    raised = sum(1 for g in ramp_gpus if g in obs.thermal_raised)
    recovered = sum(1 for g in ramp_gpus if g in obs.thermal_recovered)
    cpu = run.agent_cpu_s / window * 100 if window else float("nan")
    nats_cpu = run.nats_cpu_s / window * 100 if window else float("nan")
    bench_cpu = run.bench_cpu_s / window * 100 if window else float("nan")
    start_m, end_m = run.metrics_start, run.metrics_end

    def delta(name: str) -> float:
        return metric_sum(end_m, name) - metric_sum(start_m, name)

    rows: list[list[object]] = [
        ["window", f"{window / 60:.1f} min after {args.warmup:.0f} s warm-up", ""],
        ["RSS at start / end", f"{rss_start:.1f} / {rss_end:.1f} MB", ""],
        ["RSS growth", f"{rss_end - rss_start:+.1f} MB", "< 5 MB"],
        [
            "  max, trend",
            f"{rss_max:.1f} MB, {slope_mb_per_min(run.rss):+.3f} MB/min",
            "",
        ],
        ["agent CPU (one core = 100 %)", f"{cpu:.1f} %", ""],
        ["  nats-server / this bench", f"{nats_cpu:.1f} % / {bench_cpu:.1f} %", ""],
        ["XIDs injected (accepted by the mock)", f"{len(obs.injected)}", ""],
        ["  injection failures", f"{obs.inject_failed}", "0"],
        ["XID events received", f"{len(obs.injected) - len(missing)}", ""],
        ["health events lost", f"{len(missing)}", "0"],
        ["  duplicate XID events", f"{obs.xid_duplicates}", "0"],
        [
            "  injection -> event p50 / p99 / max",
            f"{percentile(latencies, 50):.1f} / {percentile(latencies, 99):.1f} / "
            f"{max(latencies, default=float('nan')):.1f} ms",
            "",
        ],
        ["thermal ramps raised / recovered", f"{raised} / {recovered} of {len(ramp_gpus)}", ""],
        [
            "health events from warm-up to drain",
            f"{obs.health_events} {dict(sorted(obs.kinds.items()))}",
            "",
        ],
        [
            f"sample batches ({args.gpus} GPUs) received / expected",
            f"{received} / {expected} ({received / expected * 100:.1f} %)" if expected else "-",
            "100 %",
        ],
        ["  incomplete batches", f"{incomplete}", "0"],
        ["  missing (expected - received)", f"{max(0, expected - received)}", "0"],
        ["  late: intervals over 1.5 periods", f"{late}", ""],
        [
            "  batch interval p50 / p99 / max",
            f"{percentile(gaps, 50):.0f} / {percentile(gaps, 99):.0f} / "
            f"{max(gaps, default=float('nan')):.0f} ms",
            f"{1000 / args.hz:.0f} ms",
        ],
        [
            "bus lag p50 / p99 / max",
            f"{percentile(lags, 50):.1f} / {percentile(lags, 99):.1f} / "
            f"{max(lags, default=float('nan')):.1f} ms",
            "",
        ],
        [
            "sample age p50 / p99 / max",
            f"{percentile(ages, 50):.1f} / {percentile(ages, 99):.1f} / "
            f"{max(ages, default=float('nan')):.1f} ms",
            "",
        ],
        ["malformed messages (bench side)", f"{obs.malformed}", "0"],
    ]
    if end_m:
        for label, name in (
            ("agent: GPU samples taken (metric)", "gpulet_collector_samples_total"),
            ("agent: GPU sample errors (metric)", "gpulet_collector_sample_errors_total"),
            ("agent: health events published (metric)", "gpulet_health_events_published_total"),
            ("agent: health events buffered (metric)", "gpulet_health_events_buffered_total"),
            ("agent: health events dropped (metric)", "gpulet_health_events_dropped_total"),
            ("agent: bus errors (metric)", "gpulet_bus_errors_total"),
            ("agent: malformed bus messages (metric)", "gpulet_bus_malformed_messages_total"),
        ):
            rows.append([label, f"{delta(name):.0f}", ""])
    title = (
        f"Soak: {args.gpus} mock GPUs at {args.hz:g} Hz for {args.minutes:g} min, "
        f"{args.xid_rate:g} XID/s + a thermal ramp a minute (real nats-server)"
    )
    print(table(title, ["measure", "value", "target"], rows), flush=True)
    return {
        "gpus": args.gpus,
        "hz": args.hz,
        "minutes": args.minutes,
        "window_s": window,
        "rss_start_mb": rss_start,
        "rss_end_mb": rss_end,
        "rss_growth_mb": rss_end - rss_start,
        "rss_max_mb": rss_max,
        "rss_slope_mb_per_min": slope_mb_per_min(run.rss),
        "agent_cpu_pct": cpu,
        "nats_cpu_pct": nats_cpu,
        "bench_cpu_pct": bench_cpu,
        "xids_injected": len(obs.injected),
        "inject_failed": obs.inject_failed,
        "events_lost": len(missing),
        "xid_duplicates": obs.xid_duplicates,
        "thermal_ramps": len(ramp_gpus),
        "thermal_raised": raised,
        "thermal_recovered": recovered,
        "batches_received": received,
        "batches_expected": expected,
        "incomplete_batches": incomplete,
        "late_intervals": late,
        "bus_lag_ms": {
            "p50": percentile(lags, 50),
            "p99": percentile(lags, 99),
            "max": max(lags, default=None),
        },
        "sample_age_ms": {
            "p50": percentile(ages, 50),
            "p99": percentile(ages, 99),
            "max": max(ages, default=None),
        },
        "rss_samples": run.rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="measured window")
    parser.add_argument("--gpus", type=int, default=100, help="mock GPUs on the node")
    parser.add_argument("--hz", type=float, default=10.0, help="samples per second")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before measuring")
    parser.add_argument("--xid-rate", type=float, default=1.0, help="XIDs injected per second")
    parser.add_argument("--progress-s", type=float, default=60.0, help="progress line every")
    parser.add_argument("--metrics-port", type=int, default=0, help="agent /metrics port")
    parser.add_argument(
        "--agent-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="extra --set for the agent (repeatable)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.gpus < 1 or args.hz <= 0 or args.minutes <= 0 or args.xid_rate <= 0:
        parser.error("--gpus, --hz, --minutes and --xid-rate must be positive")
    if args.gpus * len(XIDS) / args.xid_rate <= DEDUP_WINDOW_S:
        parser.error("a (GPU, XID) pair would repeat within the de-duplication window")
    args.metrics_port = args.metrics_port or free_port()
    with tempfile.TemporaryDirectory(prefix="gpulet-soak-") as tmp:
        run = anyio.run(soak, args, Path(tmp))
    figures = report(run)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
