"""Allocate calls coalesced into allocate-batch, and the batch endpoint itself.

Kubelet calls in a burst leave the plugin together (see
:mod:`gpulet_allocator.kubelet.deviceplugin.nats_backend`); these tests prove that
coalescing changes nothing a caller can see: every call gets the answer or the refusal
it would have got alone, no card is oversubscribed, a plugin newer than its allocator
still works, and a stopping plugin fails its queued calls at once instead of at their
deadline.
"""

from __future__ import annotations

import json

import anyio
import grpc
import grpc.aio
import pytest
from nats.aio.msg import Msg

from gpulet_allocator import protocol as p
from gpulet_allocator.kubelet.deviceplugin.nats_backend import NatsAllocationBackend
from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as dp
from gpulet_allocator.protocol import ContainerAllocation
from gpulet_common import subjects
from gpulet_common.bus import Bus, Refused, RequestTimeout
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import ErrorReply
from gpulet_common.refusal import refusal
from gpulet_common.settings import Settings
from gpulet_common.settings.nats import NatsSettings
from support import reference
from support.allocator_stack import (
    CORE,
    GPU,
    NODE,
    Stack,
    allocator_stack,
    ids,
)
from support.metrics import MetricsProbe

pytestmark = pytest.mark.anyio


async def endpoint_requests(stack: Stack) -> dict[str, int]:
    msg = await stack.bus.client.request(f"$SRV.STATS.{p.SERVICE_NAME}", b"", timeout=2)
    return {e["name"]: e["num_requests"] for e in json.loads(msg.data)["endpoints"]}


# --- through kubelet's socket -----------------------------------------------------------


async def test_a_burst_is_coalesced_and_every_call_decided_alone(settings: Settings) -> None:
    inventory = reference.nvlink_pairs_8()
    async with allocator_stack(settings, inventory=inventory) as stack:
        cores = ids(stack, CORE)
        before = await endpoint_requests(stack)
        answers: dict[int, dp.AllocateResponse] = {}
        refused: dict[int, grpc.aio.AioRpcError] = {}
        # 40 shares of 2 units, one of 150 units (refused), one of an unknown GPU.
        calls = [cores[2 * n : 2 * n + 2] for n in range(40)]
        calls += [cores[100:250], ["GPU-nope::core-1"]]

        async def call(n: int, device_ids: list[str]) -> None:
            try:
                answers[n] = await stack.kubelet.allocate(CORE, [device_ids])
            except grpc.aio.AioRpcError as exc:
                refused[n] = exc

        async with anyio.create_task_group() as tg:
            for n, device_ids in enumerate(calls):
                tg.start_soon(call, n, device_ids)

        assert sorted(answers) == list(range(40))
        assert sorted(refused) == [40, 41]
        assert refused[40].code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (refused[40].details() or "").startswith("invalid_core_units:")
        assert (refused[41].details() or "").startswith("unknown_device:")
        allocation_ids = {
            a.container_responses[0].annotations["gpulet.io/allocation"] for a in answers.values()
        }
        assert len(allocation_ids) == 40
        for answer in answers.values():
            envs = answer.container_responses[0].envs
            assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "2"

        state = await stack.state()
        assert {a.id for a in state.allocations} == allocation_ids
        assert all(g.cores_used <= 100 for g in state.gpus)
        assert sum(g.cores_used for g in state.gpus) == 80

        after = await endpoint_requests(stack)
        lone = after[p.ENDPOINT_ALLOCATE] - before[p.ENDPOINT_ALLOCATE]
        batches = after[p.ENDPOINT_ALLOCATE_BATCH] - before[p.ENDPOINT_ALLOCATE_BATCH]
        # Coalesced: fewer NATS requests than kubelet calls, and some were batches.
        assert batches >= 1
        assert lone + batches < len(calls)


