"""Fault-to-kubelet latency: a GPU fault in the mock NVML to the device plugin's
``ListAndWatch`` stream at kubelet, and its clearing back.

Method
------
The bench process runs a real nats-server (child process), the collector and the
health service against the mock NVML (``tests/health/scenarios/health-node.toml``, 5
GPUs) and the device-plugin service on its own NATS connection. Kubelet is another
process, as on a node: a child process runs the project's fake kubelet
(``tests/support/fake_kubelet.py``), which registers the plugin and follows its
``ListAndWatch`` streams of every resource it serves (``nvidia.com/gpu``, the core and
the memory shares) over the real unix sockets, as kubelet does. It stamps each list of
``nvidia.com/gpu`` with ``time.monotonic_ns()`` as it arrives (CLOCK_MONOTONIC, one
clock for every process on Linux) and writes it to the bench on a pipe. The bench
reads the same clock just before it injects a fault into the mock
(``MockNvml.inject``); **fault -> Unhealthy** is the arrival of the first list in
which that GPU is ``Unhealthy``. Then the condition is cleared as an operator does
(``gpulet health clear``: a request to the health service), and **clear -> Healthy**
runs to the first list that shows the GPU ``Healthy`` again. The fault is a critical
XID (95, an NVML event: the health service hears it at once), on GPUs 0-2 in turn, one
at a time (no queueing effects), ``--faults`` of them (default 30). Both directions
are event-driven end to end: nothing in the path polls.

``--same-process`` runs the fake kubelet in the bench process instead (the method
before issue 24's fix: its Python parsing of every resource's list then shares the
event loop and the GIL with the plugin). With ``--trace``, each round also records
when the plugin's node view was told of the change and when its device list moved,
so the table says where the time goes.

Target (issue 24): p99 under 20 ms in both directions on a 2-core machine. The figures
lean on the mock NVML for the fault's detection (a real driver's event arrives in
about the same time; the rest of the path is the same code). The bench prints the
load average before and after: the machine's other work shows in the tail.

Run: ``python bench/listandwatch_latency.py [--faults 30] [--trace] [--same-process]
[--json FILE]``
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ByteReceiveStream, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _util import percentile, table

from gpulet_allocator.kubelet.deviceplugin.service import DevicePluginService
from gpulet_common import codec, subjects
from gpulet_common.embedded_nats import EmbeddedNats, free_port
from gpulet_common.messages import HealthClearRequest
from support.agent import runtime_for
from support.fake_kubelet import FakeKubelet, running_fake_kubelet
from support.health_harness import HealthNode, health_node

GPU = "nvidia.com/gpu"
GPUS = 5
# A critical XID (uncontained ECC error): the GPU is unhealthy until it is cleared.
XID = 95
TARGET_MS = 20.0
WAIT_S = 5.0
MAX_LINE = 1 << 16


def now() -> float:
    """CLOCK_MONOTONIC in seconds: the clock the kubelet process stamps lists with."""
    return time.monotonic_ns() / 1e9


class Trace:
    """When the plugin heard of a change and when its device list moved (--trace)."""

    def __init__(self, plugin: DevicePluginService) -> None:
        self.view_at: list[float] = []
        self.list_at: list[float] = []
        plugin.view.listen(lambda _change: self.view_at.append(now()))
        publish = plugin.state.publish

        def traced(gpus: Any) -> bool:
            changed = publish(gpus)
            if changed:
                self.list_at.append(now())
            return changed

        plugin.state.publish = traced  # type: ignore[method-assign]

    def since(self, t0: float) -> tuple[float, float]:
        view = next((t for t in self.view_at if t >= t0), float("nan"))
        listed = next((t for t in self.list_at if t >= t0), float("nan"))
        return view - t0, listed - t0


# --- kubelet ----------------------------------------------------------------------------


async def gpu_lists(kubelet: FakeKubelet) -> AsyncIterator[tuple[int, dict[str, str]]]:
    """Each ``nvidia.com/gpu`` list kubelet receives: its arrival (monotonic ns) and
    the health of each device (the latest only, if two arrive at once)."""
    last = 0

    def arrived(_devices: object) -> bool:
        return kubelet.endpoint(GPU).received_ns != last

    while True:
        await kubelet.wait_devices(GPU, arrived, timeout_s=3600)
        ep = kubelet.endpoint(GPU)
        last = ep.received_ns
        yield last, {d.ID: d.health for d in ep.devices}


async def serve_kubelet(plugin_dir: Path) -> None:
    """The kubelet process (``--kubelet DIR``): "ready", then one line per list of
    ``nvidia.com/gpu``: its arrival and ``ID=health`` per device."""
    async with running_fake_kubelet(plugin_dir) as kubelet:
        # Kubelet is Go, whose collector pauses for well under a millisecond. Python's
        # full collection here would walk every object of the imports (grpc, protobuf,
        # gpulet's stubs) and stalled this stand-in for 50-200 ms, once a run, while
        # the plugin had long sent the list: leave the objects of the start-up out.
        gc.freeze()
        print("ready", flush=True)
        async for received, health in gpu_lists(kubelet):
            print(received, *(f"{i}={h}" for i, h in health.items()), flush=True)


class KubeletView:
    """The latest ``nvidia.com/gpu`` list kubelet received, and when."""

    def __init__(self) -> None:
        self.received = 0.0
        self.health: dict[str, str] = {}
        self._changed = anyio.Event()

    def update(self, received: float, health: dict[str, str]) -> None:
        self.received, self.health = received, health
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    async def until(self, uuid: str, health: str) -> float:
        """When the first list that shows ``uuid`` with ``health`` arrived."""
        with anyio.fail_after(WAIT_S):
            while self.health.get(uuid) != health:
                await self._changed.wait()
        return self.received

    async def until_listed(self, count: int) -> None:
        with anyio.fail_after(WAIT_S * 2):
            while len(self.health) != count:
                await self._changed.wait()

    async def follow_child(
        self, stdout: ByteReceiveStream, *, task_status: TaskStatus[None]
    ) -> None:
        lines = BufferedByteReceiveStream(stdout)
        if await lines.receive_until(b"\n", MAX_LINE) != b"ready":
            raise RuntimeError("the kubelet process did not start")
        task_status.started()
        while True:
            ns, *devices = (await lines.receive_until(b"\n", MAX_LINE)).decode().split()
            self.update(int(ns) / 1e9, dict(d.split("=", 1) for d in devices))

    async def follow_in_process(self, kubelet: FakeKubelet) -> None:
        async for received, health in gpu_lists(kubelet):
            self.update(received / 1e9, health)


# --- the rounds -------------------------------------------------------------------------


def _steps(out: dict[str, list[float]], kind: str, trace: Trace | None, t0: float) -> None:
    if trace is not None:
        view, listed = trace.since(t0)
        out[f"{kind}_view"].append(view)
        out[f"{kind}_list"].append(listed)


async def rounds(
    h: HealthNode, kubelet: KubeletView, faults: int, trace: Trace | None
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"fault": [], "clear": [], "fault_view": [], "fault_list": []}
    out.update({"clear_view": [], "clear_list": []})
    for i in range(faults):
        slot = i % 3
        uuid = h.uuid(slot)
        # The fault: a critical XID, which the health service hears as an NVML event.
        t0 = now()
        h.inject("xid", gpu=slot, value=XID)
        out["fault"].append(await kubelet.until(uuid, "Unhealthy") - t0)
        _steps(out, "fault", trace, t0)
        await anyio.sleep(0.02)
        # The clear: an operator's `gpulet health clear` of that condition.
        t0 = now()
        await h.runtime.bus.request(
            subjects.health_clear(h.node),
            HealthClearRequest(gpu=str(slot), condition=f"xid:{XID}", requested_by="bench"),
            codec.HEALTH_CLEAR_REQUEST,
            codec.HEALTH_STATE,
        )
        out["clear"].append(await kubelet.until(uuid, "Healthy") - t0)
        _steps(out, "clear", trace, t0)
        await anyio.sleep(0.02)
    return out


async def measure(
    h: HealthNode, kubelet: KubeletView, faults: int, traced: bool
) -> dict[str, list[float]]:
    async with (
        runtime_for(h.settings, name="bench-device-plugin") as rt,
        anyio.create_task_group() as tg,
    ):
        plugin = DevicePluginService(rt)
        trace = Trace(plugin) if traced else None
        await tg.start(plugin.run)
        await kubelet.until_listed(GPUS)
        await anyio.sleep(0.5)
        print(f"{faults} faults and clears ...", file=sys.stderr, flush=True)
        results = await rounds(h, kubelet, faults, trace)
        tg.cancel_scope.cancel()
    return results


async def run(faults: int, traced: bool, same_process: bool) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="gpl-") as tmp:
        base = Path(tmp)
        plugin_dir = base / "dp"
        plugin_dir.mkdir()
        async with EmbeddedNats(state_dir=base / "nats", port=free_port()) as server:
            overrides = [
                "health.dedup_window_s=0",
                "health.event_wait_timeout_ms=200",
                "health.device_poll_s=0.1",
                f"allocator.plugin.plugin_dir={plugin_dir}/",
                "allocator.plugin.watch_interval_s=0.05",
                f"allocator.plugin.dev_root={base}",
            ]
            view = KubeletView()
            async with (
                health_node(server.url, base, overrides=overrides) as h,
                anyio.create_task_group() as tg,
            ):
                kubelet = _in_process_kubelet if same_process else _kubelet_process
                await tg.start(kubelet, plugin_dir, view)
                results = await measure(h, view, faults, traced)
                tg.cancel_scope.cancel()
    return results


async def _in_process_kubelet(
    plugin_dir: Path, view: KubeletView, *, task_status: TaskStatus[None]
) -> None:
    async with running_fake_kubelet(plugin_dir) as kubelet, anyio.create_task_group() as tg:
        tg.start_soon(view.follow_in_process, kubelet)
        task_status.started()


async def _kubelet_process(
    plugin_dir: Path, view: KubeletView, *, task_status: TaskStatus[None]
) -> None:
    command = [sys.executable, __file__, "--kubelet", str(plugin_dir)]
    async with await anyio.open_process(command, stderr=None) as process:
        try:
            assert process.stdout is not None
            await view.follow_child(process.stdout, task_status=task_status)
        finally:
            process.terminate()
            with anyio.move_on_after(5, shield=True):
                await process.wait()


def _row(name: str, seconds: list[float], target: float | None) -> tuple[object, ...]:
    ms = [v * 1000 for v in seconds]
    p50, p99 = percentile(ms, 50), percentile(ms, 99)
    met = "" if target is None else ("yes" if p99 < target else "NO")
    goal = "" if target is None else f"< {target:.0f}"
    return (name, len(ms), f"{p50:.1f}", f"{p99:.1f}", f"{max(ms):.1f}", goal, met)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=30, help="faults (and clears) to time")
    parser.add_argument("--trace", action="store_true", help="also time the plugin's steps")
    parser.add_argument(
        "--same-process", action="store_true", help="run the fake kubelet in this process"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--kubelet", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kubelet:
        anyio.run(serve_kubelet, Path(args.kubelet))
        return
    # Every fault is logged at WARNING by the health service: quiet here.
    logging.basicConfig(level=logging.ERROR)
    started = time.perf_counter()
    load_before = _load()
    results = anyio.run(run, args.faults, args.trace, args.same_process)
    rows = [
        _row("fault -> Unhealthy at kubelet", results["fault"], TARGET_MS),
        _row("clear -> Healthy at kubelet", results["clear"], TARGET_MS),
    ]
    steps: list[tuple[str, Callable[[], list[float]]]] = [
        ("  fault -> plugin's node view", lambda: results["fault_view"]),
        ("  fault -> plugin's device list", lambda: results["fault_list"]),
        ("  clear -> plugin's node view", lambda: results["clear_view"]),
        ("  clear -> plugin's device list", lambda: results["clear_list"]),
    ]
    if args.trace:
        rows += [_row(name, values(), None) for name, values in steps]
    where = "in the bench process" if args.same_process else "in a process of its own"
    print(
        table(
            "ListAndWatch latency (ms): a critical XID in the mock NVML -> the fake "
            f"kubelet's device list ({where}), and its clearing back",
            ["direction", "n", "p50", "p99", "max", "target p99", "met"],
            rows,
        )
    )
    print(
        f"\n({time.perf_counter() - started:.0f}s; load average {load_before} before, "
        f"{_load()} after)"
    )
    if args.json:
        summary = {
            k: {"p50_ms": percentile(v, 50) * 1000, "p99_ms": percentile(v, 99) * 1000}
            for k, v in results.items()
            if v
        }
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
