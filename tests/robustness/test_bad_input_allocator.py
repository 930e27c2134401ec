"""The allocator's request handlers against hostile requests: refused cleanly, never broken.

What runs
---------
A real nats-server and the real :class:`~gpulet_allocator.service.AllocatorService` on
its own NATS connection, with its checkpoint on disk and its metrics going to an
in-memory reader. The node has 8 GPUs (NVLink pairs, two NUMA nodes, 80 GiB and 24 GiB
cards, so "more memory than a card" depends on the card). Two kinds of input:

* **10,000+ well-formed but hostile requests per endpoint** (allocate, allocate-batch,
  preferred, release, state), handed to the service's endpoint handlers -- the coroutines
  nats.micro calls for each message -- with a request object that captures the answer;
  the socket would only add time. Hypothesis draws a base request and a seed, and a
  fast structural mutator (:func:`allocate_variants` and its siblings) fans each out
  into 25 variants, the way :mod:`robustness.strategies` does for bytes: unknown,
  malformed and duplicated device IDs, wrong resource names, 150 core units, zero,
  negative and huge sizes, more memory than a card, valid and invalid IDs mixed,
  must-include IDs that are not offered, releases of unknown allocations, lists of
  thousands of IDs, unhealthy and lost GPUs, and valid requests and retries in between
  so that the state keeps changing. State requests carry nothing to vary but bytes, so
  theirs are byte mutants (mostly malformed, some valid with odd extras). Between
  batches GPUs turn unhealthy and healthy again and one goes missing from the
  inventory, through the bus as the health service and the collector would say so.
  Allocate-batch requests (:func:`allocate_batch_variants`) carry calls drawn from the
  allocate variants: hostile and valid calls mixed, the same call several times, the
  core and memory halves of shares, wrong resources, calls of hundreds of containers or
  thousands of IDs, retries of earlier grants, 0, 64, 65 and 1,000 calls, and 64 calls
  whose answer would not fit one NATS message.
* **A few hundred malformed raw payloads** through the real NATS endpoints
  (:func:`robustness.strategies.bases` + :func:`~robustness.strategies.mutants`, plus a
  near-1 MiB request and IDs carrying CR/LF, for allocate and allocate-batch).

Checked after every request: the answer is either a reply that decodes and makes sense
(an allocation on GPUs of the node, a preference of exactly ``size`` offered IDs) or a
typed refusal -- nats.micro's error headers, an ``ErrorReply`` with a known code and a
non-empty, bounded message, the matching ``Nats-Service-Error-Code`` -- never an
exception, never ``internal``, never more than NATS carries. An allocate-batch answer
has one outcome per call, each such an allocation or refusal; the same container gets
the same answer throughout the batch; and every call got exactly what it would have got
alone: a copy of the allocator's core taken before the batch (the *twin*) decides the
calls one at a time and must give the same answers and end in the same state (for a
batch refused whole, none of its decisions may stay). After every batch: no card past
100 core units or its memory, no GPU held twice (whole twice, or whole and shared), no
allocation made or grown on a GPU that was unhealthy or lost. At the end: every answer
is counted by outcome in the endpoint's ``$SRV.STATS`` data and in
``gpulet.allocator.requests`` (STATS also counts the calls refused inside a batch),
nats.micro saw no handler error, and the checkpoint on disk restores to the same state.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import anyio
import anyio.abc
import anyio.from_thread
import anyio.to_thread
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.msg import Msg
from nats.micro.request import Request

from gpulet_allocator import protocol as p
from gpulet_allocator.decide.books import Undo
from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.decide.engine import ShareAllocation, WholeAllocation
from gpulet_allocator.protocol import (
    CORES_PER_GPU,
    ContainerAllocation,
    PreferredRequest,
    memory_units,
)
from gpulet_allocator.service import AllocatorService
from gpulet_allocator.state.checkpoint import CheckpointFile
from gpulet_allocator.state.records import StoredState
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.codec import Codec
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import ErrorReply, Inventory
from gpulet_common.refusal import (
    MAX_ERROR_MESSAGE_CHARS,
    MICRO_ERROR_CODE_HEADER,
    MICRO_ERROR_HEADER,
    STATUS,
    Refused,
    bounded,
    status_of,
)
from gpulet_common.remediation import REMEDIATION_PLAN, REMEDIATION_REQUEST
from gpulet_common.settings import Settings
from gpulet_common.settings.allocator import ResourceNames
from robustness.strategies import bases, mutants
from support import reference
from support.agent import runtime_for
from support.allocator_stack import NODE, make_settings
from support.health_kv import gpu_health, health_bucket, put_health
from support.metrics import MetricsProbe

pytestmark = pytest.mark.anyio

CASES: Final = 10_000
# Requests derived from one hypothesis example (see the module docstring).
BATCH: Final = 25
RAW_EXAMPLES: Final = 20
RAW_BATCH: Final = 5

GIB: Final = 1024**3
NAMES: Final = ResourceNames()
GPU, CORE, MEM = NAMES.gpu, NAMES.core, NAMES.memory
RESOURCES: Final = (GPU, CORE, MEM)
KIND: Final = {GPU: "whole", CORE: "core", MEM: "memory"}


def _inventory() -> Inventory:
    base = reference.nvlink_pairs_8()
    gpus = [
        msgspec.structs.replace(g, memory_total_bytes=(80 if g.index % 2 == 0 else 24) * GIB)
        for g in base.gpus
    ]
    return msgspec.structs.replace(base, node=NODE, gpus=gpus, generation=1)


INVENTORY: Final = _inventory()
UUIDS: Final = [g.uuid for g in INVENTORY.gpus]
U0: Final = UUIDS[0]
UNITS: Final = {g.uuid: memory_units(g.memory_total_bytes) for g in INVENTORY.gpus}
LARGEST: Final = max(UNITS.values())
SMALLEST: Final = min(UNITS.values())

WRONG_RESOURCES: Final = (
    "",
    "nvidia.com/GPU",
    "nvidia.com/gpu ",
    "example.com/tpu",
    "gpulet.io/gpu-core/",
    "gpulet.io/gpu-memory\x00",
    "nvidia.com/gpu\r\nX-Injected: 1",
    "gpu.>",
    "\u0440\u0435\u0441\u0443\u0440\u0441",  # Cyrillic
    "r" * 300,
)

HOSTILE_IDS: Final = (
    "",
    " ",
    "::",
    "::core-1",
    f"{U0}::",
    f"{U0}::core-",
    f"{U0}::core--1",
    f"{U0}::core-100",
    f"{U0}::core-150",
    f"{U0}::core-1e3",
    f"{U0}::core-\u00b2",  # isdigit() but not int()
    f"{U0}::core-\u0663",  # Arabic-Indic 3: int() takes it
    f"{U0}::core-99999999999999999999999",
    f"{U0}::mem-{UNITS[U0]}",
    f"{U0}::mem-{10**30}",
    f"{U0}::gpu-1",
    f"{U0}::core-1::core-2",
    f"{U0} ",
    f" {U0}",
    U0.upper(),
    "GPU-unknown",
    "GPU-unknown::core-3",
    "GPU-unknown::mem-3",
    "GPU-\x00",
    "GPU-x\r\nX-Injected: 1",
    "\n",
    "*",
    ">",
    "gpu.>",
    "x" * 300,
    "\u00e9" * 50,
    "\ud7ff",
)

# Codes a hostile request may get; "internal" (a bug), "checkpoint_failed" (the disk)
# and "not_ready" (no inventory) must not happen here.
ALLOWED_CODES: Final = frozenset(STATUS) - {
    "internal",
    "checkpoint_failed",
    "not_ready",
    # The caller's side's, or other services'.
    "unavailable",
    "malformed_reply",
    "inventory_mismatch",
    "unknown_gpu",
}

# What hostile allocate requests (and allocate-batch calls) must all run into.
ALLOCATE_REFUSALS: Final = frozenset(
    {
        "unknown_resource",
        "unknown_device",
        "invalid_request",
        "invalid_core_units",
        "memory_exceeds_card",
        "unhealthy_device",
        "insufficient_capacity",
        "too_many_units",
    }
)

T = TypeVar("T")


# --- ID vocabulary ------------------------------------------------------------------------


def core_ids(uuid_: str, units: Sequence[int]) -> list[str]:
    return [f"{uuid_}::core-{n}" for n in units]


def mem_ids(uuid_: str, units: Sequence[int]) -> list[str]:
    return [f"{uuid_}::mem-{n}" for n in units]


def spread_ids(kind: str, count: int, rng: random.Random) -> list[str]:
    """``count`` distinct IDs of ``kind`` (beyond the node's units they are invalid)."""
    return list(_spread_ids(kind, count, rng.randrange(len(UUIDS))))


@functools.lru_cache(maxsize=256)
def _spread_ids(kind: str, count: int, start: int) -> tuple[str, ...]:
    # Cached: the lists of thousands of IDs would otherwise cost more than handling them.
    if kind == "whole":
        pool = UUIDS[start:] + UUIDS[:start]
        return (*pool[:count], *(f"GPU-extra-{n}" for n in range(count - len(pool))))
    ids: list[str] = []
    for step in range(len(UUIDS)):
        if len(ids) >= count:
            break
        gpu = UUIDS[(start + step) % len(UUIDS)]
        limit = CORES_PER_GPU if kind == "core" else UNITS[gpu]
        take = min(limit, count - len(ids))
        ids += (core_ids if kind == "core" else mem_ids)(gpu, range(take))
    tag = "core" if kind == "core" else "mem"
    ids += [f"{U0}::{tag}-{10_000 + n}" for n in range(count - len(ids))]
    return tuple(ids)


def ids_of(kind: str, count: int, rng: random.Random, gpu: str | None = None) -> list[str]:
    """``count`` IDs of ``kind`` from one GPU where it has that many, else spread."""
    gpu = gpu or rng.choice(UUIDS)
    if kind == "core" and count <= CORES_PER_GPU:
        return core_ids(gpu, rng.sample(range(CORES_PER_GPU), count))
    if kind == "memory" and count <= UNITS[gpu]:
        return mem_ids(gpu, rng.sample(range(UNITS[gpu]), count))
    return spread_ids(kind, count, rng)


# --- the world the mutators see --------------------------------------------------------------


@dataclass
class World:
    """What the mutators may aim at: refreshed from the allocator before each batch."""

    free_whole: list[str] = field(default_factory=list)
    sick: list[str] = field(default_factory=list)
    allocations: list[str] = field(default_factory=list)
    pods: list[str] = field(default_factory=list)
    granted: list[tuple[str, list[str]]] = field(default_factory=list)


# --- allocate ---------------------------------------------------------------------------------


@st.composite
def allocate_bases(draw: st.DrawFn) -> p.AllocateRequest:
    resource = draw(st.sampled_from((*RESOURCES * 8, *WRONG_RESOURCES)))
    kind = KIND.get(resource) or draw(st.sampled_from(("whole", "core", "memory")))
    containers: list[list[str]] = []
    for _ in range(draw(st.integers(1, 3))):
        gpu = draw(st.sampled_from(UUIDS))
        rng = random.Random(draw(st.integers(0, 2**16)))
        if kind == "whole":
            count = draw(st.integers(0, 4))
        elif kind == "core":
            count = draw(st.sampled_from((0, 1, 5, 10, 30, 50, 99, 100, 150, 200)))
        else:
            count = draw(st.sampled_from((0, 1, 4, 16, SMALLEST, SMALLEST + 1, LARGEST + 1)))
        containers.append(ids_of(kind, count, rng, gpu))
    return p.AllocateRequest(resource=resource, containers=containers)


Containers = list[list[str]]
AllocateOp = Callable[[random.Random, str, Containers, World], tuple[str, Containers]]


def _pick(rng: random.Random, containers: Containers) -> list[str]:
    if not containers:
        containers.append([])
    return rng.choice(containers)


def _op_resource(rng: random.Random, r: str, cs: Containers, w: World) -> tuple[str, Containers]:
    return rng.choice(RESOURCES if rng.random() < 0.5 else WRONG_RESOURCES), cs


def _op_hostile_id(rng: random.Random, r: str, cs: Containers, w: World) -> tuple[str, Containers]:
    ids = _pick(rng, cs)
    bad = rng.choice(HOSTILE_IDS)
    if ids:
        ids[rng.randrange(len(ids))] = bad
    else:
        ids.append(bad)
    return r, cs


def _op_mix(rng: random.Random, r: str, cs: Containers, w: World) -> tuple[str, Containers]:
    _pick(rng, cs).extend(rng.sample(HOSTILE_IDS, rng.randint(1, 3)))
    return r, cs


def _op_dup_id(rng: random.Random, r: str, cs: Containers, w: World) -> tuple[str, Containers]:
    ids = _pick(rng, cs)
    if ids:
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(ids))
    return r, cs


