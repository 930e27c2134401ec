"""Allocate round trip: fake kubelet -> device plugin -> NATS -> allocator -> and back.

Method
------
Everything real but kubelet, each in its own process as on a node: a nats-server;
the allocator and device-plugin services, either as two sidecar processes (the
DaemonSet layout) or together in one process (``gpulet run``); and, in this process,
the fake kubelet calling ``Allocate`` over the plugin's unix socket with kubelet's own
protos (:mod:`support.fake_kubelet`), plus a stand-in collector publishing the
inventory of the 8-GPU NVLink box with 80 GiB cards.

* Each call is a new container asking for 2 ``gpulet.io/gpu-core`` units (a share:
  parse the IDs, best-fit placement, the grant) or for one whole GPU
  (``nvidia.com/gpu``). Every answer is durable before it leaves: the checkpoint is
  fsynced (group commit), in a temporary directory on this machine's disk.
* **1 concurrent call**: one call after the other. **50 concurrent calls**: waves of
  50 calls started together, the next wave once all have answered. Between batches
  the allocations are released over NATS (not timed), so the node never fills up.
* **In process**: the same decisions through :class:`~gpulet_allocator.core.AllocatorCore`
  and the same group-committed checkpoint, called directly in this process: what the
  allocator itself costs. The ratio to it is what the split (gRPC, NATS, two more
  processes) costs.

Run from the repository root: ``python bench/allocate_roundtrip.py`` (``--quick`` for
fewer samples, ``--layout`` for one layout). Target: p99 under 10 ms.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import anyio.abc
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _util import percentile, table

from gpulet_allocator import protocol as p
from gpulet_allocator.core import AllocatorCore
from gpulet_allocator.engine import reference
from gpulet_allocator.store import CheckpointFile, Committer, encode
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, BusError, Delivery
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import Inventory, InventoryRequest
from gpulet_common.settings.allocator import ResourceNames
from support.allocator_stack import CORE, GPU, MEM, dev_root_with, make_settings
from support.fake_kubelet import FakeKubelet, running_fake_kubelet

TARGET_P99_MS = 10.0
SHARE_UNITS = 2
LAYOUTS = ("sidecars", "one-process")

Call = Callable[[list[str]], Awaitable[str]]
Results = dict[tuple[str, int], list[float]]


class IdPool:
    """Device IDs handed out the way kubelet does: each to one live container."""

    def __init__(self, ids: list[str], per_call: int) -> None:
        self._ids = ids
        self._per_call = per_call
        self._next = 0

    def take(self) -> list[str]:
        chunk = self._ids[self._next : self._next + self._per_call]
        self._next += self._per_call
        return chunk

    def reset(self) -> None:
        self._next = 0


async def measure(
    call: Call,
    pool: IdPool,
    release: Callable[[list[str]], Awaitable[None]],
    *,
    concurrency: int,
    calls: int,
    batch: int,
) -> list[float]:
    """Latencies in ms of ``calls`` calls, ``concurrency`` at a time."""
    samples: list[float] = []
    held: list[str] = []

    async def one() -> None:
        ids = pool.take()
        started = time.perf_counter()
        allocation = await call(ids)
        samples.append((time.perf_counter() - started) * 1000)
        held.append(allocation)

    while len(samples) < calls:
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(one)
        if len(held) + concurrency > batch or len(samples) >= calls:
            await release(held)
            held.clear()
            pool.reset()
    return samples


async def scenarios(
    call: Callable[[str], Call],
    release: Callable[[list[str]], Awaitable[None]],
    cores: IdPool,
    gpus: IdPool,
    n: int,
) -> Results:
    # Warm-up: connections, code paths, the first checkpoint file.
    await measure(call(CORE), cores, release, concurrency=10, calls=100, batch=200)
    return {
        ("share", 1): await measure(call(CORE), cores, release, concurrency=1, calls=n, batch=200),
        ("share", 50): await measure(
            call(CORE), cores, release, concurrency=50, calls=n, batch=200
        ),
        ("whole", 1): await measure(call(GPU), gpus, release, concurrency=1, calls=n // 2, batch=8),
    }


# --- the services, in their own processes ----------------------------------------------


def agent_process(config_file: str, services: str) -> None:
    """Entry point of a service process (what `gpulet run --only ...` does)."""
    from gpulet.agent import run_agent
    from gpulet_common import config

    logging.basicConfig(level=logging.ERROR)
    settings = config.load(config_file)
    names = services.split(",")
    anyio.run(lambda: run_agent(settings, names, embedded_nats=False))


async def serve_inventory(
    bus: Bus, node: str, inventory: Inventory, *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    """The collector's part: answer inventory requests (and publish once)."""

    async def answer(_request: Delivery[InventoryRequest]) -> Inventory:
        return inventory

    async with anyio.create_task_group() as tg:
        await tg.start(
            lambda *, task_status: bus.serve(
                subjects.inventory_request(node),
                answer,
                codec.INVENTORY_REQUEST,
                codec.INVENTORY,
                task_status=task_status,
            )
        )
        await bus.publish(subjects.inventory(node), inventory, codec.INVENTORY)
        task_status.started()


