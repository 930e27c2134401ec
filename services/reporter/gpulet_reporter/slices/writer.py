"""The node's ResourceSlices in the API server: list, compare, create/replace/delete.

:class:`SliceWriter` is a :class:`~gpulet_reporter.writer.WriteSink` of
:class:`SliceInput` (the facts a pool is rendered from), driven by the reporter's own
:class:`~gpulet_reporter.writer.WriteLoop` (debounce, back-off with full jitter or the
server's ``Retry-After``, newest-state-wins retries). One :meth:`apply`:

1. lists the node's slices of our driver (``fieldSelector=spec.nodeName=<node>,
   spec.driver=<driver>``) when it holds no observation, and decodes every item
   totally: an item that is not a slice of *this* node and driver (a server that
   ignored the selector, a forged object) is neither trusted nor touched;
2. renders the pool (:func:`gpulet_common.dra.pool.build`) with what was observed: the
   taints' ``timeAdded`` and the pool generation held there. A pool whose devices are
   the same (quantities compared by value, so ``85899345920`` is ``80Gi``) keeps its
   generation: after a restart nothing is written either;
3. writes only what differs: missing slices are created, changed ones replaced with the
   observed ``resourceVersion``, surplus ones deleted (after the new generation is in
   place, so the scheduler never sees a partial newer pool as the whole).

A 409 (a stale observation, or a slice created meanwhile) re-lists and renders again,
a few rounds; a 404 on replace creates. Everything else is a
:class:`~gpulet_reporter.writer.WriteError` mapped as the reporter maps it (429 with
``Retry-After``, 5xx, timeouts, connection errors; 4xx are permanent and retried at
the slowest pace). :meth:`refresh` forgets the observation, so the loop's reconcile
timer and the watch (:mod:`.publisher`) repair slices someone else deleted or edited.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gpulet_common.dra import limits, taints
from gpulet_common.dra import pool as dra_pool
from gpulet_common.kubeapi import KubeApiError, api_path
from gpulet_common.messages import GpuHealth, Inventory
from gpulet_common.quantity import binary, parse_whole
from gpulet_common.settings.dra import DraSettings
from gpulet_reporter.writer import MAX_CONFLICT_ROUNDS, NodeClient, WriteError, api_error

log = logging.getLogger("gpulet.reporter.slices")

GROUP: Final = "resource.k8s.io"
VERSION: Final = "v1"
PLURAL: Final = "resourceslices"
JsonObj = dict[str, Any]


@dataclass(frozen=True)
class SliceInput:
    """What the pool is rendered from: the node read model's facts."""

    inventory: Inventory
    healths: Mapping[str, GpuHealth] = field(default_factory=dict)
    # GPU uuids the device plugin holds (tainted in mode ``both``).
    held: frozenset[str] = frozenset()
    # GPU uuid -> time-slicing replicas, for the GPUs offered as replicas (tainted).
    sliced: Mapping[str, int] = field(default_factory=dict)
    # False until the allocator's first ``held`` answer: ``held`` and ``sliced`` are
    # then not facts, and the taints they lower are kept as the API server holds them.
    held_known: bool = True
    # False until the health service's state was read: the health taints the API
    # server holds are kept (a fault is never lowered by a restart).
    health_known: bool = True


_EMPTY: Final[tuple[Any, ...]] = (None, False, "", [], {})


def canonical(value: Any, key: str = "") -> Any:
    """A body as compared: every whole-number quantity written one way, and fields at
    their zero value (``false``, empty lists and maps) left out, as a server that
    defaults them returns them (``bindsToNode: false``, ``taints: []``). gpulet never
    renders a zero value, so a taint that must go is still a difference."""
    if isinstance(value, dict):
        return {
            k: canonical(v, k)
            for k, v in value.items()
            if not any(v is e or (type(v) is type(e) and v == e) for e in _EMPTY)
        }
    if isinstance(value, list):
        return [canonical(v) for v in value]
    if isinstance(value, str) and key in ("value", "default", "min", "max", "step"):
        parsed = parse_whole(value)
        return binary(parsed) if parsed is not None else value
    return value


def _ours(item: Any, node: str, driver: str) -> JsonObj | None:
    """``item`` if it is a well-formed slice of this node and driver, else None."""
    if not isinstance(item, dict):
        return None
    meta, spec = item.get("metadata"), item.get("spec")
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        return None
    if not isinstance(meta.get("name"), str) or not meta["name"]:
        return None
    if spec.get("nodeName") != node or spec.get("driver") != driver:
        return None
    pool = spec.get("pool")
    if not isinstance(pool, dict) or not isinstance(spec.get("devices", []), list):
        return None
    generation = pool.get("generation")
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        return None
    return item


