"""DRA: Prepare through the fake kubelet, fault → device taint in the API, writes at rest.

Method
------
* **Prepare**: a fake DRA kubelet (:mod:`support.fake_dra_kubelet`) registers the DRA
  kubelet plugin (``gpulet_allocator/kubelet/dra``) over its real sockets and calls
  ``NodePrepareResources`` with one claim per call, each claim allocated one whole GPU
  in the API emulator, then ``NodeUnprepareResources`` (not timed). The clock starts
  right before the call and stops at its answer. Each call reads the claim over HTTP
  (``--claim-cache``: from a watch of the node's claims, ``dra.claim_cache``; the
  bench waits until the watch has the claim, as it has by the time kubelet prepares a
  pod's claim), reserves it in the allocator's ledger (answered once the ledger's
  checkpoint is on disk), writes and fsyncs the CDI spec (on tmpfs, as
  ``/var/run/cdi`` is on a node); the plugin's checkpoint (on disk) is written after
  the answer. The claims live in the API emulator on 127.0.0.1, or with ``--api
  real`` (``--topology node``) in a real kube-apiserver and etcd
  (tests/support/control_plane.py; the binaries ``make test`` builds), read and
  written with an admin kubeconfig. Which process does what (``--topology``; every
  table says which):

  - ``node`` (the default), as on a node, where kubelet and the API server are other
    processes: the fake kubelet in a process of its own (bench/dra_kubelet.py), which
    also plays the scheduler: it creates each claim over HTTP and writes its
    allocation through ``resourceclaims/<name>/status``, then deletes it after the
    Unprepare; with ``--claim-cache`` it waits at a line on a pipe until the bench's
    watch has the claim. The API emulator in its own (``--serve-emulator``). The
    plugin where ``dra.plugin_host`` puts it (``--host``):

    - ``allocator`` (the default): the real allocator service with ``dra.mode = "dra"``
      in a process of its own (``--serve-allocator --kubeconfig``), which starts the
      plugin and decides each claim in its ledger directly
      (:class:`~gpulet_allocator.service.claims.LocalClaimCore`); the table gives that
      process's CPU per call;
    - ``device-plugin``: the plugin alone in the bench's process, asking the allocator
      (and its nats-server, in a process of their own: ``--serve-allocator``) over NATS
      (:class:`~gpulet_allocator.kubelet.dra.nats_core.NatsDecisionCore`; ``--core
      nats`` puts the allocator in the bench's process, ``--core memory`` takes the
      tests' in-memory core instead, support.dra_core, which leaves the ledger out).
  - ``in-process``, the bench before: the fake kubelet, the API emulator (each claim
    put straight into its store) and the allocator (``--core nats``; ``nats-process``
    is taken if named) on the plugin's event loop, so each call also pays for the
    fake kubelet's Python gRPC client and the emulator's request handling under the
    same GIL, which a node never does.

  The allocator runs with production PodResources intervals.
  Target p99 < 10 ms. ``--prepare-only`` prints only this table; every table says the
  load average.
* **Fault → taint**: a real nats-server, the node read model (NodeView), the slice
  publisher with the default debounce (quiet 0.5 s, at most 2 s) and the API emulator
  (its slice validation off: 45 ms of Python jsonschema a write, which a real API
  server does not spend; the tests validate every slice).
  A fatal XID 79 is written to the health KV as the health service writes it; the time
  until the emulator holds the slice with the taint (polled every 2 ms), and the same
  for the clear. Target p99 < quiet window + 200 ms.
* **Writes at rest**: with the pool published, the same inventory is published again
  every second and the health state rewritten unchanged for ``--rest`` seconds; the
  API emulator counts slice writes. Target 0.

No NVML is involved: the inventory is the 8-GPU stand-in of the reporter tests.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _util import percentile, table
from dra_kubelet import prepare_once

from gpulet_allocator.kubelet.dra.claim_cache import WatchedClaimReader
from gpulet_allocator.kubelet.dra.claims import KubeClaimReader
from gpulet_allocator.kubelet.dra.contract import ClaimReader, DecisionCore
from gpulet_allocator.kubelet.dra.nats_core import NatsDecisionCore
from gpulet_allocator.kubelet.dra.plugin import DraPlugin, PluginSettings
from gpulet_allocator.kubelet.dra.server import DraKubeletPlugin, Sockets
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, Delivery
from gpulet_common.dra.devices import device_name
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.kube import KubeConfig, from_kubeconfig
from gpulet_common.kubeapi import KubeClient
from gpulet_common.messages import Inventory, InventoryRequest
from gpulet_common.nodeview import NodeView
from gpulet_common.settings.dra import DraSettings
from gpulet_common.settings.nats import NatsSettings
from gpulet_reporter.slices.publisher import SlicePublisher
from support.allocator_stack import allocator_stack, dev_root_with, make_settings
from support.control_plane import ControlPlane
from support.dra_core import InMemoryCore, InMemoryHealth
from support.fake_dra_kubelet import registered
from support.health_kv import gpu_health, health_bucket, put_health
from support.kube_emulator import KubeEmulator
from support.kube_emulator_dra import (
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    add_claim,
    enable_dra,
    slices,
)
from support.reporter_harness import make_inventory
from support.waiting import wait_until

NODE = "bench-node"
CORES = {
    "nats": "the allocator over NATS, in the bench's process",
    "nats-process": "the allocator over NATS, in a process of its own",
    "memory": "the tests' in-memory core",
}
DRIVER = "gpu.gpulet.io"
APIS = {
    "emulator": "API emulator",
    "real": "a real kube-apiserver and etcd",
}
TOPOLOGIES = {
    "node": "the fake kubelet and the API emulator each in a process of their own",
    "in-process": "the fake kubelet and the API emulator in the plugin's process",
}


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def run_dir() -> str:
    """Where the CDI specs go: tmpfs, as /var/run is on a node (else /tmp)."""
    return "/dev/shm" if Path("/dev/shm").is_dir() else "/tmp"


BENCH_INVENTORY = msgspec.structs.replace(make_inventory(NODE, 8), seq=1, boot_id="bench")
NAMES = [device_name(g) for g in BENCH_INVENTORY.gpus]


@contextlib.asynccontextmanager
async def allocator_stack_on_nats(
    root: Path, dra: DraSettings | None = None
) -> AsyncIterator[tuple[str, Bus]]:
    """The real allocator service on a real nats-server: its URL and a connection."""
    (root / "dp").mkdir(parents=True, exist_ok=True)
    async with EmbeddedNats(state_dir=root / "nats", port=0) as nats:
        # The production intervals of the PodResources pass (the tests' make 10 a
        # second, a tenth of the allocator's CPU).
        allocator = {"release_interval_s": 30.0, "pods_poll_s": 10.0}
        settings = make_settings(
            nats.url,
            root / "state",
            root / "dp",
            dev_root_with(root / "dev", 8),
            allocator=allocator,
        )
        settings.node_name = NODE
        if dra is not None:
            settings = msgspec.structs.replace(settings, dra=dra)
        async with allocator_stack(
            settings, inventory=BENCH_INVENTORY, start_plugin=False
        ) as stack:
            await stack.wait_allocator_ready()
            yield nats.url, stack.bus


@contextlib.asynccontextmanager
async def allocator_core(root: Path) -> AsyncIterator[tuple[DecisionCore, list[str]]]:
    """The allocator in this process: its event loop is the plugin's and the fake
    kubelet's too, so its checkpoint's fsync stalls them all."""
    async with allocator_stack_on_nats(root) as (_url, bus):
        yield NatsDecisionCore(bus, NODE, timeout_s=5.0), NAMES


@contextlib.asynccontextmanager
async def served(*argv: str) -> AsyncIterator[tuple[str, int]]:
    """This script again with ``argv`` (a ``--serve-*`` mode), in a process of its own:
    the URL it prints first, and its PID; it is terminated on the way out."""
    async with await anyio.open_process([sys.executable, __file__, *argv]) as process:
        assert process.stdout is not None
        try:
            with anyio.fail_after(60):
                url = await BufferedByteReceiveStream(process.stdout).receive_until(b"\n", 4096)
            yield url.decode().strip(), process.pid
        finally:
            process.terminate()


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.asynccontextmanager
async def allocator_process_core(root: Path) -> AsyncIterator[tuple[DecisionCore, list[str]]]:
    """The allocator (and its nats-server) in a process of its own, as in the pod."""
    async with (
        served("--serve-allocator", str(root / "allocator")) as (url, _pid),
        Bus.connect(NatsSettings(url=url), name="dra-plugin", max_initial_attempts=5) as bus,
    ):
        yield NatsDecisionCore(bus, NODE, timeout_s=5.0), NAMES


async def serve_until_sigterm(server: contextlib.AbstractAsyncContextManager[str]) -> None:
    """A ``--serve-*`` mode: print the server's URL, serve until SIGTERM."""
    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async with server as url:
            print(url, flush=True)
            async for _ in signals:
                break