def _op_dup_container(
    rng: random.Random, r: str, cs: Containers, w: World
) -> tuple[str, Containers]:
    if cs:
        cs.append(list(rng.choice(cs)))
    return r, cs


def _op_empty(rng: random.Random, r: str, cs: Containers, w: World) -> tuple[str, Containers]:
    if rng.random() < 0.3:
        return r, []
    cs.insert(rng.randrange(len(cs) + 1), [])
    return r, cs


def _op_cross_kind(rng: random.Random, r: str, cs: Containers, w: World) -> tuple[str, Containers]:
    kind = rng.choice(("whole", "core", "memory"))
    ids = _pick(rng, cs)
    ids[:] = ids_of(kind, rng.randint(1, 4), rng)
    return r, cs


def _op_units(rng: random.Random, r: str, cs: Containers, w: World) -> tuple[str, Containers]:
    kind = KIND.get(r, "core")
    if kind == "whole":
        count = rng.choice((8, 9, 12))
    elif kind == "core":
        count = rng.choice((99, 100, 101, 150, 199, 200, 250, 300, 800, 801))
    else:
        gpu = rng.choice(UUIDS)
        count = rng.choice((UNITS[gpu], UNITS[gpu] + 1, SMALLEST + 1, LARGEST, LARGEST + 1))
    ids = _pick(rng, cs)
    ids[:] = ids_of(kind, count, rng)
    return r, cs


def _op_huge(rng: random.Random, r: str, cs: Containers, w: World) -> tuple[str, Containers]:
    kind = KIND.get(r, "memory")
    ids = spread_ids(kind, rng.choice((2_000, 20_000)), rng)
    if rng.random() < 0.5:
        ids.append(ids[rng.randrange(len(ids))])  # one duplicate at the end
    return r, [ids]


def _op_sick(rng: random.Random, r: str, cs: Containers, w: World) -> tuple[str, Containers]:
    if not w.sick:
        return r, cs
    gpu = rng.choice(w.sick)
    kind = KIND.get(r, "whole")
    _pick(rng, cs)[:] = (
        [gpu] if kind == "whole" else ids_of(kind, rng.choice((1, 10, 50)), rng, gpu)
    )
    return r, cs


def _op_fresh(rng: random.Random, r: str, cs: Containers, w: World) -> tuple[str, Containers]:
    """A request that fits what is free now: keeps allocations happening."""
    resource = rng.choice(RESOURCES)
    kind = KIND[resource]
    if kind == "whole":
        if not w.free_whole:
            return resource, cs
        ids = rng.sample(w.free_whole, rng.randint(1, min(2, len(w.free_whole))))
    elif kind == "core":
        ids = ids_of("core", rng.choice((1, 10, 25, 40, 100)), rng)
    else:
        ids = ids_of("memory", rng.choice((1, 8, 20)), rng)
    return resource, [ids]


def _op_replay(rng: random.Random, r: str, cs: Containers, w: World) -> tuple[str, Containers]:
    """A retry of an answered container, maybe reordered (same grant)."""
    if not w.granted:
        return r, cs
    resource, ids = rng.choice(w.granted)
    shuffled = list(ids)
    rng.shuffle(shuffled)
    return resource, [shuffled]


def _op_shuffle(rng: random.Random, r: str, cs: Containers, w: World) -> tuple[str, Containers]:
    rng.shuffle(cs)
    for ids in cs:
        rng.shuffle(ids)
    return r, cs


# (op, weight): the huge lists are rare, they cost milliseconds each.
ALLOCATE_OPS: Final[list[tuple[AllocateOp, int]]] = [
    (_op_resource, 6),
    (_op_hostile_id, 10),
    (_op_mix, 6),
    (_op_dup_id, 6),
    (_op_dup_container, 4),
    (_op_empty, 4),
    (_op_cross_kind, 5),
    (_op_units, 8),
    (_op_huge, 1),
    (_op_sick, 5),
    (_op_fresh, 12),
    (_op_replay, 6),
    (_op_shuffle, 3),
]


def allocate_variants(
    base: p.AllocateRequest, seed: int, count: int, world: World
) -> list[p.AllocateRequest]:
    rng = random.Random(seed)
    ops, weights = zip(*ALLOCATE_OPS, strict=True)
    out = [base]
    while len(out) < count:
        start = rng.choice(out) if rng.random() < 0.5 else base
        resource, containers = start.resource, [list(ids) for ids in start.containers]
        for op in rng.choices(ops, weights, k=rng.randint(1, 2)):
            resource, containers = op(rng, resource, containers, world)
        out.append(p.AllocateRequest(resource=resource, containers=containers))
    return out


# --- allocate-batch ---------------------------------------------------------------------------

Calls = list[p.AllocateRequest]
# Each example's batches draw their calls from this many of its allocate variants.
BATCH_POOL: Final = 40
# Containers per call of a batch whose answer cannot fit one NATS message (1 MiB):
# 64 calls x 85 containers x ~250 bytes per answered container (and a request, of
# distinct memory IDs, that stays under the 1 MiB a request may take).
TOO_LARGE_CONTAINERS: Final = 85


@dataclass(frozen=True)
class CallPool:
    """One example's allocate variants, as calls for its batches.

    Every ID of every call is parsed (twice: the twin decides the calls again), so the
    calls of thousands of IDs come in about as often as in the allocate test.
    """

    every: Calls
    #: Without the calls of thousands of IDs.
    usual: Calls
    #: A few IDs each: for batches that carry dozens of calls.
    small: Calls

    @classmethod
    def of(cls, calls: Calls) -> CallPool:
        def upto(n: int) -> Calls:
            return [c for c in calls if sum(map(len, c.containers)) <= n] or [
                p.AllocateRequest(resource=GPU, containers=[[]])
            ]

        return cls(every=calls, usual=upto(400), small=upto(64))