def _observed_pool(observed: Mapping[str, JsonObj], node: str, driver: str) -> dra_pool.Pool | None:
    """The pool the API server holds, when it is whole (every slice, one generation)."""
    if not observed:
        return None
    pools = [body["spec"]["pool"] for body in observed.values()]
    generations = {p.get("generation") for p in pools}
    counts = {p.get("resourceSliceCount") for p in pools}
    if len(generations) != 1 or counts != {len(observed)}:
        return None
    devices = [
        canonical(d)
        for name in sorted(observed, key=_slice_order)
        for d in observed[name]["spec"].get("devices", [])
    ]
    return dra_pool.Pool(node, driver, devices, int(next(iter(generations))))


def kept_classes(desired: SliceInput, driver: str) -> tuple[str, ...]:
    """The taint keys whose state ``desired`` does not know yet: never lowered."""
    keys: list[str] = []
    if not desired.held_known:
        keys += [f"{driver}/{taints.DEVICE_PLUGIN}", f"{driver}/{taints.TIME_SLICED}"]
    if not desired.health_known:
        keys += [f"{driver}/{k}" for k in (taints.XID, taints.UNHEALTHY, taints.WARNING)]
    return tuple(keys)


def keep_observed(
    devices: list[JsonObj], observed: Mapping[str, JsonObj], keys: tuple[str, ...]
) -> list[JsonObj]:
    """``devices`` with every taint of ``keys`` that the observed slices carry on the
    device of the same name added back (what is not known yet is not lowered)."""
    if not keys:
        return devices
    held: dict[str, list[JsonObj]] = {}
    for body in observed.values():
        for device in body["spec"].get("devices") or []:
            if not isinstance(device, dict) or not isinstance(device.get("name"), str):
                continue
            for taint in device.get("taints") or []:
                if (
                    isinstance(taint, dict)
                    and taint.get("key") in keys
                    and isinstance(taint.get("value", ""), str)
                    and isinstance(taint.get("effect"), str)
                ):
                    held.setdefault(device["name"], []).append(taint)
    out: list[JsonObj] = []
    for device in devices:
        extra = held.get(device.get("name", ""), [])
        have = device.get("taints") or []
        ident = {(t.get("key"), t.get("value"), t.get("effect")) for t in have}
        add = [
            {k: t[k] for k in ("key", "value", "effect", "timeAdded") if k in t}
            for t in extra
            if (t.get("key"), t.get("value"), t.get("effect")) not in ident
        ]
        if add:
            merged = (have + add)[: limits.MAX_TAINTS_PER_DEVICE]
            device = {**device, "taints": merged}
        out.append(device)
    return out


def _slice_order(name: str) -> tuple[int, str]:
    _, _, n = name.rpartition("-")
    return (int(n) if n.isdigit() else 1 << 30, name)


