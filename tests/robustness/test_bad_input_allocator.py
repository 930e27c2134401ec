"""The allocator's request handlers against hostile requests: refused cleanly, never broken.

What runs
---------
A real nats-server and the real :class:`~gpulet_allocator.service.AllocatorService` on
its own NATS connection, with its checkpoint on disk and its metrics going to an
in-memory reader. The node has 8 GPUs (NVLink pairs, two NUMA nodes, 80 GiB and 24 GiB
cards, so "more memory than a card" depends on the card). Two kinds of input:

* **10,000+ well-formed but hostile requests per endpoint** (allocate, preferred,
  release, state), handed to the service's endpoint handlers -- the coroutines
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
* **A few hundred malformed raw payloads** through the real NATS endpoints
  (:func:`robustness.strategies.bases` + :func:`~robustness.strategies.mutants`, plus a
  near-1 MiB request and IDs carrying CR/LF).

Checked after every request: the answer is either a reply that decodes and makes sense
(an allocation on GPUs of the node, a preference of exactly ``size`` offered IDs) or a
typed refusal -- ``Gpulet-Error`` header, an ``ErrorReply`` with a known code and a
non-empty message, the matching ``Nats-Service-Error-Code`` -- never an exception,
never ``internal``. After every batch: no card past 100 core units or its memory, no
GPU held twice (whole twice, or whole and shared), no allocation made or grown on a GPU
that was unhealthy or lost. At the end: every answer is counted by outcome in the
endpoint's ``$SRV.STATS`` data and in ``gpulet.allocator.requests``, nats.micro saw no
handler error, and the checkpoint on disk restores to the same state.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import time
import uuid
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
from gpulet_allocator.core import CORES_PER_GPU, AllocatorCore, StoredState
from gpulet_allocator.engine import ERROR_CODES, ShareAllocation, WholeAllocation, reference
from gpulet_allocator.engine.shares import memory_units
from gpulet_allocator.plugin.backend import PreferredRequest
from gpulet_allocator.service import AllocatorService
from gpulet_allocator.store import CheckpointFile
from gpulet_common import codec, subjects
from gpulet_common.bus import Bus
from gpulet_common.codec import Codec
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import HealthEvent, Inventory
from gpulet_common.runtime import NvmlProvider, Runtime
from gpulet_common.settings import Settings
from gpulet_common.settings.allocator import ResourceNames
from gpulet_common.telemetry import StatusBoard
from robustness.strategies import bases, mutants
from support.allocator_stack import NODE, make_settings
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
ALLOWED_CODES: Final = (ERROR_CODES | p.SERVICE_ERROR_CODES) - {
    "internal",
    "checkpoint_failed",
    "not_ready",
}

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
    p.ENDPOINT_PREFERRED: p.PREFERRED_REPLY,
    p.ENDPOINT_RELEASE: p.RELEASE_REPLY,
    p.ENDPOINT_STATE: p.STATE_REPLY,
}
REQUEST_CODECS: Final[dict[str, Codec[Any]]] = {
    p.ENDPOINT_ALLOCATE: p.ALLOCATE_REQUEST,
    p.ENDPOINT_PREFERRED: p.PREFERRED_REQUEST,
    p.ENDPOINT_RELEASE: p.RELEASE_REQUEST,
    p.ENDPOINT_STATE: p.STATE_REQUEST,
}


def _schedulable(core: AllocatorCore) -> frozenset[str]:
    return frozenset(d.uuid for d in core.ledger.devices() if d.schedulable)


def _footprint(core: AllocatorCore) -> dict[str, tuple[tuple[str, ...], int, int]]:
    """Each allocation's GPUs and size, to tell which ones a batch made or grew."""
    out: dict[str, tuple[tuple[str, ...], int, int]] = {}
    for alloc in core.ledger.allocations():
        if isinstance(alloc, WholeAllocation):
            out[alloc.owner.pod_uid] = (alloc.devices, CORES_PER_GPU * len(alloc.devices), 0)
        else:
            out[alloc.owner.pod_uid] = ((alloc.device,), alloc.cores, alloc.memory_units)
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
            p.ENDPOINT_PREFERRED: service._on_preferred,
            p.ENDPOINT_RELEASE: service._on_release,
            p.ENDPOINT_STATE: service._on_state,
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
        outcome = judge_answer(endpoint, data, headers, value)
        self.tally[endpoint][outcome] += 1
        if outcome == "ok" and endpoint == p.ENDPOINT_RELEASE:
            self.released += len(p.RELEASE_REPLY.decode(data).released)
        if outcome == "ok" and endpoint == p.ENDPOINT_ALLOCATE and value is not None:
            self.granted += [(value.resource, list(ids)) for ids in value.containers]
            del self.granted[:-200]
        return outcome

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
            ids = [a.owner.pod_uid for a in held]
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
        event = HealthEvent(
            event_id=uuid.uuid4().hex,
            node=NODE,
            gpu_uuid=gpu,
            kind="recovered" if healthy else "xid",
            severity="info" if healthy else "critical",
            healthy=healthy,
            reason="recovered" if healthy else "Xid 79: GPU fell off the bus",
            condition="xid:79",
            observed_at=time.time(),
        )
        await self.bus.publish(subjects.health(NODE), event, codec.HEALTH_EVENT)
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
            allocations=[a.owner.pod_uid for a in ledger.allocations()],
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
        if endpoint != p.ENDPOINT_ALLOCATE:
            await self.populate(rng)
        self.refresh()
        schedulable = _schedulable(self.core)
        before = _footprint(self.core)
        values = make(self.world)
        self.cases[endpoint] += len(values)
        if raw:
            for request in await self.handle(endpoint, values):
                self.judge(endpoint, request, None)
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
            refusals = {k: v for k, v in tally.items() if k != "ok"}
            assert counted["ok"] == tally["ok"], endpoint
            assert counted["codes"] == refusals, endpoint
            assert counted["malformed"] == tally["malformed_request"], endpoint
            assert counted["rejected"] == sum(refusals.values()) - tally["malformed_request"]
            for outcome, n in tally.items():
                measured = self.probe.value(
                    "gpulet.allocator.requests", endpoint=endpoint, outcome=outcome
                )
                assert measured == n, (endpoint, outcome, measured, n)

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