@contextlib.asynccontextmanager
async def allocator_url(root: Path, kubeconfig: str, cdi_dir: str) -> AsyncIterator[str]:
    """``--serve-allocator``: the allocator and its nats-server (stopped with it); with
    ``--kubeconfig``, hosting the DRA kubelet plugin too, as ``dra.plugin_host``
    ``allocator`` has it (sockets under ``root``, CDI specs in ``cdi_dir``)."""
    dra = None
    if kubeconfig:
        dra = DraSettings(
            mode="dra",
            plugin_host="allocator",
            kubeconfig=kubeconfig,
            cdi_dir=cdi_dir,
            plugins_registry=str(root / "registry"),
            plugins_dir=str(root / "plugins"),
        )
    async with allocator_stack_on_nats(root, dra) as (url, _bus):
        yield url


@contextlib.asynccontextmanager
async def emulator_url(kubeconfig: str) -> AsyncIterator[str]:
    """``--serve-emulator``: the API emulator with resource.k8s.io/v1 (its kubeconfig
    written to ``kubeconfig`` if named)."""
    async with KubeEmulator.running() as emu:
        enable_dra(emu)
        if kubeconfig:
            emu.write_kubeconfig(kubeconfig)
        yield emu.url


@contextlib.asynccontextmanager
async def memory_core(_root: Path) -> AsyncIterator[tuple[DecisionCore, list[str]]]:
    core = InMemoryCore.with_gpus(8)
    yield core, sorted(core.gpus)


