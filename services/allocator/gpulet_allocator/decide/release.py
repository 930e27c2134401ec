"""Releasing allocations: explicitly, and those of pods kubelet no longer lists.

Kubelet's PodResources API lists the device IDs each live container holds; hashing them
gives the live grant keys (:mod:`gpulet_allocator.service.podresources`). An allocation
none of whose grants has been listed for ``release_grace_s`` is released (the grace
covers a kubelet that lists nothing for a moment after a restart, and a grant younger
than the grace is never released). Without PodResources, an explicit release by
allocation ID, pod or device IDs does it (:meth:`Releases.release`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import msgspec

from gpulet_allocator.decide.books import Books, grant_key
from gpulet_allocator.decide.record import PodRef
from gpulet_allocator.decide.views import allocation_view, pods_of
from gpulet_allocator.protocol import AllocationView, ReleaseRequest
from gpulet_allocator.state.records import Grant, GrantKind
from gpulet_common.refusal import Refused

log = logging.getLogger("gpulet.allocator")


class Releases:
    def __init__(
        self,
        books: Books,
        *,
        grace_s: float,
        kind_of: Callable[[str], GrantKind],
        on_release: Callable[[str], None],
    ) -> None:
        self._books = books
        self._grace_s = grace_s
        self._kind_of = kind_of
        # Told of every allocation released (the joiner forgets its open half).
        self._on_release = on_release
        self._missing_since: dict[str, float] = {}
        self._mismatch_reported: set[str] = set()
        #: Share joins that PodResources showed to span two containers.
        self.join_mismatches = 0

    def release(self, request: ReleaseRequest) -> list[AllocationView]:
        """Explicit release; unknown names release nothing (it is idempotent)."""
        books = self._books
        targets: list[str] = []
        if not (request.allocation_ids or request.pods or request.device_ids):
            raise Refused(
                "invalid_request", "name allocation_ids, pods, or resource and device_ids"
            )
        targets.extend(a for a in request.allocation_ids if books.ledger.get(a) is not None)
        if request.pods:
            wanted = set(request.pods)
            targets.extend(g.allocation for g in books.grants.values() if g.pod in wanted)
        if request.device_ids:
            kind = self._kind_of(request.resource)
            grant = books.grants.get(grant_key(kind, request.resource, request.device_ids))
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
        if self._books.ledger.get(allocation) is None:
            return None
        view = allocation_view(self._books, allocation)
        self._books.release(allocation)
        self._missing_since.pop(allocation, None)
        self._on_release(allocation)
        return view

    def reconcile(self, live: Mapping[str, PodRef]) -> list[AllocationView]:
        """Apply one PodResources answer: ``live`` maps live grant keys to their pod."""
        books = self._books
        now, wall = books.clock(), books.wall()
        changed = False
        for key, ref in live.items():
            grant = books.grants.get(key)
            if grant is None:
                continue
            # The UID: the one learnt now, or the one kept while the pod is the same.
            uid = ref.uid or (grant.pod_uid if grant.pod == ref.pod else "")
            if (grant.pod, grant.container, grant.pod_uid) != (ref.pod, ref.container, uid):
                books.grants[key] = msgspec.structs.replace(
                    grant, pod=ref.pod, container=ref.container, pod_uid=uid
                )
                changed = True
        by_allocation: dict[str, list[Grant]] = {}
        for grant in books.grants.values():
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
            books.version += 1
        if released:
            log.info(
                "released %d allocation(s) of pods that no longer exist: %s",
                len(released),
                ", ".join(f"{v.id} ({pods_of(v)})" for v in released),
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