BatchOp = Callable[[random.Random, CallPool, World], Calls]


def _fresh_call(rng: random.Random, w: World) -> p.AllocateRequest:
    """A call that fits what is free now (see :func:`_op_fresh`)."""
    resource, containers = _op_fresh(rng, GPU, [], w)
    if not containers:
        resource, containers = CORE, [ids_of("core", rng.choice((1, 10, 25)), rng)]
    return p.AllocateRequest(resource=resource, containers=containers)


def _reordered(rng: random.Random, call: p.AllocateRequest) -> p.AllocateRequest:
    """The same call with its containers and IDs in another order: the same grants."""
    containers = [rng.sample(ids, len(ids)) for ids in call.containers]
    rng.shuffle(containers)
    return p.AllocateRequest(resource=call.resource, containers=containers)


def _b_mixed(rng: random.Random, pool: CallPool, w: World) -> Calls:
    """Hostile calls with valid ones in between."""
    calls = rng.choices(pool.usual, k=rng.randint(1, 4))
    if rng.random() < 0.6:
        calls.insert(rng.randrange(len(calls) + 1), _fresh_call(rng, w))
    return calls


def _b_single(rng: random.Random, pool: CallPool, w: World) -> Calls:
    return [rng.choice(pool.every)]


def _b_dup(rng: random.Random, pool: CallPool, w: World) -> Calls:
    """One call several times (kubelet retrying within a batch), maybe reordered."""
    call = rng.choice(pool.usual) if rng.random() < 0.5 else _fresh_call(rng, w)
    calls = rng.choices(pool.small, k=rng.randint(0, 2))
    for _ in range(rng.randint(2, 3)):
        again = call if rng.random() < 0.5 else _reordered(rng, call)
        calls.insert(rng.randrange(len(calls) + 1), again)
    return calls


def _b_pairs(rng: random.Random, pool: CallPool, w: World) -> Calls:
    """The core and memory calls of share containers, adjacent, as kubelet makes them."""
    calls: Calls = []
    for _ in range(rng.randint(1, 2)):
        cores = ids_of("core", rng.choice((1, 10, 25, 50, 99, 100)), rng)
        memory = ids_of("memory", rng.choice((1, 4, 16, 40, SMALLEST + 1)), rng)
        pair = [
            p.AllocateRequest(resource=CORE, containers=[cores]),
            p.AllocateRequest(resource=MEM, containers=[memory]),
        ]
        if rng.random() < 0.5:
            pair.reverse()
        if rng.random() < 0.2:
            pair.insert(1, rng.choice(pool.small))  # something between the halves
        calls += pair
    if rng.random() < 0.2:
        calls += calls  # all of it again: retries
    return calls


def _b_wrong_resource(rng: random.Random, pool: CallPool, w: World) -> Calls:
    calls = rng.choices(pool.usual, k=rng.randint(1, 4))
    return [
        msgspec.structs.replace(c, resource=rng.choice(WRONG_RESOURCES))
        if rng.random() < 0.7
        else c
        for c in calls
    ]


def _b_many_containers(rng: random.Random, pool: CallPool, w: World) -> Calls:
    """A call of hundreds of containers, or of thousands of IDs in one."""
    roll = rng.random()
    if roll < 0.4:
        gpu = rng.choice(w.free_whole or UUIDS)
        big = p.AllocateRequest(resource=GPU, containers=[[gpu]] * rng.choice((50, 300)))
    elif roll < 0.7:
        resource = rng.choice(RESOURCES)
        big = p.AllocateRequest(
            resource=resource, containers=[spread_ids(KIND[resource], 2_000, rng)]
        )
    else:
        hostile = [[rng.choice(HOSTILE_IDS)] for _ in range(rng.choice((100, 1_000)))]
        big = p.AllocateRequest(resource=rng.choice(RESOURCES), containers=hostile)
    calls = rng.choices(pool.small, k=rng.randint(0, 2))
    calls.insert(rng.randrange(len(calls) + 1), big)
    return calls


def _b_replay(rng: random.Random, pool: CallPool, w: World) -> Calls:
    """Retries of containers answered before, alone or together in one call."""
    if not w.granted:
        return _b_mixed(rng, pool, w)
    picks = rng.sample(w.granted, min(len(w.granted), rng.randint(1, 3)))
    calls = [p.AllocateRequest(resource=r, containers=[list(ids)]) for r, ids in picks]
    resource = picks[0][0]
    together = [list(ids) for r, ids in picks if r == resource]
    if len(together) > 1:
        calls.append(p.AllocateRequest(resource=resource, containers=together))
    calls += rng.choices(pool.small, k=rng.randint(0, 1))
    rng.shuffle(calls)
    return calls


def _b_count(rng: random.Random, pool: CallPool, w: World) -> Calls:
    """No call, the most allowed, one too many, far too many."""
    n = rng.choice((0, p.MAX_BATCH_CALLS, p.MAX_BATCH_CALLS + 1, 1_000))
    return rng.choices(pool.small, k=n)


def _b_too_large(rng: random.Random, pool: CallPool, w: World) -> Calls:
    """64 calls whose answer would pass NATS's max_payload: refused whole, undone."""
    # One-unit memory shares (IDs of an 80 GiB card), a distinct ID per container: a
    # device named in two containers of one call is refused (issue 23). The same call
    # 64 times: the first places them, the rest are kubelet's retries.
    card = rng.choice(UUIDS[::2])
    containers = [mem_ids(card, [n]) for n in range(TOO_LARGE_CONTAINERS)]
    call = p.AllocateRequest(resource=MEM, containers=containers)
    calls = [call] * p.MAX_BATCH_CALLS
    calls[rng.randrange(len(calls))] = rng.choice(pool.small)
    return calls


# (op, weight): about 20 too-large batches per run, they cost tens of milliseconds each.
BATCH_OPS: Final[list[tuple[BatchOp, float]]] = [
    (_b_mixed, 10),
    (_b_single, 4),
    (_b_dup, 5),
    (_b_pairs, 5),
    (_b_wrong_resource, 2),
    (_b_many_containers, 0.5),
    (_b_replay, 3),
    (_b_count, 1),
    (_b_too_large, 0.07),
]


def allocate_batch_variants(
    base: p.AllocateRequest, seed: int, count: int, world: World
) -> list[p.AllocateBatchRequest]:
    """``count`` batches of calls derived from ``base`` (see :func:`allocate_variants`)."""
    rng = random.Random(seed)
    pool = CallPool.of(allocate_variants(base, seed, BATCH_POOL, world))
    ops, weights = zip(*BATCH_OPS, strict=True)
    out = [p.AllocateBatchRequest(calls=[base])]
    while len(out) < count:
        op = rng.choices(ops, weights)[0]
        out.append(p.AllocateBatchRequest(calls=op(rng, pool, world)))
    return out


# --- preferred --------------------------------------------------------------------------------


@st.composite
def preferred_bases(draw: st.DrawFn) -> p.PreferredAllocationRequest:
    resource = draw(st.sampled_from((*[GPU] * 10, CORE, CORE, MEM, MEM, *WRONG_RESOURCES[:4])))
    kind = KIND.get(resource, "whole")
    containers: list[PreferredRequest] = []
    for _ in range(draw(st.integers(1, 3))):
        rng = random.Random(draw(st.integers(0, 2**16)))
        available = ids_of(kind, draw(st.integers(0, 8)), rng)
        must = (
            draw(st.lists(st.sampled_from(available), max_size=3, unique=True)) if available else []
        )
        size = draw(st.integers(-2, 10))
        containers.append(PreferredRequest(available=available, must_include=must, size=size))
    return p.PreferredAllocationRequest(resource=resource, containers=containers)


UNKNOWN_GPUS: Final = tuple(f"GPU-nope-{n}" for n in range(10_000))
PreferredOp = Callable[[random.Random, PreferredRequest, World], PreferredRequest]


def _p_size(rng: random.Random, r: PreferredRequest, w: World) -> PreferredRequest:
    n = len(set(r.available))
    size = rng.choice((0, -1, -(2**63), 2**63 - 1, n, n + 1, n - 1, 1, len(r.must_include) - 1))
    return msgspec.structs.replace(r, size=size)


def _p_hostile(rng: random.Random, r: PreferredRequest, w: World) -> PreferredRequest:
    extra = rng.sample(HOSTILE_IDS, rng.randint(1, 4))
    return msgspec.structs.replace(r, available=[*r.available, *extra])


def _p_dup(rng: random.Random, r: PreferredRequest, w: World) -> PreferredRequest:
    if not r.available:
        return r
    return msgspec.structs.replace(r, available=[*r.available, *rng.choices(r.available, k=3)])


def _p_must_not_offered(rng: random.Random, r: PreferredRequest, w: World) -> PreferredRequest:
    outside = [u for u in UUIDS if u not in r.available] or UUIDS
    return msgspec.structs.replace(r, must_include=[*r.must_include, rng.choice(outside)])


def _p_must_unknown(rng: random.Random, r: PreferredRequest, w: World) -> PreferredRequest:
    bad = rng.choice(HOSTILE_IDS)
    if rng.random() < 0.5:
        return msgspec.structs.replace(r, must_include=[bad], available=[*r.available, bad])
    return msgspec.structs.replace(r, must_include=[*r.must_include, bad])