async def cached(reader: WatchedClaimReader, count: int) -> None:
    await wait_until(lambda: len(reader) == count, timeout_s=5.0, what="the claim watch")


async def prepare_in_process(
    emu: KubeEmulator,
    registry: Path,
    names: list[str],
    calls: int,
    watched: WatchedClaimReader | None,
) -> list[float]:
    """``--topology in-process``: the fake kubelet on this process's loop, each claim
    seeded allocated into the emulator's store (no HTTP)."""
    timings: list[float] = []
    async with registered(registry, DRIVER) as kubelet:
        for i in range(calls):
            name = f"c{i}"
            uid = str(uuid.uuid4())
            result = {
                "request": "gpu",
                "driver": DRIVER,
                "pool": NODE,
                "device": names[i % len(names)],
            }
            add_claim(
                emu,
                {
                    "metadata": {"name": name, "namespace": "default", "uid": uid},
                    "spec": {},
                    "status": {"allocation": {"devices": {"results": [result]}}},
                },
            )
            if watched is not None:
                # kubelet prepares a claim well after the scheduler allocated
                # it (binding, the pod's sync): the watch has seen it by then.
                await cached(watched, 1)
            timings.append(await prepare_once(kubelet, uid, name))
            emu.delete_object(RESOURCE_CLAIMS, f"default/{name}")
            if watched is not None:
                await cached(watched, 0)
    return timings


