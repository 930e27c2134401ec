"""Checks of what a decoded message claims, against what the receiver knows.

Design
------
msgspec checks a message's shape, types and wire-level ranges (``msgspec.Meta`` in
:mod:`gpulet_common.messages`: non-negative counters and indexes, percentages
0..100). What one field cannot say alone is checked here, in one place for every
service, by :func:`check`, which :meth:`gpulet_common.codec.Codec.decode` runs on every
message it decodes:

* **node**: a message about a node (inventory, samples, health event, health state)
  must name the node of the subject it came on (``gpu.health.<node>``, or the subject
  a reply was asked on), and the consumer's node when the consumer gave one. Another
  node's inventory published on ours would otherwise list its GPUs as ours.
* **GPUs**: at most ``limits.max_gpus`` per message, each UUID non-empty and listed
  once, each index once per inventory, at most ``max_gpus`` peer links per GPU. A
  duplicate UUID used to raise deep in the allocator's topology and end the agent.
* **time**: a finite timestamp; observations (``observed_at``, a sample's time, an
  inventory's ``published_at``) no more than ``limits.max_clock_skew_s`` ahead of the
  receiver's clock nor older than ``limits.max_age_s``; "since" times
  (``condition_since``, ``updated_at``) not in the future. Checked only when the
  caller passes its clock (``now``): every bus subscription, reply and stream
  consumer does; files and tests replaying old messages do not.

A failed check raises :class:`RejectedMessage` (a :class:`msgspec.ValidationError`)
with a short ``reason`` (the ``reason`` label of ``gpulet_bus_rejected_messages_total``)
and changes nothing: it runs before any consumer sees the message.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from gpulet_common import messages as m
from gpulet_common import subjects
from gpulet_common.settings.limits import LimitsSettings

NODE_MISMATCH: Final = "node_mismatch"
WRONG_NODE: Final = "wrong_node"
TOO_MANY_GPUS: Final = "too_many_gpus"
TOO_MANY_LINKS: Final = "too_many_links"
DUPLICATE_UUID: Final = "duplicate_uuid"
DUPLICATE_INDEX: Final = "duplicate_index"
EMPTY_UUID: Final = "empty_uuid"
BAD_TIMESTAMP: Final = "bad_timestamp"
FUTURE_TIMESTAMP: Final = "future_timestamp"
STALE_TIMESTAMP: Final = "stale_timestamp"
BAD_NUMBER: Final = "bad_number"


class RejectedMessage(msgspec.ValidationError):
    """A well-formed message whose claims do not hold."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Context:
    limits: LimitsSettings
    # The subject the message came on, or the request subject of a reply.
    subject: str | None = None
    # The consumer's own node, when it only takes messages about that node.
    node: str | None = None
    # The receiver's clock (time.time()); None skips the time checks.
    now: float | None = None


def _node(claimed: str, ctx: Context, what: str) -> None:
    if ctx.subject is not None:
        expected = subjects.node_token(ctx.subject)
        if expected is not None and (not claimed or subjects.token(claimed) != expected):
            raise RejectedMessage(
                NODE_MISMATCH,
                f"{what} names node {claimed[:100]!r} but came on {ctx.subject[:200]}",
            )
    if ctx.node is not None and claimed != ctx.node:
        raise RejectedMessage(
            WRONG_NODE, f"{what} names node {claimed[:100]!r}, this is node {ctx.node!r}"
        )


def _node_gpus(node: str, uuids: Iterable[str], count: int, ctx: Context, what: str) -> None:
    """A message about one node's GPUs: about this node (:func:`_node`), and each GPU
    listed once, with a UUID, within ``max_gpus``."""
    _node(node, ctx, what)
    limit = ctx.limits.max_gpus
    if count > limit:
        raise RejectedMessage(TOO_MANY_GPUS, f"{what} lists {count} GPUs, at most {limit} allowed")
    seen: set[str] = set()
    for uuid in uuids:
        if not uuid:
            raise RejectedMessage(EMPTY_UUID, f"{what} lists a GPU without a UUID")
        if uuid in seen:
            raise RejectedMessage(DUPLICATE_UUID, f"{what} lists GPU {uuid[:100]!r} twice")
        seen.add(uuid)


