"""The machines and histories of remediation by reset, in the node's NATS KV.

Bucket :data:`gpulet_common.heal.HEAL_KV_BUCKET` on the node's own NATS (the
health service's ``gpu_health`` lives there too), keys ``<node>.machine.<gpu>`` and
``<node>.history.<gpu>``. Every write is a compare-and-set on the key's revision
(``create`` for a new key, ``update(last=revision)`` otherwise): a write that loses
raises :class:`~.heal.Conflict`, so two writers never both think they moved a machine.

What is read back is decoded totally (:mod:`gpulet_common.codec`): an entry that does
not decode, or that names another GPU than its key, is a record that cannot be trusted;
it reads as a GPU out of service (``escalated``, saying why), never as no record,
since "no record" would let a new machine reset the GPU again.
"""

from __future__ import annotations

import logging

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from gpulet_allocator.service.remediate.breaker import BREAKER_STATE, BreakerState
from gpulet_allocator.service.remediate.heal import Conflict
from gpulet_common import subjects
from gpulet_common.bus.jetstream import kv_keys
from gpulet_common.codec import MalformedMessage
from gpulet_common.heal import (
    FAULT_HISTORY,
    HEAL_KV_BUCKET,
    HEAL_RECORD,
    FaultHistory,
    HealRecord,
    heal_key,
    history_key,
)
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.validate import RejectedMessage

log = logging.getLogger("gpulet.allocator.remediation.heal")
_bad_log = RateLimitedLog(log, per_minute=6)


class KvHealStore:
    def __init__(self, kv: KeyValue, js: JetStreamContext, node: str) -> None:
        self._kv = kv
        self._js = js
        self._node = node

    async def _get(self, key: str) -> tuple[bytes | None, int]:
        try:
            entry = await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None, 0
        if entry.value is None or entry.operation in ("DEL", "PURGE"):
            return None, int(entry.revision or 0)
        return entry.value, int(entry.revision or 0)

    async def _put(self, key: str, value: bytes, revision: int) -> int:
        try:
            if revision == 0:
                return int(await self._kv.create(key, value))
            return int(await self._kv.update(key, value, last=revision))
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError) as exc:
            raise Conflict(f"{key} changed under us: {exc}") from exc

    async def get(self, gpu_uuid: str) -> tuple[HealRecord | None, int]:
        return await self._record_at(heal_key(self._node, gpu_uuid), subjects.token(gpu_uuid))

    async def _record_at(self, key: str, gpu_token: str) -> tuple[HealRecord | None, int]:
        gpu_uuid = subjects.untoken(gpu_token)
        raw, revision = await self._get(key)
        if raw is None:
            return None, revision
        try:
            record = HEAL_RECORD.decode(raw)
        except (MalformedMessage, RejectedMessage) as exc:
            _bad_log.error("remediation record %s is unreadable: %s", key, exc)
            return self._untrusted(gpu_uuid, f"its record is unreadable ({exc})"), revision
        if subjects.token(record.gpu_uuid) != gpu_token:
            return self._untrusted(gpu_uuid, f"its record names {record.gpu_uuid[:80]}"), revision
        return record, revision

    @staticmethod
    def _untrusted(gpu_uuid: str, why: str) -> HealRecord:
        return HealRecord(gpu_uuid=gpu_uuid, state="escalated", detail=f"not trusted: {why}")

    async def put(self, record: HealRecord, revision: int) -> int:
        return await self._put(
            heal_key(self._node, record.gpu_uuid), HEAL_RECORD.encode(record), revision
        )

    async def records(self) -> list[HealRecord]:
        prefix = f"{subjects.token(self._node)}.machine."
        found = []
        for key in await kv_keys(self._js, HEAL_KV_BUCKET, prefix):
            record, _ = await self._record_at(key, key[len(prefix) :])
            if record is not None:
                found.append(record)
        return found

    async def history(self, gpu_uuid: str) -> tuple[FaultHistory, int]:
        raw, revision = await self._get(history_key(self._node, gpu_uuid))
        if raw is None:
            return FaultHistory(gpu_uuid=gpu_uuid), revision
        try:
            history = FAULT_HISTORY.decode(raw)
        except (MalformedMessage, RejectedMessage) as exc:
            _bad_log.error("fault history of GPU %s is unreadable: %s", gpu_uuid, exc)
            # Kept out of service: a history that cannot be read may have said "retired".
            return FaultHistory(
                gpu_uuid=gpu_uuid, retired=True, retired_reason=f"history unreadable: {exc}"
            ), revision
        if history.gpu_uuid != gpu_uuid:
            history = FaultHistory(
                gpu_uuid=gpu_uuid, retired=True, retired_reason="history names another GPU"
            )
        return history, revision

    async def put_history(self, history: FaultHistory, revision: int) -> int:
        return await self._put(
            history_key(self._node, history.gpu_uuid), FAULT_HISTORY.encode(history), revision
        )


class KvBreakerStore:
    """The node breaker's window (:class:`~.breaker.BreakerState`) under
    ``<node>.breaker`` in the same bucket; one writer (this node's allocator), so a
    plain put. A state that does not decode fails closed: it reads as a window already
    full of evictions (nothing is evicted until the window has passed), said once."""

    def __init__(self, kv: KeyValue, node: str) -> None:
        self._kv = kv
        self._key = f"{subjects.token(node)}.breaker"

    async def load(self) -> BreakerState | None:
        try:
            entry = await self._kv.get(self._key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        try:
            return BREAKER_STATE.decode(entry.value)
        except (MalformedMessage, RejectedMessage) as exc:
            _bad_log.error(
                "remediation breaker state unreadable (%s): evicting nothing for a window", exc
            )
            return BreakerState(full=True)

    async def save(self, state: BreakerState) -> None:
        await self._kv.put(self._key, BREAKER_STATE.encode(state))
