"""Every service SIGKILLed under load and restarted, one after the other.

The pod as deployed, one process per service (``gpulet serve collector``, ``health``,
``reporter``, ``allocator``, ``device-plugin``; NATS auth left out), a real
nats-server, the Kubernetes API emulator (the reporter in cluster mode, through a
kubeconfig) and a fake kubelet speaking the device-plugin gRPC API. Each mock-NVML
process (collector, health) plays its own copy of the dgx-h100 node; faults are
injected over NATS (``gpulet.mock.inject.<node>``), which every such process applies.

Load while the services die and come back:

* a stream of XIDs (about 30 a second, each its own code, classified as warnings so
  that the GPUs stay schedulable), every one of which must become a health event;
* a kubelet allocating and releasing whole GPUs 0-5 several times a second through
  the device plugin and the allocator, retrying a failed call with the same device IDs
  the way kubelet re-admits a pod.

Kill order: collector, health, reporter, allocator, device-plugin; each is SIGKILLed,
stays dead 0.5 s, is restarted and must be serving again before the next one goes.
Meanwhile GPU 7 fails for good (XID 79, before the health service is killed: its
sticky condition must survive the restart) and, once every service is back, GPU 6
overheats.

What must hold:

* **no lost health event**: every XID injected while the health service was running
  (and not in its last 200 ms, when an event can be read from NVML and not yet
  published: those are counted and reported) is in the ``GPU_HEALTH`` stream, once;
* **no double allocation**: in the allocator's final state no GPU is in two
  allocations, the allocations are exactly the ones the kubelet holds, the checkpoint
  on disk says the same, and a retried Allocate of each of them gets the same answer;
* **the Device converges**: it says what the health service's state says (GPUs 6 and
  7 unhealthy), and so do the device plugin's ListAndWatch and the allocator.

The figures (kills, outages seen by kubelet, events, allocations, retries) are printed
on a ``FIGURES`` line.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import grpc
import grpc.aio
import pytest

from gpulet_allocator import protocol as p
from gpulet_allocator.decide.engine.ledger import WholeAllocation
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as dp
from gpulet_allocator.state import checkpoint as store
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus, BusError
from gpulet_common.embedded_nats import EmbeddedNats, free_port
from gpulet_common.messages import HealthState, HealthStateRequest, MockInjectRequest
from gpulet_common.nvml.loader import open_mock
from gpulet_common.settings.nats import NatsSettings
from support.fake_kubelet import FakeKubelet, running_fake_kubelet
from support.faults import (
    Sidecars,
    device_mismatches,
    device_view,
    duplicates,
    read_stream,
    running_sidecars,
    service_env,
    summary,
    wait_component,
)
from support.kube_emulator import KubeEmulator

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

NODE = "kill-test-node"
GPU = "nvidia.com/gpu"
KILL_ORDER = ("collector", "health", "reporter", "allocator", "device-plugin")
POOL = range(6)  # GPUs the workload allocates; 6 and 7 get real faults
XID_EVERY_S = 0.025
IN_FLIGHT_S = 0.2
DEAD_S = 0.5
READY_WITHIN_S = 30.0


def _uuids() -> list[str]:
    adapter = open_mock("dgx-h100")
    try:
        return [g.uuid for g in adapter.inventory(NODE, 1).gpus]
    finally:
        adapter.shutdown()


@dataclass
class Injection:
    code: int
    gpu: int
    sent: float
    answered: float


@dataclass
class World:
    url: str
    bus: Bus
    kubelet: FakeKubelet
    emulator: KubeEmulator
    sidecars: Sidecars
    ports: dict[str, int]
    state_dir: Path
    uuids: list[str]
    stop: anyio.Event = field(default_factory=anyio.Event)
    injections: list[Injection] = field(default_factory=list)
    # When the health service could see faults: (ready, killed or None).
    health_up: list[tuple[float, float | None]] = field(default_factory=list)
    held: dict[str, dp.ContainerAllocateResponse] = field(default_factory=dict)
    allocations: int = 0
    releases: int = 0
    allocate_retries: int = 0
    allocate_failures: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    # Every Allocate kubelet made: (when it ended, whether it succeeded).
    attempts: list[tuple[float, bool]] = field(default_factory=list)
    kills: list[tuple[str, float]] = field(default_factory=list)
    recovery: dict[str, dict[str, float]] = field(default_factory=dict)

    async def inject(self, fault: str, gpu: int | None = None, value: float | None = None) -> str:
        reply = await self.bus.request(
            subjects.mock_inject(NODE),
            MockInjectRequest(gpu=gpu, fault=fault, value=value),
            codec.MOCK_INJECT_REQUEST,
            codec.MOCK_INJECT_REPLY,
            timeout_s=5,
        )
        assert reply.applied, reply
        return reply.detail

    async def health_state(self) -> HealthState:
        return await self.bus.request(
            subjects.health_state(NODE),
            HealthStateRequest(),
            codec.HEALTH_STATE_REQUEST,
            codec.HEALTH_STATE,
            timeout_s=2,
        )

    async def allocator_state(self) -> p.StateReply:
        return await self.bus.request(
            subjects.allocator_endpoint(NODE, p.ENDPOINT_STATE),
            p.StateRequest(),
            p.STATE_REQUEST,
            p.STATE_REPLY,
            timeout_s=2,
        )


# --- load -------------------------------------------------------------------------------


async def _xid_stream(w: World) -> None:
    """Distinct XID codes (warnings by configuration), round-robin over the GPUs."""
    i = 0
    while not w.stop.is_set():
        gpu, code = i % 8, 1000 + i
        sent = time.monotonic()
        try:
            await w.inject("xid", gpu=gpu, value=code)
        except BusError:
            pass  # no mock process listening for a moment: not injected
        else:
            w.injections.append(Injection(code, gpu, sent, time.monotonic()))
        i += 1
        await anyio.sleep(XID_EVERY_S)


async def _allocate(w: World, uuid: str) -> dp.ContainerAllocateResponse:
    """Kubelet admitting a pod on ``uuid``: the same request until it is answered."""
    attempt = 0
    with anyio.fail_after(READY_WITHIN_S):
        while True:
            try:
                response = await w.kubelet.allocate(GPU, [[uuid]], timeout_s=5)
                w.attempts.append((time.monotonic(), True))
                return response.container_responses[0]
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    w.unexpected.append(f"Allocate {uuid}: {exc.code()}: {exc.details()}")
                    raise
                w.allocate_failures[exc.code().name] += 1
            except AssertionError:  # the plugin is not registered (it is restarting)
                w.allocate_failures["not_registered"] += 1
            except grpc.aio.UsageError:  # kubelet's channel to a plugin that went away
                w.allocate_failures["channel_closed"] += 1
            except asyncio.CancelledError:
                # grpc.aio ends a call whose channel is closed under it (the fake kubelet
                # drops the channel of a plugin whose ListAndWatch ended) with
                # CancelledError: for us, a failed call. Our own cancellation (the task
                # was asked to cancel) goes on.
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise
                w.allocate_failures["call_cancelled"] += 1
            w.attempts.append((time.monotonic(), False))
            attempt += 1
            w.allocate_retries += 1
            await anyio.sleep(min(0.05 * attempt, 0.5))


async def _release(w: World, allocation_id: str) -> None:
    with anyio.fail_after(READY_WITHIN_S):
        while True:
            try:
                await w.bus.request(
                    subjects.allocator_endpoint(NODE, p.ENDPOINT_RELEASE),
                    p.ReleaseRequest(allocation_ids=[allocation_id]),
                    p.RELEASE_REQUEST,
                    p.RELEASE_REPLY,
                    timeout_s=2,
                )
                return
            except BusError:
                await anyio.sleep(0.1)  # the allocator is away: idempotent, ask again


async def _workload(w: World) -> None:
    rng = random.Random(11)
    pool = [w.uuids[i] for i in POOL]
    while not w.stop.is_set():
        free = [u for u in pool if u not in w.held]
        if free and (len(w.held) < 3 or rng.random() < 0.5):
            uuid = rng.choice(free)
            w.held[uuid] = await _allocate(w, uuid)
            w.allocations += 1
        elif w.held:
            uuid = rng.choice(sorted(w.held))
            await _release(w, w.held[uuid].annotations["gpulet.io/allocation"])
            del w.held[uuid]
            w.releases += 1
        await anyio.sleep(0.1)


# --- the services -----------------------------------------------------------------------


async def _serving(w: World, name: str) -> None:
    """Until the restarted service does its job again."""
    with anyio.fail_after(READY_WITHIN_S):
        if name == "allocator":
            while True:
                try:
                    if (await w.allocator_state()).ready:
                        return
                except BusError:
                    pass
                await anyio.sleep(0.05)
        if name == "device-plugin":
            await w.kubelet.wait_devices(GPU, lambda ds: len(ds) == 8, timeout_s=READY_WITHIN_S)
            return
        await wait_component(w.ports[name], name, within=READY_WITHIN_S)


async def _kill_and_restart(w: World, name: str) -> None:
    sidecar = w.sidecars[name]
    registrations = w.kubelet.registration_count(GPU)
    killed = time.monotonic()
    sidecar.kill()
    if name == "health":
        w.health_up[-1] = (w.health_up[-1][0], killed)
    await anyio.sleep(DEAD_S)
    restarted = time.monotonic()
    sidecar.start()
    if name == "device-plugin":
        await w.kubelet.wait_registered(GPU, count=registrations + 1, timeout_s=READY_WITHIN_S)
    await _serving(w, name)
    serving = time.monotonic()
    if name == "health":
        w.health_up.append((serving, None))
    w.kills.append((name, killed))
    w.recovery[name] = {"serving_after_restart_s": serving - restarted}
    await anyio.sleep(1.0)  # load on the restarted service


def _allocate_outages(w: World) -> dict[str, float]:
    """Per kill: from kubelet's first failed Allocate to its next success (0: none failed)."""
    out: dict[str, float] = {}
    bounds = [*(at for _, at in w.kills[1:]), float("inf")]
    for (name, killed), until in zip(w.kills, bounds, strict=True):
        attempts = [(t, ok) for t, ok in w.attempts if killed <= t < until]
        failed = [t for t, ok in attempts if not ok]
        if not failed:
            out[name] = 0.0
            continue
        after = [t for t, ok in attempts if ok and t > failed[-1]]
        out[name] = (after[0] if after else float("nan")) - failed[0]
    return out


