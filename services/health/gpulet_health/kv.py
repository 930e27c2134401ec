"""Each GPU's current health in the JetStream KV bucket ``gpu_health``.

Design
------
A consumer that starts late needs the *current* state, not the history: it reads the
bucket (key ``<node>.<gpu-uuid>``, value a JSON :class:`GpuHealth`) or asks
``gpulet.health.state.<node>``. Writes are coalesced: the rule engine marks GPUs
dirty, one task writes the latest snapshot of each dirty GPU. Only the latest state
matters, so a write that fails (NATS away) leaves the GPU dirty and is retried with
back-off; nothing queues up.

On start the service reads its node's keys back (:meth:`StateStore.load`) and the
rule engine takes them over, so a sticky condition (a fatal XID) survives a restart
of the agent. A GPU the engine forgot (an operator cleared a GPU that is not present)
has its key deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import anyio.abc
import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from gpulet_common import subjects
from gpulet_common.bus import Bus, kv_keys
from gpulet_common.codec import GPU_HEALTH
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.messages import GpuHealth

log = logging.getLogger("gpulet.health.kv")
# One per malformed entry: a node could hold many (rate-limited, counted).
_malformed_log = RateLimitedLog(log, per_minute=10)

_RETRY_MIN_S = 0.1
_RETRY_MAX_S = 5.0


class StateStore:
    def __init__(self, bus: Bus, node: str, *, history: int, timeout_s: float) -> None:
        self._bus = bus
        self._node = node
        self._history = history
        self._timeout_s = timeout_s
        self._kv: KeyValue | None = None
        self._dirty: set[str] = set()
        self._wake = anyio.Event()
        self.writes = 0

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            with anyio.fail_after(self._timeout_s * 2):
                self._kv = await self._bus.key_value(
                    subjects.HEALTH_KV_BUCKET, history=self._history
                )
        return self._kv

    async def load(self, *, within_s: float = 0.0) -> list[GpuHealth] | None:
        """This node's GPUs as a previous run left them ([] when there are none).

        A bucket that cannot be read yet (JetStream still recovering after a restart,
        NATS busy) is retried with back-off for ``within_s``; None when it stayed
        unreadable: the caller then knows it starts without the previous state.
        """
        deadline = anyio.current_time() + within_s
        retry_s = _RETRY_MIN_S
        while True:
            try:
                return await self._load_once()
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                if anyio.current_time() + retry_s > deadline:
                    log.warning(
                        "cannot read the previous health state from KV %s: %s",
                        subjects.HEALTH_KV_BUCKET,
                        exc,
                    )
                    return None
                log.info("the health state in KV is not readable yet (%s); retrying", exc)
                await anyio.sleep(retry_s)
                retry_s = min(retry_s * 2, _RETRY_MAX_S)

    async def _load_once(self) -> list[GpuHealth]:
        prefix = subjects.token(self._node) + "."
        kv = await self._bucket()
        with anyio.fail_after(self._timeout_s * 2):
            # The stream's subject list, not kv.keys() (a race under load: kv_keys).
            keys = await kv_keys(self._bus.jetstream, subjects.HEALTH_KV_BUCKET, prefix)
            found: list[GpuHealth] = []
            for key in keys:
                try:
                    entry = await kv.get(key)
                except (nats.js.errors.KeyDeletedError, nats.js.errors.KeyNotFoundError):
                    continue
                if entry.value is None:
                    continue
                try:
                    found.append(GPU_HEALTH.decode(entry.value))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    _malformed_log.warning("ignoring malformed health state %s: %s", key, exc)
            return found

    def mark(self, uuids: set[str]) -> None:
        if uuids:
            self._dirty |= uuids
            self._wake.set()

    async def run(
        self,
        snapshot: Callable[[str], GpuHealth | None],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        retry_s = _RETRY_MIN_S
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._dirty:
                if not self._bus.is_connected:
                    await anyio.sleep(_RETRY_MIN_S)
                    continue
                uuid = next(iter(self._dirty))
                self._dirty.discard(uuid)
                health = snapshot(uuid)
                key = subjects.health_kv_key(self._node, uuid)
                try:
                    kv = await self._bucket()
                    with anyio.fail_after(self._timeout_s):
                        if health is None:
                            # A GPU the rule engine forgot (taken out of the node).
                            await kv.delete(key)
                        else:
                            await kv.put(key, GPU_HEALTH.encode(health))
                    self.writes += 1
                    retry_s = _RETRY_MIN_S
                except (nats.errors.Error, OSError, TimeoutError) as exc:
                    self._dirty.add(uuid)
                    log.debug("KV write of %s failed (%s); retrying in %.1fs", uuid, exc, retry_s)
                    await anyio.sleep(retry_s)
                    retry_s = min(retry_s * 2, _RETRY_MAX_S)