def _p_must_over_size(rng: random.Random, r: PreferredRequest, w: World) -> PreferredRequest:
    must = list(dict.fromkeys(r.available))[: max(2, len(r.available))]
    return msgspec.structs.replace(r, must_include=must, size=max(1, len(must) - 1))


def _p_huge(rng: random.Random, r: PreferredRequest, w: World) -> PreferredRequest:
    available = [*UUIDS, *UNKNOWN_GPUS[: rng.choice((1_000, 10_000))]]
    rng.shuffle(available)
    return msgspec.structs.replace(r, available=available, size=rng.choice((2, 8, 9)))


def _p_empty(rng: random.Random, r: PreferredRequest, w: World) -> PreferredRequest:
    return msgspec.structs.replace(r, available=[], must_include=[])


def _p_sick(rng: random.Random, r: PreferredRequest, w: World) -> PreferredRequest:
    if not w.sick:
        return r
    return msgspec.structs.replace(r, available=[*r.available, *w.sick])


def _p_valid(rng: random.Random, r: PreferredRequest, w: World) -> PreferredRequest:
    available = rng.sample(UUIDS, rng.randint(1, len(UUIDS)))
    must = available[: rng.randint(0, min(2, len(available)))]
    size = rng.randint(max(1, len(must)), len(available))
    return PreferredRequest(available=available, must_include=must, size=size)


PREFERRED_OPS: Final[list[tuple[PreferredOp, int]]] = [
    (_p_size, 8),
    (_p_hostile, 6),
    (_p_dup, 4),
    (_p_must_not_offered, 5),
    (_p_must_unknown, 5),
    (_p_must_over_size, 4),
    (_p_huge, 1),
    (_p_empty, 3),
    (_p_sick, 4),
    (_p_valid, 10),
]


def preferred_variants(
    base: p.PreferredAllocationRequest, seed: int, count: int, world: World
) -> list[p.PreferredAllocationRequest]:
    rng = random.Random(seed)
    ops, weights = zip(*PREFERRED_OPS, strict=True)
    out = [base]
    while len(out) < count:
        start = rng.choice(out) if rng.random() < 0.5 else base
        resource, containers = start.resource, list(start.containers)
        roll = rng.random()
        if roll < 0.05:
            resource = rng.choice((*RESOURCES, *WRONG_RESOURCES))
        elif roll < 0.12:
            containers = []
        elif roll < 0.15 and containers:
            containers = containers * rng.choice((2, 40))
        if not containers and rng.random() < 0.7:
            containers = [PreferredRequest(available=[], size=1)]
        for _ in range(rng.randint(1, 2)):
            if containers:
                i = rng.randrange(len(containers))
                op = rng.choices(ops, weights)[0]
                containers[i] = op(rng, containers[i], world)
        out.append(p.PreferredAllocationRequest(resource=resource, containers=containers))
    return out


# --- release ----------------------------------------------------------------------------------


@st.composite
def release_bases(draw: st.DrawFn) -> p.ReleaseRequest:
    hostile = st.sampled_from(HOSTILE_IDS)
    resource = draw(st.sampled_from((*RESOURCES * 4, "", *WRONG_RESOURCES[:3])))
    rng = random.Random(draw(st.integers(0, 2**16)))
    device_ids = (
        ids_of(KIND.get(resource, "whole"), draw(st.integers(0, 3)), rng)
        if resource in RESOURCES and draw(st.booleans())
        else []
    )
    return p.ReleaseRequest(
        allocation_ids=draw(st.lists(hostile, max_size=3)),
        pods=draw(st.lists(st.sampled_from(("default/x", "", "a/b/c", *HOSTILE_IDS)), max_size=2)),
        resource=resource,
        device_ids=device_ids,
        reason=draw(st.sampled_from(("explicit", "", "r" * 2000, "line\r\nbreak"))),
    )


UNKNOWN_ALLOCATIONS: Final = tuple(f"whole-{i:020x}" for i in range(10_000))
ReleaseOp = Callable[[random.Random, p.ReleaseRequest, World], p.ReleaseRequest]


def _r_known(rng: random.Random, r: p.ReleaseRequest, w: World) -> p.ReleaseRequest:
    if not w.allocations:
        return r
    return msgspec.structs.replace(r, allocation_ids=[*r.allocation_ids, rng.choice(w.allocations)])


def _r_known_only(rng: random.Random, r: p.ReleaseRequest, w: World) -> p.ReleaseRequest:
    picked = rng.sample(w.allocations, min(len(w.allocations), rng.randint(1, 2)))
    return p.ReleaseRequest(allocation_ids=picked)


def _r_devices(rng: random.Random, r: p.ReleaseRequest, w: World) -> p.ReleaseRequest:
    """A granted container named by its device IDs, maybe under the wrong resource."""
    if not w.granted:
        return r
    resource, ids = rng.choice(w.granted)
    if rng.random() < 0.1:
        resource = rng.choice((*RESOURCES, "", *WRONG_RESOURCES))
    return msgspec.structs.replace(r, resource=resource, device_ids=list(reversed(ids)))


def _r_pods(rng: random.Random, r: p.ReleaseRequest, w: World) -> p.ReleaseRequest:
    pods = [*(w.pods[:1]), "default/unknown", "", "ns/" + "p" * 300]
    return msgspec.structs.replace(r, pods=rng.sample(pods, rng.randint(1, len(pods))))


def _r_unknown(rng: random.Random, r: p.ReleaseRequest, w: World) -> p.ReleaseRequest:
    ids = [f"whole-{rng.getrandbits(80):020x}", f"core-{rng.getrandbits(80):020x}"]
    return msgspec.structs.replace(r, allocation_ids=[*r.allocation_ids, *ids])


def _r_nothing(rng: random.Random, r: p.ReleaseRequest, w: World) -> p.ReleaseRequest:
    return p.ReleaseRequest(resource=rng.choice(("", GPU)), reason=rng.choice(("", "x")))


def _r_dups(rng: random.Random, r: p.ReleaseRequest, w: World) -> p.ReleaseRequest:
    return msgspec.structs.replace(
        r,
        allocation_ids=r.allocation_ids * 3,
        device_ids=[*r.device_ids, *r.device_ids[:1]],
    )


def _r_huge(rng: random.Random, r: p.ReleaseRequest, w: World) -> p.ReleaseRequest:
    n = rng.choice((1_000, 10_000))
    if rng.random() < 0.5:
        return msgspec.structs.replace(r, allocation_ids=list(UNKNOWN_ALLOCATIONS[:n]))
    return msgspec.structs.replace(r, resource=MEM, device_ids=spread_ids("memory", n, rng))


def _r_wrong_resource(rng: random.Random, r: p.ReleaseRequest, w: World) -> p.ReleaseRequest:
    ids = r.device_ids or [rng.choice(UUIDS)]
    return msgspec.structs.replace(r, resource=rng.choice(WRONG_RESOURCES), device_ids=ids)


RELEASE_OPS: Final[list[tuple[ReleaseOp, int]]] = [
    (_r_known, 5),
    (_r_known_only, 3),
    (_r_devices, 6),
    (_r_pods, 4),
    (_r_unknown, 6),
    (_r_nothing, 3),
    (_r_dups, 3),
    (_r_huge, 1),
    (_r_wrong_resource, 2),
]


def release_variants(
    base: p.ReleaseRequest, seed: int, count: int, world: World
) -> list[p.ReleaseRequest]:
    rng = random.Random(seed)
    ops, weights = zip(*RELEASE_OPS, strict=True)
    out = [base]
    while len(out) < count:
        request = rng.choice(out) if rng.random() < 0.5 else base
        for op in rng.choices(ops, weights, k=rng.randint(1, 2)):
            request = op(rng, request, world)
        out.append(request)
    return out


# --- state ------------------------------------------------------------------------------------


def state_variants(base: bytes, seed: int, count: int, world: World) -> list[bytes]:
    """State requests carry nothing but a version: hostile ones are odd bytes."""
    rng = random.Random(seed)
    odd = [
        b"",
        b"{}",
        b'{"schema_version": 9223372036854775807}',
        b'{"schema_version": -1, "gpu": "x"}',
        b'{"unknown": ' + b"[" * 50 + b"]" * 50 + b"}",
        b'{"schema_version": 1, "pad": "' + b"x" * 100_000 + b'"}',
    ]
    out = mutants(base, seed, count - 2)
    out += rng.sample(odd, 2)
    return out


# --- the running allocator ------------------------------------------------------------------


