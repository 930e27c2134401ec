"""No gap at restart, on the real control plane: in ``dra.mode=both`` a GPU the device
plugin holds carries the ``device-plugin`` taint in its slice, and a claim pinned to
that GPU waits, Unschedulable. The agent is stopped (SIGTERM) and started again three
times while the slice and the pod are sampled every 50 ms: the taint never leaves the
slice and the real kube-scheduler never gives the held GPU to the claim (a restarted
reporter once wrote the slice untainted for about 5 s before the allocator's first
``held`` answer, and the scheduler took the GPU in that window)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import anyio
import pytest
from kube.test_dra_real import DRIVER, DraNode, Scheduled, dra_node_on, pinned

from gpulet_allocator import protocol as p
from gpulet_common import subjects
from gpulet_common.bus import Bus
from gpulet_common.settings.nats import NatsSettings
from support.control_plane import ControlPlane

pytestmark = pytest.mark.anyio

GPU = 2
TAINT = f"{DRIVER}/device-plugin"


@pytest.fixture(scope="module")
def both_node(
    kube_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DraNode]:
    with dra_node_on(kube_cluster, tmp_path_factory, mode="both") as dra:
        yield dra


async def test_a_restart_never_frees_a_gpu_the_device_plugin_holds(both_node: DraNode) -> None:
    dra = both_node
    name = f"gpu-{GPU}"

    def tainted() -> bool:
        return any(t["key"] == TAINT for t in dra.devices().get(name, {}).get("taints") or [])

    uuid = dra.devices()[name]["attributes"]["uuid"]["string"]
    settings = NatsSettings(url=dra.agent.nats_url, request_timeout_s=5.0)
    async with Bus.connect(settings, name="test", max_initial_attempts=20) as bus:
        await bus.request(
            subjects.allocator_endpoint(dra.node, p.ENDPOINT_ALLOCATE),
            p.AllocateRequest(resource="nvidia.com/gpu", containers=[[uuid]]),
            p.ALLOCATE_REQUEST,
            p.ALLOCATE_REPLY,
        )
    deadline = time.monotonic() + 30
    while not tainted():
        assert time.monotonic() < deadline, "the device-plugin taint never came"
        await anyio.sleep(0.05)
    waiting = Scheduled(dra, pinned("held", GPU))
    try:
        deadline = time.monotonic() + 60
        while not waiting.unschedulable():
            assert time.monotonic() < deadline, waiting.why_not()
            await anyio.sleep(0.1)
        samples = untainted = 0
        for _ in range(3):
            await anyio.to_thread.run_sync(dra.agent.restart)
            ready_at: float | None = None
            for _ in range(1200):  # at most 60 s of samples
                samples += 1
                untainted += not tainted()
                assert not waiting.bound(), f"the held GPU went to the claim ({samples})"
                dra.agent.check_running()
                if ready_at is None:
                    answer = await anyio.to_thread.run_sync(dra.agent.readyz)
                    if answer is not None and answer[0] == 200:
                        ready_at = time.monotonic()
                elif time.monotonic() - ready_at > 3.0:
                    break
                await anyio.sleep(0.05)
            assert ready_at is not None, dra.agent.output()[-3000:]
        assert untainted == 0, f"{untainted} of {samples} samples without the taint"
        assert not waiting.bound()
    finally:
        waiting.delete()