async def watch_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    """Fail at once when a service process dies (a bad setting, say), not at a timeout."""
    while True:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        await anyio.sleep(0.2)


async def wait_ready(bus: Bus, kubelet: FakeKubelet, node: str, gpus: int) -> None:
    with anyio.fail_after(60):
        for resource in (GPU, CORE, MEM):
            await kubelet.wait_registered(resource, timeout_s=60)
        await kubelet.wait_devices(GPU, lambda d: len(d) == gpus, timeout_s=60)
        await kubelet.wait_devices(CORE, lambda d: len(d) == 100 * gpus, timeout_s=60)
        while True:
            try:
                state = await p.request(
                    bus.client,
                    subjects.allocator_endpoint(node, p.ENDPOINT_STATE),
                    p.StateRequest(),
                    p.STATE_REQUEST,
                    p.STATE_REPLY,
                    timeout_s=1.0,
                )
            except BusError:
                state = None
            if state is not None and state.ready:
                return
            await anyio.sleep(0.1)


async def round_trip(base: Path, layout: str, nats_url: str, n: int) -> Results:
    plugin_dir = base / layout / "dp"
    plugin_dir.mkdir(parents=True)
    settings = make_settings(
        nats_url, base / layout / "state", plugin_dir, dev_root_with(base / "dev", 8)
    )
    settings.telemetry.http_port = 0
    settings.telemetry.log_level = "error"
    config_file = base / layout / "gpulet.json"
    config_file.write_bytes(msgspec.json.encode(settings))
    inventory = msgspec.structs.replace(reference.nvlink_pairs_8(), node=settings.node_name)
    groups = ["allocator", "device-plugin"] if layout == "sidecars" else ["allocator,device-plugin"]

    async with AsyncExitStack() as stack:
        bus = await stack.enter_async_context(Bus.connect(settings.nats, name="bench"))
        kubelet = await stack.enter_async_context(running_fake_kubelet(plugin_dir))
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        await tg.start(serve_inventory, bus, settings.node_name, inventory)
        processes = [
            subprocess.Popen(  # noqa: ASYNC220 - started once, stopped below
                [sys.executable, __file__, "--agent", str(config_file), group],
                stdout=subprocess.DEVNULL,
                # GPULET_* variables are settings; the bench's own must not leak in.
                env={k: v for k, v in os.environ.items() if not k.startswith("GPULET_")},
            )
            for group in groups
        ]
        try:
            async with anyio.create_task_group() as watch:
                watch.start_soon(watch_processes, processes)
                await wait_ready(bus, kubelet, settings.node_name, len(inventory.gpus))
                watch.cancel_scope.cancel()

            async def release(allocations: list[str]) -> None:
                await p.request(
                    bus.client,
                    subjects.allocator_endpoint(settings.node_name, p.ENDPOINT_RELEASE),
                    p.ReleaseRequest(allocation_ids=allocations, reason="bench"),
                    p.RELEASE_REQUEST,
                    p.RELEASE_REPLY,
                    timeout_s=5.0,
                )

            def via_kubelet(resource: str) -> Call:
                async def call(ids: list[str]) -> str:
                    response = await kubelet.allocate(resource, [ids])
                    return response.container_responses[0].annotations["gpulet.io/allocation"]

                return call

            return await scenarios(
                via_kubelet,
                release,
                IdPool([d.ID for d in kubelet.devices(CORE)], SHARE_UNITS),
                IdPool([d.ID for d in kubelet.devices(GPU)], 1),
                n,
            )
        finally:
            for process in processes:
                process.send_signal(signal.SIGTERM)
            for process in processes:
                try:
                    await anyio.to_thread.run_sync(process.wait, 10)
                except subprocess.TimeoutExpired:
                    process.kill()