async def prepare_from_kubelet_process(
    kubeconfig: str,
    registry: Path,
    names: list[str],
    calls: int,
    watched: WatchedClaimReader | None,
) -> list[float]:
    """``--topology node``: the fake kubelet (and the scheduler's claim writes) in a
    process of its own, bench/dra_kubelet.py; with the claim cache, it waits at each
    ``wait`` / ``gone`` until this process's watch has the claim / has dropped it."""
    argv = [sys.executable, str(Path(__file__).with_name("dra_kubelet.py"))]
    argv += ["--registry", str(registry), "--kubeconfig", kubeconfig]
    argv += ["--driver", DRIVER, "--pool", NODE]
    argv += ["--names", ",".join(names), "--calls", str(calls)]
    if watched is not None:
        argv.append("--handshake")

    async with await anyio.open_process(argv, stderr=None) as process:
        assert process.stdout is not None
        assert process.stdin is not None
        lines = BufferedByteReceiveStream(process.stdout)
        while True:
            with anyio.fail_after(60):
                line = (await lines.receive_until(b"\n", 1 << 24)).decode()
            if line.startswith("{"):
                timings: list[float] = msgspec.json.decode(line, type=dict[str, list[float]])[
                    "timings"
                ]
                return timings
            assert watched is not None, line
            await cached(watched, 1 if line == "wait" else 0)
            await process.stdin.send(b"go\n")


@contextlib.asynccontextmanager
async def api_server(
    kind: str, root: Path, topology: str = "node"
) -> AsyncIterator[tuple[str, KubeEmulator | None]]:
    """The API server the claims live in, and a kubeconfig for it: the API emulator in
    this process (``in-process``) or in its own, or (``--api real``) etcd and a real
    kube-apiserver (tests/support/control_plane.py, the binaries ``make test`` builds),
    with an admin kubeconfig."""
    kubeconfig = root / "kubeconfig"
    if kind == "real":
        plane = ControlPlane(root / "control-plane")
        await anyio.to_thread.run_sync(plane.start)
        try:
            plane.write_kubeconfig(kubeconfig)
            yield str(kubeconfig), None
        finally:
            await anyio.to_thread.run_sync(plane.stop)
    elif topology == "in-process":
        async with KubeEmulator.running() as emu:
            enable_dra(emu)
            emu.write_kubeconfig(kubeconfig)
            yield str(kubeconfig), emu
    else:
        async with served("--serve-emulator", "--kubeconfig", str(kubeconfig)):
            yield str(kubeconfig), None


async def bench_prepare(
    calls: int, which: str, claim_cache: bool = False, topology: str = "node", api: str = ""
) -> tuple[list[float], float]:
    """Each call's time, and the CPU time of this process per call (Prepare, Unprepare
    and, ``in-process``, the rest: the fake kubelet, the emulator, maybe the allocator)."""
    # Sockets and the checkpoint on disk (/var/lib/kubelet, /var/lib/gpulet on a node).
    root = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))
    run = Path(tempfile.mkdtemp(prefix="dra-cdi", dir=run_dir()))
    make_core = {"nats": allocator_core, "nats-process": allocator_process_core}.get(
        which, memory_core
    )
    try:
        async with (
            api_server(api, root, topology) as (kubeconfig, emu),
            make_core(root) as (core, names),
        ):
            settings = PluginSettings(
                driver=DRIVER,
                pool=NODE,
                cdi_dir=run / "cdi",
                checkpoint=root / "state" / "checkpoint.json",
                dev_root=root,
            )
            sockets = Sockets.for_driver(DRIVER, root / "registry", root / "plugins")
            async with (
                KubeClient(await from_kubeconfig(kubeconfig)) as client,
                anyio.create_task_group() as tg,
            ):
                reader: ClaimReader = KubeClaimReader(client)
                watched: WatchedClaimReader | None = None
                if claim_cache:
                    reader = watched = WatchedClaimReader(client, reader, driver=DRIVER, pool=NODE)
                    await tg.start(watched.run)
                plugin = DraPlugin(core, reader, settings)
                server = DraKubeletPlugin(plugin, InMemoryHealth(NODE, []), sockets, DRIVER)
                await tg.start(server.run)
                cpu = time.process_time()
                if emu is not None:
                    timings = await prepare_in_process(
                        emu, root / "registry", names, calls, watched
                    )
                else:
                    timings = await prepare_from_kubelet_process(
                        kubeconfig, root / "registry", names, calls, watched
                    )
                cpu = (time.process_time() - cpu) / calls
                tg.cancel_scope.cancel()
        return timings, cpu
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)