def _observed(ts: float, ctx: Context, what: str) -> None:
    """An observation time: finite, not ahead of our clock, not too old."""
    if not math.isfinite(ts):
        raise RejectedMessage(BAD_TIMESTAMP, f"{what} is not a finite number")
    if ctx.now is None:
        return
    limits = ctx.limits
    if ts > ctx.now + limits.max_clock_skew_s:
        raise RejectedMessage(
            FUTURE_TIMESTAMP,
            f"{what} {ts:.6g} is {ts - ctx.now:.6g} s ahead of this clock "
            f"(at most {limits.max_clock_skew_s:g} s allowed)",
        )
    if ts < ctx.now - limits.max_age_s:
        raise RejectedMessage(
            STALE_TIMESTAMP,
            f"{what} {ts:.6g} is {ctx.now - ts:.6g} s old (at most {limits.max_age_s:g} s)",
        )


def _since(ts: float | None, ctx: Context, what: str) -> None:
    """A "since" or "updated" time: may be long ago, never ahead of our clock."""
    if ts is None:
        return
    if not math.isfinite(ts):
        raise RejectedMessage(BAD_TIMESTAMP, f"{what} is not a finite number")
    if ctx.now is not None and ts > ctx.now + ctx.limits.max_clock_skew_s:
        raise RejectedMessage(
            FUTURE_TIMESTAMP, f"{what} {ts:.6g} is {ts - ctx.now:.6g} s ahead of this clock"
        )


def _inventory(inv: m.Inventory, ctx: Context) -> None:
    gpus = inv.gpus
    _node_gpus(inv.node, (g.uuid for g in gpus), len(gpus), ctx, "inventory")
    if len({g.index for g in gpus}) != len(gpus):
        raise RejectedMessage(DUPLICATE_INDEX, "inventory lists a GPU index twice")
    limit = ctx.limits.max_gpus
    for g in gpus:
        if len(g.topology) > limit:
            raise RejectedMessage(
                TOO_MANY_LINKS, f"GPU {g.uuid[:100]!r} lists {len(g.topology)} peer links"
            )
    if inv.published_at:
        _observed(inv.published_at, ctx, "inventory published_at")


def _samples(batch: m.SampleBatch, ctx: Context) -> None:
    samples = batch.samples
    _node_gpus(batch.node, (s.uuid for s in samples), len(samples), ctx, "sample batch")
    _observed(batch.timestamp, ctx, "sample batch timestamp")
    for s in samples:
        _observed(s.timestamp, ctx, f"sample timestamp of GPU {s.uuid[:100]!r}")


def _event(event: m.HealthEvent, ctx: Context) -> None:
    # No UUID check: node-wide events (nvml_unavailable, buffer_overflow) name no GPU.
    _node(event.node, ctx, "health event")
    _observed(event.observed_at, ctx, "health event observed_at")
    if event.published_at:
        _observed(event.published_at, ctx, "health event published_at")
    _since(event.condition_since, ctx, "health event condition_since")


def _gpu_health(gpu: m.GpuHealth, ctx: Context) -> None:
    _since(gpu.updated_at, ctx, f"updated_at of GPU {gpu.gpu_uuid[:100]!r}")
    for condition in gpu.conditions:
        _since(condition.since, ctx, f"since of condition {condition.condition[:100]!r}")


def _health_state(state: m.HealthState, ctx: Context) -> None:
    gpus = state.gpus
    _node_gpus(state.node, (g.gpu_uuid for g in gpus), len(gpus), ctx, "health state")
    _since(state.updated_at, ctx, "health state updated_at")
    for gpu in gpus:
        _gpu_health(gpu, ctx)


def _one_gpu_health(gpu: m.GpuHealth, ctx: Context) -> None:
    if not gpu.gpu_uuid:
        raise RejectedMessage(EMPTY_UUID, "GPU health without a GPU UUID")
    _gpu_health(gpu, ctx)


def _mock_inject(request: m.MockInjectRequest, ctx: Context) -> None:
    for name, value in (("value", request.value), ("duration_s", request.duration_s)):
        if value is not None and not math.isfinite(value):
            raise RejectedMessage(BAD_NUMBER, f"mock injection {name} is not a finite number")


_CHECKS: dict[type, Callable[[Any, Context], None]] = {
    m.Inventory: _inventory,
    m.SampleBatch: _samples,
    m.HealthEvent: _event,
    m.HealthState: _health_state,
    m.GpuHealth: _one_gpu_health,
    m.MockInjectRequest: _mock_inject,
}


def check(value: object, ctx: Context) -> None:
    """Raise :class:`RejectedMessage` when ``value`` claims what cannot be."""
    checker = _CHECKS.get(type(value))
    if checker is not None:
        checker(value, ctx)