class CapturedRequest(Request):
    """What nats.micro hands a handler, with the answer kept instead of published."""

    def __init__(self, subject: str, data: bytes) -> None:
        msg = Msg(_client=None, subject=subject, reply="_INBOX.fuzz", data=data)  # type: ignore[arg-type]
        super().__init__(msg)
        self.answers: list[tuple[bytes, dict[str, str]]] = []

    async def respond(self, data: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.answers.append((data, dict(headers or {})))


REPLY_CODECS: Final[dict[str, Codec[Any]]] = {
    p.ENDPOINT_ALLOCATE: p.ALLOCATE_REPLY,
    p.ENDPOINT_ALLOCATE_BATCH: p.ALLOCATE_BATCH_REPLY,
    p.ENDPOINT_PREFERRED: p.PREFERRED_REPLY,
    p.ENDPOINT_RELEASE: p.RELEASE_REPLY,
    p.ENDPOINT_STATE: p.STATE_REPLY,
    p.ENDPOINT_RESET: p.RESET_REPLY,
    p.ENDPOINT_WITHHELD: p.WITHHELD_REPLY,
    p.ENDPOINT_RESERVE_CLAIM: p.RESERVE_CLAIM_REPLY,
    p.ENDPOINT_RELEASE_CLAIM: p.RELEASE_CLAIM_REPLY,
    p.ENDPOINT_HELD: codec.HELD_REPLY,
    p.ENDPOINT_PODS: codec.PODS_REPLY,
    p.ENDPOINT_REMEDIATION: REMEDIATION_PLAN,
}
REQUEST_CODECS: Final[dict[str, Codec[Any]]] = {
    p.ENDPOINT_ALLOCATE: p.ALLOCATE_REQUEST,
    p.ENDPOINT_ALLOCATE_BATCH: p.ALLOCATE_BATCH_REQUEST,
    p.ENDPOINT_PREFERRED: p.PREFERRED_REQUEST,
    p.ENDPOINT_RELEASE: p.RELEASE_REQUEST,
    p.ENDPOINT_STATE: p.STATE_REQUEST,
    p.ENDPOINT_RESET: p.RESET_REQUEST,
    p.ENDPOINT_WITHHELD: p.WITHHELD_REQUEST,
    p.ENDPOINT_RESERVE_CLAIM: p.RESERVE_CLAIM_REQUEST,
    p.ENDPOINT_RELEASE_CLAIM: p.RELEASE_CLAIM_REQUEST,
    p.ENDPOINT_HELD: codec.HELD_REQUEST,
    p.ENDPOINT_PODS: codec.HELD_REQUEST,
    p.ENDPOINT_REMEDIATION: REMEDIATION_REQUEST,
}


def _schedulable(core: AllocatorCore) -> frozenset[str]:
    return frozenset(d.uuid for d in core.ledger.devices() if d.schedulable)


def _footprint(core: AllocatorCore) -> dict[str, tuple[tuple[str, ...], int, int]]:
    """Each allocation's GPUs and size, to tell which ones a batch made or grew."""
    out: dict[str, tuple[tuple[str, ...], int, int]] = {}
    for alloc in core.ledger.allocations():
        if isinstance(alloc, WholeAllocation):
            out[alloc.owner.allocation_id] = (alloc.devices, CORES_PER_GPU * len(alloc.devices), 0)
        else:
            out[alloc.owner.allocation_id] = ((alloc.device,), alloc.cores, alloc.memory_units)
    return out


class Fuzz:
    """The running allocator plus what the test has sent it and what it answered."""

    def __init__(
        self, service: AllocatorService, world_bus: Bus, probe: MetricsProbe, checkpoint: Path
    ) -> None:
        self.service = service
        self.bus = world_bus
        self.probe = probe
        self.checkpoint = checkpoint
        self.handlers: dict[str, Callable[[Request], Awaitable[None]]] = {
            p.ENDPOINT_ALLOCATE: service._on_allocate,
            p.ENDPOINT_ALLOCATE_BATCH: service._on_allocate_batch,
            p.ENDPOINT_PREFERRED: service._on_preferred,
            p.ENDPOINT_RELEASE: service._on_release,
            p.ENDPOINT_STATE: service._on_state,
            p.ENDPOINT_RESET: service._on_reset,
            p.ENDPOINT_WITHHELD: service._on_withheld,
            p.ENDPOINT_RESERVE_CLAIM: service.claims.on_reserve,
            p.ENDPOINT_RELEASE_CLAIM: service.claims.on_release,
            p.ENDPOINT_HELD: self._on_held,
            p.ENDPOINT_PODS: self._on_pods,
            p.ENDPOINT_REMEDIATION: lambda req: service.remediation.on_request(
                req, service._replies
            ),
        }
        #: Outcome ("ok" or the refusal's code) of every answer, by endpoint.
        self.tally: dict[str, Counter[str]] = {e: Counter() for e in p.ENDPOINTS}
        self.world = World()
        self.granted: list[tuple[str, list[str]]] = []
        self.lost: str | None = None
        self.generation = INVENTORY.generation
        self.batches = 0
        #: Allocations that release answers named as released.
        self.released = 0
        #: Hostile requests sent by ``batch`` (the tallies also count housekeeping).
        self.cases: Counter[str] = Counter()
        #: Outcome ("ok" or the code) of every call inside an answered allocate-batch;
        #: the service counts the refused ones with the endpoint's refusals.
        self.batch_calls: Counter[str] = Counter()
        #: Batches of 1 to 64 calls refused whole (their answer was too large).
        self.too_large = 0
        #: A copy of the core taken before a batch of allocate-batch requests, which
        #: decides their calls one at a time, as lone allocates; what the two disagree on.
        self.twin: AllocatorCore | None = None
        self.divergences: list[str] = []
        #: Batches compared with the twin, and skipped (a join window closing meanwhile).
        self.twin_checked = 0
        self.twin_skipped = 0

    async def _on_held(self, req: Request) -> None:
        assert self.service._tg is not None
        await self.service.held.on_request(req, self.service._tg)

    async def _on_pods(self, req: Request) -> None:
        assert self.service._tg is not None
        await self.service.pods.on_request(req, self.service._tg)

    @property
    def core(self) -> AllocatorCore:
        return self.service.core

    # --- sending ------------------------------------------------------------------------

    async def handle(self, endpoint: str, payloads: Sequence[bytes]) -> list[CapturedRequest]:
        """Hand each payload to the endpoint's handler, in order, and wait for answers."""
        subject = subjects.allocator_endpoint(NODE, endpoint)
        handler = self.handlers[endpoint]
        requests = [CapturedRequest(subject, data) for data in payloads]
        for request in requests:
            await handler(request)
        # Allocate and release answer once the checkpoint has the change (group commit).
        # Polled: the answers leave from tasks of the service, with no event to wait on.
        deadline = anyio.current_time() + 10
        while anyio.current_time() < deadline:
            if all(r.answers for r in requests):
                return requests
            await anyio.sleep(0.001)
        raise AssertionError(f"{endpoint}: requests left unanswered")

    async def call(self, endpoint: str, values: Sequence[Any]) -> None:
        """Send well-formed requests of ``endpoint`` and judge every answer."""
        request_codec = REQUEST_CODECS[endpoint]
        payloads = [request_codec.encode(v) for v in values]
        for value, request in zip(values, await self.handle(endpoint, payloads), strict=True):
            self.judge(endpoint, request, value)

    def judge(self, endpoint: str, request: CapturedRequest, value: Any) -> str:
        """Check one answer; record and return its outcome."""
        assert len(request.answers) == 1, f"{endpoint}: {len(request.answers)} answers"
        data, headers = request.answers[0]
        # Handed to the handler directly, nothing else would notice an answer that
        # NATS cannot carry.
        assert len(data) <= self.bus.client.max_payload, f"{endpoint}: {len(data)} bytes"
        return self.record(endpoint, data, headers, value)

    def record(self, endpoint: str, data: bytes, headers: dict[str, str], value: Any) -> str:
        """Judge one answer (``value``: the request, None for raw bytes); tally it."""
        outcome, reply = judge_answer(endpoint, data, headers, value)
        self.tally[endpoint][outcome] += 1
        if isinstance(value, p.AllocateBatchRequest):
            if outcome != "ok" and 0 < len(value.calls) <= p.MAX_BATCH_CALLS:
                self.too_large += 1
            self._replay(value, reply)
        if outcome != "ok":
            return outcome
        if endpoint == p.ENDPOINT_RELEASE:
            self.released += len(reply.released)
        elif endpoint == p.ENDPOINT_ALLOCATE and value is not None:
            self._remember(value)
        elif endpoint == p.ENDPOINT_ALLOCATE_BATCH:
            for n, answer in enumerate(reply.outcomes):
                self.batch_calls[answer.error.code if answer.error else "ok"] += 1
                if answer.error is None and value is not None:
                    self._remember(value.calls[n])
        return outcome

    def _remember(self, call: p.AllocateRequest) -> None:
        """Keep a granted call's containers for retries and releases by device IDs."""
        self.granted += [(call.resource, list(ids)) for ids in call.containers]
        del self.granted[:-200]

    # --- allocate-batch against lone allocates ------------------------------------------

    def _replay(self, value: p.AllocateBatchRequest, reply: Any) -> None:
        """Decide ``value``'s calls on the twin as lone allocates; note what differs.

        ``reply`` is the service's answer: an AllocateBatchReply, or the ErrorReply of a
        batch refused whole, whose decisions must then have been undone.
        """
        twin = self.twin
        if twin is None or not 0 < len(value.calls) <= p.MAX_BATCH_CALLS:
            return
        alone: list[list[ContainerAllocation] | Refused] = []
        undos: list[Undo] = []
        for call in value.calls:
            try:
                answers, undo = twin.allocate(call.resource, call.containers)
            except Refused as exc:
                alone.append(exc)
                continue
            alone.append(answers)
            undos.append(undo)
        if not isinstance(reply, p.AllocateBatchReply):
            for undo in reversed(undos):
                undo()
            return
        for n, (got, want) in enumerate(zip(reply.outcomes, alone, strict=True)):
            if isinstance(want, Refused):
                same = got.error is not None and (got.error.code, got.error.message) == (
                    want.code,
                    bounded(want.message),
                )
            else:
                same = got.error is None and got.containers == want
            if not same:
                self.divergences.append(
                    f"call {n} of {len(value.calls)}, {value.calls[n]!r:.300}: in the batch "
                    f"{got!r:.300}, alone {want!r:.300}"
                )

    def start_twin(self) -> None:
        # The twin shares the health source (the service's NodeView), not a copy of it.
        health_of = self.core.books.health_of
        self.twin = copy.deepcopy(self.core, {id(health_of): health_of})
        self.divergences = []

    def finish_twin(self, started: float, open_half: tuple[float, ...]) -> None:
        """The batch's calls, decided alone, got the same answers and left the same state.

        Both cores read the monotonic clock, the twin a little later: skipped when a
        share's join window (opened before the batch, or during it) closed in between.
        """
        twin, self.twin = self.twin, None
        assert twin is not None
        ended = time.monotonic()
        window = self.core.joiner.window_s
        if any(started <= at + window <= ended for at in open_half) or ended - started > window:
            self.twin_skipped += 1
            return
        assert not self.divergences, "\n".join(self.divergences[:5])
        assert _decided(twin) == _decided(self.core), "a batch left another state than alone"
        self.twin_checked += 1

    # --- between batches ----------------------------------------------------------------

    async def churn(self, rng: random.Random) -> None:
        """Turn a GPU unhealthy or healthy, lose or find one, free some capacity."""
        roll = rng.random()
        unhealthy = [d.uuid for d in self.core.ledger.devices() if not d.healthy]
        if roll < 0.15 and len(unhealthy) < 3:
            await self.set_health(rng.choice([u for u in UUIDS if u not in unhealthy]), False)
        elif roll < 0.3 and unhealthy:
            await self.set_health(rng.choice(unhealthy), True)
        elif roll < 0.34:
            await self.toggle_lost(rng.choice(UUIDS))
        held = self.core.ledger.allocations()
        if len(held) > 10 or len(self.core.ledger.free_whole()) < 2:
            ids = [a.owner.allocation_id for a in held]
            release = p.ReleaseRequest(allocation_ids=rng.sample(ids, len(ids) // 2 + 1))
            await self.call(p.ENDPOINT_RELEASE, [release])

    async def populate(self, rng: random.Random) -> None:
        """A few valid allocations, so that releases and views have something to hit."""
        for _ in range(rng.randint(1, 3)):
            resource, containers = _op_fresh(rng, GPU, [], self.world)
            if containers:
                request = p.AllocateRequest(resource=resource, containers=containers)
                await self.call(p.ENDPOINT_ALLOCATE, [request])
            self.refresh()

    async def set_health(self, gpu: str, healthy: bool) -> None:
        await put_health(self.bus, NODE, gpu_health(gpu, healthy=healthy))
        await self._until(lambda: self.core.ledger.device(gpu).healthy == healthy)

    async def toggle_lost(self, gpu: str) -> None:
        """Publish the inventory without ``gpu`` (lost), or complete again."""
        self.generation += 1
        if self.lost is None:
            self.lost = gpu
            gpus = [g for g in INVENTORY.gpus if g.uuid != gpu]
        else:
            self.lost = None
            gpus = list(INVENTORY.gpus)
        inventory = msgspec.structs.replace(
            INVENTORY, gpus=gpus, generation=self.generation, published_at=time.time()
        )
        await self.bus.publish(subjects.inventory(NODE), inventory, codec.INVENTORY)
        await self._until(lambda: self.core.inventory_generation == self.generation)

    async def _until(self, done: Callable[[], bool]) -> None:
        await self.bus.flush()
        deadline = anyio.current_time() + 5
        while anyio.current_time() < deadline:
            if done():
                return
            await anyio.sleep(0.001)
        raise AssertionError("the allocator did not take in what was published")

    def refresh(self) -> None:
        ledger = self.core.ledger
        self.world = World(
            free_whole=[u for u in ledger.free_whole() if u in ledger.topology],
            sick=[d.uuid for d in ledger.devices() if not d.schedulable],
            allocations=[a.owner.allocation_id for a in ledger.allocations()],
            pods=[v.grants[0].pod for v in self.core.allocation_views() if v.grants],
            granted=list(self.granted),
        )

    # --- one batch ----------------------------------------------------------------------

    async def batch(
        self,
        endpoint: str,
        make: Callable[[World], Sequence[Any]],
        *,
        seed: int,
        raw: bool = False,
    ) -> None:
        """Churn, send one batch of ``make``'s requests, then check the invariants."""
        rng = random.Random(seed ^ 0x5EED)
        await self.churn(rng)
        if endpoint not in (p.ENDPOINT_ALLOCATE, p.ENDPOINT_ALLOCATE_BATCH):
            await self.populate(rng)
        self.refresh()
        schedulable = _schedulable(self.core)
        before = _footprint(self.core)
        values = make(self.world)
        self.cases[endpoint] += len(values)
        if raw:
            for request in await self.handle(endpoint, values):
                self.judge(endpoint, request, None)
        elif endpoint == p.ENDPOINT_ALLOCATE_BATCH:
            started = time.monotonic()
            open_half = (self.core.joiner.open.at,) if self.core.joiner.open else ()
            self.start_twin()
            await self.call(endpoint, values)
            self.finish_twin(started, open_half)
        else:
            await self.call(endpoint, values)
        check_invariants(self.core, schedulable, before)
        self.batches += 1

    # --- at the end -----------------------------------------------------------------------

    async def check_counts(self) -> None:
        """Every answer is counted by outcome in $SRV.STATS and in the metrics."""
        nc = self.bus.client
        reply = await nc.request(f"$SRV.STATS.{p.SERVICE_NAME}", b"", timeout=5)
        stats = {e["name"]: e for e in json.loads(reply.data)["endpoints"]}
        for endpoint, tally in self.tally.items():
            entry = stats[endpoint]
            assert entry["num_errors"] == 0, entry["last_error"]
            counted = entry["data"]
            # STATS counts answers sent ("ok") and refusals: of whole requests, and for
            # allocate-batch also of each call refused inside an answered batch.
            refusals = Counter({k: v for k, v in tally.items() if k != "ok"})
            if endpoint == p.ENDPOINT_ALLOCATE_BATCH:
                # Not the calls of a batch then refused whole (its answer too large):
                # only that batch's invalid_request was sent.
                refusals.update({k: v for k, v in self.batch_calls.items() if k != "ok"})
            assert counted["ok"] == tally["ok"], endpoint
            assert counted["codes"] == dict(refusals), endpoint
            assert counted["malformed"] == tally["malformed_request"], endpoint
            assert counted["rejected"] == sum(refusals.values()) - tally["malformed_request"]
            # The metric counts answers only: a call refused inside a batch is not one.
            for outcome in set(tally) | set(refusals):
                measured = self.probe.value(
                    "gpulet.allocator.requests", endpoint=endpoint, outcome=outcome
                )
                assert measured == tally[outcome], (endpoint, outcome, measured, tally[outcome])

    async def check_checkpoint(self) -> None:
        """What is on disk restores to exactly the state in memory."""
        committer = self.service._committer
        assert committer is not None
        with anyio.fail_after(5):
            await committer.wait(self.core.version)
        loaded = CheckpointFile(self.checkpoint).load()
        assert loaded.status == "ok", loaded.detail
        fresh = AllocatorCore(node=NODE, names=NAMES)
        fresh.update_inventory(INVENTORY)
        assert fresh.restore(loaded.state) == []
        assert _stored(fresh.snapshot()) == _stored(self.core.snapshot())


def _stored(state: StoredState) -> bytes:
    return msgspec.json.encode(state)


def _decided(core: AllocatorCore) -> bytes:
    """Allocations, grants (without their wall-clock times) and the open share half."""
    state = core.snapshot()
    allocations = sorted(state.allocations, key=lambda a: a.owner.allocation_id)
    grants = [msgspec.structs.replace(g, created_at=0.0) for g in state.grants]
    open_half = (core.joiner.open.allocation, core.joiner.open.kind) if core.joiner.open else None
    return msgspec.json.encode((allocations, grants, open_half))


# --- judging answers --------------------------------------------------------------------------


def judge_answer(
    endpoint: str, data: bytes, headers: dict[str, str], value: Any
) -> tuple[str, Any]:
    """``"ok"`` for a sound reply, the code for a clean refusal; AssertionError otherwise.

    ``value`` is the request that was sent (None when it was raw bytes). Returns the
    outcome with the decoded reply (the ErrorReply of a refusal).
    """
    if MICRO_ERROR_CODE_HEADER in headers:
        # Raised past our handler, nats.micro would have answered a bare 500 without
        # an ErrorReply body: that fails here.
        error = codec.ERROR_REPLY.decode(data)
        _judge_error(endpoint, error)
        assert headers[MICRO_ERROR_CODE_HEADER] == str(status_of(error.code).wire)
        assert headers[MICRO_ERROR_HEADER].startswith(f"{error.code}: ")
        if isinstance(value, p.AllocateBatchRequest):
            _judge_batch_refusal(value, error)
        return error.code, error
    reply = REPLY_CODECS[endpoint].decode(data)
    if isinstance(value, p.AllocateRequest):
        _judge_allocate(value, reply.containers)
    elif isinstance(value, p.PreferredAllocationRequest):
        _judge_preferred(value, reply)
    elif endpoint == p.ENDPOINT_ALLOCATE_BATCH:
        _judge_allocate_batch(value, reply)
    return "ok", reply


def _judge_error(endpoint: str, error: ErrorReply) -> None:
    assert error.code in ALLOWED_CODES, f"{endpoint}: {error.code}: {error.message}"
    assert error.message.strip(), f"{endpoint}: {error.code} without a message"
    # Bounded: 64 refusals quoting 20,000 IDs each must still fit one answer.
    assert len(error.message) <= MAX_ERROR_MESSAGE_CHARS + 50, error.message[-100:]


def _judge_batch_refusal(request: p.AllocateBatchRequest, error: ErrorReply) -> None:
    """A well-formed batch is refused whole only for its size, or its answer's (or, over
    the 1 MiB a request may take, unread: 1,000 calls of 64 IDs can be)."""
    if error.code == "malformed_request":
        assert "-byte limit of AllocateBatchRequest" in error.message, error
        assert len(p.ALLOCATE_BATCH_REQUEST.encode(request)) > 1_000_000, error
        return
    assert error.code == "invalid_request", error
    calls = len(request.calls)
    if 0 < calls <= p.MAX_BATCH_CALLS:
        # Only thousands of answered containers make an answer of 1 MiB.
        containers = sum(len(c.containers) for c in request.calls)
        assert containers >= 1_000, (calls, containers, error.message)


def _judge_allocate_batch(
    request: p.AllocateBatchRequest | None, reply: p.AllocateBatchReply
) -> None:
    """One outcome per call: a sound allocation or a refusal, the same grant alike."""
    if request is not None:
        assert 0 < len(request.calls) <= p.MAX_BATCH_CALLS, len(request.calls)
        assert len(reply.outcomes) == len(request.calls), (len(reply.outcomes), request)
    granted: dict[tuple[str, tuple[str, ...]], ContainerAllocation] = {}
    for n, outcome in enumerate(reply.outcomes):
        call = request.calls[n] if request is not None else None
        if outcome.error is not None:
            assert not outcome.containers, f"call {n} refused with containers: {outcome}"
            _judge_error(p.ENDPOINT_ALLOCATE_BATCH, outcome.error)
            assert outcome.error.code != "malformed_request", outcome
            if call is not None and call.containers:
                # Containers this batch granted already: a retry gets the same answer.
                # (Unless the call names a device in two of its containers: refused.)
                keys = [(call.resource, tuple(sorted(ids))) for ids in call.containers]
                named = [i for ids in call.containers for i in set(ids)]
                if len(named) == len(set(named)):
                    assert not all(k in granted for k in keys), (n, call, outcome.error)
            continue
        assert outcome.containers, f"call {n}: neither containers nor an error"
        if call is None:
            continue
        _judge_allocate(call, outcome.containers)
        for ids, answer in zip(call.containers, outcome.containers, strict=True):
            first = granted.setdefault((call.resource, tuple(sorted(ids))), answer)
            assert first == answer, f"call {n}: {ids} answered {first} and {answer}"


def _judge_allocate(request: p.AllocateRequest, containers: list[ContainerAllocation]) -> None:
    assert len(containers) == len(request.containers)
    for answer in containers:
        assert answer.gpus, "an allocation without a GPU"
        assert set(answer.gpus) <= set(UUIDS), answer.gpus
        assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(answer.gpus)
        assert answer.annotations["gpulet.io/allocation"]


def _judge_preferred(
    request: p.PreferredAllocationRequest, reply: p.PreferredAllocationReply
) -> None:
    assert len(reply.containers) == len(request.containers)
    for asked, picked in zip(request.containers, reply.containers, strict=True):
        assert len(picked) == asked.size, (asked, picked)
        assert len(set(picked)) == len(picked), picked
        assert set(picked) <= set(asked.available), (asked, picked)
        assert set(asked.must_include) <= set(picked), (asked, picked)


def check_invariants(
    core: AllocatorCore,
    schedulable: frozenset[str],
    before: dict[str, tuple[tuple[str, ...], int, int]],
) -> None:
    """No card over-committed, no GPU held twice, nothing new on a sick GPU."""
    for d in core.ledger.devices():
        assert 0 <= d.cores_used <= CORES_PER_GPU, d
        assert 0 <= d.memory_used <= d.memory_units, d
        if d.whole_owner is not None:
            assert not d.shares, f"{d.uuid} is held whole and shared"
        else:
            assert sum(s.cores for s in d.shares) == d.cores_used
    whole: dict[str, str] = {}
    shared: set[str] = set()
    share_cores: Counter[str] = Counter()
    share_memory: Counter[str] = Counter()
    for alloc in core.ledger.allocations():
        owner = alloc.owner.allocation_id
        if isinstance(alloc, WholeAllocation):
            assert alloc.devices, owner
            for gpu in alloc.devices:
                assert gpu not in whole, f"{gpu} held whole by {whole[gpu]} and {owner}"
                assert gpu not in shared, f"{gpu} held whole by {owner} and shared"
                whole[gpu] = owner
        else:
            assert isinstance(alloc, ShareAllocation)
            assert alloc.device not in whole, f"{alloc.device} held whole and shared"
            assert 0 < alloc.cores < CORES_PER_GPU, alloc
            assert alloc.memory_units > 0, alloc
            shared.add(alloc.device)
            share_cores[alloc.device] += alloc.cores
            share_memory[alloc.device] += alloc.memory_units
    for gpu, cores in share_cores.items():
        assert cores <= CORES_PER_GPU, f"{gpu} has {cores} core units of shares"
        assert share_memory[gpu] <= UNITS[gpu], f"{gpu} has {share_memory[gpu]} memory units"
    for owner, (gpus, cores, memory) in _footprint(core).items():
        previous = before.get(owner)
        grown = (
            previous is None or previous[0] != gpus or cores > previous[1] or memory > previous[2]
        )
        if grown:
            sick = set(gpus) - schedulable
            assert not sick, f"{owner} was given {sorted(sick)}, unhealthy or lost"


# --- fixtures ---------------------------------------------------------------------------------


@asynccontextmanager
async def running_allocator(settings: Settings, probe: MetricsProbe) -> AsyncIterator[Fuzz]:
    async with (
        Bus.connect(settings.nats, name="fuzz-world", max_initial_attempts=5) as world,
        runtime_for(settings, meter=probe.meter, name="fuzz-allocator") as runtime,
        anyio.create_task_group() as tg,
    ):
        # The health state bucket, as a health service with nothing to report has it.
        await health_bucket(world)
        service = AllocatorService(runtime)
        with anyio.fail_after(10):
            await tg.start(service.run)
        fuzz = Fuzz(service, world, probe, service.checkpoint.path)
        await world.publish(subjects.inventory(NODE), INVENTORY, codec.INVENTORY)
        await fuzz._until(lambda: service.core.ready)
        try:
            yield fuzz
        finally:
            tg.cancel_scope.cancel()


@pytest.fixture
async def fuzz(
    nats_server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[Fuzz]:
    # Every refusal is logged; formatting 10,000 of them would be most of the run.
    caplog.set_level(logging.ERROR, logger="gpulet.allocator")
    settings = make_settings(nats_server.url, tmp_path / "state", tmp_path / "p", tmp_path / "d")
    probe = MetricsProbe()
    async with running_allocator(settings, probe) as running:
        yield running


def _run_examples(
    strategy: st.SearchStrategy[T],
    examples: int,
    batch: Callable[[T, int], Coroutine[Any, Any, None]],
) -> Callable[[], None]:
    """Hypothesis, in a worker thread, feeding (base, seed) to ``batch`` on the event loop."""

    def run() -> None:
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(strategy, st.integers(0, 2**32))
        def check(base: T, seed: int) -> None:
            anyio.from_thread.run(batch, base, seed)

        check()

    return run


# --- the tests --------------------------------------------------------------------------------


async def test_allocate_refuses_hostile_requests_cleanly(fuzz: Fuzz) -> None:
    async def batch(base: p.AllocateRequest, seed: int) -> None:
        await fuzz.batch(
            p.ENDPOINT_ALLOCATE,
            lambda world: allocate_variants(base, seed, BATCH, world),
            seed=seed,
        )

    await anyio.to_thread.run_sync(_run_examples(allocate_bases(), CASES // BATCH, batch))
    tally = fuzz.tally[p.ENDPOINT_ALLOCATE]
    assert fuzz.cases[p.ENDPOINT_ALLOCATE] >= CASES
    # The inputs reach every kind of refusal, and valid requests still succeed.
    assert tally["ok"] > CASES // 20, tally
    assert set(tally) >= ALLOCATE_REFUSALS, tally
    await fuzz.check_counts()
    await fuzz.check_checkpoint()


async def test_allocate_batch_decides_each_call_as_if_alone(fuzz: Fuzz) -> None:
    async def batch(base: p.AllocateRequest, seed: int) -> None:
        await fuzz.batch(
            p.ENDPOINT_ALLOCATE_BATCH,
            lambda world: allocate_batch_variants(base, seed, BATCH, world),
            seed=seed,
        )

    await anyio.to_thread.run_sync(_run_examples(allocate_bases(), CASES // BATCH, batch))
    tally = fuzz.tally[p.ENDPOINT_ALLOCATE_BATCH]
    calls = fuzz.batch_calls
    assert fuzz.cases[p.ENDPOINT_ALLOCATE_BATCH] >= CASES
    assert calls.total() >= 3 * CASES, calls
    # Most batches are answered; their calls reach every kind of refusal, and valid
    # calls still succeed.
    assert tally["ok"] > CASES // 2, tally
    assert calls["ok"] > CASES // 5, calls
    assert set(calls) >= ALLOCATE_REFUSALS, calls
    # Refused whole: empty, more than 64 calls, and answers too large for NATS (and,
    # rarely, 1,000 calls whose request is over 1 MiB: unread, see _judge_batch_refusal).
    assert {"ok", "invalid_request"} <= set(tally) <= {"ok", "invalid_request", "malformed_request"}
    assert tally["malformed_request"] <= tally["invalid_request"], tally
    assert fuzz.too_large > 0, "no batch had an answer too large to send"
    # Nearly every batch was checked against lone allocates on a copy of the core.
    assert fuzz.twin_checked > fuzz.batches * 9 // 10, (fuzz.twin_checked, fuzz.twin_skipped)
    await fuzz.check_counts()
    await fuzz.check_checkpoint()


async def test_preferred_refuses_hostile_requests_cleanly(fuzz: Fuzz) -> None:
    async def batch(base: p.PreferredAllocationRequest, seed: int) -> None:
        await fuzz.batch(
            p.ENDPOINT_PREFERRED,
            lambda world: preferred_variants(base, seed, BATCH, world),
            seed=seed,
        )

    await anyio.to_thread.run_sync(_run_examples(preferred_bases(), CASES // BATCH, batch))
    tally = fuzz.tally[p.ENDPOINT_PREFERRED]
    assert fuzz.cases[p.ENDPOINT_PREFERRED] >= CASES
    assert tally["ok"] > CASES // 20, tally
    assert {"unknown_resource", "unknown_device", "invalid_request", "too_many_units"} <= set(
        tally
    ), tally
    await fuzz.check_counts()


async def test_release_refuses_hostile_requests_cleanly(fuzz: Fuzz) -> None:
    async def batch(base: p.ReleaseRequest, seed: int) -> None:
        await fuzz.batch(
            p.ENDPOINT_RELEASE,
            lambda world: release_variants(base, seed, BATCH, world),
            seed=seed,
        )

    await anyio.to_thread.run_sync(_run_examples(release_bases(), CASES // BATCH, batch))
    tally = fuzz.tally[p.ENDPOINT_RELEASE]
    assert fuzz.cases[p.ENDPOINT_RELEASE] >= CASES
    assert tally["ok"] > CASES // 20, tally
    assert {"unknown_resource", "invalid_request"} <= set(tally), tally
    assert fuzz.released > CASES // 50, "the releases must also hit held allocations"
    await fuzz.check_counts()
    await fuzz.check_checkpoint()


async def test_state_answers_or_refuses_odd_requests(fuzz: Fuzz) -> None:
    async def batch(base: bytes, seed: int) -> None:
        await fuzz.batch(
            p.ENDPOINT_STATE,
            lambda world: state_variants(base, seed, BATCH, world),
            seed=seed,
            raw=True,
        )

    await anyio.to_thread.run_sync(_run_examples(bases(p.StateRequest), CASES // BATCH, batch))
    tally = fuzz.tally[p.ENDPOINT_STATE]
    assert fuzz.cases[p.ENDPOINT_STATE] >= CASES
    assert set(tally) == {"ok", "malformed_request"}, tally
    await fuzz.check_counts()


# --- raw payloads over NATS -------------------------------------------------------------------


def _big_payload() -> bytes:
    """An allocate request just under NATS's 1 MiB payload limit, all unknown IDs."""
    ids = [f"GPU-{n:08x}\r\nX-Injected: {n}" for n in range(25_000)]
    return p.ALLOCATE_REQUEST.encode(p.AllocateRequest(resource=GPU, containers=[ids]))


SPECIAL_PAYLOADS: Final = (
    _big_payload(),
    p.ALLOCATE_REQUEST.encode(
        p.AllocateRequest(resource=GPU, containers=[["GPU-x\r\nNats-Service-Error-Code: 200"]])
    ),
    p.ALLOCATE_REQUEST.encode(p.AllocateRequest(resource="x\r\ny", containers=[["a"]])),
    # Its answer would pass the 1 MiB limit: refused (and undone), not left unanswered.
    p.ALLOCATE_REQUEST.encode(p.AllocateRequest(resource=GPU, containers=[[UUIDS[1]]] * 5_000)),
    b"\x00" * 1000,
    b"[" * 10_000,
    b'{"resource": "nvidia.com/gpu", "containers": [[' + b'"a",' * 50_000 + b'"a"]]}',
)


def _batch_payload(calls: Sequence[p.AllocateRequest]) -> bytes:
    return p.ALLOCATE_BATCH_REQUEST.encode(p.AllocateBatchRequest(calls=list(calls)))


def _big_batch_payload() -> bytes:
    """64 calls of unknown IDs carrying CR/LF, just under 1 MiB: 64 refusals, bounded."""
    ids = [f"GPU-{n:08x}\r\nX-Injected: {n}" for n in range(24_000)]
    step = len(ids) // p.MAX_BATCH_CALLS
    calls = [
        p.AllocateRequest(resource=GPU, containers=[ids[n : n + step]])
        for n in range(0, step * p.MAX_BATCH_CALLS, step)
    ]
    return _batch_payload(calls)


# (payload, the outcome it must get)
BATCH_SPECIAL_PAYLOADS: Final = (
    (_big_batch_payload(), "ok"),
    (_batch_payload([]), "invalid_request"),
    (_batch_payload([p.AllocateRequest(resource=GPU, containers=[[U0]])] * 65), "invalid_request"),
    (b'{"calls": null}', "malformed_request"),
    (b'{"calls": [1, "x", null]}', "malformed_request"),
    (b'{"calls": [{"resource": "nvidia.com/gpu"}]}', "malformed_request"),
    (b'{"calls": {"resource": "nvidia.com/gpu", "containers": [["a"]]}}', "malformed_request"),
    (b'{"calls": ' + b"[" * 10_000, "malformed_request"),
    (_batch_payload([p.AllocateRequest(resource="", containers=[[]])] * 15_000), "invalid_request"),
    (
        b'{"calls": [' + b'{"resource": "", "containers": [[]]},' * 20_000 + b"{}]}",
        "malformed_request",
    ),
)


async def test_malformed_payloads_over_nats_are_refused_and_counted(fuzz: Fuzz) -> None:
    nc = fuzz.bus.client
    sent: Counter[str] = Counter()

    async def send(endpoint: str, payloads: Sequence[bytes]) -> list[str]:
        subject = subjects.allocator_endpoint(NODE, endpoint)
        schedulable, before = _schedulable(fuzz.core), _footprint(fuzz.core)
        outcomes = []
        for payload in payloads:
            msg = await nc.request(subject, payload, timeout=5)
            outcomes.append(fuzz.record(endpoint, msg.data, dict(msg.headers or {}), None))
            sent[endpoint] += 1
        check_invariants(fuzz.core, schedulable, before)
        return outcomes

    for endpoint in p.ENDPOINTS:
        request_type: type[msgspec.Struct] = REQUEST_CODECS[endpoint].type

        async def batch(base: bytes, seed: int, endpoint: str = endpoint) -> None:
            await send(endpoint, mutants(base, seed, RAW_BATCH))

        await anyio.to_thread.run_sync(_run_examples(bases(request_type), RAW_EXAMPLES, batch))
    await send(p.ENDPOINT_ALLOCATE, SPECIAL_PAYLOADS)
    await send(p.ENDPOINT_RELEASE, SPECIAL_PAYLOADS[4:])
    payloads, expected = zip(*BATCH_SPECIAL_PAYLOADS, strict=True)
    refused = fuzz.batch_calls.copy()
    assert await send(p.ENDPOINT_ALLOCATE_BATCH, payloads) == list(expected)
    assert fuzz.batch_calls - refused == Counter(unknown_device=p.MAX_BATCH_CALLS)
    # An answer too large for NATS is refused (and undone), not left unanswered.
    held = fuzz.core.ledger.count()
    containers = [mem_ids(UUIDS[0], [n]) for n in range(TOO_LARGE_CONTAINERS)]
    call = p.AllocateRequest(resource=MEM, containers=containers)
    too_large = _batch_payload([call] * p.MAX_BATCH_CALLS)
    assert await send(p.ENDPOINT_ALLOCATE_BATCH, [too_large]) == ["invalid_request"]
    assert fuzz.core.ledger.count() == held

    assert sum(sent.values()) >= len(p.ENDPOINTS) * RAW_EXAMPLES * RAW_BATCH
    for endpoint in p.ENDPOINTS:
        assert fuzz.tally[endpoint]["malformed_request"] > 0, endpoint
    nats_stats = json.loads((await nc.request(f"$SRV.STATS.{p.SERVICE_NAME}", b"", timeout=5)).data)
    for entry in nats_stats["endpoints"]:
        assert entry["num_requests"] == sent[entry["name"]], entry
    await fuzz.check_counts()
