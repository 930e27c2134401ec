"""The allocator's decision core: one small, typed interface for every kubelet adapter.

Kubelet never says which pod it allocates for: an ``Allocate`` call carries only the
device IDs it picked of one resource, one list per container. The core bridges that to
the engine's ledger, synchronously and without I/O, so the NATS service
(:mod:`gpulet_allocator.service`) and the in-process benchmark drive the very same
code, and a second kubelet adapter (DRA's kubelet plugin) will too.

Interface
---------
:class:`AllocatorCore`: ``allocate`` and ``preferred`` (kubelet's calls), ``release``
and ``reconcile`` (explicit, and from PodResources), ``update_inventory`` and
``set_health`` (the node's read model), ``withheld`` (cards not to be offered whole),
``claims.reserve``/``claims.release`` (DRA's kubelet plugin, :mod:`.claims`),
``snapshot``/``restore`` (the checkpoint), ``adopt``/``mark_lost``/``end_loss`` (a lost
record), ``state`` and ``allocation_views``. Every refusal is a
:class:`~gpulet_common.refusal.Refused` with a code of the one table.

Pieces, by concern (each a module of :mod:`gpulet_allocator.decide`):

* :mod:`.books` -- ledger access and health gating: the ledger, the grants, the
  inventory, the change version;
* :mod:`.checks` -- what a request must be before anything is decided;
* the engine (:mod:`.engine`) -- whole-GPU placement, topology- and
  fragmentation-aware; :mod:`.joining` -- gpulet's shares and the join rule;
* :mod:`.handshake` -- koord-scheduler's decisions (:mod:`.koordinator`'s book);
* :mod:`.record` -- checkpoint snapshots, restores and the lost record;
* :mod:`.release` -- releases, explicit and of pods that are gone;
* :mod:`.answers` and :mod:`.views` -- what a container and an operator are told.

**Grants.** Each container list of an ``Allocate`` call is a *grant*, keyed by a hash
of the resource name and the sorted device IDs (:func:`~.books.grant_key`). Kubelet
never gives the same device ID to two live containers, so the key names one
container's request, and a retry of the call (kubelet's, or after an allocator
restart, since grants are checkpointed with the allocations) finds the grant and gets
the recorded answer: nothing is allocated twice -- unless the pod watch says the call
is another pod's, which is refused as already held (:mod:`.handshake`). An allocation
(the ledger's entry) is owned by the key of its first grant, which is also its ID
(``gpulet.io/allocation`` annotation, ``GPULET_ALLOCATION_ID`` env).

**Resources.** ``nvidia.com/gpu`` IDs are GPU UUIDs; kubelet's pick is honoured (and
steered beforehand by ``GetPreferredAllocation``, which the engine answers
topology- and fragmentation-aware). A named GPU that may not take it (the ledger's one
answer, :meth:`~.engine.Ledger.refusal`: unhealthy, lost, held, holding shares) is
refused precisely rather than swapped, so kubelet's accounting never drifts from
ours. Share IDs (``<uuid>::core-<n>``, ``<uuid>::mem-<n>``) are only counted, as
gpu-manager does: N core IDs are N core units wherever kubelet took them from, and the
allocator places the share itself (:mod:`.joining`); 150 core units are refused
(``invalid_core_units``).

**MIG** (:mod:`gpulet_allocator.mig`): a MIG-enabled GPU is refused whole and shared
by the ledger's one answer. Under the ``single`` and ``mixed`` strategies MIG UUIDs are
whole-kind IDs of the resource the strategy offers them under (``nvidia.com/gpu``, or
``nvidia.com/mig-<profile>``); a MIG UUID under any other resource, or not offered by
the strategy (``none``, an invalid single layout), is refused as ``unknown_device``.

**Time-slicing** (:mod:`gpulet_allocator.timeslicing`, :mod:`.timeslice`): a replica
``<uuid>::<n>`` is a whole-kind ID of ``nvidia.com/gpu``, a card of its own in the
ledger; the container is given its GPU. The ledger's one answer keeps one owner per GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import cast

from gpulet_allocator.decide import checks
from gpulet_allocator.decide.answers import Answers
from gpulet_allocator.decide.books import Books, Undo, grant_key
from gpulet_allocator.decide.claims import Claims
from gpulet_allocator.decide.engine import Ledger, Owner
from gpulet_allocator.decide.handshake import Handshake, RefusalHook
from gpulet_allocator.decide.joining import ShareJoiner
from gpulet_allocator.decide.koordinator import PodBook
from gpulet_allocator.decide.record import Adoption, HeldDevices, PodRef, Record
from gpulet_allocator.decide.release import Releases
from gpulet_allocator.decide.timeslice import TimeSlicing
from gpulet_allocator.decide.views import allocation_views, gpu_views
from gpulet_allocator.mig import MigPlan, MigStrategy, mig_plan, mig_resource_prefix
from gpulet_allocator.protocol import (
    AllocationView,
    ContainerAllocation,
    PreferredRequest,
    ReleaseRequest,
    StateReply,
    card_id,
    resource_specs,
)
from gpulet_allocator.state.records import Grant, GrantKind, StoredState
from gpulet_common.messages import Inventory
from gpulet_common.refusal import Refused
from gpulet_common.settings.allocator import CdiSettings, MpsSettings, ResourceNames
from gpulet_common.settings.sharing import TimeSlicingSettings


class AllocatorCore:
    """The decision core (see the module docstring). Not thread-safe: one event loop."""

    def __init__(
        self,
        *,
        node: str,
        names: ResourceNames,
        shares: bool = True,
        mps: MpsSettings | None = None,
        mps_root: str = "",
        cdi: CdiSettings | None = None,
        join_window_s: float = 5.0,
        release_grace_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        health_of: Callable[[str], bool] = lambda _uuid: True,
        profile: str = "gpulet",
        book: PodBook | None = None,
        on_refusal: RefusalHook | None = None,
        mig_strategy: MigStrategy = "none",
        time_slicing: TimeSlicingSettings | None = None,
    ) -> None:
        self.node = node
        self.names = names
        self.mig_strategy: MigStrategy = mig_strategy
        #: What the MIG strategy offers of the current inventory.
        self.mig = MigPlan(strategy=mig_strategy)
        self.books = Books(clock=clock, wall_clock=wall_clock, health_of=health_of)
        self._kinds: dict[str, GrantKind] = {
            # resource_specs never gives the plugin's MIG kind (mixed MIG resources
            # are whole-kind here: kind_of).
            spec.name: cast(GrantKind, spec.kind.value)
            for spec in resource_specs(names, shares=shares, profile=profile)
        }
        self.handshake = Handshake(
            self.books, book, koordinator=profile == "koordinator", on_refusal=on_refusal
        )
        self.joiner = ShareJoiner(self.books, join_window_s)
        self.record = Record(self.books, node, self._kinds)
        self.releases = Releases(
            self.books,
            grace_s=release_grace_s,
            kind_of=self.resource_kind,
            on_release=self.joiner.forget,
        )
        #: DRA claims (the DRA kubelet plugin): ``reserve`` (raises Refused; its undo,
        #: None when nothing changed, reverts it for a checkpoint that failed) and
        #: ``release``. A reservation is refused like Allocate while the record is lost
        #: or there is no inventory.
        self.claims = Claims(self.books, self._refuse_unready)
        self._answers = Answers(
            self.books, mps or MpsSettings(), cdi or CdiSettings(), mps_root=mps_root
        )
        #: Time-slicing replicas: the node's config in force (:mod:`.timeslice`).
        self.time_slicing = TimeSlicing(
            self.books, time_slicing or TimeSlicingSettings(), names.gpu
        )

    # --- what the pieces hold -----------------------------------------------------------

    @property
    def ledger(self) -> Ledger:
        return self.books.ledger

    @property
    def version(self) -> int:
        """Bumped on every change that must reach the checkpoint."""
        return self.books.version

    @property
    def book(self) -> PodBook | None:
        """This node's watched pods (koord-scheduler's decisions); None: no handshake."""
        return self.handshake.book

    @property
    def lost(self) -> str | None:
        """Why the record of allocations is lost (None: it is not); Allocate is refused."""
        return self.record.lost

    @property
    def ready(self) -> bool:
        return self.books.inventory is not None

    @property
    def inventory_generation(self) -> int:
        inventory = self.books.inventory
        return inventory.generation if inventory else 0

    # --- inputs ---------------------------------------------------------------------------

    def pod_uid(self, namespace: str, name: str) -> str:
        """The UID of this node's pod by name, from the pod watch ("" unknown)."""
        book = self.handshake.book
        return book.uid_of(namespace, name) if book is not None else ""

    def kind_of(self, resource: str) -> GrantKind | None:
        kind = self._kinds.get(resource)
        if kind is None and self._mig_resource(resource):
            return "whole"
        return kind

    def _mig_resource(self, resource: str) -> bool:
        prefix = mig_resource_prefix(self.names.gpu)
        return self.mig_strategy == "mixed" and resource.startswith(prefix) and resource != prefix

    def resource_kind(self, resource: str) -> GrantKind:
        kind = self.kind_of(resource)
        if kind is None:
            served = ", ".join(sorted(self._kinds))
            raise Refused("unknown_resource", f"{resource!r} is not served here ({served})")
        return kind

    def update_inventory(self, inventory: Inventory) -> bool:
        if not self.books.update_inventory(inventory):
            return False
        self.mig = mig_plan(inventory.gpus, self.mig_strategy, self.names.gpu)
        self.time_slicing.apply()
        return True

    def check_mig_pool(self, resource: str, uuids: Sequence[str]) -> None:
        """MIG UUIDs only under the resource their strategy offers them as; a MIG
        resource takes its MIG devices only."""
        for uuid in uuids:
            offer = self.mig.offers.get(uuid)
            if offer is not None and offer.resource == resource:
                continue
            if offer is not None:
                why = f"a {offer.resource} device"
            elif self.ledger.is_mig(uuid):
                why = f"a MIG device, not offered under the {self.mig_strategy!r} MIG strategy"
                if self.mig.invalid:
                    why += f" (invalid single layout: {self.mig.invalid})"
            elif self._mig_resource(resource):
                why = "not a MIG device"
            else:
                continue
            raise Refused("unknown_device", f"{uuid} is not a {resource} device: {why}")

    def set_health(self, uuid: str, healthy: bool) -> bool:
        return self.books.set_health(uuid, healthy)

    def mig_devices_of(self, uuid: str) -> list[str]:
        """The MIG devices (UUIDs) of a GPU of the inventory, whose health follows
        their own conditions (their GPU's is checked by the ledger)."""
        info = self.books.gpus.get(uuid)
        if info is None or info.mig_mode != "enabled":
            return []
        return [d.uuid for d in info.mig_devices]

    def withheld(self) -> dict[str, str]:
        return self.books.withheld()

    # --- Allocate ---------------------------------------------------------------------------

    def allocate(
        self, resource: str, containers: Sequence[Sequence[str]]
    ) -> tuple[list[ContainerAllocation], Undo]:
        """Answer kubelet's Allocate; all containers or none (raises :class:`Refused`).

        The returned undo reverts what this call changed, for a checkpoint that failed.
        """
        kind = self.resource_kind(resource)
        self._refuse_unready()
        if not containers:
            raise Refused("invalid_request", "the request names no container")
        checks.check_across(containers)
        undo: list[Undo] = []
        try:
            answers = [
                self._answers.answer(self._allocate_one(resource, kind, list(ids), n, undo))
                for n, ids in enumerate(containers)
            ]
        except Exception:
            # All or nothing (a refusal, or a bug that then surfaces): an earlier
            # container of this call is given back. The open half is closed too:
            # kubelet fails this pod and moves on to the next.
            self._revert(undo)
            self.joiner.close()
            raise
        return answers, lambda: self._revert(undo)

    def _revert(self, undo: list[Undo]) -> None:
        if not undo:
            return
        for step in reversed(undo):
            step()
        self.joiner.after_revert()
        self.books.version += 1

    def _allocate_one(
        self, resource: str, kind: GrantKind, ids: list[str], n: int, undo: list[Undo]
    ) -> Grant:
        books = self.books
        checks.check_ids(books, resource, kind, ids, n)
        key = grant_key(kind, resource, ids)
        existing = books.grants.get(key)
        if existing is not None:
            self.handshake.check_retry(existing, resource, kind, ids)
            return existing
        if kind == "whole":
            # A replica is a card of its own (its GPU is the ledger's ``gpu_of``).
            uuids = [card_id(i) for i in ids]
            self.check_mig_pool(resource, uuids)
            claim = self.handshake.whole_claim(resource, uuids)
            books.ledger.allocate_whole(Owner(allocation_id=key), devices=uuids)
            self.joiner.close()
            pod, container, uid = (
                (str(claim.pod), claim.container, claim.pod.uid) if claim else ("", "", "")
            )
            grant = books.grant(
                key, resource, kind, len(ids), key, pod=pod, container=container, pod_uid=uid
            )
            books.new_grant(grant, undo, own=True)
            self.handshake.mark(claim, key, undo)
            return grant
        if kind in ("core", "ratio") and self.handshake.koordinator:
            return self.handshake.decided_share(resource, kind, ids, key, undo)
        return self.joiner.place(key, resource, kind, len(ids), undo)

    def _refuse_unready(self) -> None:
        """Nothing is granted while the record is lost or there is no inventory."""
        if self.record.lost is not None:
            raise self.record.lost_refusal()
        if not self.ready:
            raise Refused("not_ready", "the allocator has no GPU inventory yet")

    # --- GetPreferredAllocation ---------------------------------------------------------

    def preferred(self, resource: str, requests: Sequence[PreferredRequest]) -> list[list[str]]:
        kind = self.resource_kind(resource)
        if kind != "whole":
            return [checks.preferred_share(r) for r in requests]
        if not self.ready:
            raise Refused("not_ready", "the allocator has no GPU inventory yet")
        return [
            self.handshake.preferred(resource, r) or self._preferred_one(resource, r)
            for r in requests
        ]

    def _preferred_one(self, resource: str, request: PreferredRequest) -> list[str]:
        unknown_must = [u for u in request.must_include if not self.books.known_gpu(u)]
        if unknown_must:
            raise Refused("unknown_device", f"unknown GPU IDs: {', '.join(unknown_must)}")
        # Unknown offers are left out rather than failing the hint for the whole node.
        self.check_mig_pool(resource, request.must_include)
        available = [
            u
            for u in request.available
            if u in self.ledger.topology
            or (u in self.mig.offers and self.mig.offers[u].resource == resource)
            or (self.ledger.is_replica(u) and resource == self.names.gpu)
        ]
        return self.ledger.preferred(available, request.must_include, request.size)

    # --- release --------------------------------------------------------------------------

    def release(self, request: ReleaseRequest) -> list[AllocationView]:
        return self.releases.release(request)

    def reconcile(self, live: Mapping[str, PodRef]) -> list[AllocationView]:
        return self.releases.reconcile(live)

    # --- the record -----------------------------------------------------------------------

    def lost_refusal(self) -> Refused:
        return self.record.lost_refusal()

    def adopt(self, held: Iterable[HeldDevices]) -> Adoption:
        return self.record.adopt(held)

    def mark_lost(self, reason: str) -> None:
        self.record.mark_lost(reason)

    def end_loss(self) -> str | None:
        return self.record.end_loss()

    def snapshot(self) -> StoredState:
        return self.record.snapshot()

    def restore(self, state: StoredState) -> list[str]:
        return self.record.restore(state)

    # --- views ----------------------------------------------------------------------------

    def allocation_views(self) -> list[AllocationView]:
        return allocation_views(self.books)

    def state(self, *, checkpoint: str = "") -> StateReply:
        lost = self.record.lost
        return StateReply(
            node=self.node,
            ready=self.ready and lost is None,
            gpus=gpu_views(self.books),
            allocations=self.allocation_views(),
            checkpoint=checkpoint,
            inventory_generation=self.inventory_generation,
            lost=self.record.lost_refusal().message if lost is not None else "",
        )
