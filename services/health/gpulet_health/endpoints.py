"""The health service's two request endpoints.

* ``gpulet.health.state.<node>``: the node's current health (one GPU or all), read from
  the rule engine; an unknown GPU is refused ``unknown_gpu``, naming the known ones.
* ``gpulet.health.clear.<node>``: an operator clears a GPU's sticky conditions (or one
  named condition); refused ``invalid_request``, ``unknown_gpu`` or
  ``unknown_condition`` (naming the active ones). The resulting events are published
  like any other, and the list of expected GPUs is updated (a cleared ``missing`` GPU
  that is not present is forgotten).

Refusals follow :mod:`gpulet_common.refusal` (through :meth:`Bus.serve`).
"""

from __future__ import annotations

import logging
import time

import anyio
import anyio.abc

from gpulet_common import codec, subjects
from gpulet_common.bus import Delivery, Refused
from gpulet_common.messages import HealthClearRequest, HealthState, HealthStateRequest
from gpulet_health.rules import NotPresent, UnknownCondition, UnknownGpu
from gpulet_health.stages import HealthStages

log = logging.getLogger("gpulet.health")


class HealthEndpoints:
    def __init__(self, stages: HealthStages) -> None:
        self._s = stages

    async def serve_state(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async def answer(request: Delivery[HealthStateRequest]) -> HealthState:
            gpu = request.value.gpu
            try:
                return self._s.engine.state(time.time(), gpu)
            except UnknownGpu:
                raise Refused("unknown_gpu", self._unknown_gpu(gpu or "")) from None

        await self._s.bus.serve(
            subjects.health_state(self._s.node),
            answer,
            codec.HEALTH_STATE_REQUEST,
            codec.HEALTH_STATE,
            task_status=task_status,
        )

    async def serve_clear(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        await self._s.bus.serve(
            subjects.health_clear(self._s.node),
            self._clear,
            codec.HEALTH_CLEAR_REQUEST,
            codec.HEALTH_STATE,
            task_status=task_status,
        )

    async def _clear(self, request: Delivery[HealthClearRequest]) -> HealthState:
        value = request.value
        if not value.gpu.strip():
            raise Refused("invalid_request", "gpu must be a GPU UUID or index")
        if value.condition is not None and not value.condition.strip():
            raise Refused("invalid_request", "condition must not be empty")
        now = time.time()
        try:
            gpu, events = self._s.engine.clear(value.gpu, value.condition, now, value.requested_by)
        except UnknownGpu:
            raise Refused("unknown_gpu", self._unknown_gpu(value.gpu)) from None
        except NotPresent as gone:
            raise Refused(
                "not_present",
                f"GPU {value.gpu} is not present ({gone.args[0]}); clearing its sticky "
                f"conditions would leave it expected here. To forget it: gpulet health clear "
                f"--gpu {value.gpu} --condition {gone.args[0]}",
            ) from None
        except UnknownCondition:
            gpu = self._s.engine.find(value.gpu)
            active = ", ".join(sorted(gpu.conditions)) or "none"
            raise Refused(
                "unknown_condition",
                f"GPU {value.gpu} has no active condition {value.condition!r} (active: {active})",
            ) from None
        log.info(
            "%s cleared %s on GPU %s (%d condition(s))",
            value.requested_by,
            value.condition or "the sticky conditions",
            gpu.uuid,
            len([e for e in events if e.kind == "cleared"]),
        )
        await self._s.stage.emit(events)
        await self._s.scanner.remember()
        return HealthState(node=self._s.node, gpus=[gpu.snapshot()], updated_at=now)

    def _unknown_gpu(self, ref: str) -> str:
        known = ", ".join(
            f"{g.index}={g.uuid}"
            for g in sorted(self._s.engine.gpus.values(), key=lambda g: g.index or 0)
        )
        return f"no GPU {ref!r} on node {self._s.node} (known: {known or 'none'})"
