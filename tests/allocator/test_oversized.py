"""A caller's error never reads as an outage (issue 23, finding 8).

A request too large for one NATS message is the caller's fault: kubelet gets
``INVALID_ARGUMENT`` saying it is too large, not ``UNAVAILABLE: allocator
unavailable`` (which the alerts count as an outage, and which made
GetPreferredAllocation answer locally). Every path from the gRPC server through the
NATS request is covered: Allocate alone and coalesced with others, the preference,
and a client of the bus.
"""

from __future__ import annotations

import anyio
import grpc
import pytest

from gpulet_allocator import protocol as p
from gpulet_common.refusal import Refused
from gpulet_common.settings import Settings
from support import reference
from support.allocator_stack import GPU, allocator_stack, ids, rpc_error

pytestmark = pytest.mark.anyio

HUGE = "GPU-" + "x" * 3_000_000


async def test_a_3_mb_device_id_is_an_invalid_argument_everywhere(settings: Settings) -> None:
    async with allocator_stack(settings, inventory=reference.nvlink_pairs_8()) as stack:
        gpus = ids(stack, GPU)
        error = await rpc_error(stack.kubelet.allocate(GPU, [[HUGE]]))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "too large" in (error.details() or "")
        assert "unavailable" not in (error.details() or "")

        error = await rpc_error(stack.kubelet.preferred(GPU, [([*gpus, HUGE], [], 1)]))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "too large" in (error.details() or "")
        assert stack.metrics.value("gpulet.device_plugin.preferred_fallbacks", resource=GPU) == 0

        # A bus client gets the same refusal.
        with pytest.raises(Refused) as err:
            await stack.ask(
                p.ENDPOINT_RELEASE,
                p.ReleaseRequest(allocation_ids=[HUGE]),
                p.RELEASE_REQUEST,
                p.RELEASE_REPLY,
            )
        assert err.value.code == "invalid_request"
        assert "too large" in err.value.message


async def test_a_large_call_never_sinks_the_calls_coalesced_with_it(settings: Settings) -> None:
    """Calls that each fit go together as allocate-batch; one close to the limit must
    not make their batch too large for all of them."""
    async with allocator_stack(settings, inventory=reference.nvlink_pairs_8()) as stack:
        gpus = ids(stack, GPU)
        large = ["GPU-" + "y" * 700_000]
        outcomes: dict[int, str] = {}

        async def call(n: int, devices: list[str]) -> None:
            try:
                await stack.kubelet.allocate(GPU, [devices])
            except grpc.aio.AioRpcError as exc:
                outcomes[n] = exc.code().name
            else:
                outcomes[n] = "OK"

        async with anyio.create_task_group() as tg:
            for n in range(4):
                tg.start_soon(call, n, large)
            for n in range(4, 8):
                tg.start_soon(call, n, [gpus[n]])
        assert [outcomes[n] for n in range(4, 8)] == ["OK"] * 4
        assert {outcomes[n] for n in range(4)} <= {"NOT_FOUND", "INVALID_ARGUMENT"}
