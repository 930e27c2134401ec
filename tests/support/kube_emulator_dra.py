"""resource.k8s.io/v1 in the API emulator: ResourceSlices, ResourceClaims, DeviceClasses.

Kept apart from :mod:`support.kube_emulator` (which nobody else extends for DRA) and
added to a running emulator with :func:`enable_dra`. What it models:

* ``resourceslices`` and ``deviceclasses`` (cluster-scoped) and ``resourceclaims``
  (namespaced), with the emulator's own semantics for every verb: create (with
  ``generateName``), get, list and watch with label selectors and the field selectors
  the real server takes for slices (``spec.nodeName``, ``spec.driver``), update with
  a resourceVersion precondition (409 on a stale one), patch, delete.
* Validation of every written object the way the server would refuse it, in two parts:
  the 1.37 OpenAPI schema (kubernetes-validate's files, strict, the validator built
  once per kind: a field the server does not know is an error here, where the real
  server would drop it with a warning) and, for slices, the DRA rules the schema
  cannot say (:func:`gpulet_common.dra.limits.device_problems`: names, lengths,
  counts) plus the slice rules (exactly one of the node selections, devices per
  slice). Failures are 422 Invalid with causes.

* ``resourceclaims/status`` as the real claim strategies have it (what kube-scheduler
  writes the allocation through): a create clears ``.status``; a PUT or PATCH of the
  claim keeps the stored ``.status`` whatever the body says; a PUT or PATCH of
  ``/status`` changes only ``.status`` (spec, labels, annotations, finalizers and owner
  references stay as stored, ``ResetObjectMetaForStatus``; a ``resourceVersion`` in the
  body is still a precondition). Writes through it count under ``resourceclaims/status``.

Not modelled: ``deletecollection``, the ``spec.pool.name`` field selector, the claim's
spec being immutable after create, the allocator in kube-scheduler (the real-server
tests do that; tests may also seed an allocated claim whole with :func:`add_claim`).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final

import jsonschema
import kubernetes_validate
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from gpulet_common.dra import limits
from support import kube_emulator as ke

RESOURCE_SLICES: Final = "resourceslices"
RESOURCE_CLAIMS: Final = "resourceclaims"
DEVICE_CLASSES: Final = "deviceclasses"
GROUP: Final = "resource.k8s.io"
VERSION: Final = "v1"
K8S_VERSION: Final = kubernetes_validate.latest_version()


@functools.lru_cache(maxsize=8)
def _validator(kind: str) -> jsonschema.Draft202012Validator:
    """kubernetes-validate's strict 1.37 schema for ``kind`` (resource.k8s.io/v1), built
    once: its own ``validate`` reads the 4 MB definitions file on every call (150 ms,
    which the slice latency bench would otherwise measure as the server's)."""
    schema_dir = f"kubernetes-json-schema/v{K8S_VERSION}-local-strict"
    schema = schema_contents(f"{schema_dir}/{kind.lower()}-resource-v1.json", K8S_VERSION)
    definitions = schema_contents(f"{schema_dir}/_definitions.json", K8S_VERSION)
    registry: Registry[Any] = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(definitions) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


class BuiltinSchema:
    """The part of :class:`~support.kube_emulator.CrdSchema` the store calls."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def prune(self, obj: ke.JsonObj) -> list[str]:
        return []

    def default(self, obj: ke.JsonObj) -> None:
        return None

    def validate(self, obj: ke.JsonObj) -> list[ke.Cause]:
        causes: list[ke.Cause] = []
        body = dict(obj)
        body["metadata"] = {
            k: v for k, v in (obj.get("metadata") or {}).items() if k != "resourceVersion"
        }
        error = jsonschema.exceptions.best_match(_validator(self.kind).iter_errors(body))
        if error is not None:
            path = ".".join(str(p) for p in error.path)
            causes.append(ke.Cause(path, "FieldValueInvalid", error.message[:300]))
        if self.kind == "ResourceSlice" and not causes:
            causes += _slice_causes(obj.get("spec") or {})
        return causes


def _slice_causes(spec: ke.JsonObj) -> list[ke.Cause]:
    causes: list[ke.Cause] = []
    chosen = [
        k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)
    ]
    if len(chosen) != 1:
        causes.append(
            ke.Cause("spec", "FieldValueInvalid", f"exactly one node selection, got {chosen}")
        )
    if not limits.is_driver_name(str(spec.get("driver", ""))):
        causes.append(ke.Cause("spec.driver", "FieldValueInvalid", "not a DNS subdomain ≤ 63"))
    pool = spec.get("pool") or {}
    if not limits.is_pool_name(str(pool.get("name", ""))):
        causes.append(ke.Cause("spec.pool.name", "FieldValueInvalid", "not a pool name"))
    if int(pool.get("resourceSliceCount") or 0) < 1:
        causes.append(ke.Cause("spec.pool.resourceSliceCount", "FieldValueInvalid", "must be > 0"))
    devices = spec.get("devices") or []
    if len(devices) > limits.slice_limit(devices):
        causes.append(ke.Cause("spec.devices", "TooMany", f"{len(devices)} devices"))
    names = [d.get("name") for d in devices]
    if len(set(names)) != len(names):
        causes.append(ke.Cause("spec.devices", "FieldValueDuplicate", "device names repeat"))
    causes.extend(
        ke.Cause(f"spec.devices[{i}]", "FieldValueInvalid", problem)
        for i, device in enumerate(devices)
        for problem in limits.device_problems(device)
    )
    return causes


def _split_claim_status(
    obj: ke.JsonObj, current: ke.JsonObj, *, status: bool
) -> tuple[ke.JsonObj, ke.JsonObj]:
    """A ResourceClaim write as the claim's update and status strategies take it: through
    ``/status`` only ``.status`` counts (labels and annotations too stay as stored)."""
    return ke._split_status(obj, current, status=status, labels_from_body=False)


def enable_dra(emu: ke.KubeEmulator, *, validate: bool = True) -> ke.KubeEmulator:
    """Serve resource.k8s.io/v1 on ``emu`` (before or after it started). ``validate``
    False skips the schema checks (45 ms a write): for benchmarks only, whose writes the
    tests validate."""
    resources = {
        RESOURCE_SLICES: ke._Resource(
            RESOURCE_SLICES,
            "ResourceSlice",
            "ResourceSliceList",
            GROUP,
            VERSION,
            BuiltinSchema("ResourceSlice") if validate else None,  # type: ignore[arg-type]
            custom=False,
        ),
        DEVICE_CLASSES: ke._Resource(
            DEVICE_CLASSES,
            "DeviceClass",
            "DeviceClassList",
            GROUP,
            VERSION,
            BuiltinSchema("DeviceClass"),  # type: ignore[arg-type]
            custom=False,
        ),
        RESOURCE_CLAIMS: ke._Resource(
            RESOURCE_CLAIMS,
            "ResourceClaim",
            "ResourceClaimList",
            GROUP,
            VERSION,
            BuiltinSchema("ResourceClaim"),  # type: ignore[arg-type]
            custom=False,
            namespaced=True,
            status_split=_split_claim_status,
            create_clears_status=True,
            returns_deleted_object=True,
        ),
    }
    for plural, res in resources.items():
        emu._resources[plural] = res
        emu._objects.setdefault(plural, {})
    # The real server's field selectors for slices (the store's list is module-wide).
    ke._FIELDS = ke._FIELDS | {"spec.driver"}  # type: ignore[misc]
    return emu


@asynccontextmanager
async def dra_emulator(node: str) -> AsyncIterator[ke.KubeEmulator]:
    """A running API emulator with resource.k8s.io/v1 (:func:`enable_dra`) and Node
    ``node``: what every DRA test's ``emu`` fixture starts from."""
    async with ke.KubeEmulator.running() as emu:
        enable_dra(emu)
        emu.add_node(node)
        yield emu


def slices(emu: ke.KubeEmulator) -> list[ke.JsonObj]:
    return emu.list_objects(RESOURCE_SLICES)


def add_claim(emu: ke.KubeEmulator, claim: ke.JsonObj) -> ke.JsonObj:
    """Seed a ResourceClaim whole (status included), as kube-scheduler leaves it."""
    stored: dict[str, Any] = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim", **claim}
    meta = stored.setdefault("metadata", {})
    meta.setdefault("uid", str(uuid.uuid4()))
    meta.setdefault("namespace", "default")
    key = f"{meta['namespace']}/{meta['name']}"
    emu._commit(emu._resources[RESOURCE_CLAIMS], stored, "ADDED")
    return emu._objects[RESOURCE_CLAIMS][key]