async def test_a_lone_call_is_sent_alone(settings: Settings) -> None:
    async with allocator_stack(settings, inventory=reference.nvlink_pairs_8()) as stack:
        before = await endpoint_requests(stack)
        for n in range(3):
            await stack.kubelet.allocate(GPU, [ids(stack, GPU)[n : n + 1]])
        after = await endpoint_requests(stack)
        assert after[p.ENDPOINT_ALLOCATE] - before[p.ENDPOINT_ALLOCATE] == 3
        assert after[p.ENDPOINT_ALLOCATE_BATCH] == before[p.ENDPOINT_ALLOCATE_BATCH]


# --- the endpoint itself ----------------------------------------------------------------


async def test_batch_endpoint_decides_each_call_in_order(settings: Settings) -> None:
    async with allocator_stack(
        settings, inventory=reference.nvlink_pairs_8(), start_plugin=False
    ) as stack:
        gpus = [g.uuid for g in reference.nvlink_pairs_8().gpus]
        share = p.AllocateRequest(resource=CORE, containers=[[f"{gpus[7]}::core-0"] * 1])
        calls = [
            share,
            p.AllocateRequest(
                resource=CORE, containers=[[f"{gpus[0]}::core-{u}" for u in range(100)] * 2]
            ),
            p.AllocateRequest(resource=GPU, containers=[[gpus[3]]]),
            p.AllocateRequest(resource=GPU, containers=[[gpus[3]]]),
            share,
            p.AllocateRequest(resource="example.com/nope", containers=[[gpus[1]]]),
        ]
        reply = await stack.ask(
            p.ENDPOINT_ALLOCATE_BATCH,
            p.AllocateBatchRequest(calls=calls),
            p.ALLOCATE_BATCH_REQUEST,
            p.ALLOCATE_BATCH_REPLY,
        )
        first, duplicate_ids, whole, whole_again, share_again, unknown = reply.outcomes
        assert first.error is None
        assert first.containers[0].gpus
        assert duplicate_ids.error is not None
        assert duplicate_ids.error.code == "invalid_request"
        assert duplicate_ids.containers == []
        assert whole.error is None
        assert whole.containers[0].gpus == [gpus[3]]
        # A call repeated in the same batch is the same grant, as a kubelet retry is.
        assert whole_again == whole
        assert share_again == first
        assert unknown.error is not None
        assert unknown.error.code == "unknown_resource"
        state = await stack.state()
        assert len(state.allocations) == 2


async def test_batch_endpoint_refuses_empty_and_oversized_batches(settings: Settings) -> None:
    async with allocator_stack(
        settings, inventory=reference.nvlink_pairs_8(), start_plugin=False
    ) as stack:
        gpu = reference.nvlink_pairs_8().gpus[0].uuid
        for calls in (0, p.MAX_BATCH_CALLS + 1):
            batch = p.AllocateBatchRequest(
                calls=[p.AllocateRequest(resource=GPU, containers=[[gpu]])] * calls
            )
            with pytest.raises(Refused) as refused:
                await stack.ask(
                    p.ENDPOINT_ALLOCATE_BATCH,
                    batch,
                    p.ALLOCATE_BATCH_REQUEST,
                    p.ALLOCATE_BATCH_REPLY,
                )
            assert refused.value.code == "invalid_request"
            assert f"1 to {p.MAX_BATCH_CALLS} calls, not {calls}" in refused.value.message
        assert (await stack.state()).allocations == []


# --- the plugin's side, against stand-in allocators ------------------------------------


def _answer_for(request: p.AllocateRequest) -> p.AllocateReply:
    return p.AllocateReply(
        containers=[
            ContainerAllocation(gpus=["GPU-x"], annotations={"ids": ",".join(c)})
            for c in request.containers
        ]
    )