async def bench_prepare_hosted(calls: int, api: str) -> tuple[list[float], float]:
    """``--topology node --host allocator`` (the default): the DRA kubelet plugin in the
    allocator's process, as ``dra.plugin_host = "allocator"`` runs it (the real
    allocator service starts it, deciding in its ledger directly); the API emulator
    and the fake kubelet in processes of their own. Each call's time, and the CPU time
    of the allocator's process per call."""
    root = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))
    run = Path(tempfile.mkdtemp(prefix="dra-cdi", dir=run_dir()))
    try:
        async with (
            api_server(api, root) as (kubeconfig, _),
            served(
                "--serve-allocator",
                str(root / "allocator"),
                "--kubeconfig",
                kubeconfig,
                "--cdi-dir",
                str(run / "cdi"),
            ) as (_, pid),
        ):
            cpu = cpu_seconds(pid)
            registry = root / "allocator" / "registry"
            timings = await prepare_from_kubelet_process(kubeconfig, registry, NAMES, calls, None)
            return timings, (cpu_seconds(pid) - cpu) / calls
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)


def tainted(emu: KubeEmulator, device: str) -> bool:
    for body in slices(emu):
        for d in body["spec"]["devices"]:
            if d["name"] == device:
                return bool(d.get("taints"))
    return False


async def bench_taints(faults: int, rest_s: float) -> tuple[list[float], list[float], int]:
    settings = DraSettings(mode="dra")
    inventory = msgspec.structs.replace(make_inventory(NODE, 8), seq=1, boot_id="bench")
    with tempfile.TemporaryDirectory() as state:
        async with (
            EmbeddedNats(state_dir=Path(state), port=0) as nats,
            KubeEmulator.running() as emu,
        ):
            # Without the emulator's schema check (45 ms a write here, a cost of the
            # emulator's Python jsonschema, not of an API server): the tests validate.
            enable_dra(emu, validate=False)
            emu.add_node(NODE)
            nats_settings = NatsSettings(url=nats.url)
            async with (
                Bus.connect(nats_settings, name="collector", max_initial_attempts=5) as collector,
                Bus.connect(nats_settings, name="reporter", max_initial_attempts=5) as reader,
                KubeClient(KubeConfig(emu.url)) as api,
                anyio.create_task_group() as tg,
            ):

                async def answer(_request: Delivery[InventoryRequest]) -> Inventory:
                    return inventory

                await tg.start(
                    collector.serve,
                    subjects.inventory_request(NODE),
                    answer,
                    codec.INVENTORY_REQUEST,
                    codec.INVENTORY,
                )
                await health_bucket(collector)
                view = NodeView(reader, NODE, retry_s=0.05, who="bench")
                await tg.start(view.run)
                publisher = SlicePublisher(api, NODE, settings)
                publisher.attach(view)
                tg.start_soon(publisher.run)
                await wait_until(lambda: len(slices(emu)) == 1, timeout_s=10, what="pool")
                uuid_ = inventory.gpus[3].uuid
                raised: list[float] = []
                cleared: list[float] = []
                for _ in range(faults):
                    for healthy, out in ((False, raised), (True, cleared)):
                        started = time.perf_counter()
                        state_ = gpu_health(uuid_, healthy=healthy, severity="fatal")
                        await put_health(collector, NODE, state_)
                        await wait_until(
                            lambda h=healthy: tainted(emu, "gpu-3") != h,  # type: ignore[misc]
                            timeout_s=10,
                            interval_s=0.002,
                            what="taint",
                        )
                        out.append(time.perf_counter() - started)
                # At rest: the same facts again and again.
                await anyio.sleep(settings.max_delay_s + 0.5)
                before = emu.stats.total_writes(RESOURCE_SLICES)
                deadline = time.monotonic() + rest_s
                while time.monotonic() < deadline:
                    await collector.publish(subjects.inventory(NODE), inventory, codec.INVENTORY)
                    await put_health(collector, NODE, gpu_health(uuid_, healthy=True))
                    await anyio.sleep(1.0)
                at_rest = emu.stats.total_writes(RESOURCE_SLICES) - before
                tg.cancel_scope.cancel()
    return raised, cleared, at_rest


