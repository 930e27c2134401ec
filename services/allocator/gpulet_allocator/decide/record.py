"""The record of allocations as a checkpoint sees it, and what happens when it is lost.

:meth:`Record.snapshot` is what the checkpoint (:mod:`gpulet_allocator.state`) writes
and :meth:`Record.restore` what it reads back; an entry that breaks an invariant, or a
grant whose allocation is unknown, is set aside and reported.

**Lost record.** When the checkpoint was corrupt, the allocations running pods hold are
unknown and :attr:`Record.lost` says why: the core refuses every Allocate
(``checkpoint_lost``, :meth:`Record.lost_refusal`) rather than hand out a GPU twice.
The record is rebuilt from PodResources (:meth:`Record.adopt`: whole GPUs; kubelet does
not know which card a share went to, so a share container blocks the rebuild) or the
loss is accepted by an operator; the service decides which, then calls
:meth:`Record.end_loss`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpulet_allocator.decide.books import Books, grant_key
from gpulet_allocator.decide.claims import Claims
from gpulet_allocator.decide.engine import Owner, WholeAllocation
from gpulet_allocator.protocol import card_id
from gpulet_allocator.state.records import GrantKind, MigLink, StoredState
from gpulet_common.refusal import Refused


@dataclass(frozen=True, slots=True)
class PodRef:
    pod: str
    container: str
    # The pod's UID when known (PodResources names pods, the pod watch knows UIDs).
    uid: str = ""


@dataclass(frozen=True, slots=True)
class HeldDevices:
    """One container's devices of one resource, as kubelet's PodResources lists them."""

    ref: PodRef
    resource: str
    device_ids: tuple[str, ...]


def _shown(lines: tuple[str, ...]) -> str:
    more = f" and {len(lines) - 3} more" if len(lines) > 3 else ""
    return "; ".join(lines[:3]) + more


@dataclass(frozen=True, slots=True)
class Adoption:
    """What :meth:`Record.adopt` made of one PodResources answer."""

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
            parts.append(
                f"{len(self.unplaceable)} container(s) hold GPU shares whose cards kubelet "
                f"does not know (the allocator placed them): {_shown(self.unplaceable)}"
            )
        if self.conflicts:
            parts.append(f"{len(self.conflicts)} grant(s) conflict: {_shown(self.conflicts)}")
        return "; ".join(parts)


class Record:
    """Checkpoint snapshots and restores, and the lost record (the module docstring)."""

    def __init__(self, books: Books, node: str, kinds: dict[str, GrantKind]) -> None:
        self._books = books
        self._node = node
        self._kinds = kinds
        #: Why the record of allocations is lost (None: it is not); Allocate is refused.
        self.lost: str | None = None
        #: Why the record cannot be rebuilt yet (shown with the refusal).
        self.rebuild_blocker = ""

    def lost_refusal(self) -> Refused:
        blocker = f"; {self.rebuild_blocker}" if self.rebuild_blocker else ""
        return Refused(
            "checkpoint_lost",
            f"the record of this node's allocations is lost: {self.lost}{blocker}. GPUs "
            "that running pods hold are unknown, so nothing is allocated until kubelet's "
            "PodResources API rebuilds the record or an operator accepts the loss with "
            f"`gpulet allocator reset --confirm --node {self._node}`",
        )

    def mark_lost(self, reason: str) -> None:
        """Refuse to allocate until the record is rebuilt or the loss accepted."""
        if self.lost != reason:
            self.lost = reason
            self._books.version += 1

    def end_loss(self) -> str | None:
        """The record is whole again (rebuilt, or the loss accepted); returns the old reason."""
        reason, self.lost, self.rebuild_blocker = self.lost, None, ""
        if reason is not None:
            self._books.version += 1
        return reason

    def adopt(self, held: Iterable[HeldDevices]) -> Adoption:
        """Take over the whole-GPU grants kubelet lists that the ledger lacks.

        For a lost record: kubelet names the cards of ``nvidia.com/gpu`` (its IDs are
        the UUIDs), so those grants are recorded as they were answered (same key, same
        allocation ID). A share's card was chosen by the allocator, not by kubelet, so
        a container holding share units cannot be placed: it is reported as
        ``unplaceable``. Adopting only ever adds holders, so it is safe to repeat.
        """
        books = self._books
        adopted = 0
        unplaceable: list[str] = []
        conflicts: list[str] = []
        for item in held:
            kind = self._kinds.get(item.resource)
            if kind is None or not item.device_ids:
                continue
            key = grant_key(kind, item.resource, item.device_ids)
            where = f"{item.ref.pod}/{item.ref.container}"
            if key in books.grants:
                continue
            if kind != "whole":
                unplaceable.append(f"{where} ({len(item.device_ids)} {item.resource})")
                continue
            try:
                # A time-slicing replica is its own card (protocol.card_id).
                uuids = tuple(card_id(i) for i in item.device_ids)
            except ValueError as exc:
                conflicts.append(f"{where}: {exc}")
                continue
            problems = books.ledger.restore(
                [WholeAllocation(owner=Owner(allocation_id=key), devices=uuids)]
            )
            if problems:
                conflicts.extend(f"{where}: {p}" for p in problems)
                continue
            books.grants[key] = books.grant(
                key,
                item.resource,
                kind,
                len(uuids),
                key,
                pod=item.ref.pod,
                container=item.ref.container,
                pod_uid=item.ref.uid,
            )
            adopted += 1
        if adopted:
            books.version += 1
        return Adoption(adopted, tuple(unplaceable), tuple(conflicts))

    def snapshot(self) -> StoredState:
        books = self._books
        return StoredState(
            node=self._node,
            allocations=books.ledger.snapshot(),
            grants=sorted(books.grants.values(), key=lambda g: g.key),
            claims=sorted(books.claims.values(), key=lambda c: c.uid),
            mig_links=[
                MigLink(device=d, parent=p, gpu_instance_id=gi, compute_instance_id=ci)
                for d, p, gi, ci in books.ledger.mig_links()
            ],
            lost=self.lost or "",
        )

    def restore(self, state: StoredState) -> list[str]:
        """Adopt a checkpoint; returns one line per entry set aside."""
        books = self._books
        if state.lost:
            self.lost = state.lost
        books.ledger.restore_mig_links(
            (m.device, m.parent, m.gpu_instance_id, m.compute_instance_id) for m in state.mig_links
        )
        problems = books.ledger.restore(state.allocations)
        for grant in state.grants:
            if books.ledger.get(grant.allocation) is None:
                problems.append(f"grant {grant.key}: allocation {grant.allocation} is unknown")
                continue
            books.grants[grant.key] = grant
        problems += Claims(books).restore(state.claims)
        owned = {g.allocation for g in books.grants.values()} | set(books.claims)
        for alloc in books.ledger.allocations():
            if alloc.owner.allocation_id not in owned:
                # Nothing could ever name it again, so nothing would release it.
                problems.append(f"allocation {alloc.owner.allocation_id} has no grant; released")
                books.ledger.release(alloc.owner.allocation_id)
        if problems:
            books.version += 1
        return problems
