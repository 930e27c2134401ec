"""The allocator's decisions for kubelet's calls, on top of the engine's ledger.

Design
------
The engine (:mod:`gpulet_allocator.engine`) knows allocations keyed by a request key
and decides placements. Kubelet, however, never says which pod it allocates for: an
``Allocate`` call carries only the device IDs it picked of one resource, one list per
container. This module bridges the two; it is synchronous and does no I/O, so the
NATS service (:mod:`gpulet_allocator.service`) and the in-process benchmark drive the
very same code.

**Grants.** Each container list of an ``Allocate`` call is a *grant*, keyed by a hash
of the resource name and the sorted device IDs. Kubelet never gives the same device ID
to two live containers, so the key names one container's request, and a retry of the
call (kubelet's, or after an allocator restart, since grants are checkpointed with the
allocations) finds the grant and gets the recorded answer: nothing is allocated twice.
An allocation (the ledger's entry) is owned by the key of its first grant, which is
also its ID (``gpulet.io/allocation`` annotation, ``GPULET_ALLOCATION_ID`` env).

**Resources.** ``nvidia.com/gpu`` IDs are GPU UUIDs; kubelet's pick is honoured (and
steered beforehand by ``GetPreferredAllocation``, which the engine answers
topology- and fragmentation-aware). A named GPU that is unhealthy, lost or busy is
refused precisely rather than swapped, so kubelet's accounting never drifts from ours.
Share IDs (``<uuid>::core-<n>``, ``<uuid>::mem-<n>``) are only counted, as
gpu-manager does: N core IDs are N core units wherever kubelet took them from, and the
allocator places the share itself, best fit. Core units that are a multiple of 100 are
that many whole cards (the engine picks them; they come with all their memory, so a
``gpu-memory`` request in the same container is refused); 150 is refused
(``invalid_core_units``).

**Joining the core and memory halves of a share.** Kubelet admits one pod at a time
and, for each container, calls ``Allocate`` once per resource, one call after the
other, in no fixed order. A container's ``gpu-core`` and ``gpu-memory`` calls are
therefore adjacent, and the rule is:

* a share call with no *open half* places a share best fit, taking the dimension it
  does not know proportionally (memory: cores/100 of the node's smallest card; cores:
  memory's fraction of the largest card, 1..99) -- or, when no card has that much
  left, the least (one memory unit, one core unit) -- and leaves it open;
* the next call, if it is of the *other* share resource and arrives within
  ``share_join_window_s``, joins: the share is resized to the real numbers on the
  same card, so both answers name the same GPU (kubelet merges their environments and
  keeps the first value of a duplicated variable). If the card cannot take the
  resized share the call fails with ``insufficient_capacity`` naming the card, and
  the first half stays as it was;
* any other call, and any call that fails, closes the open half, which keeps its
  guessed amount.

Each answer sets only its own limit (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` for cores,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for memory): a half that is never joined keeps its
guessed amount in the accounting but is not limited in the other dimension. Ask for both
resources in every share container (gpu-manager requires it too). The one sequence
this cannot tell apart is a core-only container followed directly by a
memory-first container; :meth:`AllocatorCore.reconcile` detects it from PodResources
and reports it.

**koord-scheduler's decisions.** With a :class:`~.koordinator.PodBook` (the pod watch
of :mod:`.pod_watch`), a call that belongs to a pod carrying the
``scheduling.koordinator.sh/device-allocated`` annotation (the rule is in
:mod:`.koordinator`) follows it: ``GetPreferredAllocation`` answers exactly the decided
GPUs, ``Allocate`` of whole GPUs checks kubelet's IDs against them, and under the
``koordinator`` profile a share (``koordinator.sh/gpu-core`` and
``koordinator.sh/gpu-memory-ratio``, whichever kubelet asks first) is placed on the
decided card with the decided amounts, both MPS limits in both answers. A decision
that cannot be honoured (unknown minor, unhealthy, lost or held GPU, other IDs, an
invalid annotation) is refused with ``scheduler_decision`` and reported to the refusal
hook (a Kubernetes Event), never served from another card. Calls no pod's decision
covers are decided as above. The book is only read here, in memory: no I/O.

**Release.** Kubelet's PodResources API lists the device IDs each live container
holds; hashing them gives the live grant keys (:meth:`AllocatorCore.reconcile`). An
allocation none of whose grants has been listed for ``release_grace_s`` is released
(the grace covers a kubelet that lists nothing for a moment after a restart, and a
grant younger than the grace is never released). Without PodResources, an explicit
release by allocation ID, pod or device IDs does it (:meth:`AllocatorCore.release`).

**Lost record.** When the checkpoint was corrupt, the allocations running pods hold are
unknown and ``lost`` says why: :meth:`AllocatorCore.allocate` refuses every call
(``checkpoint_lost``) rather than hand out a GPU twice. The record is rebuilt from
PodResources (:meth:`AllocatorCore.adopt`: whole GPUs; kubelet does not know which
card a share went to, so a share container blocks the rebuild) or the loss is accepted
by an operator; the service decides which, then calls :meth:`AllocatorCore.end_loss`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, NoReturn

import msgspec

from gpulet_allocator.engine import (
    DeviceState,
    Ledger,
    Owner,
    ShareAllocation,
    WholeAllocation,
    classify_cores,
)
from gpulet_allocator.koordinator import Claim, GpuEntry, PodBook, PodKey, memory_mib
from gpulet_allocator.protocol import (
    CORES_PER_GPU,
    MEMORY_UNIT_MIB,
    AllocationView,
    ContainerAllocation,
    GpuView,
    GrantView,
    Mount,
    PreferredRequest,
    ReleaseRequest,
    ResourceKind,
    StateReply,
    parse_device_id,
    resource_specs,
)
from gpulet_allocator.protocol import memory_units as memory_units_of
from gpulet_common.messages import GpuInfo, Inventory
from gpulet_common.refusal import Refused
from gpulet_common.settings.allocator import CdiSettings, MpsSettings, ResourceNames

log = logging.getLogger("gpulet.allocator")

ALLOCATION_ANNOTATION: Final = "gpulet.io/allocation"
ALLOCATION_ENV: Final = "GPULET_ALLOCATION_ID"
STATE_VERSION: Final = 1

GrantKind = Literal["whole", "core", "memory", "ratio"]
RefusalHook = Callable[[PodKey, str], None]
Allocation = WholeAllocation | ShareAllocation
Undo = Callable[[], None]


class Grant(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One container's Allocate of one resource, as answered."""

    key: str
    resource: str
    kind: GrantKind
    units: int
    allocation: str
    created_at: float
    # Learnt from PodResources (or the pod watch): "namespace/name" and the container.
    pod: str = ""
    container: str = ""
    # Shares placed by koord-scheduler's decision: the MPS limits it accounted (the
    # ledger's memory is in 256 MiB units, the limit is the annotated MiB).
    mps_cores: int = 0
    mps_memory_mib: int = 0