async def main_async(args: argparse.Namespace) -> None:
    reads = "claims from the watch cache" if args.claim_cache else "a GET per claim"
    if args.topology == "node" and args.host == "allocator":
        prepare, cpu = await bench_prepare_hosted(args.calls, args.api)
        where = (
            f"topology node: {TOPOLOGIES['node']}; the plugin in the allocator's "
            "process (dra.plugin_host allocator), deciding in its ledger directly"
        )
        whose = "CPU of the allocator's process per call"
    else:
        prepare, cpu = await bench_prepare(
            args.calls, args.core, args.claim_cache, args.topology, args.api
        )
        where = f"topology {args.topology}: {TOPOLOGIES[args.topology]}; {CORES[args.core]}"
        whose = "CPU of this process per call"
    print(
        table(
            f"DRA Prepare through the fake kubelet ({args.calls} calls, one claim each; "
            f"{where}, {reads}, {APIS[args.api]}; load average {load_average()})",
            ["", "p50 ms", "p99 ms", "max ms", "target"],
            [
                [
                    "NodePrepareResources",
                    ms(percentile(prepare, 50)),
                    ms(percentile(prepare, 99)),
                    ms(max(prepare)),
                    "p99 < 10 ms",
                ],
                [whose, ms(cpu), "", "", ""],
            ],
        )
    )
    print()
    if args.prepare_only:
        return
    raised, cleared, at_rest = await bench_taints(args.faults, args.rest)
    quiet = DraSettings().quiet_window_s
    print(
        table(
            f"Fault -> device taint in the API ({args.faults} faults; debounce quiet "
            f"{quiet:.1f} s)",
            ["", "p50 ms", "p99 ms", "max ms", "target"],
            [
                [
                    "XID 79 -> NoSchedule taint",
                    ms(percentile(raised, 50)),
                    ms(percentile(raised, 99)),
                    ms(max(raised)),
                    f"p99 < {ms(quiet + 0.2)} ms",
                ],
                [
                    "clear -> taint removed",
                    ms(percentile(cleared, 50)),
                    ms(percentile(cleared, 99)),
                    ms(max(cleared)),
                    f"p99 < {ms(quiet + 0.2)} ms",
                ],
            ],
        )
    )
    print()
    print(
        table(
            "ResourceSlice writes at rest",
            ["window s", "writes", "target"],
            [[f"{args.rest:.0f}", at_rest, "0"]],
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument(
        "--topology",
        choices=sorted(TOPOLOGIES),
        default="node",
        help="which process runs what (default: as on a node)",
    )
    parser.add_argument(
        "--api",
        choices=sorted(APIS),
        default="emulator",
        help="where the claims live: the API emulator, or (real) etcd and kube-apiserver "
        "built by scripts/k8s-bins.sh (as make test does)",
    )
    parser.add_argument(
        "--host",
        choices=["allocator", "device-plugin"],
        default="allocator",
        help="node topology: the process that runs the plugin (dra.plugin_host; "
        "device-plugin: this one, over NATS)",
    )
    parser.add_argument(
        "--core",
        choices=sorted(CORES),
        help="--host device-plugin: default nats-process (node), nats (in-process)",
    )
    parser.add_argument("--faults", type=int, default=30)
    parser.add_argument("--rest", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="100 calls, 5 faults, 10 s rest")
    parser.add_argument(
        "--claim-cache", action="store_true", help="read claims from a watch (dra.claim_cache)"
    )
    parser.add_argument("--prepare-only", action="store_true", help="only the Prepare table")
    parser.add_argument("--serve-allocator", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--serve-emulator", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cdi-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_allocator or args.serve_emulator:
        logging.basicConfig(level=logging.WARNING)
        if args.serve_allocator:
            server = allocator_url(Path(args.serve_allocator), args.kubeconfig, args.cdi_dir)
        else:
            server = emulator_url(args.kubeconfig)
        anyio.run(serve_until_sigterm, server)
        return 0
    if args.api == "real" and args.topology != "node":
        parser.error("--api real needs --topology node")
    if args.claim_cache and args.topology == "node" and args.host == "allocator":
        parser.error("--claim-cache needs --host device-plugin or --topology in-process")
    if args.core is None:
        args.core = "nats" if args.topology == "in-process" else "nats-process"
    if args.quick:
        args.calls, args.faults, args.rest = 100, 5, 10.0
    logging.basicConfig(level=logging.WARNING)
    anyio.run(main_async, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