async def test_plugin_sends_calls_alone_to_an_allocator_without_batches(
    nats_server: EmbeddedNats,
) -> None:
    """An allocator older than the plugin serves only ``allocate``: nothing breaks."""
    nats = NatsSettings(url=nats_server.url)
    async with (
        Bus.connect(nats, name="old-allocator") as allocator,
        Bus.connect(nats, name="plugin") as plugin,
    ):
        seen: list[p.AllocateRequest] = []

        async def answer(msg: Msg) -> None:
            request = p.ALLOCATE_REQUEST.decode(msg.data)
            seen.append(request)
            await anyio.sleep(0.01)  # long enough for the other calls to queue up
            await msg.respond(p.ALLOCATE_REPLY.encode(_answer_for(request)))

        subject = subjects.allocator_endpoint(NODE, p.ENDPOINT_ALLOCATE)
        sub = await allocator.client.subscribe(subject, cb=answer)
        await allocator.flush()
        await plugin.flush()  # the requester's own round trip after the SUB's (see Bus.subscribe)
        backend = NatsAllocationBackend(plugin, NODE, timeout_s=2.0)
        results: dict[int, list[ContainerAllocation]] = {}

        async def call(n: int) -> None:
            results[n] = await backend.allocate(CORE, [[f"GPU-x::core-{n}"]])

        try:
            async with anyio.create_task_group() as tg:
                await tg.start(backend.run)
                with anyio.fail_after(10):
                    async with anyio.create_task_group() as calls:
                        for n in range(10):
                            calls.start_soon(call, n)
                tg.cancel_scope.cancel()
        finally:
            await sub.unsubscribe()
        assert len(seen) == 10
        for n, containers in results.items():
            assert containers[0].annotations["ids"] == f"GPU-x::core-{n}"


async def test_batched_refusals_reach_each_caller_with_their_code(
    nats_server: EmbeddedNats,
) -> None:
    nats = NatsSettings(url=nats_server.url)
    async with (
        Bus.connect(nats, name="allocator") as allocator,
        Bus.connect(nats, name="plugin") as plugin,
    ):
        release = anyio.Event()

        async def lone(msg: Msg) -> None:
            await release.wait()  # holds the lone calls in flight while the rest queue
            request = p.ALLOCATE_REQUEST.decode(msg.data)
            await msg.respond(p.ALLOCATE_REPLY.encode(_answer_for(request)))

        batches: list[int] = []

        async def batch(msg: Msg) -> None:
            calls = p.ALLOCATE_BATCH_REQUEST.decode(msg.data).calls
            batches.append(len(calls))
            outcomes = [
                p.AllocateOutcome(
                    error=ErrorReply(code="too_many_units", message=f"call {n} is too big")
                )
                if n % 2
                else p.AllocateOutcome(containers=_answer_for(c).containers)
                for n, c in enumerate(calls)
            ]
            reply = p.AllocateBatchReply(outcomes=outcomes)
            await msg.respond(p.ALLOCATE_BATCH_REPLY.encode(reply))

        subs = [
            await allocator.client.subscribe(
                subjects.allocator_endpoint(NODE, p.ENDPOINT_ALLOCATE), cb=lone
            ),
            await allocator.client.subscribe(
                subjects.allocator_endpoint(NODE, p.ENDPOINT_ALLOCATE_BATCH), cb=batch
            ),
        ]
        await allocator.flush()
        await plugin.flush()  # the requester's own round trip after the SUB's (see Bus.subscribe)
        backend = NatsAllocationBackend(plugin, NODE, timeout_s=2.0)
        # The first call is the one request out, and is held; the rest queue up.
        held = 1
        outcomes: dict[int, object] = {}

        async def call(n: int) -> None:
            try:
                outcomes[n] = await backend.allocate(CORE, [[f"GPU-x::core-{n}"]])
            except Refused as exc:
                outcomes[n] = exc

        try:
            async with anyio.create_task_group() as tg:
                await tg.start(backend.run)
                with anyio.fail_after(10):
                    async with anyio.create_task_group() as calls:
                        for n in range(held):
                            calls.start_soon(call, n)
                            await anyio.sleep(0.02)  # each alone: nothing else waits
                        for n in range(held, held + 6):
                            calls.start_soon(call, n)
                        await anyio.sleep(0.05)
                        release.set()
                tg.cancel_scope.cancel()
        finally:
            for sub in subs:
                await sub.unsubscribe()
        assert batches == [6]
        assert all(isinstance(outcomes[n], list) for n in range(held))
        # In the batch, every second call was refused.
        for i, n in enumerate(range(held, held + 6)):
            outcome = outcomes[n]
            if i % 2:
                assert isinstance(outcome, Refused)
                assert (outcome.code, outcome.message) == ("too_many_units", f"call {i} is too big")
            else:
                assert isinstance(outcome, list)
                assert outcome[0].annotations["ids"] == f"GPU-x::core-{n}"


