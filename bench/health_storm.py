"""An XID storm against the real health service: its CPU and RSS, what reaches the bus.

Method
------
One process runs a real nats-server (child process), the health service against the
mock NVML (``tests/health/scenarios/health-node.toml``, 5 GPUs; no collector, so only the
storm costs) and a plain subscriber on its own NATS connection, as in
``bench/health_latency.py``. After ``--idle`` seconds of quiet (the baseline), the
mock's XID injection (``MockNvml.inject``, the same path as ``gpulet mock inject``)
puts XID 95 on a GPU for ``--seconds`` at each of ``--rates`` a second (one storm per
rate, each on its own GPU), in batches every 10 ms, with
one XID 48 on the same GPU halfway through. The figures:

* **CPU**: the process's CPU time over the phase (``getrusage``), as % of one core,
  and the same less the injector's own CPU time (``time.thread_time`` around its
  calls): what the health service, its NVML event thread and the bus client cost;
* **RSS**: the process's resident set at the phase's end, and its peak (VmHWM);
* **bus**: events the subscriber received, the most in any one second, the sum of the
  XID 95 events' ``repeat_count`` (after the last de-duplication window closes) against
  the XIDs the mock delivered, and how long the XID 48 took from injection to receipt;
* **log**: records the gpulet loggers wrote during the phase.

The storm leans on the mock NVML: real NVML delivers events from the driver, and its
per-event cost in ``nvmlEventSetWait`` is not measured here. The mock, like NVML,
buffers at most 1024 events per event set: a storm faster than the event thread drains
it loses the overflow there, before the service (``queued by mock`` vs ``counted``):
the oldest events go, and with them, possibly, the XID 48.

Run: ``python bench/health_storm.py [--rates 2000,10000] [--seconds 30] [--window 5]``
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _util import rss_mb, table

from gpulet_common.embedded_nats import EmbeddedNats, free_port
from gpulet_common.messages import MockInjectRequest
from support.health_harness import HealthNode, health_node

STORM_XID = 95
MIDDLE_XID = 48
BATCH_S = 0.01


class CountingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def storm(h: HealthNode, gpu: int, rate: int, seconds: float) -> dict[str, float]:
    per_batch = max(1, round(rate * BATCH_S))
    xid = MockInjectRequest(gpu=gpu, fault="xid", value=STORM_XID)
    injector_cpu = 0.0
    delivered = 0
    injected = 0
    middle_at = 0.0
    start = time.monotonic()
    batches = round(seconds / BATCH_S)
    for n in range(batches):
        t0 = time.thread_time()
        for _ in range(per_batch):
            reply = h.mock.inject(xid)
            injected += 1
            delivered += "delivered to 0" not in reply.detail
        injector_cpu += time.thread_time() - t0
        if n == batches // 2:
            middle_at = time.time()
            h.inject("xid", gpu=gpu, value=MIDDLE_XID)
        # Keep to the rate: sleep until this batch's slot ends (at least a yield).
        await anyio.sleep(max(0.0, start + (n + 1) * BATCH_S - time.monotonic()))
    return {
        "injected": injected,
        "delivered": delivered,
        "injector_cpu_s": injector_cpu,
        "middle_at": middle_at,
        "wall_s": time.monotonic() - start,
    }


async def run(args: argparse.Namespace) -> list[tuple[object, ...]]:
    counter = CountingHandler()
    logging.getLogger("gpulet").addHandler(counter)
    rows: list[tuple[object, ...]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        async with EmbeddedNats.running(state_dir=base / "nats", port=free_port()) as server:
            overrides = [f"health.dedup_window_s={args.window}", "health.tick_s=0.5"]
            async with health_node(server.url, base, overrides=overrides, collector=False) as h:
                await anyio.sleep(1.0)

                cpu0, wall0, logs0 = cpu_s(), time.monotonic(), counter.count
                await anyio.sleep(args.idle)
                idle_cpu = (cpu_s() - cpu0) / (time.monotonic() - wall0) * 100
                idle_logs = str(counter.count - logs0)
                rows.append(("idle", "-", "-", f"{idle_cpu:.1f}", "-", f"{rss_mb():.1f}", "-", "-"))
                rows[-1] += ("-", "-", idle_logs)

                for gpu, rate in enumerate(args.rates):
                    uuid = h.uuid(gpu)
                    print(f"storm: {rate}/s x {args.seconds}s ...", file=sys.stderr, flush=True)
                    rss_before = rss_mb()
                    events0 = len(h.log.events)
                    cpu0, logs0 = cpu_s(), counter.count
                    result = await storm(h, gpu, rate, args.seconds)
                    storm_cpu = cpu_s() - cpu0
                    wall = result["wall_s"]
                    rss_end = rss_mb()
                    logs = counter.count - logs0
                    # The last window's summary: wait for the counts to settle.
                    with anyio.move_on_after(args.window + 5):
                        while True:
                            counted = sum(
                                e.repeat_count
                                for e in h.log.events[events0:]
                                if e.xid == STORM_XID and e.gpu_uuid == uuid
                            )
                            if counted >= result["delivered"]:
                                break
                            await anyio.sleep(0.1)
                    events = h.log.events[events0:]
                    times = h.log.received_at[events0:]
                    per_second: dict[int, int] = {}
                    for at in times:
                        per_second[int(at)] = per_second.get(int(at), 0) + 1
                    middle = [
                        t
                        for e, t in zip(events, times, strict=True)
                        if e.xid == MIDDLE_XID and e.gpu_uuid == uuid
                    ]
                    latency = (
                        f"{(middle[0] - result['middle_at']) * 1000:.0f}" if middle else "never"
                    )
                    rows.append(
                        (
                            f"storm {rate}/s x {args.seconds:g}s",
                            f"{result['injected']:,}",
                            f"{result['delivered']:,}",
                            f"{storm_cpu / wall * 100:.1f}",
                            f"{(storm_cpu - result['injector_cpu_s']) / wall * 100:.1f}",
                            f"{rss_before:.1f} -> {rss_end:.1f}",
                            f"{peak_rss_mb():.1f}",
                            f"{len(events)} (max {max(per_second.values(), default=0)}/s)",
                            f"{counted:,}",
                            latency,
                            str(logs),
                        )
                    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rates",
        type=lambda text: [int(r) for r in text.split(",")],
        default=[2_000, 10_000],
        help="XIDs a second, one storm each on its own GPU (2000,10000)",
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="storm length (30 s)")
    parser.add_argument("--window", type=float, default=5.0, help="health.dedup_window_s (5)")
    parser.add_argument("--idle", type=float, default=5.0, help="baseline phase (5 s)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    rows = anyio.run(run, args)
    print(
        table(
            f"Health service under an XID {STORM_XID} storm on one GPU (mock NVML; one "
            f"XID {MIDDLE_XID} in the middle; dedup window {args.window:g}s)",
            [
                "phase",
                "injected",
                "queued by mock",
                "CPU %",
                "CPU % w/o injector",
                "RSS MB",
                "peak RSS MB",
                "bus events",
                "XID 95 counted",
                f"XID {MIDDLE_XID} ms",
                "log records",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