async def _eventually(check: Callable[[], Awaitable[bool]], within: float, what: str) -> float:
    started = time.monotonic()
    with anyio.move_on_after(within):
        while not await check():  # noqa: ASYNC110 - the state lives in other processes
            await anyio.sleep(0.05)
    if not await check():
        raise AssertionError(f"not within {within}s: {what}")
    return time.monotonic() - started


@pytest.fixture
async def world(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[World]:
    short = Path(tempfile.mkdtemp(prefix="gpl-"))  # unix sockets: 107 bytes at most
    plugin_dir = short / "dp"
    plugin_dir.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    state_dir = tmp_path / "state"
    ports = {name: free_port() for name in KILL_ORDER}
    env = service_env(
        {
            "GPULET_NATS__RECONNECT_MAX_WAIT_S": "0.5",
            "GPULET_ALLOCATOR__PLUGIN__PLUGIN_DIR": f"{plugin_dir}/",
            # No PodResources API: allocations end by explicit release only.
            "GPULET_ALLOCATOR__POD_RESOURCES_SOCKET": str(short / "absent.sock"),
        }
    )
    common = ["--nats", nats_server.url, "--state-dir", str(state_dir), "--node", NODE]
    try:
        async with (
            KubeEmulator.running() as emulator,
            running_fake_kubelet(plugin_dir) as kubelet,
            Bus.connect(NatsSettings(url=nats_server.url), max_initial_attempts=5) as bus,
        ):
            emulator.add_node(NODE)
            kubeconfig = emulator.write_kubeconfig(tmp_path / "kubeconfig")
            with running_sidecars(logs, common, env) as sidecars:
                args = {
                    "collector": ["--nvml", "mock:dgx-h100"],
                    "health": [
                        "--nvml",
                        "mock:dgx-h100",
                        "--set",
                        "health.unknown_xid.severity=warning",
                    ],
                    "reporter": [
                        "--set",
                        "reporter.mode=cluster",
                        "--set",
                        f"reporter.kubeconfig={kubeconfig}",
                    ],
                    "allocator": [],
                    "device-plugin": [],
                }
                for name in KILL_ORDER:
                    sidecars.add(name, [*args[name], "--metrics-port", str(ports[name])]).start()
                w = World(
                    nats_server.url,
                    bus,
                    kubelet,
                    emulator,
                    sidecars,
                    ports,
                    state_dir,
                    _uuids(),
                )
                yield w
    finally:
        shutil.rmtree(short, ignore_errors=True)


async def test_each_service_sigkilled_under_load_loses_nothing_and_converges(
    world: World,
) -> None:
    try:
        await _scenario(world)
    except BaseException:
        print(world.sidecars.dump())
        raise


async def _scenario(w: World) -> None:
    t0 = time.monotonic()
    for name in KILL_ORDER:
        await _serving(w, name)
    with anyio.fail_after(READY_WITHIN_S):
        while len(device_view(w.emulator, NODE)) != 8:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    w.health_up.append((time.monotonic(), None))
    started = time.monotonic() - t0

    async with anyio.create_task_group() as load:
        load.start_soon(_xid_stream, w)
        load.start_soon(_workload, w)
        await anyio.sleep(1.0)
        for name in KILL_ORDER:
            if name == "health":
                # A sticky condition that must survive the health service's restart.
                await w.inject("xid", gpu=7, value=79)
                await _eventually(_unhealthy(w, {7}), 10, "GPU 7 unhealthy on the Device")
            await _kill_and_restart(w, name)
        # Every service is back: GPU 6 overheats.
        fault_at = time.monotonic()
        await w.inject("temperature", gpu=6, value=99)
        await anyio.sleep(1.0)
        w.stop.set()

    assert sorted(w.recovery) == sorted(KILL_ORDER), "the kill sequence did not complete"

    async def device_converged() -> bool:
        try:
            state = await w.health_state()
        except BusError:
            return False
        healthy = {g.gpu_uuid: g.healthy for g in state.gpus}
        want = {u: i < 6 for i, u in enumerate(w.uuids)}
        return healthy == want and not device_mismatches(w.emulator, NODE, state)

    async def plugin_converged() -> bool:
        try:
            devices = w.kubelet.devices(GPU)
        except AssertionError:
            return False
        health = {d.ID: d.health == "Healthy" for d in devices}
        return health == {u: i < 6 for i, u in enumerate(w.uuids)}

    try:
        device_s = await _eventually(device_converged, 15, "the Device reflecting the state")
    except AssertionError:
        health = await w.health_state()
        print("health state:", [(g.gpu_index, g.healthy) for g in health.gpus])
        print("device:", device_view(w.emulator, NODE))
        print("mismatches:", device_mismatches(w.emulator, NODE, health))
        print("logs:", w.sidecars.logs)
        raise
    plugin_s = await _eventually(plugin_converged, 15, "ListAndWatch reflecting it")
    converged_after_fault = time.monotonic() - fault_at

    # --- allocations: no GPU twice, the kubelet's view, the checkpoint, retries ----
    state = await w.allocator_state()
    holders = Counter(g for a in state.allocations for g in a.gpus)
    assert [g for g, n in holders.items() if n > 1] == [], "a GPU is in two allocations"
    held_ids = {r.annotations["gpulet.io/allocation"]: u for u, r in w.held.items()}
    assert {a.id: tuple(a.gpus) for a in state.allocations} == {
        i: (u,) for i, u in held_ids.items()
    }
    # The checkpoint on disk holds the same (an allocation's ID is its owner's key):
    # the snapshot and its journal, as a start reads them.
    checkpoint, _ = await anyio.to_thread.run_sync(store.read_state, Path(state.checkpoint))
    on_disk = {
        a.owner.allocation_id: tuple(a.devices)
        for a in checkpoint.allocations
        if isinstance(a, WholeAllocation)
    }
    assert len(on_disk) == len(checkpoint.allocations)
    assert on_disk == {i: (u,) for i, u in held_ids.items()}
    for uuid, answer in w.held.items():
        again = await _allocate(w, uuid)
        assert again == answer, f"a retried Allocate of {uuid} got another answer"
    assert {g.uuid: g.healthy for g in state.gpus} == {u: i < 6 for i, u in enumerate(w.uuids)}
    assert w.unexpected == []

    # --- health events: nothing lost, nothing twice ------------------------------------
    events = await read_stream(w.url)
    seen = {(e.gpu_uuid, e.xid) for e in events if e.kind == "xid"}

    def health_could_see(i: Injection) -> str:
        for ready, killed in w.health_up:
            if i.sent >= ready and (killed is None or i.answered <= killed - IN_FLIGHT_S):
                return "expected"
            if i.sent >= ready and killed is not None and i.sent <= killed:
                return "in_flight"
        return "health_down"

    classes = Counter(health_could_see(i) for i in w.injections)
    missing = [
        i
        for i in w.injections
        if health_could_see(i) == "expected" and (w.uuids[i.gpu], i.code) not in seen
    ]
    in_flight_lost = [
        i
        for i in w.injections
        if health_could_see(i) == "in_flight" and (w.uuids[i.gpu], i.code) not in seen
    ]
    figures = {
        "startup_s": started,
        "kills": len(w.recovery),
        **{
            f"{name}_{key}": value
            for name, figures_ in w.recovery.items()
            for key, value in figures_.items()
        },
        **{f"{name}_allocate_outage_s": s for name, s in _allocate_outages(w).items()},
        "xids_injected": len(w.injections),
        "xids_expected": classes["expected"],
        "xids_in_flight_at_kill": classes["in_flight"],
        "xids_while_health_down": classes["health_down"],
        "events_in_stream": len(events),
        "lost": len(missing),
        "in_flight_lost": len(in_flight_lost),
        "duplicates": len(duplicates(events)),
        "allocations": w.allocations,
        "releases": w.releases,
        "allocate_retries": w.allocate_retries,
        "allocate_failures": dict(w.allocate_failures),
        "allocations_held_at_end": len(w.held),
        "device_converged_s": device_s,
        "plugin_converged_s": plugin_s,
        "converged_after_last_fault_s": converged_after_fault,
        "total_s": time.monotonic() - t0,
    }
    print(summary(figures))
    assert missing == [], f"{len(missing)} health events lost: {missing[:5]}"
    assert duplicates(events) == []
    assert classes["expected"] > 300, figures


def _unhealthy(w: World, gpus: set[int]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        seen = device_view(w.emulator, NODE)
        return {i for i, u in enumerate(w.uuids) if u in seen and not seen[u].health} == gpus

    return check