async def test_a_stopping_plugin_fails_queued_calls_at_once(nats_server: EmbeddedNats) -> None:
    nats = NatsSettings(url=nats_server.url)
    async with (
        Bus.connect(nats, name="hung-allocator") as allocator,
        Bus.connect(nats, name="plugin") as plugin,
    ):
        # Listens on both endpoints and never answers.
        subs = [
            await allocator.client.subscribe(subjects.allocator_endpoint(NODE, e))
            for e in (p.ENDPOINT_ALLOCATE, p.ENDPOINT_ALLOCATE_BATCH)
        ]
        await allocator.flush()
        await plugin.flush()  # the requester's own round trip after the SUB's (see Bus.subscribe)
        backend = NatsAllocationBackend(plugin, NODE, timeout_s=30.0)
        failures: list[Exception] = []

        async def call(n: int) -> None:
            try:
                await backend.allocate(GPU, [[f"GPU-{n}"]])
            except RequestTimeout as exc:
                failures.append(exc)

        try:
            with anyio.fail_after(5):
                # The calls outlive the sender: they must end by themselves.
                async with (
                    anyio.create_task_group() as calls,
                    anyio.create_task_group() as sender,
                ):
                    await sender.start(backend.run)
                    for n in range(4):
                        calls.start_soon(call, n)
                    await anyio.sleep(0.2)
                    sender.cancel_scope.cancel()
        finally:
            for sub in subs:
                await sub.unsubscribe()
        assert len(failures) == 4
        assert all("stopping" in str(f) for f in failures)


async def test_plugin_asks_on_the_bus_with_trace_context_and_total_decoding(
    nats_server: EmbeddedNats,
) -> None:
    """The plugin's requests carry the trace context; whatever the allocator answers,
    the plugin gets a typed refusal of the one tree (counted when malformed), never a
    crash: a reply that is not the type, a refusal whose body is broken, nats.micro's
    bare 500, and a refusal with a code this plugin does not know."""
    nats = NatsSettings(url=nats_server.url)
    probe = MetricsProbe()
    answers: list[tuple[bytes, dict[str, str] | None]] = [
        (b'{"containers": 3}', None),
        (b"not json", {"Nats-Service-Error-Code": "409", "Nats-Service-Error": "x: y"}),
        (b"", {"Nats-Service-Error-Code": "500", "Nats-Service-Error": "handler error"}),
        refusal("a_newer_code", "from a newer allocator"),
    ]
    headers_seen: list[dict[str, str]] = []
    async with (
        Bus.connect(nats, name="odd-allocator") as allocator,
        Bus.connect(nats, name="plugin", meter=probe.meter) as plugin,
    ):

        async def answer(msg: Msg) -> None:
            headers_seen.append(dict(msg.headers or {}))
            data, headers = answers[len(headers_seen) - 1]
            await allocator.client.publish(msg.reply, data, headers=headers)

        subject = subjects.allocator_endpoint(NODE, p.ENDPOINT_ALLOCATE)
        sub = await allocator.client.subscribe(subject, cb=answer)
        await allocator.flush()
        await plugin.flush()
        backend = NatsAllocationBackend(plugin, NODE, timeout_s=2.0)
        refusals: list[Refused] = []
        try:
            for _ in answers:
                with pytest.raises(Refused) as refused:
                    await backend.allocate(GPU, [["GPU-x"]])
                refusals.append(refused.value)
        finally:
            await sub.unsubscribe()
    assert all("traceparent" in h for h in headers_seen), headers_seen
    assert [r.code for r in refusals] == ["malformed_reply", "internal", "internal", "a_newer_code"]
    assert probe.value("gpulet.bus.malformed_messages", type="AllocateReply") == 1
    assert probe.value("gpulet.bus.malformed_messages", type="ErrorReply") == 2
