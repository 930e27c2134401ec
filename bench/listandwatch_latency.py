"""Fault-to-kubelet latency: a GPU fault in the mock NVML to the device plugin's
``ListAndWatch`` stream at kubelet, and its clearing back.

Method
------
One process runs a real nats-server (child process), the collector and the health
service against the mock NVML (``tests/health/scenarios/health-node.toml``, 5 GPUs),
the device-plugin service on its own NATS connection, and the project's fake kubelet
(``tests/support/fake_kubelet.py``), which registers the plugin and follows its
``ListAndWatch`` stream of ``nvidia.com/gpu`` over the real unix socket, as kubelet
does. For each fault the wall clock is read just before the fault is injected into
the mock (``MockNvml.inject``) and again when the fake kubelet has received a device
list in which that GPU is ``Unhealthy`` (**fault -> Unhealthy**); then the condition is
cleared as an operator does (``gpulet health clear``: a request to the health service)
and timed until the list shows the GPU ``Healthy`` again (**clear -> Healthy**). The
fault is a critical XID (95, an NVML event: the health service hears it at once), on
GPUs 0-2 in turn, one at a time (no queueing effects), ``--faults`` of them (default
30). Both directions are event-driven end to end: nothing in the path polls.

With ``--trace``, each round also records when the plugin's node view was told of the
change and when its device list moved, so the table says where the time goes.

Target (issue 24): p99 under 20 ms in both directions on a 2-core machine. The figures
lean on the mock NVML for the fault's detection (a real driver's event arrives in
about the same time; the rest of the path is the same code).

Run: ``python bench/listandwatch_latency.py [--faults 30] [--trace] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

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
# A critical XID (uncontained ECC error): the GPU is unhealthy until it is cleared.
XID = 95
TARGET_MS = 20.0


class Trace:
    """When the plugin heard of a change and when its device list moved (--trace)."""

    def __init__(self, plugin: DevicePluginService) -> None:
        self.view_at: list[float] = []
        self.list_at: list[float] = []
        plugin.view.listen(lambda _change: self.view_at.append(time.time()))
        publish = plugin.state.publish

        def traced(gpus: Any) -> bool:
            changed = publish(gpus)
            if changed:
                self.list_at.append(time.time())
            return changed

        plugin.state.publish = traced  # type: ignore[method-assign]

    def since(self, t0: float) -> tuple[float, float]:
        view = next((t for t in self.view_at if t >= t0), float("nan"))
        listed = next((t for t in self.list_at if t >= t0), float("nan"))
        return view - t0, listed - t0


def _steps(out: dict[str, list[float]], kind: str, trace: Trace | None, t0: float) -> None:
    if trace is not None:
        view, listed = trace.since(t0)
        out[f"{kind}_view"].append(view)
        out[f"{kind}_list"].append(listed)


def health_of(kubelet: FakeKubelet, uuid: str) -> str:
    return next((d.health for d in kubelet.devices(GPU) if uuid == d.ID), "")


async def until_listed(kubelet: FakeKubelet, uuid: str, health: str) -> float:
    await kubelet.wait_devices(GPU, lambda _d: health_of(kubelet, uuid) == health, timeout_s=5)
    return time.time()


async def rounds(
    h: HealthNode, kubelet: FakeKubelet, faults: int, trace: Trace | None
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"fault": [], "clear": [], "fault_view": [], "fault_list": []}
    out.update({"clear_view": [], "clear_list": []})
    for i in range(faults):
        slot = i % 3
        uuid = h.uuid(slot)
        # The fault: a critical XID, which the health service hears as an NVML event.
        t0 = time.time()
        h.inject("xid", gpu=slot, value=XID)
        out["fault"].append(await until_listed(kubelet, uuid, "Unhealthy") - t0)
        _steps(out, "fault", trace, t0)
        await anyio.sleep(0.02)
        # The clear: an operator's `gpulet health clear` of that condition.
        t0 = time.time()
        await h.runtime.bus.request(
            subjects.health_clear(h.node),
            HealthClearRequest(gpu=str(slot), condition=f"xid:{XID}", requested_by="bench"),
            codec.HEALTH_CLEAR_REQUEST,
            codec.HEALTH_STATE,
        )
        out["clear"].append(await until_listed(kubelet, uuid, "Healthy") - t0)
        _steps(out, "clear", trace, t0)
        await anyio.sleep(0.02)
    return out


async def run(faults: int, traced: bool) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="gpl-") as tmp:
        base = Path(tmp)
        plugin_dir = base / "dp"
        plugin_dir.mkdir()
        async with EmbeddedNats.running(state_dir=base / "nats", port=free_port()) as server:
            overrides = [
                "health.dedup_window_s=0",
                "health.event_wait_timeout_ms=200",
                "health.device_poll_s=0.1",
                f"allocator.plugin.plugin_dir={plugin_dir}/",
                "allocator.plugin.watch_interval_s=0.05",
                f"allocator.plugin.dev_root={base}",
            ]
            async with (
                health_node(server.url, base, overrides=overrides) as h,
                running_fake_kubelet(plugin_dir) as kubelet,
                runtime_for(h.settings, name="bench-device-plugin") as rt,
                anyio.create_task_group() as tg,
            ):
                plugin = DevicePluginService(rt)
                trace = Trace(plugin) if traced else None
                await tg.start(plugin.run)
                await kubelet.wait_registered(GPU, timeout_s=10)
                await kubelet.wait_devices(GPU, lambda d: len(d) == 5, timeout_s=10)
                await anyio.sleep(0.5)
                print(f"{faults} faults and clears ...", file=sys.stderr, flush=True)
                results = await rounds(h, kubelet, faults, trace)
                tg.cancel_scope.cancel()
    return results


def _row(name: str, seconds: list[float], target: float | None) -> tuple[object, ...]:
    ms = [v * 1000 for v in seconds]
    p50, p99 = percentile(ms, 50), percentile(ms, 99)
    met = "" if target is None else ("yes" if p99 < target else "NO")
    goal = "" if target is None else f"< {target:.0f}"
    return (name, len(ms), f"{p50:.1f}", f"{p99:.1f}", f"{max(ms):.1f}", goal, met)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=30, help="faults (and clears) to time")
    parser.add_argument("--trace", action="store_true", help="also time the plugin's steps")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    # Every fault is logged at WARNING by the health service: quiet here.
    logging.basicConfig(level=logging.ERROR)
    started = time.perf_counter()
    results = anyio.run(run, args.faults, args.trace)
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
    print(
        table(
            "ListAndWatch latency (ms): a critical XID in the mock NVML -> the fake "
            "kubelet's device list, and its clearing back",
            ["direction", "n", "p50", "p99", "max", "target p99", "met"],
            rows,
        )
    )
    print(f"\n({time.perf_counter() - started:.0f}s)")
    if args.json:
        summary = {
            k: {"p50_ms": percentile(v, 50) * 1000, "p99_ms": percentile(v, 99) * 1000}
            for k, v in results.items()
            if v
        }
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