class StoredState(msgspec.Struct, frozen=True, kw_only=True):
    """What the checkpoint holds. Add fields with defaults only; bump version otherwise."""

    version: int = STATE_VERSION
    node: str = ""
    allocations: list[WholeAllocation | ShareAllocation] = []
    grants: list[Grant] = []
    # Not empty: the record of allocations was lost (a corrupt file, why); what is
    # above was rebuilt since. Kept until PodResources rebuilt it or an operator
    # accepted the loss (see "Lost record" in the module docstring).
    lost: str = ""


@dataclass(frozen=True, slots=True)
class PodRef:
    pod: str
    container: str


@dataclass(frozen=True, slots=True)
class HeldDevices:
    """One container's devices of one resource, as kubelet's PodResources lists them."""

    ref: PodRef
    resource: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Adoption:
    """What :meth:`AllocatorCore.adopt` made of one PodResources answer."""

    adopted: int
    # Containers whose cards PodResources cannot tell (shares), one line each.
    unplaceable: tuple[str, ...] = ()
    # Whole-GPU grants that could not be recorded (a card listed twice...), one line each.
    conflicts: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        return not self.unplaceable and not self.conflicts

    def blocker(self) -> str:
        """Why this answer cannot stand for the lost record ("" when it can)."""
        parts: list[str] = []
        if self.unplaceable:
            shown = "; ".join(self.unplaceable[:3])
            more = f" and {len(self.unplaceable) - 3} more" if len(self.unplaceable) > 3 else ""
            parts.append(
                f"{len(self.unplaceable)} container(s) hold GPU shares whose cards kubelet "
                f"does not know (the allocator placed them): {shown}{more}"
            )
        if self.conflicts:
            shown = "; ".join(self.conflicts[:3])
            more = f" and {len(self.conflicts) - 3} more" if len(self.conflicts) > 3 else ""
            parts.append(f"{len(self.conflicts)} grant(s) conflict: {shown}{more}")
        return "; ".join(parts)


@dataclass(slots=True)
class _OpenHalf:
    allocation: str
    kind: Literal["core", "memory"]
    at: float


# Kubelet asks for a container's resources in random order, and a memory answer
# given first could not name the whole cards a later core answer gets: refused in
# both orders, so that such a pod fails the same way every time.
_WHOLE_WITH_MEMORY = (
    "{} core units are whole cards, which come with all their memory: do not ask for "
    "gpulet.io/gpu-memory next to them (or ask nvidia.com/gpu for whole cards)"
)


def grant_key(kind: GrantKind, resource: str, device_ids: Iterable[str]) -> str:
    """The stable key of one container's request (see the module docstring)."""
    digest = hashlib.blake2b(digest_size=10)
    digest.update(resource.encode())
    for device_id in sorted(device_ids):
        digest.update(b"\0" + device_id.encode())
    return f"{kind}-{digest.hexdigest()}"


