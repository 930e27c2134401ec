"""koord-scheduler's device decisions, and which pod a kubelet call belongs to.

What koord-scheduler says
-------------------------
Its DeviceShare plugin picks a pod's GPUs while it schedules and writes the choice on
the pod as the annotation :data:`ANNOTATION_DEVICE_ALLOCATED`
(``scheduling.koordinator.sh/device-allocated``; Koordinator's
``apis/extension/device_share.go``), JSON keyed by device type::

    {"gpu": [{"minor": 1, "resources": {"koordinator.sh/gpu-core": "100",
                                         "koordinator.sh/gpu-memory": "81251Mi",
                                         "koordinator.sh/gpu-memory-ratio": "100"}}]}

Only the ``gpu`` key is read; ``rdma`` and other types are not ours. The decision is
per pod: a pod's GPU containers take the entries in container order, each as many as
it asks for (``nvidia.com/gpu: 2`` takes two entries; a share container takes one).

:func:`parse_decision` is total: whatever the annotation holds (not JSON, 10 MB, a
minor of -3 or 2**40, a minor twice, a core of "lots"), it returns a
:class:`Decision` or an :class:`InvalidDecision` that says precisely what is wrong.
It never raises, and it bounds what it reads (:data:`MAX_ANNOTATION_BYTES`,
:data:`MAX_ENTRIES`).

Which pod a call belongs to
---------------------------
Kubelet's ``Allocate`` and ``GetPreferredAllocation`` carry no pod. Kubelet admits one
pod at a time and, for each of its containers, asks each resource in turn, so the
call belongs to the pod being admitted. gpu-manager finds that pod among the node's
pods by the requested amount and the time the scheduler decided (its predicate time);
HAMi marks the pod ``bind-phase: allocating`` and takes the pending one. gpulet's rule,
over the watched pods of this node (:class:`PodBook`):

1. candidates are pods bound to this node, ``Pending``, not being deleted, that carry
   the annotation with a ``gpu`` key;
2. of their containers, those whose request (limit) of the call's resource equals the
   call's device count and that have not yet been allocated that resource (in this run,
   or by the allocator's checkpointed grants, which survive a restart);
3. for whole GPUs, a candidate whose decided GPUs are exactly kubelet's IDs wins (that
   is unambiguous); otherwise the oldest binding first: the pod's ``PodScheduled``
   condition time, then its creation time, then namespace/name.

An ``Allocate`` that is answered marks the container's resource allocated; a
``GetPreferredAllocation`` marks nothing (kubelet follows it with the Allocate of the
same container). A call no candidate matches has no decision: gpulet decides as
without Koordinator.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

import msgspec

from gpulet_common.quantity import SUFFIX
from gpulet_common.untrusted import UntrustedDocumentError, json_document

ANNOTATION_DEVICE_ALLOCATED: Final = "scheduling.koordinator.sh/device-allocated"
RES_GPU_CORE: Final = "koordinator.sh/gpu-core"
RES_GPU_MEMORY: Final = "koordinator.sh/gpu-memory"
RES_GPU_MEMORY_RATIO: Final = "koordinator.sh/gpu-memory-ratio"
KOORDINATOR_RESOURCES: Final = (RES_GPU_CORE, RES_GPU_MEMORY_RATIO, RES_GPU_MEMORY)

# A real decision for 16 GPUs is about 2 KB; the API server allows 256 KB of
# annotations in all. Larger is refused unread.
MAX_ANNOTATION_BYTES: Final = 64 * 1024
MAX_ENTRIES: Final = 64
_INT32_MAX: Final = 2**31 - 1
_MIB: Final = 2**20

_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?\s*$")


class GpuEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One decided GPU: its minor and the amounts the scheduler accounted on it."""

    minor: int
    # Percent of the card's SMs (100: the whole card).
    core: int = 100
    # Percent of the card's memory; None when the scheduler wrote only bytes.
    memory_ratio: int | None = None
    # Bytes of the card's memory; None when the scheduler wrote only the ratio.
    memory_bytes: int | None = None

    @property
    def whole(self) -> bool:
        return self.core >= 100

    def memory_of(self, card_bytes: int) -> int:
        """The decided memory in bytes on a card of ``card_bytes``."""
        if self.memory_bytes is not None:
            return min(self.memory_bytes, card_bytes) if card_bytes > 0 else self.memory_bytes
        ratio = 100 if self.memory_ratio is None else self.memory_ratio
        return card_bytes * ratio // 100


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    gpus: tuple[GpuEntry, ...]