# --- judging answers --------------------------------------------------------------------------


def judge_answer(endpoint: str, data: bytes, headers: dict[str, str], value: Any) -> str:
    """``"ok"`` for a sound reply, the code for a clean refusal; AssertionError otherwise.

    ``value`` is the request that was sent (None when it was raw bytes).
    """
    if p.GPULET_ERROR_HEADER in headers:
        error = codec.ERROR_REPLY.decode(data)
        assert error.code == headers[p.GPULET_ERROR_HEADER]
        assert error.code in ALLOWED_CODES, f"{endpoint}: {error.code}: {error.message}"
        assert error.message.strip(), f"{endpoint}: {error.code} without a message"
        assert headers[p.MICRO_ERROR_CODE_HEADER] == p.micro_status(error.code)
        assert headers[p.MICRO_ERROR_HEADER].startswith(error.code)
        return error.code
    # Raised past our handler, nats.micro would have answered a bare 500.
    assert p.MICRO_ERROR_CODE_HEADER not in headers, headers
    reply = REPLY_CODECS[endpoint].decode(data)
    if isinstance(value, p.AllocateRequest):
        _judge_allocate(value, reply)
    elif isinstance(value, p.PreferredAllocationRequest):
        _judge_preferred(value, reply)
    return "ok"


def _judge_allocate(request: p.AllocateRequest, reply: p.AllocateReply) -> None:
    assert len(reply.containers) == len(request.containers)
    for answer in reply.containers:
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
        owner = alloc.owner.pod_uid
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
        Bus.connect(settings.nats, name="fuzz-allocator", max_initial_attempts=5) as bus,
        anyio.create_task_group() as tg,
    ):
        runtime = Runtime(
            settings=settings,
            bus=bus,
            status=StatusBoard(),
            nvml=NvmlProvider(settings.nvml),
            meter=probe.meter,
        )
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
    expected = {
        "unknown_resource",
        "unknown_device",
        "invalid_request",
        "invalid_core_units",
        "memory_exceeds_card",
        "unhealthy_device",
        "insufficient_capacity",
        "too_many_units",
    }
    assert expected <= set(tally), tally
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


async def test_malformed_payloads_over_nats_are_refused_and_counted(fuzz: Fuzz) -> None:
    nc = fuzz.bus.client
    sent: Counter[str] = Counter()

    async def send(endpoint: str, payloads: Sequence[bytes]) -> None:
        subject = subjects.allocator_endpoint(NODE, endpoint)
        schedulable, before = _schedulable(fuzz.core), _footprint(fuzz.core)
        for payload in payloads:
            msg = await nc.request(subject, payload, timeout=5)
            outcome = judge_answer(endpoint, msg.data, dict(msg.headers or {}), None)
            fuzz.tally[endpoint][outcome] += 1
            sent[endpoint] += 1
        check_invariants(fuzz.core, schedulable, before)

    for endpoint in p.ENDPOINTS:
        request_type: type[msgspec.Struct] = REQUEST_CODECS[endpoint].type

        async def batch(base: bytes, seed: int, endpoint: str = endpoint) -> None:
            await send(endpoint, mutants(base, seed, RAW_BATCH))

        await anyio.to_thread.run_sync(_run_examples(bases(request_type), RAW_EXAMPLES, batch))
    await send(p.ENDPOINT_ALLOCATE, SPECIAL_PAYLOADS)
    await send(p.ENDPOINT_RELEASE, SPECIAL_PAYLOADS[4:])

    assert sum(sent.values()) >= 4 * RAW_EXAMPLES * RAW_BATCH
    for endpoint in p.ENDPOINTS:
        assert fuzz.tally[endpoint]["malformed_request"] > 0, endpoint
    nats_stats = json.loads((await nc.request(f"$SRV.STATS.{p.SERVICE_NAME}", b"", timeout=5)).data)
    for entry in nats_stats["endpoints"]:
        assert entry["num_requests"] == sent[entry["name"]], entry
    await fuzz.check_counts()