class AllocatorCore:
    """Ledger + grants + the join rule. Not thread-safe: call from one event loop."""

    def __init__(
        self,
        *,
        node: str,
        names: ResourceNames,
        shares: bool = True,
        mps: MpsSettings | None = None,
        cdi: CdiSettings | None = None,
        join_window_s: float = 5.0,
        release_grace_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        health_of: Callable[[str], bool] = lambda _uuid: True,
        profile: str = "gpulet",
        book: PodBook | None = None,
        on_refusal: RefusalHook | None = None,
    ) -> None:
        self.node = node
        # Where each GPU's health is read (the service's NodeView): the ledger holds
        # the only copy here, taken from it when a GPU arrives and on every change.
        self._health_of = health_of
        self.ledger = Ledger()
        self._kinds: dict[str, GrantKind] = {
            spec.name: spec.kind.value
            for spec in resource_specs(names, shares=shares, profile=profile)
        }
        #: This node's watched pods (koord-scheduler's decisions); None: no handshake.
        self.book = book
        # Koordinator's share resources: placed only where the scheduler decided.
        self._koordinator = profile == "koordinator"
        self._on_refusal = on_refusal or (lambda _pod, _message: None)
        #: Calls that followed a koord-scheduler decision, and refusals of one.
        self.decisions_followed = 0
        self.decisions_refused = 0
        self._mps = mps or MpsSettings()
        self._cdi = cdi or CdiSettings()
        self._join_window_s = join_window_s
        self._grace_s = release_grace_s
        self._clock = clock
        self._wall = wall_clock
        self._grants: dict[str, Grant] = {}
        self._gpus: dict[str, GpuInfo] = {}
        self._inventory: Inventory | None = None
        self._open: _OpenHalf | None = None
        self._missing_since: dict[str, float] = {}
        self._mismatch_reported: set[str] = set()
        #: Why the record of allocations is lost (None: it is not); Allocate is refused.
        self.lost: str | None = None
        #: Why the record cannot be rebuilt yet (shown with the refusal).
        self.rebuild_blocker = ""
        #: Bumped on every change that must reach the checkpoint.
        self.version = 0
        #: Share joins that PodResources showed to span two containers.
        self.join_mismatches = 0

    # --- inputs ------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._inventory is not None

    @property
    def inventory_generation(self) -> int:
        return self._inventory.generation if self._inventory else 0

    def kind_of(self, resource: str) -> GrantKind | None:
        return self._kinds.get(resource)

    def resource_kind(self, resource: str) -> GrantKind:
        kind = self._kinds.get(resource)
        if kind is None:
            served = ", ".join(sorted(self._kinds))
            raise Refused("unknown_resource", f"{resource!r} is not served here ({served})")
        return kind

    def update_inventory(self, inventory: Inventory) -> bool:
        """Adopt an inventory; returns False when it is ignored.

        A degraded inventory without GPUs (NVML failed) says nothing about the GPUs,
        so the last known one is kept rather than every GPU being declared lost.
        """
        if inventory.degraded_reason and not inventory.gpus and self._inventory is not None:
            log.warning("ignoring a degraded inventory: %s", inventory.degraded_reason)
            return False
        self._inventory = inventory
        self._gpus = {g.uuid: g for g in inventory.gpus}
        self.ledger.update_inventory(inventory.gpus)
        for uuid in self._gpus:
            self.ledger.set_health(uuid, self._health_of(uuid))
        return True

    def set_health(self, uuid: str, healthy: bool) -> bool:
        """Record a GPU's health; returns whether it changed.

        A GPU not in the inventory yet is left alone: ``health_of`` gives its health
        when it arrives.
        """
        try:
            return self.ledger.set_health(uuid, healthy)
        except Refused:
            return False

    # --- Allocate ----------------------------------------------------------------------

    def allocate(
        self, resource: str, containers: Sequence[Sequence[str]]
    ) -> tuple[list[ContainerAllocation], Undo]:
        """Answer kubelet's Allocate; all containers or none (raises :class:`Refused`).

        The returned undo reverts what this call changed, for a checkpoint that failed.
        """
        kind = self.resource_kind(resource)
        if self.lost is not None:
            raise self.lost_refusal()
        if not self.ready:
            raise Refused("not_ready", "the allocator has no GPU inventory yet")
        if not containers:
            raise Refused("invalid_request", "the request names no container")
        _check_across(containers)
        undo: list[Undo] = []
        try:
            answers = [
                self._allocate_one(resource, kind, list(ids), n, undo)
                for n, ids in enumerate(containers)
            ]
        except Exception:
            # All or nothing (a refusal, or a bug that then surfaces): an earlier
            # container of this call is given back. The open half is closed too:
            # kubelet fails this pod and moves on to the next.
            self._revert(undo)
            self._open = None
            raise
        return answers, lambda: self._revert(undo)

    def _revert(self, undo: list[Undo]) -> None:
        if not undo:
            return
        for step in reversed(undo):
            step()
        if self._open is not None and self.ledger.get(self._open.allocation) is None:
            self._open = None
        self.version += 1

    def _allocate_one(
        self, resource: str, kind: GrantKind, ids: list[str], n: int, undo: list[Undo]
    ) -> ContainerAllocation:
        self._check_ids(resource, kind, ids, n)
        key = grant_key(kind, resource, ids)
        existing = self._grants.get(key)
        if existing is not None:
            self._check_retry(existing, resource, kind, ids)
            return self._answer(existing)
        now = self._clock()
        if kind == "whole":
            uuids = [parse_device_id(i).gpu_uuid for i in ids]
            claim = self._claim(resource, len(ids), uuids)
            if claim is not None:
                decided = self._decided_whole(claim)
                if sorted(decided) != sorted(uuids):
                    self._refuse(
                        claim,
                        f"kubelet allocated {self._describe(uuids)} but koord-scheduler "
                        f"decided {self._describe(decided)} for {claim.pod}",
                    )
            self.ledger.allocate_whole(Owner(allocation_id=key), devices=uuids)
            self._open = None
            answer = self._new_grant(
                key, resource, kind, len(ids), key, undo, own=True, claim=claim
            )
            self._mark(claim, key, undo)
            return answer
        if kind in ("core", "ratio") and self._koordinator:
            return self._allocate_decided_share(resource, kind, ids, key, undo)
        if kind == "core":
            request = classify_cores(len(ids))
            if request.kind == "whole":
                if self._joinable("memory", now) is not None:
                    raise Refused("invalid_request", _WHOLE_WITH_MEMORY.format(len(ids)))
                self.ledger.allocate_whole(Owner(allocation_id=key), request.count)
                grant = self._new_grant(key, resource, kind, len(ids), key, undo, own=True)
                self._open = _OpenHalf(allocation=key, kind="core", at=now)
                return grant
            partner = self._joinable("memory", now)
            if partner is not None:
                self._resize(partner, cores=request.cores, half="core", undo=undo)
                self._open = None
                return self._new_grant(
                    key, resource, kind, len(ids), partner.owner.allocation_id, undo
                )
            memory = self._proportional_memory(request.cores)
            self._place_half(
                key,
                request.cores,
                memory,
                least=(request.cores, 1),
                asked=f"{request.cores} core units",
            )
            self._open = _OpenHalf(allocation=key, kind="core", at=now)
            return self._new_grant(key, resource, kind, len(ids), key, undo, own=True)
        units = len(ids)
        self._check_memory(units)
        partner = self._joinable("core", now)
        if partner is not None:
            self._resize(partner, memory=units, half="memory", undo=undo)
            self._open = None
            return self._new_grant(key, resource, kind, units, partner.owner.allocation_id, undo)
        whole = self._joinable_any("core", now)
        if whole is not None:
            cores = CORES_PER_GPU * len(whole.devices) if isinstance(whole, WholeAllocation) else 0
            raise Refused("invalid_request", _WHOLE_WITH_MEMORY.format(cores))
        cores = self._proportional_cores(units)
        self._place_half(key, cores, units, least=(1, units), asked=f"{units} memory units")
        self._open = _OpenHalf(allocation=key, kind="memory", at=now)
        return self._new_grant(key, resource, kind, units, key, undo, own=True)

    def _check_retry(self, existing: Grant, resource: str, kind: GrantKind, ids: list[str]) -> None:
        """A repeated device-ID set is kubelet's retry, unless the pod watch says the call
        belongs to another pod: then the devices are already held, and that is refused
        (with the Event), never answered with the earlier pod's allocation."""
        if kind != "whole" and not (kind in ("core", "ratio") and self._koordinator):
            return
        uuids = [parse_device_id(i).gpu_uuid for i in ids] if kind == "whole" else []
        claim = self._claim(resource, len(ids), uuids)
        if claim is None or existing.pod == str(claim.pod):
            return
        what = self._describe(uuids) if uuids else f"these {len(ids)} {resource} devices"
        holder = f" of {existing.pod}" if existing.pod else ""
        self._refuse(claim, f"{what} already held by allocation {existing.allocation}{holder}")

    # --- koord-scheduler's decisions (gpulet_allocator.koordinator) ---------------------

    def _minor_of(self, info: GpuInfo) -> int:
        # The reporter writes the NVML index where NVML has no minor; so do we.
        return info.minor if info.minor is not None else info.index

    def _minors(self) -> dict[str, int]:
        return {uuid: self._minor_of(g) for uuid, g in self._gpus.items()}

    def _claim(self, resource: str, count: int, device_ids: Sequence[str] = ()) -> Claim | None:
        if self.book is None:
            return None
        taken = {
            (g.pod, g.container) for g in self._grants.values() if g.pod and g.resource == resource
        }
        return self.book.find(
            resource, count, minor_of=self._minors(), device_ids=device_ids, taken=taken
        )

    def _refuse(self, claim: Claim, message: str) -> NoReturn:
        """Refuse a decision: precise, an Event on the pod, never another card."""
        self.decisions_refused += 1
        who = f"{claim.pod} container {claim.container!r}"
        text = f"cannot follow koord-scheduler for {who}: {message}"
        self._on_refusal(claim.pod, text)
        raise Refused("scheduler_decision", text)

    def _describe(self, uuids: Iterable[str]) -> str:
        minors = self._minors()
        parts = [f"minor {minors[u]} ({u})" if u in minors else u for u in sorted(uuids, key=str)]
        return ", ".join(parts) or "no GPU"

    def _decided_uuid(self, claim: Claim, entry: GpuEntry) -> str:
        by_minor = {m: u for u, m in self._minors().items()}
        uuid = by_minor.get(entry.minor)
        if uuid is None:
            have = ", ".join(str(m) for m in sorted(by_minor)) or "none"
            self._refuse(claim, f"GPU minor {entry.minor} is not on this node (its minors: {have})")
            raise AssertionError("unreachable")
        return uuid

    def _check_usable(self, claim: Claim, uuid: str, *, whole: bool) -> DeviceState:
        # The ledger's one answer, refused as a decision that cannot be followed.
        refused = self.ledger.refusal(uuid, whole=whole)
        if refused is not None:
            # Its message names the card by UUID; the Event names it by minor too.
            self._refuse(claim, "GPU " + refused.message.replace(uuid, self._describe([uuid]), 1))
        return self.ledger.device(uuid)

    def withheld(self) -> dict[str, str]:
        """Cards kubelet must not count as whole GPUs, and why: healthy, present, not
        held whole (kubelet knows of those), yet the ledger refuses them whole -- they
        hold shares. The device plugin lists them ``Unhealthy`` for the whole-GPU
        resource."""
        out: dict[str, str] = {}
        for d in self.ledger.devices():
            if d.present and self.ledger.refusal(d.uuid, whole=False) is None:
                refused = self.ledger.refusal(d.uuid, whole=True)
                if refused is not None:
                    out[d.uuid] = refused.message
        return out

    def _decided_whole(self, claim: Claim) -> list[str]:
        """The UUIDs koord-scheduler decided for a whole-GPU claim, checked usable."""
        if claim.problem:
            self._refuse(claim, claim.problem)
        uuids = [self._decided_uuid(claim, e) for e in claim.gpus]
        for uuid in uuids:
            self._check_usable(claim, uuid, whole=True)
        return uuids

    def _mark(self, claim: Claim | None, allocation: str, undo: list[Undo]) -> None:
        if claim is None or self.book is None:
            return
        book = self.book
        book.mark(claim, allocation)
        self.decisions_followed += 1
        undo.append(lambda: book.unmark(claim))

    def _allocate_decided_share(
        self, resource: str, kind: GrantKind, ids: list[str], key: str, undo: list[Undo]
    ) -> ContainerAllocation:
        """A Koordinator share: card and amounts from the annotation, never guessed.

        The container's first share call (gpu-core or gpu-memory-ratio, in whichever
        order kubelet asks) places the allocation; the other joins it. Both answers
        carry both MPS limits, as decided.
        """
        claim = self._claim(resource, len(ids))
        if claim is None:
            raise Refused(
                "scheduler_decision",
                f"no pending pod on this node carries koord-scheduler's decision for a "
                f"container asking {len(ids)} {resource}: under the koordinator profile "
                f"shares are placed by koord-scheduler (is the pod scheduled by it, and "
                f"is the pod watch running?)",
            )
        if claim.problem:
            self._refuse(claim, claim.problem)
        if not claim.gpus:
            self._refuse(claim, "the annotation decides no GPU for this container")
        assert self.book is not None
        for other in claim.share_resources:
            existing = self.book.allocation_of(claim, other)
            if existing is not None and self.ledger.get(existing) is not None:
                grant = self._new_grant(
                    key,
                    resource,
                    kind,
                    len(ids),
                    existing,
                    undo,
                    claim=claim,
                    limits=self._decided_limits(claim),
                )
                self._mark(claim, existing, undo)
                return grant
        uuids = [self._decided_uuid(claim, e) for e in claim.gpus]
        whole = all(e.whole for e in claim.gpus)
        if whole:
            for uuid in uuids:
                self._check_usable(claim, uuid, whole=True)
            self.ledger.allocate_whole(Owner(allocation_id=key), devices=uuids)
        else:
            if len(claim.gpus) != 1:
                self._refuse(
                    claim, f"a share spans {len(claim.gpus)} GPUs; gpulet places a share on one"
                )
            entry, uuid = claim.gpus[0], uuids[0]
            state = self._check_usable(claim, uuid, whole=False)
            info = self._gpus[uuid]
            units = max(1, entry.memory_of(info.memory_total_bytes) // (MEMORY_UNIT_MIB * 2**20))
            if entry.core > state.cores_free or units > state.memory_free:
                self._refuse(
                    claim,
                    f"GPU {self._describe([uuid])} has {state.cores_free} core units and "
                    f"{state.memory_free} memory units free, the decision needs "
                    f"{entry.core} and {units}",
                )
            try:
                self.ledger.allocate_share(Owner(allocation_id=key), entry.core, units, device=uuid)
            except Refused as exc:
                self._refuse(claim, f"GPU {self._describe([uuid])}: {exc.message}")
        grant = self._new_grant(
            key,
            resource,
            kind,
            len(ids),
            key,
            undo,
            own=True,
            claim=claim,
            limits=self._decided_limits(claim),
        )
        self._mark(claim, key, undo)
        return grant

    def _decided_limits(self, claim: Claim) -> tuple[int, int]:
        """(cores, memory MiB) of a one-card share decision; (0, 0) for whole cards."""
        if len(claim.gpus) != 1 or claim.gpus[0].whole:
            return 0, 0
        entry = claim.gpus[0]
        uuid = {m: u for u, m in self._minors().items()}.get(entry.minor)
        card = self._gpus[uuid].memory_total_bytes if uuid in self._gpus else 0
        return entry.core, memory_mib(entry, card)

    def _check_ids(self, resource: str, kind: GrantKind, ids: list[str], n: int) -> None:
        if not ids:
            raise Refused("invalid_request", f"container {n} asks for no {resource} device")
        if len(set(ids)) != len(ids):
            # Counted in one pass: ids.count() per ID was quadratic, so one hostile
            # request of 20,000 IDs held the event loop (every endpoint) for seconds.
            dupes = sorted(i for i, n in Counter(ids).items() if n > 1)
            raise Refused("invalid_request", f"duplicate device IDs: {', '.join(dupes[:5])}")
        bad: list[str] = []
        unknown_gpus: set[str] = set()
        expected = ResourceKind(kind)
        for device_id in ids:
            try:
                parsed = parse_device_id(device_id)
            except ValueError:
                bad.append(device_id)
                continue
            if parsed.kind is not expected:
                bad.append(device_id)
                continue
            known = self._known_gpu(parsed.gpu_uuid)
            if not known:
                unknown_gpus.add(parsed.gpu_uuid)
            elif parsed.unit is not None and not self._unit_exists(
                parsed.gpu_uuid, kind, parsed.unit
            ):
                bad.append(device_id)
        if bad:
            shown = ", ".join(repr(b) for b in bad[:5])
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise Refused(
                "unknown_device", f"not {resource} device IDs of this node: {shown}{more}"
            )
        if unknown_gpus:
            raise Refused("unknown_device", f"unknown GPU IDs: {', '.join(sorted(unknown_gpus))}")

    def _known_gpu(self, uuid: str) -> bool:
        if uuid in self._gpus:
            return True
        try:
            self.ledger.device(uuid)
        except Refused:
            return False
        return True

    def _unit_exists(self, uuid: str, kind: GrantKind, unit: int) -> bool:
        if kind in ("core", "ratio"):
            return unit < CORES_PER_GPU
        info = self._gpus.get(uuid)
        # A lost GPU's size is unknown; kubelet no longer lists its units anyway.
        return info is None or unit < memory_units_of(info.memory_total_bytes)

    def _check_memory(self, units: int) -> None:
        sizes = self._card_sizes()
        if sizes and units > max(sizes):
            largest = max(self._present(), key=lambda g: (g.memory_total_bytes, -g.index))
            raise Refused(
                "memory_exceeds_card",
                f"the share asks for {units} memory units ({units * MEMORY_UNIT_MIB} MiB) "
                f"but the largest card, {largest.uuid}, has {max(sizes)} "
                f"({max(sizes) * MEMORY_UNIT_MIB} MiB)",
            )

    def _present(self) -> list[GpuInfo]:
        return list(self._gpus.values())

    def _card_sizes(self) -> list[int]:
        return [u for g in self._gpus.values() if (u := memory_units_of(g.memory_total_bytes)) > 0]

    def _proportional_memory(self, cores: int) -> int:
        sizes = self._card_sizes()
        if not sizes:
            return 1
        return max(1, math.ceil(cores * min(sizes) / CORES_PER_GPU))

    def _proportional_cores(self, units: int) -> int:
        sizes = self._card_sizes()
        if not sizes:
            return 1
        return min(CORES_PER_GPU - 1, max(1, math.ceil(units * CORES_PER_GPU / max(sizes))))

    def _place_half(
        self, key: str, cores: int, memory: int, *, least: tuple[int, int], asked: str
    ) -> None:
        """Place a first half; if the proportional guess does not fit, the least share."""
        try:
            self.ledger.allocate_share(Owner(allocation_id=key), cores, memory)
        except Refused as exc:
            if exc.code != "insufficient_capacity" or (cores, memory) == least:
                raise
        else:
            return
        try:
            self.ledger.allocate_share(Owner(allocation_id=key), *least)
        except Refused as exc:
            if exc.code != "insufficient_capacity":
                raise
            raise Refused(
                exc.code, f"no card has {asked} free for a share: {exc.message}"
            ) from None

    def _joinable_any(self, half: Literal["core", "memory"], now: float) -> Allocation | None:
        open_half = self._open
        if open_half is None or open_half.kind != half or now - open_half.at > self._join_window_s:
            return None
        return self.ledger.get(open_half.allocation)

    def _joinable(self, half: Literal["core", "memory"], now: float) -> ShareAllocation | None:
        alloc = self._joinable_any(half, now)
        return alloc if isinstance(alloc, ShareAllocation) else None

    def _resize(
        self,
        share: ShareAllocation,
        *,
        half: Literal["core", "memory"],
        undo: list[Undo],
        cores: int | None = None,
        memory: int | None = None,
    ) -> None:
        new_cores = share.cores if cores is None else cores
        new_memory = share.memory_units if memory is None else memory
        if (new_cores, new_memory) == (share.cores, share.memory_units):
            return
        owner = share.owner
        self.ledger.release(owner.allocation_id)
        try:
            self.ledger.allocate_share(owner, new_cores, new_memory, device=share.device)
        except Refused as exc:
            # Restore skips the health check: the first half must come back as it was.
            self.ledger.restore([share])
            other = "memory" if half == "core" else "core"
            raise Refused(
                exc.code,
                f"this container's {other} request already placed its share on "
                f"{share.device}, which cannot take {new_cores} core units and "
                f"{new_memory} memory units: {exc.message}",
            ) from None

        def revert() -> None:
            self.ledger.release(owner.allocation_id)
            self.ledger.restore([share])

        undo.append(revert)

    def _new_grant(
        self,
        key: str,
        resource: str,
        kind: GrantKind,
        units: int,
        allocation: str,
        undo: list[Undo],
        *,
        own: bool = False,
        claim: Claim | None = None,
        limits: tuple[int, int] = (0, 0),
    ) -> ContainerAllocation:
        grant = Grant(
            key=key,
            resource=resource,
            kind=kind,
            units=units,
            allocation=allocation,
            created_at=self._wall(),
            pod=str(claim.pod) if claim is not None else "",
            container=claim.container if claim is not None else "",
            mps_cores=limits[0],
            mps_memory_mib=limits[1],
        )
        self._grants[key] = grant
        self.version += 1

        def revert() -> None:
            self._grants.pop(key, None)
            if own:
                self.ledger.release(allocation)

        undo.append(revert)
        return self._answer(grant)

    # --- answers -------------------------------------------------------------------------

    def _answer(self, grant: Grant) -> ContainerAllocation:
        alloc = self.ledger.get(grant.allocation)
        if alloc is None:
            raise Refused("internal", f"grant {grant.key} has lost its allocation")
        gpus = list(alloc.devices) if isinstance(alloc, WholeAllocation) else [alloc.device]
        envs = {"NVIDIA_VISIBLE_DEVICES": ",".join(gpus), ALLOCATION_ENV: grant.allocation}
        mounts: list[Mount] = []
        if isinstance(alloc, ShareAllocation) and self._mps.enabled:
            if grant.mps_cores:
                # A share koord-scheduler decided: both limits, as it accounted them.
                envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(grant.mps_cores)
                envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={grant.mps_memory_mib}M"
            elif grant.kind == "core":
                envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(alloc.cores)
            elif grant.kind == "memory":
                # One visible device, so it is ordinal 0 inside the container.
                mib = alloc.memory_units * MEMORY_UNIT_MIB
                envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={mib}M"
            if self._mps.pipe_directory:
                envs["CUDA_MPS_PIPE_DIRECTORY"] = self._mps.pipe_directory
                mounts.append(
                    Mount(
                        container_path=self._mps.pipe_directory,
                        host_path=self._mps.pipe_directory,
                    )
                )
        cdi: list[str] = []
        if self._cdi.enabled:
            for uuid in gpus:
                info = self._gpus.get(uuid)
                name = str(info.index) if self._cdi.device_name == "index" and info else uuid
                cdi.append(f"{self._cdi.kind}={name}")
        return ContainerAllocation(
            gpus=gpus,
            envs=envs,
            mounts=mounts,
            annotations={ALLOCATION_ANNOTATION: grant.allocation},
            cdi_devices=cdi,
        )

    # --- GetPreferredAllocation -------------------------------------------------------------

    def preferred(self, resource: str, requests: Sequence[PreferredRequest]) -> list[list[str]]:
        kind = self.resource_kind(resource)
        if kind != "whole":
            # Shares are placed by Allocate itself; any IDs will do.
            return [self._preferred_share(r) for r in requests]
        if not self.ready:
            raise Refused("not_ready", "the allocator has no GPU inventory yet")
        return [self._preferred_decided(resource, r) or self._preferred_one(r) for r in requests]

    def _preferred_decided(self, resource: str, request: PreferredRequest) -> list[str] | None:
        """Exactly the GPUs koord-scheduler decided, or None when no pod's decision
        covers the call (then gpulet chooses). Nothing is marked: the Allocate that
        follows does it."""
        claim = self._claim(resource, request.size)
        if claim is None:
            return None
        decided = self._decided_whole(claim)
        offered = set(request.available)
        missing = [u for u in decided if u not in offered]
        if missing:
            self._refuse(claim, f"kubelet does not offer {self._describe(missing)}")
        extra = [u for u in request.must_include if u not in decided]
        if extra:
            self._refuse(
                claim,
                f"kubelet must include {self._describe(extra)}, "
                "which koord-scheduler did not decide",
            )
        self.decisions_followed += 1
        return decided

    @staticmethod
    def _preferred_share(request: PreferredRequest) -> list[str]:
        # Any IDs will do, but the answer must be one kubelet can use: exactly ``size``
        # of the offered IDs, must-include among them. Slicing alone answered a size
        # of -1 with all IDs but the last and a must-include that was never offered
        # with itself, so a malformed request is refused like a whole-GPU one
        # (the same checks and messages as the engine's ``whole._validate``).
        available = list(dict.fromkeys(request.available))
        must = list(dict.fromkeys(request.must_include))
        if request.size <= 0:
            raise Refused(
                "invalid_request", f"the request size must be positive, got {request.size}"
            )
        offered = set(available)
        missing = [i for i in must if i not in offered]
        if missing:
            shown = ", ".join(sorted(missing)[:5])
            raise Refused("invalid_request", f"must-include IDs are not available: {shown}")
        if len(must) > request.size:
            raise Refused(
                "invalid_request",
                f"must-include lists {len(must)} IDs but the request is for {request.size}",
            )
        if request.size > len(available):
            raise Refused(
                "too_many_units",
                f"asks {request.size} units but only {len(available)} are available",
            )
        return list(dict.fromkeys([*must, *available]))[: request.size]

    def _preferred_one(self, request: PreferredRequest) -> list[str]:
        unknown_must = [u for u in request.must_include if not self._known_gpu(u)]
        if unknown_must:
            raise Refused("unknown_device", f"unknown GPU IDs: {', '.join(unknown_must)}")
        # Unknown offers are left out rather than failing the hint for the whole node.
        available = [u for u in request.available if u in self.ledger.topology]
        return self.ledger.preferred(available, request.must_include, request.size)

    # --- release ---------------------------------------------------------------------------

    def release(self, request: ReleaseRequest) -> list[AllocationView]:
        """Explicit release; unknown names release nothing (it is idempotent)."""
        targets: list[str] = []
        if not (request.allocation_ids or request.pods or request.device_ids):
            raise Refused(
                "invalid_request", "name allocation_ids, pods, or resource and device_ids"
            )
        targets.extend(a for a in request.allocation_ids if self.ledger.get(a) is not None)
        if request.pods:
            wanted = set(request.pods)
            targets.extend(g.allocation for g in self._grants.values() if g.pod in wanted)
        if request.device_ids:
            kind = self.resource_kind(request.resource)
            grant = self._grants.get(grant_key(kind, request.resource, request.device_ids))
            if grant is not None:
                targets.append(grant.allocation)
        released = [self._release(a) for a in dict.fromkeys(targets)]
        views = [v for v in released if v is not None]
        if views:
            log.info(
                "released %s (%s)", ", ".join(v.id for v in views), request.reason or "explicit"
            )
        return views

    def _release(self, allocation: str) -> AllocationView | None:
        if self.ledger.get(allocation) is None:
            return None
        view = self._view(allocation)
        self.ledger.release(allocation)
        for key in [k for k, g in self._grants.items() if g.allocation == allocation]:
            del self._grants[key]
        self._missing_since.pop(allocation, None)
        if self._open is not None and self._open.allocation == allocation:
            self._open = None
        self.version += 1
        return view

    def reconcile(self, live: Mapping[str, PodRef]) -> list[AllocationView]:
        """Apply one PodResources answer: ``live`` maps live grant keys to their pod."""
        now, wall = self._clock(), self._wall()
        changed = False
        for key, ref in live.items():
            grant = self._grants.get(key)
            if grant is not None and (grant.pod, grant.container) != (ref.pod, ref.container):
                self._grants[key] = msgspec.structs.replace(
                    grant, pod=ref.pod, container=ref.container
                )
                changed = True
        by_allocation: dict[str, list[Grant]] = {}
        for grant in self._grants.values():
            by_allocation.setdefault(grant.allocation, []).append(grant)
        released: list[AllocationView] = []
        for allocation, grants in sorted(by_allocation.items()):
            alive = [g for g in grants if g.key in live]
            if alive:
                self._missing_since.pop(allocation, None)
                self._check_join(allocation, alive, live)
                continue
            since = self._missing_since.setdefault(allocation, now)
            newest = max(g.created_at for g in grants)
            if now - since >= self._grace_s and wall - newest >= self._grace_s:
                view = self._release(allocation)
                if view is not None:
                    released.append(view)
        for allocation in list(self._missing_since):
            if allocation not in by_allocation:
                del self._missing_since[allocation]
        if changed:
            self.version += 1
        if released:
            log.info(
                "released %d allocation(s) of pods that no longer exist: %s",
                len(released),
                ", ".join(f"{v.id} ({_pods(v)})" for v in released),
            )
        return released

    def _check_join(self, allocation: str, alive: list[Grant], live: Mapping[str, PodRef]) -> None:
        holders = {live[g.key] for g in alive}
        if len(holders) > 1 and allocation not in self._mismatch_reported:
            self._mismatch_reported.add(allocation)
            self.join_mismatches += 1
            log.warning(
                "share %s was joined across containers %s: its accounting is approximate "
                "(request gpu-core and gpu-memory together in share containers)",
                allocation,
                ", ".join(sorted(f"{h.pod}/{h.container}" for h in holders)),
            )

    # --- a lost record -----------------------------------------------------------------------

    def lost_refusal(self) -> Refused:
        blocker = f"; {self.rebuild_blocker}" if self.rebuild_blocker else ""
        return Refused(
            "checkpoint_lost",
            f"the record of this node's allocations is lost: {self.lost}{blocker}. GPUs "
            "that running pods hold are unknown, so nothing is allocated until kubelet's "
            "PodResources API rebuilds the record or an operator accepts the loss with "
            f"`gpulet allocator reset --confirm --node {self.node}`",
        )

    def adopt(self, held: Iterable[HeldDevices]) -> Adoption:
        """Take over the whole-GPU grants kubelet lists that the ledger lacks.

        For a lost record: kubelet names the cards of ``nvidia.com/gpu`` (its IDs are
        the UUIDs), so those grants are recorded as they were answered (same key, same
        allocation ID). A share's card was chosen by the allocator, not by kubelet, so
        a container holding share units cannot be placed: it is reported as
        ``unplaceable``. Adopting only ever adds holders, so it is safe to repeat.
        """
        adopted = 0
        unplaceable: list[str] = []
        conflicts: list[str] = []
        wall = self._wall()
        for item in held:
            kind = self._kinds.get(item.resource)
            if kind is None or not item.device_ids:
                continue
            key = grant_key(kind, item.resource, item.device_ids)
            where = f"{item.ref.pod}/{item.ref.container}"
            if key in self._grants:
                continue
            if kind != "whole":
                unplaceable.append(f"{where} ({len(item.device_ids)} {item.resource})")
                continue
            try:
                uuids = tuple(parse_device_id(i).gpu_uuid for i in item.device_ids)
            except ValueError as exc:
                conflicts.append(f"{where}: {exc}")
                continue
            problems = self.ledger.restore(
                [WholeAllocation(owner=Owner(allocation_id=key), devices=uuids)]
            )
            if problems:
                conflicts.extend(f"{where}: {p}" for p in problems)
                continue
            self._grants[key] = Grant(
                key=key,
                resource=item.resource,
                kind=kind,
                units=len(uuids),
                allocation=key,
                created_at=wall,
                pod=item.ref.pod,
                container=item.ref.container,
            )
            adopted += 1
        if adopted:
            self.version += 1
        return Adoption(adopted, tuple(unplaceable), tuple(conflicts))

    def mark_lost(self, reason: str) -> None:
        """Refuse to allocate until the record is rebuilt or the loss accepted."""
        if self.lost != reason:
            self.lost = reason
            self.version += 1

    def end_loss(self) -> str | None:
        """The record is whole again (rebuilt, or the loss accepted); returns the old reason."""
        reason, self.lost, self.rebuild_blocker = self.lost, None, ""
        if reason is not None:
            self.version += 1
        return reason

    # --- views and persistence --------------------------------------------------------------

    def _view(self, allocation: str) -> AllocationView:
        alloc = self.ledger.get(allocation)
        grants = sorted(
            (g for g in self._grants.values() if g.allocation == allocation),
            key=lambda g: (g.created_at, g.key),
        )
        grant_views = [
            GrantView(
                key=g.key,
                resource=g.resource,
                kind=g.kind,
                units=g.units,
                created_at=g.created_at,
                pod=g.pod,
                container=g.container,
            )
            for g in grants
        ]
        if isinstance(alloc, ShareAllocation):
            return AllocationView(
                id=allocation,
                kind="share",
                gpus=[alloc.device],
                cores=alloc.cores,
                memory_units=alloc.memory_units,
                grants=grant_views,
            )
        devices = list(alloc.devices) if alloc is not None else []
        return AllocationView(
            id=allocation,
            kind="whole",
            gpus=devices,
            cores=CORES_PER_GPU * len(devices),
            grants=grant_views,
        )

    def allocation_views(self) -> list[AllocationView]:
        return [self._view(a.owner.allocation_id) for a in self.ledger.allocations()]

    def state(self, *, checkpoint: str = "") -> StateReply:
        gpus = [
            GpuView(
                uuid=d.uuid,
                index=d.index,
                healthy=d.healthy,
                present=d.present,
                cores_used=d.cores_used,
                memory_units=d.memory_units,
                memory_used=d.memory_used,
                whole=d.whole_owner.allocation_id if d.whole_owner else "",
                shares=[s.owner.allocation_id for s in d.shares],
            )
            for d in self.ledger.devices()
        ]
        return StateReply(
            node=self.node,
            ready=self.ready and self.lost is None,
            gpus=gpus,
            allocations=self.allocation_views(),
            checkpoint=checkpoint,
            inventory_generation=self.inventory_generation,
            lost=self.lost_refusal().message if self.lost is not None else "",
        )

    def snapshot(self) -> StoredState:
        return StoredState(
            node=self.node,
            allocations=self.ledger.snapshot(),
            grants=sorted(self._grants.values(), key=lambda g: g.key),
            lost=self.lost or "",
        )

    def restore(self, state: StoredState) -> list[str]:
        """Adopt a checkpoint; returns one line per entry set aside."""
        if state.lost:
            self.lost = state.lost
        problems = self.ledger.restore(state.allocations)
        for grant in state.grants:
            if self.ledger.get(grant.allocation) is None:
                problems.append(f"grant {grant.key}: allocation {grant.allocation} is unknown")
                continue
            self._grants[grant.key] = grant
        owned = {g.allocation for g in self._grants.values()}
        for alloc in self.ledger.allocations():
            if alloc.owner.allocation_id not in owned:
                # Nothing could ever name it again, so nothing would release it.
                problems.append(f"allocation {alloc.owner.allocation_id} has no grant; released")
                self.ledger.release(alloc.owner.allocation_id)
        if problems:
            self.version += 1
        return problems


def _check_across(containers: Sequence[Sequence[str]]) -> None:
    """Kubelet gives a device to one container: a request naming one in two is refused
    (checked per container, a repeated set would read as a retry of the first)."""
    seen: dict[str, int] = {}
    for n, ids in enumerate(containers):
        for device_id in ids:
            first = seen.setdefault(device_id, n)
            if first != n:
                raise Refused(
                    "invalid_request",
                    f"device {device_id[:100]!r} is named by containers {first} and {n} of "
                    "one request; a device goes to one container",
                )


def _pods(view: AllocationView) -> str:
    pods = sorted({g.pod for g in view.grants if g.pod})
    return ", ".join(pods) if pods else "pod unknown"