class InvalidDecision(msgspec.Struct, frozen=True, kw_only=True):
    """An annotation gpulet cannot follow; ``problem`` says why (for the refusal)."""

    problem: str


def parse_quantity(value: Any) -> int | None:
    """A Kubernetes quantity as an integer (rounded up), or None when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return math.ceil(value) if math.isfinite(value) else None
    if not isinstance(value, str) or len(value) > 64:
        return None
    match = _QUANTITY.fullmatch(value)
    if match is None:
        return None
    number, suffix = match.group(1), match.group(2)
    if suffix == "m":
        whole, _, frac = number.partition(".")
        return math.ceil(int(whole) / 1000) if not frac else math.ceil(float(number) / 1000)
    scale: int = SUFFIX[suffix]
    if "." in number:
        whole, _, frac = number.partition(".")
        numerator = int(whole + frac) * scale
        divisor = int(10 ** len(frac))
        return -(-numerator // divisor)
    return int(number) * scale


def _bad(problem: str) -> InvalidDecision:
    return InvalidDecision(problem=f"{ANNOTATION_DEVICE_ALLOCATED}: {problem}")


def _entry(index: int, raw: Any) -> GpuEntry | InvalidDecision:
    where = f"gpu[{index}]"
    if not isinstance(raw, dict):
        return _bad(f"{where} is not an object")
    minor = raw.get("minor")
    if isinstance(minor, bool) or not isinstance(minor, int):
        return _bad(f"{where}.minor is {_show(minor)}, not an integer")
    if not 0 <= minor <= _INT32_MAX:
        return _bad(f"{where}.minor {minor} is out of range")
    resources = raw.get("resources", {})
    if resources is None:
        resources = {}
    if not isinstance(resources, dict):
        return _bad(f"{where}.resources is not an object")
    core = 100
    ratio: int | None = None
    memory: int | None = None
    if RES_GPU_CORE in resources:
        parsed = parse_quantity(resources[RES_GPU_CORE])
        if parsed is None or not 0 < parsed <= 100:
            return _bad(f"{where} {RES_GPU_CORE} is {_show(resources[RES_GPU_CORE])}, not 1-100")
        core = parsed
    if RES_GPU_MEMORY_RATIO in resources:
        parsed = parse_quantity(resources[RES_GPU_MEMORY_RATIO])
        if parsed is None or not 0 < parsed <= 100:
            shown = _show(resources[RES_GPU_MEMORY_RATIO])
            return _bad(f"{where} {RES_GPU_MEMORY_RATIO} is {shown}, not 1-100")
        ratio = parsed
    if RES_GPU_MEMORY in resources:
        parsed = parse_quantity(resources[RES_GPU_MEMORY])
        if parsed is None or not 0 < parsed < 2**62:
            shown = _show(resources[RES_GPU_MEMORY])
            return _bad(f"{where} {RES_GPU_MEMORY} is {shown}, not a positive byte quantity")
        memory = parsed
    return GpuEntry(minor=minor, core=core, memory_ratio=ratio, memory_bytes=memory)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_decision(annotation: Any) -> Decision | InvalidDecision | None:
    """The GPU decision in an annotation value; None when there is none for GPUs (no
    annotation, or no ``gpu`` key). A ``gpu`` key that decides nothing (null, an
    empty list) is an :class:`InvalidDecision`: a pod that asks for a GPU under it is
    refused, not given a card gpulet picks."""
    if annotation is None:
        return None
    if not isinstance(annotation, str):
        return _bad("the value is not a string")
    if len(annotation) > MAX_ANNOTATION_BYTES:
        return _bad(f"{len(annotation)} characters, more than the {MAX_ANNOTATION_BYTES} read")
    try:
        doc = json_document(annotation, max_bytes=MAX_ANNOTATION_BYTES, what="annotation")
    except UntrustedDocumentError as exc:  # deep, too, is a refusal, not a RecursionError
        return _bad(f"not JSON ({exc})")
    if not isinstance(doc, dict):
        return _bad("not a JSON object keyed by device type")
    if "gpu" not in doc:
        return None
    gpus = doc["gpu"]
    if gpus is None or gpus == []:
        # Present, yet deciding nothing: never read as "no decision", which would let
        # gpulet pick a card the scheduler did not account (docs/koordinator.md).
        return _bad(f'"gpu" is {_show(gpus)}: the annotation decides no GPU')
    if not isinstance(gpus, list):
        return _bad('"gpu" is not a list')
    if len(gpus) > MAX_ENTRIES:
        return _bad(f"{len(gpus)} GPU entries, more than any node has ({MAX_ENTRIES})")
    entries: list[GpuEntry] = []
    for index, raw in enumerate(gpus):
        entry = _entry(index, raw)
        if isinstance(entry, InvalidDecision):
            return entry
        entries.append(entry)
    minors = [e.minor for e in entries]
    if len(set(minors)) != len(minors):
        twice = sorted({m for m in minors if minors.count(m) > 1})
        return _bad(f"minor {', '.join(map(str, twice))} decided twice")
    return Decision(gpus=tuple(entries))


# --- pods ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodKey:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class WatchedPod:
    """What the book keeps of one pod of this node."""

    key: PodKey
    # The binding's time (PodScheduled), else the creation time, as epoch seconds.
    bound_at: float
    pending: bool
    # One (name, {resource: count}) per container, in spec order.
    containers: tuple[tuple[str, Mapping[str, int]], ...]
    decision: Decision | InvalidDecision | None
    resource_version: int = 0


def _epoch(text: Any) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _count(value: Any) -> int | None:
    parsed = parse_quantity(value)
    return parsed if parsed is not None and 0 < parsed <= 1_000_000 else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def watched_pod(obj: Any) -> WatchedPod | None:
    """The book's view of a Pod object (a JSON dict); None when it is not a usable pod."""
    if not isinstance(obj, dict):
        return None
    meta, spec, status = _dict(obj.get("metadata")), obj.get("spec"), _dict(obj.get("status"))
    if not isinstance(spec, dict):
        return None
    namespace, name, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
    if not (
        isinstance(namespace, str)
        and namespace
        and isinstance(name, str)
        and name
        and isinstance(uid, str)
        and uid
    ):
        return None
    bound_at = None
    conditions = status.get("conditions")
    for cond in conditions if isinstance(conditions, list) else []:
        if isinstance(cond, dict) and cond.get("type") == "PodScheduled":
            bound_at = _epoch(cond.get("lastTransitionTime"))
    if bound_at is None:
        bound_at = _epoch(meta.get("creationTimestamp")) or 0.0
    containers: list[tuple[str, Mapping[str, int]]] = []
    listed = spec.get("containers")
    for container in listed if isinstance(listed, list) else []:
        if not isinstance(container, dict):
            continue
        resources = _dict(container.get("resources"))
        counts: dict[str, int] = {}
        # Extended resources: the limit is the request (the API server requires them
        # equal), so either table says it.
        for table in (_dict(resources.get("requests")), _dict(resources.get("limits"))):
            for resource, value in table.items():
                if isinstance(resource, str) and (n := _count(value)) is not None:
                    counts[resource] = n
        containers.append((str(container.get("name", "")), counts))
    annotations = _dict(meta.get("annotations"))
    phase = status.get("phase") or "Pending"
    try:
        rv = int(meta.get("resourceVersion") or 0)
    except (TypeError, ValueError):
        rv = 0
    return WatchedPod(
        key=PodKey(namespace, name, uid),
        bound_at=bound_at,
        pending=phase == "Pending" and not meta.get("deletionTimestamp"),
        containers=tuple(containers),
        decision=parse_decision(annotations.get(ANNOTATION_DEVICE_ALLOCATED)),
        resource_version=rv,
    )