async def in_process(base: Path, n: int) -> Results:
    core = AllocatorCore(node="bench", names=ResourceNames())
    inventory = reference.nvlink_pairs_8()
    core.update_inventory(inventory)
    store = CheckpointFile(base / "in-process" / "allocations.json")
    committer = Committer(lambda: encode(core.snapshot()), store.write)

    def direct(resource: str) -> Call:
        async def call(ids: list[str]) -> str:
            [answer], _undo = core.allocate(resource, [ids])
            await committer.wait(core.version)
            return answer.annotations["gpulet.io/allocation"]

        return call

    async def release(allocations: list[str]) -> None:
        core.release(p.ReleaseRequest(allocation_ids=allocations))
        await committer.wait(core.version)

    async with anyio.create_task_group() as tg:
        await tg.start(committer.run)
        results = await scenarios(
            direct,
            release,
            IdPool([f"{g.uuid}::core-{u}" for g in inventory.gpus for u in range(100)], 2),
            IdPool([g.uuid for g in inventory.gpus], 1),
            n,
        )
        tg.cancel_scope.cancel()
    return results


def row(label: str, samples: list[float], base: list[float] | None = None) -> list[str]:
    p50, p99 = percentile(samples, 50), percentile(samples, 99)
    ratio = ""
    if base is not None:
        ratio = f"{p50 / percentile(base, 50):.1f}x / {p99 / percentile(base, 99):.1f}x"
    verdict = "yes" if p99 < TARGET_P99_MS else "NO"
    return [
        label,
        str(len(samples)),
        f"{p50:.2f}",
        f"{p99:.2f}",
        f"{max(samples):.2f}",
        ratio,
        verdict,
    ]


async def main(quick: bool, layouts: list[str]) -> int:
    logging.basicConfig(level=logging.ERROR)
    load = os.getloadavg()[0]
    n = 200 if quick else 1000
    with tempfile.TemporaryDirectory(prefix="gpl-bench-") as tmp:
        base = Path(tmp)
        over_nats: dict[str, Results] = {}
        async with EmbeddedNats.running(state_dir=base / "nats", port=0) as server:
            for layout in layouts:
                over_nats[layout] = await round_trip(base, layout, server.url, n)
        local = await in_process(base, n)

    rows = []
    for key in (("share", 1), ("share", 50), ("whole", 1)):
        kind, concurrency = key
        label = f"{kind}, {concurrency} concurrent"
        rows.append(row(f"in process: {label}", local[key]))
        rows.extend(
            row(f"round trip ({layout}): {label}", over_nats[layout][key], local[key])
            for layout in layouts
        )
    header = ["path", "calls", "p50 ms", "p99 ms", "max ms", "vs in process p50/p99", "p99<10ms"]
    title = (
        f"Allocate round trip (fake kubelet -> plugin -> NATS -> allocator); {os.cpu_count()} "
        f"CPUs, load average {load:.1f} before the run; checkpoint fsynced before every answer"
    )
    print(table(title, header, rows))
    worst = max(percentile(r[k], 99) for r in over_nats.values() for k in r)
    return 0 if worst < TARGET_P99_MS else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--layout", choices=LAYOUTS, action="append", help="default: both")
    parser.add_argument("--agent", nargs=2, metavar=("CONFIG", "SERVICES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        agent_process(*args.agent)
        sys.exit(0)
    sys.exit(anyio.run(main, args.quick, args.layout or list(LAYOUTS)))