class SliceWriter:
    def __init__(
        self,
        kube: NodeClient,
        settings: DraSettings,
        *,
        clock: Callable[[], float] = time.time,
        pcie_root: Callable[[str], str] | None = None,
        server: str = "",
    ) -> None:
        self._kube = kube
        self.api = kube.api
        self.collection = api_path(GROUP, VERSION, PLURAL)
        self._settings = settings
        self._clock = clock
        self._pcie_root = pcie_root
        self.node = kube.node
        self.description = f"API server {server} (ResourceSlices)" if server else "ResourceSlices"
        self._selector = f"spec.nodeName={self.node},spec.driver={settings.driver}"
        self.observed: dict[str, JsonObj] = {}
        self.listed = False
        self.pool: dra_pool.Pool | None = None
        self.ignored = 0
        self.writes = 0
        # The slices of the pool last applied, by name (what the API should hold).
        self.wanted: dict[str, JsonObj] = {}

    async def refresh(self) -> None:
        self.listed = False
        self._kube.node_read = False

    async def list_slices(self) -> None:
        try:
            found = await self._kube.call(
                "list resourceslices", self.api.list, self.collection, field_selector=self._selector
            )
        except KubeApiError as exc:
            raise api_error(exc, "list resourceslices") from exc
        items = found.get("items") if isinstance(found, dict) else None
        observed: dict[str, JsonObj] = {}
        for item in items if isinstance(items, list) else []:
            body = _ours(item, self.node, self._settings.driver)
            if body is None:
                self.ignored += 1
                continue
            observed[body["metadata"]["name"]] = body
        self.observed = observed
        self.listed = True

    def render(self, desired: SliceInput) -> dra_pool.Pool:
        known = taints.known_times(list(self.observed.values()))
        floor = max(
            (int(b["spec"]["pool"]["generation"]) for b in self.observed.values()), default=0
        )
        previous = self.pool
        held_pool = _observed_pool(self.observed, self.node, self._settings.driver)
        if held_pool is not None:
            previous = held_pool
        node = self._kube.node_object or {}
        uid = (node.get("metadata") or {}).get("uid") if isinstance(node, dict) else None
        built = dra_pool.build(
            desired.inventory,
            desired.healths,
            self._settings,
            held=desired.held,
            sliced=desired.sliced,
            known=known,
            now=self._clock(),
            node_uid=uid if isinstance(uid, str) and uid else None,
            pcie_root=self._pcie_root,
        )
        kept = keep_observed(
            built.devices, self.observed, kept_classes(desired, self._settings.driver)
        )
        devices = canonical(kept)
        generation = dra_pool.next_generation(previous, devices, floor)
        if generation == built.generation and kept is built.devices:
            return built
        return dra_pool.Pool(
            built.node,
            built.driver,
            kept,
            generation,
            dra_pool.slices(
                built.node,
                built.driver,
                kept,
                generation,
                node_uid=uid if isinstance(uid, str) and uid else None,
            ),
        )

    def _differs(self, want: JsonObj, have: JsonObj | None) -> bool:
        if have is None:
            return True
        if canonical(want["spec"]) != canonical(have["spec"]):
            return True
        meta, held = want["metadata"], have.get("metadata") or {}
        labels = held.get("labels") or {}
        if any(labels.get(k) != v for k, v in meta.get("labels", {}).items()):
            return True
        owners = meta.get("ownerReferences")
        return owners is not None and owners != held.get("ownerReferences")

    def accept_if_ours(self, name: str, item: Any) -> bool:
        """A watched slice that is exactly what we last applied (our own write, seen
        before its answer reached us): held as observed, True. Else False."""
        want = self.wanted.get(name)
        body = _ours(item, self.node, self._settings.driver)
        if want is None or body is None or self._differs(want, body):
            return False
        self.observed[name] = body
        return True

    async def apply(self, desired: SliceInput) -> bool:
        if not self._kube.node_read:
            await self._kube.read_node()
        for _ in range(MAX_CONFLICT_ROUNDS):
            if not self.listed:
                await self.list_slices()
            try:
                built = self.render(desired)
            except dra_pool.PoolError as exc:
                # Not "permanent": the loop would then sleep its longest back-off before
                # it looks at a newer input, and a newer inventory is what cures this.
                raise WriteError("invalid", f"pool of {self.node}: {exc}") from exc
            try:
                wrote = await self._write(built)
            except KubeApiError as exc:
                if exc.status == 409:
                    self.listed = False
                    continue
                raise api_error(exc, "write resourceslice") from exc
            self.pool = dra_pool.Pool(
                built.node, built.driver, canonical(built.devices), built.generation
            )
            return wrote
        raise WriteError("conflict", f"slices of {self.node}: {MAX_CONFLICT_ROUNDS} conflicts")

    async def _write(self, built: dra_pool.Pool) -> bool:
        wanted = {body["metadata"]["name"]: body for body in built.slices}
        # The target, before the first request: the watch may report our own writes
        # (and deletions of surplus slices) before their answers reach us.
        self.wanted = wanted
        wrote = False
        manager = self._settings.field_manager
        for name, body in wanted.items():
            have = self.observed.get(name)
            if not self._differs(body, have):
                continue
            if have is None:
                result = await self._kube.call(
                    "create resourceslice",
                    self.api.create,
                    self.collection,
                    body,
                    field_manager=manager,
                )
                verb = "created"
            else:
                replaced = {**body, "metadata": {**body["metadata"]}}
                replaced["metadata"]["resourceVersion"] = have["metadata"].get("resourceVersion")
                try:
                    result = await self._kube.call(
                        "replace resourceslice",
                        self.api.replace,
                        api_path(GROUP, VERSION, PLURAL, name=name),
                        replaced,
                        field_manager=manager,
                    )
                except KubeApiError as exc:
                    if exc.status != 404:
                        raise
                    self.observed.pop(name, None)
                    raise KubeApiError(409, "gone meanwhile") from exc
                verb = "replaced"
            self._note(name, result)
            wrote = True
            self.writes += 1
            log.info(
                "resourceslice %s %s (pool %s generation %d)",
                name,
                verb,
                built.node,
                built.generation,
            )
        for name in sorted(set(self.observed) - set(wanted)):
            try:
                await self._kube.call(
                    "delete resourceslice",
                    self.api.delete,
                    api_path(GROUP, VERSION, PLURAL, name=name),
                )
            except KubeApiError as exc:
                if exc.status != 404:
                    raise
            self.observed.pop(name, None)
            wrote = True
            self.writes += 1
            log.info("resourceslice %s deleted (pool %s)", name, built.node)
        return wrote

    def _note(self, name: str, result: Any) -> None:
        body = _ours(result, self.node, self._settings.driver)
        if body is None:
            # An answer we cannot read: observe nothing, so the next apply re-lists.
            self.listed = False
            self.observed.pop(name, None)
        else:
            self.observed[name] = body