# --- matching calls to pods ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Claim:
    """The container of a pod a kubelet call belongs to, and what was decided for it."""

    pod: PodKey
    container: str
    container_index: int
    resource: str
    # The entries of the decision this container takes; empty when invalid.
    gpus: tuple[GpuEntry, ...]
    # Set when the pod's annotation cannot be followed.
    problem: str = ""
    # The pod's other share resources this container asks for (to join halves).
    share_resources: tuple[str, ...] = ()


@dataclass(slots=True)
class PodBook:
    """This node's pods, as watched; answers which pod a call belongs to.

    Synchronous and in memory: the allocator consults it on every call without any
    I/O. :meth:`upsert` / :meth:`remove` are fed by the pod watch.
    """

    node: str
    # The resource names the decision entries are shared out by (see _entries_taken).
    whole_resource: str = "nvidia.com/gpu"
    core_resource: str = RES_GPU_CORE
    share_resources: tuple[str, ...] = (RES_GPU_CORE, RES_GPU_MEMORY_RATIO)
    pods: dict[str, WatchedPod] = field(default_factory=dict)
    # (pod uid, container index, resource) -> allocation id, for answered Allocates.
    allocated: dict[tuple[str, int, str], str] = field(default_factory=dict)
    synced: bool = False

    def upsert(self, pod: WatchedPod) -> None:
        self.pods[pod.key.uid] = pod

    def remove(self, uid: str) -> None:
        self.pods.pop(uid, None)
        for key in [k for k in self.allocated if k[0] == uid]:
            del self.allocated[key]

    def replace_all(self, pods: Iterable[WatchedPod]) -> None:
        fresh = {p.key.uid: p for p in pods}
        for uid in [u for u in self.pods if u not in fresh]:
            self.remove(uid)
        self.pods = fresh
        self.synced = True

    def uid_of(self, namespace: str, name: str) -> str:
        """The UID of this node's pod ``namespace/name`` as watched ("" when the book
        has none, or more than one: a pod re-created under its name, not yet gone)."""
        found = {
            p.key.uid
            for p in self.pods.values()
            if (p.key.namespace, p.key.name) == (namespace, name)
        }
        return found.pop() if len(found) == 1 else ""

    def allocation_of(self, claim: Claim, resource: str) -> str | None:
        return self.allocated.get((claim.pod.uid, claim.container_index, resource))

    def mark(self, claim: Claim, allocation: str) -> None:
        self.allocated[(claim.pod.uid, claim.container_index, claim.resource)] = allocation

    def unmark(self, claim: Claim) -> None:
        self.allocated.pop((claim.pod.uid, claim.container_index, claim.resource), None)

    def find(
        self,
        resource: str,
        count: int,
        *,
        minor_of: Mapping[str, int] | None = None,
        device_ids: Iterable[str] = (),
        taken: Collection[tuple[str, str]] = (),
    ) -> Claim | None:
        """The container a call of ``count`` devices of ``resource`` belongs to (the
        rule in the module docstring), or None when no pod's decision covers it.

        ``taken``: (``namespace/name``, container) pairs that already hold ``resource``
        by the allocator's own (checkpointed) record, so that after a restart, which
        empties the book's marks, a pod still pending is not matched twice."""
        candidates: list[tuple[WatchedPod, int, tuple[GpuEntry, ...], str]] = []
        for pod in self.pods.values():
            if not pod.pending or pod.decision is None:
                continue
            offset = 0
            for index, (_name, counts) in enumerate(pod.containers):
                asked = counts.get(resource, 0)
                takes = self._entries_taken(counts)
                if (
                    asked == count
                    and (pod.key.uid, index, resource) not in self.allocated
                    and (str(pod.key), _name) not in taken
                ):
                    if isinstance(pod.decision, InvalidDecision):
                        candidates.append((pod, index, (), pod.decision.problem))
                    else:
                        entries = pod.decision.gpus[offset : offset + takes]
                        problem = ""
                        if len(entries) < takes:
                            problem = (
                                f"{ANNOTATION_DEVICE_ALLOCATED} decides "
                                f"{len(pod.decision.gpus)} GPUs, fewer than the pod's "
                                f"containers ask for"
                            )
                        candidates.append((pod, index, tuple(entries), problem))
                offset += takes
        if not candidates:
            return None
        wanted = set(device_ids)
        if wanted and minor_of is not None:
            wanted_minors = {minor_of.get(i) for i in wanted}
            exact = [c for c in candidates if {e.minor for e in c[2]} == wanted_minors]
            if exact:
                candidates = exact
        pod, index, entries, problem = min(
            candidates, key=lambda c: (c[0].bound_at, c[0].key.namespace, c[0].key.name, c[1])
        )
        name, counts = pod.containers[index]
        return Claim(
            pod=pod.key,
            container=name,
            container_index=index,
            resource=resource,
            gpus=entries,
            problem=problem,
            share_resources=tuple(r for r in self.share_resources if r in counts),
        )

    def _entries_taken(self, counts: Mapping[str, int]) -> int:
        """How many decision entries a container takes (0 when it asks for no GPU):
        ``nvidia.com/gpu: N`` takes N; a share takes one card, or N cards for a
        gpu-core of N x 100."""
        whole = counts.get(self.whole_resource, 0)
        if whole:
            return whole
        core = counts.get(self.core_resource, 0)
        if core >= 100:
            return core // 100
        return 1 if any(r in counts for r in self.share_resources) else 0


def memory_mib(entry: GpuEntry, card_bytes: int) -> int:
    return entry.memory_of(card_bytes) // _MIB
