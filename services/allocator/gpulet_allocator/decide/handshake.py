"""The scheduler handshake: following koord-scheduler's decisions in the core.

With a :class:`~gpulet_allocator.decide.koordinator.PodBook` (the pod watch of
:mod:`gpulet_allocator.service.pod_watch`), a call that belongs to a pod carrying the
``scheduling.koordinator.sh/device-allocated`` annotation (the rule is in
:mod:`.koordinator`) follows it: ``GetPreferredAllocation`` answers exactly the decided
GPUs, ``Allocate`` of whole GPUs checks kubelet's IDs against them, and under the
``koordinator`` profile a share (``koordinator.sh/gpu-core`` and
``koordinator.sh/gpu-memory-ratio``, whichever kubelet asks first) is placed on the
decided card with the decided amounts, both MPS limits in both answers.

A decision that cannot be honoured (unknown minor, a GPU the ledger refuses -- its one
answer, :meth:`~gpulet_allocator.decide.engine.Ledger.refusal` --, other IDs, an
invalid or empty annotation, devices already held by another pod's grant) is refused
with ``scheduler_decision`` and reported to the refusal hook (a Kubernetes Event),
never served from another card. Calls no pod's decision covers are decided as
without Koordinator. The book is only read here, in memory: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NoReturn

from gpulet_allocator.decide.books import Books, Undo
from gpulet_allocator.decide.engine import DeviceState, Owner
from gpulet_allocator.decide.koordinator import Claim, GpuEntry, PodBook, PodKey, memory_mib
from gpulet_allocator.protocol import MEMORY_UNIT_MIB, PreferredRequest, parse_device_id
from gpulet_allocator.state.records import Grant, GrantKind
from gpulet_common.refusal import Refused

RefusalHook = Callable[[PodKey, str], None]


class Handshake:
    """koord-scheduler's decisions, as far as the core follows them."""

    def __init__(
        self,
        books: Books,
        book: PodBook | None,
        *,
        koordinator: bool,
        on_refusal: RefusalHook | None = None,
    ) -> None:
        self._books = books
        #: This node's watched pods (koord-scheduler's decisions); None: no handshake.
        self.book = book
        # Koordinator's share resources: placed only where the scheduler decided.
        self.koordinator = koordinator
        self._on_refusal = on_refusal or (lambda _pod, _message: None)
        #: Calls that followed a koord-scheduler decision, and refusals of one.
        self.followed = 0
        self.refused = 0

    # --- which pod a call belongs to ----------------------------------------------------

    def claim(self, resource: str, count: int, device_ids: Sequence[str] = ()) -> Claim | None:
        if self.book is None:
            return None
        taken = {
            (g.pod, g.container)
            for g in self._books.grants.values()
            if g.pod and g.resource == resource
        }
        return self.book.find(
            resource, count, minor_of=self._books.minors(), device_ids=device_ids, taken=taken
        )

    def refuse(self, claim: Claim, message: str) -> NoReturn:
        """Refuse a decision: precise, an Event on the pod, never another card."""
        self.refused += 1
        who = f"{claim.pod} container {claim.container!r}"
        text = f"cannot follow koord-scheduler for {who}: {message}"
        self._on_refusal(claim.pod, text)
        raise Refused("scheduler_decision", text)

    def mark(self, claim: Claim | None, allocation: str, undo: list[Undo]) -> None:
        if claim is None or self.book is None:
            return
        book = self.book
        book.mark(claim, allocation)
        self.followed += 1
        undo.append(lambda: book.unmark(claim))

    # --- whole GPUs -----------------------------------------------------------------------

    def whole_claim(self, resource: str, uuids: list[str]) -> Claim | None:
        """The claim of a whole-GPU Allocate, checked against kubelet's IDs (None: no
        pod's decision covers it)."""
        claim = self.claim(resource, len(uuids), uuids)
        if claim is not None:
            decided = self.decided_whole(claim)
            if sorted(decided) != sorted(uuids):
                describe = self._books.describe
                self.refuse(
                    claim,
                    f"kubelet allocated {describe(uuids)} but koord-scheduler "
                    f"decided {describe(decided)} for {claim.pod}",
                )
        return claim

    def check_retry(self, existing: Grant, resource: str, kind: GrantKind, ids: list[str]) -> None:
        """A repeated device-ID set is kubelet's retry, unless the pod watch says the call
        belongs to another pod: then the devices are already held, and that is refused
        (with the Event), never answered with the earlier pod's allocation."""
        if kind != "whole" and not (kind in ("core", "ratio") and self.koordinator):
            return
        uuids = [parse_device_id(i).gpu_uuid for i in ids] if kind == "whole" else []
        claim = self.claim(resource, len(ids), uuids)
        if claim is None or existing.pod == str(claim.pod):
            return
        what = self._books.describe(uuids) if uuids else f"these {len(ids)} {resource} devices"
        holder = f" of {existing.pod}" if existing.pod else ""
        self.refuse(claim, f"{what} already held by allocation {existing.allocation}{holder}")

    def preferred(self, resource: str, request: PreferredRequest) -> list[str] | None:
        """Exactly the GPUs koord-scheduler decided, or None when no pod's decision
        covers the call (then gpulet chooses). Nothing is marked: the Allocate that
        follows does it."""
        claim = self.claim(resource, request.size)
        if claim is None:
            return None
        decided = self.decided_whole(claim)
        offered = set(request.available)
        describe = self._books.describe
        missing = [u for u in decided if u not in offered]
        if missing:
            self.refuse(claim, f"kubelet does not offer {describe(missing)}")
        extra = [u for u in request.must_include if u not in decided]
        if extra:
            self.refuse(
                claim,
                f"kubelet must include {describe(extra)}, which koord-scheduler did not decide",
            )
        self.followed += 1
        return decided

    def decided_whole(self, claim: Claim) -> list[str]:
        """The UUIDs koord-scheduler decided for a whole-GPU claim, checked usable."""
        if claim.problem:
            self.refuse(claim, claim.problem)
        uuids = [self._decided_uuid(claim, e) for e in claim.gpus]
        for uuid in uuids:
            self._check_usable(claim, uuid, whole=True)
        return uuids

    def _decided_uuid(self, claim: Claim, entry: GpuEntry) -> str:
        by_minor = {m: u for u, m in self._books.minors().items()}
        uuid = by_minor.get(entry.minor)
        if uuid is None:
            have = ", ".join(str(m) for m in sorted(by_minor)) or "none"
            self.refuse(claim, f"GPU minor {entry.minor} is not on this node (its minors: {have})")
        return uuid

    def _check_usable(self, claim: Claim, uuid: str, *, whole: bool) -> DeviceState:
        # The ledger's one answer, refused as a decision that cannot be followed.
        refused = self._books.ledger.refusal(uuid, whole=whole)
        if refused is not None:
            # Its message names the card by UUID; the Event names it by minor too.
            self.refuse(claim, "GPU " + refused.message.replace(uuid, self._describe(uuid), 1))
        return self._books.ledger.device(uuid)

    def _describe(self, uuid: str) -> str:
        return self._books.describe([uuid])

    # --- Koordinator's shares ------------------------------------------------------------

    def decided_share(
        self, resource: str, kind: GrantKind, ids: list[str], key: str, undo: list[Undo]
    ) -> Grant:
        """A Koordinator share: card and amounts from the annotation, never guessed.

        The container's first share call (gpu-core or gpu-memory-ratio, in whichever
        order kubelet asks) places the allocation; the other joins it. Both answers
        carry both MPS limits, as decided.
        """
        books = self._books
        claim = self.claim(resource, len(ids))
        if claim is None:
            raise Refused(
                "scheduler_decision",
                f"no pending pod on this node carries koord-scheduler's decision for a "
                f"container asking {len(ids)} {resource}: under the koordinator profile "
                f"shares are placed by koord-scheduler (is the pod scheduled by it, and "
                f"is the pod watch running?)",
            )
        if claim.problem:
            self.refuse(claim, claim.problem)
        if not claim.gpus:
            self.refuse(claim, "the annotation decides no GPU for this container")
        assert self.book is not None
        limits = self._decided_limits(claim)
        book = self.book
        joined = next(
            (
                a
                for other in claim.share_resources
                if (a := book.allocation_of(claim, other)) is not None
                and books.ledger.get(a) is not None
            ),
            None,
        )
        if joined is None:
            self._place_decided(claim, key)
        allocation = joined or key
        grant = books.grant(
            key,
            resource,
            kind,
            len(ids),
            allocation,
            pod=str(claim.pod),
            container=claim.container,
            limits=limits,
            pod_uid=claim.pod.uid,
        )
        books.new_grant(grant, undo, own=joined is None)
        self.mark(claim, allocation, undo)
        return grant

    def _place_decided(self, claim: Claim, key: str) -> None:
        ledger = self._books.ledger
        uuids = [self._decided_uuid(claim, e) for e in claim.gpus]
        if all(e.whole for e in claim.gpus):
            for uuid in uuids:
                self._check_usable(claim, uuid, whole=True)
            ledger.allocate_whole(Owner(allocation_id=key), devices=uuids)
            return
        if len(claim.gpus) != 1:
            self.refuse(
                claim, f"a share spans {len(claim.gpus)} GPUs; gpulet places a share on one"
            )
        entry, uuid = claim.gpus[0], uuids[0]
        state = self._check_usable(claim, uuid, whole=False)
        info = self._books.gpus[uuid]
        units = max(1, entry.memory_of(info.memory_total_bytes) // (MEMORY_UNIT_MIB * 2**20))
        if entry.core > state.cores_free or units > state.memory_free:
            self.refuse(
                claim,
                f"GPU {self._describe(uuid)} has {state.cores_free} core units and "
                f"{state.memory_free} memory units free, the decision needs "
                f"{entry.core} and {units}",
            )
        try:
            ledger.allocate_share(Owner(allocation_id=key), entry.core, units, device=uuid)
        except Refused as exc:
            self.refuse(claim, f"GPU {self._describe(uuid)}: {exc.message}")

    def _decided_limits(self, claim: Claim) -> tuple[int, int]:
        """(cores, memory MiB) of a one-card share decision; (0, 0) for whole cards."""
        if len(claim.gpus) != 1 or claim.gpus[0].whole:
            return 0, 0
        entry = claim.gpus[0]
        gpus = self._books.gpus
        uuid = {m: u for u, m in self._books.minors().items()}.get(entry.minor)
        card = gpus[uuid].memory_total_bytes if uuid in gpus else 0
        return entry.core, memory_mib(entry, card)
