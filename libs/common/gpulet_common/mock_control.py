"""Live fault injection into the mock NVML over NATS (``gpulet mock inject``).

Every process that runs a mock NVML subscribes to ``gpulet.mock.inject.<node>`` —
*not* as a queue group — so one request reaches all of them: in docker-compose each
service container has its own mock playing the same scenario, and they must all see
the same fault. The first reply answers the caller.
"""

from __future__ import annotations

import logging

import anyio
import anyio.abc

from gpulet_common import codec, subjects
from gpulet_common.bus import Delivery, Refused
from gpulet_common.messages import MockInjectReply, MockInjectRequest
from gpulet_common.mock_nvml import MockNvml
from gpulet_common.runtime import Runtime

log = logging.getLogger("gpulet.mock")


class MockControlService:
    name = "mock-control"

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        await self._rt.bus.serve(
            subjects.mock_inject(self._rt.node),
            self._inject,
            codec.MOCK_INJECT_REQUEST,
            codec.MOCK_INJECT_REPLY,
            task_status=task_status,
        )

    async def _inject(self, request: Delivery[MockInjectRequest]) -> MockInjectReply:
        handle = await self._rt.nvml.get()
        mock = getattr(handle.adapter, "module", None)
        if not isinstance(mock, MockNvml):
            raise Refused("not_a_mock", "this process does not run the mock NVML")
        reply = await anyio.to_thread.run_sync(mock.inject, request.value)
        log.info(
            "mock fault %s on GPU %s: %s",
            request.value.fault,
            request.value.gpu,
            reply.detail or ("applied" if reply.applied else "rejected"),
        )
        return reply
