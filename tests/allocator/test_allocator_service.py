"""Whole GPUs through the real path: fake kubelet -> plugin -> NATS -> allocator -> back.

Each test runs a real nats-server, the allocator and device-plugin services on their
own NATS connections, and the fake kubelet calling the plugin's sockets the way
kubelet does. Inventories come from the mock NVML scenarios (the same adapter the
collector uses) or from the engine's reference topologies.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import grpc
import grpc.aio
import msgspec
import pytest

from gpulet_allocator import protocol as p
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as dp
from gpulet_allocator.state.checkpoint import decode, read_state
from gpulet_common import subjects
from gpulet_common.bus import Refused
from gpulet_common.codec import ERROR_REPLY
from gpulet_common.messages import Inventory
from gpulet_common.nvml.loader import open_mock
from gpulet_common.settings import Settings
from support import reference
from support.allocator_stack import (
    CORE,
    GPU,
    MEM,
    NODE,
    allocator_stack,
    ids,
    rpc_error,
)
from support.health_kv import gpu_health, health_bucket, put_health

pytestmark = pytest.mark.anyio


def mock_inventory(scenario: str) -> Inventory:
    adapter = open_mock(scenario)
    try:
        return adapter.inventory(NODE, 1)
    finally:
        adapter.shutdown()


def index_of(inventory: Inventory) -> dict[str, int]:
    return {g.uuid: g.index for g in inventory.gpus}


# --- whole GPUs -----------------------------------------------------------------------


async def test_whole_gpu_allocation(settings: Settings) -> None:
    inventory = mock_inventory("nvlink-pairs-8gpu")
    index = index_of(inventory)
    async with allocator_stack(settings, inventory=inventory) as stack:
        available = ids(stack, GPU)
        assert len(available) == 8
        [preferred] = await stack.kubelet.preferred(GPU, [(available, [], 2)])
        # The pair joined by four NVLinks, not two GPUs one link apart.
        assert sorted(index[u] for u in preferred) in ([0, 1], [2, 3], [4, 5], [6, 7])

        response = await stack.kubelet.allocate(GPU, [preferred])
        [container] = response.container_responses
        assert container.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(preferred)
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in container.envs
        allocation_id = container.annotations["gpulet.io/allocation"]
        assert container.envs["GPULET_ALLOCATION_ID"] == allocation_id
        minors = sorted(index[u] for u in preferred)
        assert [d.host_path for d in container.devices] == [
            *(f"/dev/nvidia{m}" for m in minors),
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
        ]
        assert all(d.permissions == "rw" for d in container.devices)

        state = await stack.state()
        [allocation] = state.allocations
        assert allocation.id == allocation_id
        assert allocation.kind == "whole"
        assert sorted(allocation.gpus) == sorted(preferred)
        held = {g.uuid for g in state.gpus if g.whole == allocation_id}
        assert held == set(preferred)

        # Kubelet naming a GPU that is already held gets a precise refusal.
        error = await rpc_error(stack.kubelet.allocate(GPU, [[preferred[0]]]))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "insufficient_capacity" in (error.details() or "")
        assert allocation_id in (error.details() or "")


async def test_topology_on_the_7_gpu_pix_phb_host(settings: Settings) -> None:
    inventory = mock_inventory("pcie-7gpu")
    index = index_of(inventory)
    async with allocator_stack(settings, inventory=inventory) as stack:
        free = ids(stack, GPU)
        [three] = await stack.kubelet.preferred(GPU, [(free, [], 3)])
        assert sorted(index[u] for u in three) == [0, 1, 2]
        await stack.kubelet.allocate(GPU, [three])
        # Kubelet offers what it believes free; the allocator picks the other group.
        free = [u for u in free if u not in three]
        [four] = await stack.kubelet.preferred(GPU, [(free, [], 4)])
        assert sorted(index[u] for u in four) == [3, 4, 5, 6]


async def test_one_gpu_requests_fill_broken_groups_first(settings: Settings) -> None:
    inventory = mock_inventory("pcie-7gpu")
    index = index_of(inventory)
    async with allocator_stack(settings, inventory=inventory) as stack:
        free = ids(stack, GPU)
        [one] = await stack.kubelet.preferred(GPU, [(free, [], 1)])
        # The 3-group is broken first, so the 4-group stays whole for a 4-GPU job.
        assert index[one[0]] in (0, 1, 2)


async def test_topology_on_the_8_gpu_nvlink_box(settings: Settings) -> None:
    inventory = mock_inventory("nvlink-pairs-8gpu")
    index = index_of(inventory)
    by_index = {i: u for u, i in index.items()}
    async with allocator_stack(settings, inventory=inventory) as stack:
        # Kubelet gave GPU 0 away on its own; GPU 1 lost its best partner.
        await stack.kubelet.allocate(GPU, [[by_index[0]]])
        free = [u for u in ids(stack, GPU) if u != by_index[0]]
        [one] = await stack.kubelet.preferred(GPU, [(free, [], 1)])
        assert index[one[0]] == 1, "a 1-GPU request must not break an intact NVLink pair"
        await stack.kubelet.allocate(GPU, [one])
        free = [u for u in free if u != one[0]]
        [two] = await stack.kubelet.preferred(GPU, [(free, [], 2)])
        assert sorted(index[u] for u in two) in ([2, 3], [4, 5], [6, 7])


async def test_numa_two_by_four_stays_on_one_socket(settings: Settings) -> None:
    inventory = reference.numa_2x4()
    index = index_of(inventory)
    async with allocator_stack(settings, inventory=inventory) as stack:
        [four] = await stack.kubelet.preferred(GPU, [(ids(stack, GPU), [], 4)])
        numa = {g.uuid: g.numa_node for g in inventory.gpus}
        assert len({numa[u] for u in four}) == 1, sorted(index[u] for u in four)


# --- health ----------------------------------------------------------------------------


async def test_unhealthy_gpu_is_excluded_and_comes_back(settings: Settings) -> None:
    inventory = mock_inventory("nvlink-pairs-8gpu")
    by_index = {g.index: g.uuid for g in inventory.gpus}
    sick = by_index[0]
    async with allocator_stack(settings, inventory=inventory) as stack:
        await stack.publish_health(sick, healthy=False)

        def sick_is(health: str, devices: list[dp.Device]) -> bool:
            return any(d.ID.startswith(sick) and d.health == health for d in devices)

        await stack.kubelet.wait_devices(GPU, lambda d: sick_is("Unhealthy", d))
        # Its shares are withdrawn with it.
        cores = await stack.kubelet.wait_devices(CORE, lambda d: sick_is("Unhealthy", d))
        assert all(d.health == "Unhealthy" for d in cores if d.ID.startswith(sick))
        await stack.wait_for(
            lambda: (
                stack.allocator is not None and not stack.allocator.core.ledger.device(sick).healthy
            ),
            "the allocator to see the GPU unhealthy",
        )

        # Even if kubelet offers it, the preference avoids it...
        [two] = await stack.kubelet.preferred(GPU, [(ids(stack, GPU), [], 2)])
        assert sick not in two
        # ...and naming it in Allocate is refused, precisely.
        error = await rpc_error(stack.kubelet.allocate(GPU, [[sick]]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "unhealthy_device" in (error.details() or "")
        # Shares are not placed on it either.
        core_ids = [i for i in ids(stack, CORE) if not i.startswith(sick)]
        share = await stack.kubelet.allocate(CORE, [core_ids[:50]])
        assert share.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] != sick

        # Recovery is advertised again and the GPU is allocatable again.
        await stack.publish_health(sick, healthy=True)
        await stack.kubelet.wait_devices(GPU, lambda d: sick_is("Healthy", d))
        await stack.kubelet.wait_devices(CORE, lambda d: not sick_is("Unhealthy", d))
        await stack.wait_for(
            lambda: (
                stack.allocator is not None and stack.allocator.core.ledger.device(sick).healthy
            ),
            "the allocator to see the GPU recover",
        )
        response = await stack.kubelet.allocate(GPU, [[sick]])
        assert response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == sick


async def test_a_gpu_that_is_not_present_stays_listed_unhealthy(settings: Settings) -> None:
    inventory = mock_inventory("nvlink-pairs-8gpu")
    gone = inventory.gpus[3]
    async with allocator_stack(settings, inventory=inventory) as stack:
        await stack.kubelet.wait_devices(GPU, lambda d: len(d) == 8)
        # The collector's inventory leaves GPU 3 out (it is lost)...
        await stack.publish_inventory(
            msgspec.structs.replace(
                inventory, generation=2, gpus=[g for g in inventory.gpus if g is not gone]
            )
        )
        await stack.kubelet.wait_devices(GPU, lambda d: len(d) == 7)
        # ...and the health service says it is missing, naming it (GpuHealth.info).
        missing = msgspec.structs.replace(
            gpu_health(gone.uuid, healthy=False, kind="gpu_missing", condition="missing"),
            present=False,
            info=gone,
        )
        await put_health(stack.bus, stack.node, missing)

        def listed_unhealthy(devices: list[dp.Device]) -> bool:
            return len(devices) == 8 and any(
                gone.uuid == d.ID and d.health == "Unhealthy" for d in devices
            )

        await stack.kubelet.wait_devices(GPU, listed_unhealthy)
        # Forgotten by the health service (its key deleted): it leaves kubelet's list.
        kv = await health_bucket(stack.bus)
        await kv.delete(subjects.health_kv_key(stack.node, gone.uuid))
        devices = await stack.kubelet.wait_devices(GPU, lambda d: len(d) == 7)
        assert gone.uuid not in {d.ID for d in devices}


# --- refusals ----------------------------------------------------------------------------


async def test_invalid_requests_get_precise_errors(settings: Settings) -> None:
    inventory = reference.pix_phb_7()  # 16 GiB cards: 64 memory units each
    async with allocator_stack(settings, inventory=inventory) as stack:
        cores = ids(stack, CORE)
        error = await rpc_error(stack.kubelet.allocate(CORE, [cores[:150]]))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (error.details() or "").startswith("invalid_core_units:")
        assert "150" in (error.details() or "")

        memory = ids(stack, MEM)
        error = await rpc_error(stack.kubelet.allocate(MEM, [memory[:65]]))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (error.details() or "").startswith("memory_exceeds_card:")
        assert "65 memory units" in (error.details() or "")

        error = await rpc_error(stack.kubelet.allocate(GPU, [["GPU-nope"]]))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (error.details() or "").startswith("unknown_device:")
        assert "GPU-nope" in (error.details() or "")

        error = await rpc_error(stack.kubelet.allocate(GPU, [[cores[0]]]))
        assert (error.details() or "").startswith("unknown_device:")

        whole = ids(stack, GPU)
        error = await rpc_error(stack.kubelet.allocate(GPU, [[whole[0], whole[0]]]))
        assert (error.details() or "").startswith("invalid_request:")

        # Nothing was allocated by any of them.
        assert (await stack.state()).allocations == []


async def test_a_retried_allocate_gets_the_same_answer(settings: Settings) -> None:
    inventory = mock_inventory("nvlink-pairs-8gpu")
    async with allocator_stack(settings, inventory=inventory) as stack:
        gpus = ids(stack, GPU)
        first = await stack.kubelet.allocate(GPU, [gpus[2:4]])
        again = await stack.kubelet.allocate(GPU, [gpus[2:4]])
        assert first == again
        share = await stack.kubelet.allocate(CORE, [ids(stack, CORE)[:20]])
        share_again = await stack.kubelet.allocate(CORE, [ids(stack, CORE)[:20]])
        assert share == share_again
        assert len((await stack.state()).allocations) == 2


# --- allocator down, restarted, late ------------------------------------------------------


async def test_allocator_down_gives_a_clean_bounded_error(settings: Settings) -> None:
    inventory = mock_inventory("nvlink-pairs-8gpu")
    async with allocator_stack(settings, inventory=inventory) as stack:
        gpus = ids(stack, GPU)
        await stack.stop_allocator()
        started = anyio.current_time()
        error = await rpc_error(stack.kubelet.allocate(GPU, [gpus[:1]]))
        assert anyio.current_time() - started < settings.allocator.plugin.backend_timeout_s
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "allocator" in (error.details() or "")
        # The preference is only a hint: it is answered locally rather than failed.
        [local] = await stack.kubelet.preferred(GPU, [(gpus, [], 2)])
        assert len(local) == 2

        await stack.start_allocator()
        await stack.wait_allocator_ready()
        response = await stack.kubelet.allocate(GPU, [gpus[:1]])
        assert response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == gpus[0]

        # What kubelet saw is counted in the plugin: the allocator never saw the failure.
        calls = "gpulet.device_plugin.calls"
        metrics = stack.metrics
        assert metrics.value(calls, rpc="Allocate", resource=GPU, code="UNAVAILABLE") == 1
        assert metrics.value(calls, rpc="Allocate", resource=GPU, code="OK") == 1
        assert metrics.value(calls, rpc="GetPreferredAllocation", code="OK") == 1
        assert metrics.value("gpulet.device_plugin.preferred_fallbacks", resource=GPU) == 1
        assert metrics.value("gpulet.allocator.requests", endpoint="allocate", outcome="ok") == 1


async def test_a_hung_allocator_times_out(settings: Settings) -> None:
    inventory = mock_inventory("nvlink-pairs-8gpu")
    settings = msgspec.structs.replace(
        settings,
        allocator=msgspec.structs.replace(settings.allocator, request_timeout_s=0.3),
    )
    async with allocator_stack(settings, inventory=inventory, start_allocator=False) as stack:
        gpus = ids(stack, GPU)
        # Something listens on the subject but never answers.
        subject = f"gpulet.allocator.{NODE.replace('.', '_')}.allocate"
        sub = await stack.bus.client.subscribe(subject)
        # The server knows the subscription before the plugin asks: without this the
        # request could find no responder yet ("no allocator is listening").
        await stack.bus.client.flush()
        try:
            started = anyio.current_time()
            error = await rpc_error(stack.kubelet.allocate(GPU, [gpus[:1]]))
            assert 0.25 < anyio.current_time() - started < 1.5
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "no reply" in (error.details() or "")
        finally:
            await sub.unsubscribe()


async def test_allocator_restart_recovers_and_never_double_allocates(settings: Settings) -> None:
    inventory = mock_inventory("nvlink-pairs-8gpu")
    async with allocator_stack(settings, inventory=inventory) as stack:
        gpus = ids(stack, GPU)
        [pair] = await stack.kubelet.preferred(GPU, [(gpus, [], 2)])
        whole = await stack.kubelet.allocate(GPU, [pair])
        share = await stack.kubelet.allocate(CORE, [ids(stack, CORE)[:40]])
        before = await stack.state()

        await stack.stop_allocator()
        # The stop folded the journal into the snapshot: alone it holds both (what a
        # version that reads only the snapshot, a rollback, starts from).
        snapshot = decode(await anyio.Path(before.checkpoint).read_bytes())
        assert len(snapshot.allocations) == 2
        await stack.start_allocator()
        await stack.wait_allocator_ready()

        after = await stack.state()
        assert after.allocations == before.allocations
        # Kubelet retrying after the restart gets the same devices, not new ones.
        assert await stack.kubelet.allocate(GPU, [pair]) == whole
        assert await stack.kubelet.allocate(CORE, [ids(stack, CORE)[:40]]) == share
        # The held GPUs are not handed out again.
        error = await rpc_error(stack.kubelet.allocate(GPU, [[pair[1]]]))
        assert "insufficient_capacity" in (error.details() or "")
        rest = [u for u in gpus if u not in pair]
        [next_pair] = await stack.kubelet.preferred(GPU, [(gpus, [], 2)])
        assert set(next_pair) <= set(rest)
        on_disk, _ = read_state(Path(after.checkpoint))  # the snapshot and its journal
        assert on_disk.version == 1
        assert len(on_disk.allocations) == 2


async def test_start_order_does_not_matter(settings: Settings) -> None:
    inventory = mock_inventory("nvlink-pairs-8gpu")
    async with allocator_stack(settings, inventory=None) as stack:
        assert stack.allocator is not None
        assert not stack.allocator.core.ready
        status = stack.status.get("allocator")
        assert status is not None
        assert status.state == "degraded"
        assert "inventory" in status.detail
        # No inventory yet: the allocator says so, and kubelet sees "unavailable".
        error = await rpc_error(stack.kubelet.allocate(GPU, [["GPU-x"]]))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "not_ready" in (error.details() or "")
        # The collector comes up later and publishes: both services pick it up.
        await stack.publish_inventory(inventory)
        await stack.wait_allocator_ready()
        await stack.wait_listed(inventory)
        await stack.wait_for(
            lambda: getattr(stack.status.get("allocator"), "state", "") == "ready",
            "the allocator to report ready",
        )


# --- the micro service ----------------------------------------------------------------------


async def test_discoverable_with_stats_and_malformed_requests_counted(settings: Settings) -> None:
    inventory = mock_inventory("nvlink-pairs-8gpu")
    async with allocator_stack(settings, inventory=inventory) as stack:
        nc = stack.bus.client
        ping = json.loads((await nc.request("$SRV.PING.gpulet-allocator", b"", timeout=2)).data)
        assert ping["name"] == p.SERVICE_NAME
        assert ping["metadata"]["node"] == NODE
        info = json.loads((await nc.request("$SRV.INFO.gpulet-allocator", b"", timeout=2)).data)
        subjects = sorted(e["subject"] for e in info["endpoints"])
        assert subjects == sorted(f"gpulet.allocator.node-a_example.{e}" for e in p.ENDPOINTS)

        subject = "gpulet.allocator.node-a_example.allocate"
        for bad in (b"not json", b'{"resource": 3}', b"[]"):
            msg = await nc.request(subject, bad, timeout=2)
            assert msg.headers is not None
            assert msg.headers["Nats-Service-Error-Code"] == "400"
            assert msg.headers["Nats-Service-Error"].startswith("malformed_request: ")
            assert ERROR_REPLY.decode(msg.data).code == "malformed_request"
        with pytest.raises(Refused) as refused:
            await stack.ask(
                p.ENDPOINT_ALLOCATE,
                p.AllocateRequest(resource="example.com/tpu", containers=[["x"]]),
                p.ALLOCATE_REQUEST,
                p.ALLOCATE_REPLY,
            )
        assert refused.value.code == "unknown_resource"
        assert "example.com/tpu" in refused.value.message
        await stack.kubelet.allocate(GPU, [ids(stack, GPU)[:1]])

        stats = json.loads((await nc.request("$SRV.STATS.gpulet-allocator", b"", timeout=2)).data)
        allocate = next(e for e in stats["endpoints"] if e["name"] == "allocate")
        assert allocate["num_requests"] == 5
        assert allocate["data"]["malformed"] == 3
        assert allocate["data"]["codes"] == {"malformed_request": 3, "unknown_resource": 1}
        assert allocate["data"]["ok"] == 1


async def test_a_kubelet_restart_keeps_allocations_and_answers(settings: Settings) -> None:
    inventory = mock_inventory("dgx-h100")
    async with allocator_stack(settings, inventory=inventory) as stack:
        gpus = ids(stack, GPU)
        [four] = await stack.kubelet.preferred(GPU, [(gpus, [], 4)])
        first = await stack.kubelet.allocate(GPU, [four])
        await stack.kubelet.restart(timeout_s=10)
        await stack.wait_listed(inventory)
        # Kubelet re-admits running pods after a restart: same IDs, same answer.
        assert await stack.kubelet.allocate(GPU, [four]) == first
        rest = [u for u in gpus if u not in four]
        [other] = await stack.kubelet.preferred(GPU, [(rest, [], 4)])
        assert set(other) == set(rest)
        assert len((await stack.state()).allocations) == 1
