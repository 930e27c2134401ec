"""An in-process Kubernetes API server for the reporter's tests.

Why: the reporter talks to the API server through the unmodified kubernetes-asyncio
client, and the bugs that matter live in the protocol, not in our code's view of it:
which PATCH content type the client really sends, what a stale resourceVersion does,
what a 429 looks like to the caller, what the API server silently prunes. A fake
client (what koordlet's tests use) cannot show any of that. This emulator speaks the
real REST protocol over HTTP on 127.0.0.1 so the client under test is the one that
ships, and it holds the same rules the real server applies to our two resources.

Layers, bottom up:

- patch engines: RFC 7386 merge patch, RFC 6902 JSON patch (with ``test``), a
  strategic-merge approximation for Nodes and a single-manager server-side apply;
- ``CrdSchema``: the Device CRD's ``openAPIV3Schema`` loaded from ``deploy/``, applied
  as the real server does: prune unknown fields, prune non-nullable nulls, default,
  then validate (jsonschema plus int32/int64/date-time formats) into ``Status`` causes;
- ``FaultInjector`` and ``Stats``: what tests switch on (failures, latency, dropped
  connections, before or after the write commits) and what they assert on (request
  log, committed writes per object, changes, rejections);
- the object store: a global resourceVersion counter, optimistic concurrency,
  generation, no-op detection, owner-reference garbage collection and a watch history;
- ``KubeEmulator``: the aiohttp application, the routes and the start/stop API, plus a
  kubeconfig writer and a standalone ``python -m support.kube_emulator`` entry point.

Resources: Devices and Nodes (cluster-scoped), and namespaced Pods and Events (for the
allocator's pod watch and the Events it posts; stored as ``<namespace>/<name>``, listed
and watched across namespaces or in one, field selectors ``metadata.name``,
``metadata.namespace``, ``spec.nodeName`` and ``status.phase``). Pods and Events have
no schema here, so their validation beyond object metadata is not modelled.

Subresources: ``nodes/status`` (and ``resourceclaims/status`` where
:mod:`support.kube_emulator_dra` enables DRA), with the real split: a PUT or PATCH of
``/api/v1/nodes/<name>/status`` changes nothing but ``.status`` (metadata, labels and
spec stay as stored; a ``resourceVersion`` in the body is still a precondition), and a
PUT or PATCH of the Node itself keeps the stored ``.status`` whatever the body says.
Both bump the resourceVersion. Their writes are counted apart, under ``nodes/status``
(``stats.writes_to("nodes/status", name)``).

Deliberate differences from a real API server (each documented where it lives): no
TLS, no managedFields, strategic merge patch merges lists by key only for the Node's
``status.conditions`` and ``status.addresses`` (and the same paths of other core
objects; other lists are replaced whole), server-side apply tracks one applied
configuration per manager, never reports conflicts and is not offered on
``nodes/status``, list continue tokens read the live state rather than a snapshot,
finalizers are not honoured, and 422 messages for JSON-patch failures are the patch
engine's own.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import json
import random
import re
import signal
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Protocol

import jsonschema
import yaml
from aiohttp import web

JsonObj = dict[str, Any]

DEVICES: Final = "devices"
NODES: Final = "nodes"
PODS: Final = "pods"
EVENTS: Final = "events"
DEVICE_GROUP: Final = "scheduling.koordinator.sh"
DEVICE_VERSION: Final = "v1alpha1"
DEFAULT_CRD_PATH: Final = (
    Path(__file__).resolve().parents[2]
    / "deploy"
    / "crds"
    / "scheduling.koordinator.sh_devices.yaml"
)

MERGE_PATCH: Final = "application/merge-patch+json"
JSON_PATCH: Final = "application/json-patch+json"
STRATEGIC_PATCH: Final = "application/strategic-merge-patch+json"
APPLY_PATCH: Final = "application/apply-patch+yaml"

# The reporter only ever talks to one cluster version; this is what /version claims.
_SERVER_VERSION: Final = {
    "major": "1",
    "minor": "31",
    "gitVersion": "v1.31.0-kube-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2024-08-13T00:00:00Z",
    "goVersion": "go1.22.5",
    "compiler": "gc",
    "platform": "linux/amd64",
}
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_OBJECT_META_FIELDS: Final = frozenset(
    {
        "name",
        "generateName",
        "namespace",
        "selfLink",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "labels",
        "annotations",
        "ownerReferences",
        "finalizers",
        "managedFields",
    }
)
# Fields the server owns: whatever a client sends for them on update is overwritten.
_SYSTEM_META_FIELDS: Final = ("uid", "creationTimestamp", "generation", "selfLink")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})",
)
_MAX_ANNOTATIONS_BYTES = 256 * 1024


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json_type(value: Any) -> str:
    """The JSON type name the real server quotes in its type errors."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _json_equal(a: Any, b: Any) -> bool:
    """Deep equality that, unlike ``==``, tells ``true`` from ``1`` as JSON does."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if _is_number(a) and _is_number(b):
        return bool(a == b)
    return type(a) is type(b) and a == b


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# --------------------------------------------------------------------------- errors


@dataclass
class Cause:
    """One entry of ``Status.details.causes``."""

    field: str
    reason: str
    message: str

    def to_json(self) -> JsonObj:
        return {"reason": self.reason, "message": self.message, "field": self.field}


class ApiError(Exception):
    """A failure answered as a ``Status`` object, the way every real API error is."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: JsonObj | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = dict(headers or {})

    def status(self) -> JsonObj:
        body: JsonObj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


# --------------------------------------------------------------------------- patches


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch; returns a new document, inputs untouched."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: JsonObj = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# Lists the core types declare ``patchStrategy: merge`` for, by path, with their
# ``patchMergeKey`` (k8s.io/api/core/v1: NodeStatus.Conditions and .Addresses,
# PodStatus.Conditions). Every other list is atomic here and replaced whole -- among
# them ``spec.taints``, which is atomic on the real server too.
STRATEGIC_MERGE_KEYS: Final[Mapping[tuple[str, ...], str]] = {
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
}


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """Strategic merge patch as far as Nodes (labels, spec, status) need it.

    Maps merge as in a merge patch and the ``$patch: replace|delete`` directives are
    honoured. Lists with a merge key (:data:`STRATEGIC_MERGE_KEYS`) merge by it, as
    the real server merges ``status.conditions`` by ``type``: an element whose key
    matches a stored one is merged into it, a new key is added, and ``{"type": X,
    "$patch": "delete"}`` removes that element; the result is in the real server's
    order (:func:`_element_order`: a new element first).
    Other lists are replaced whole. Other ``$`` directives (``$setElementOrder/...``,
    ``$retainKeys``) are dropped.
    """
    if not isinstance(patch, dict):
        merge_key = STRATEGIC_MERGE_KEYS.get(path)
        if merge_key is not None and isinstance(patch, list) and isinstance(target, list):
            return _merge_list_by_key(target, patch, merge_key, path)
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    body = {k: v for k, v in patch.items() if not k.startswith("$")}
    if directive == "replace":
        return copy.deepcopy(body)
    result: JsonObj = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in body.items():
        if value is None or (isinstance(value, dict) and value.get("$patch") == "delete"):
            result.pop(key, None)
        else:
            result[key] = strategic_merge_patch(result.get(key), value, (*path, key))
    return result


def _merge_list_by_key(
    target: list[Any], patch: list[Any], key: str, path: tuple[str, ...]
) -> list[Any]:
    result = copy.deepcopy(target)
    for element in patch:
        if not isinstance(element, dict) or key not in element:
            # The real server answers 400 for an element without its merge key.
            raise _bad_request(f"map: {element!r} does not contain declared merge key: {key}")
        at = next(
            (i for i, e in enumerate(result) if isinstance(e, dict) and e.get(key) == element[key]),
            None,
        )
        if element.get("$patch") == "delete":
            if at is not None:
                del result[at]
        elif at is None:
            result.append(strategic_merge_patch({}, element, path))
        else:
            result[at] = strategic_merge_patch(result[at], element, path)
    return _element_order(result, target, patch, key)


def _element_order(merged: list[Any], target: list[Any], patch: list[Any], key: str) -> list[Any]:
    """The real server's order of a merged list (apimachinery strategicpatch,
    ``normalizeElementOrder``/``mergeSortedSlice``): the patch's elements in the patch's
    order, the stored-only ones in stored order, interleaved by their stored positions;
    an element new to the list goes before the stored-only ones it meets. So a new
    condition comes first, and a merged one keeps its place."""
    patched = [e.get(key) for e in patch if isinstance(e, dict) and e.get("$patch") != "delete"]
    stored = [e.get(key) for e in target if isinstance(e, dict)]
    by_key = {e.get(key): e for e in merged}
    right = [by_key[k] for k in patched if k in by_key]
    left = [e for e in merged if e.get(key) not in patched]
    out: list[Any] = []
    i = j = 0
    while i < len(left) or j < len(right):
        if j >= len(right):
            out.append(left[i])
            i += 1
        elif i >= len(left):
            out.append(right[j])
            j += 1
        else:
            li, ri = left[i].get(key), right[j].get(key)
            if li in stored and ri in stored and stored.index(li) < stored.index(ri):
                out.append(left[i])
                i += 1
            else:
                out.append(right[j])
                j += 1
    return out


class StatusSplit(Protocol):
    def __call__(
        self, obj: JsonObj, current: JsonObj, *, status: bool
    ) -> tuple[JsonObj, JsonObj]: ...


def _split_status(
    obj: JsonObj, current: JsonObj, *, status: bool, labels_from_body: bool = True
) -> tuple[JsonObj, JsonObj]:
    """A Node write as the real server's node strategies take it.

    Through ``/status`` (``status`` True) the new ``.status``, labels and annotations
    count (the node status strategy resets only ``.spec``: a status write changes a
    Node's labels, as tests/kube/test_differential.py found on the real server);
    everything else is the stored object's, except a ``resourceVersion`` the body
    carries, which stays a precondition. ``labels_from_body`` False: the labels and
    annotations are the stored ones too (``ResetObjectMetaForStatus``, which most
    types' status strategies call, ResourceClaims' among them).
    Through the main resource the stored ``.status`` is kept whatever the body says.
    Returns the object to store and its metadata.
    """
    if status:
        incoming_rv = (obj.get("metadata") or {}).get("resourceVersion", "")
        kept = {k: copy.deepcopy(v) for k, v in current.items() if k != "status"}
        kept["status"] = copy.deepcopy(obj.get("status") or {})
        meta: JsonObj = kept["metadata"]
        incoming = obj.get("metadata") or {}
        for field_name in ("labels", "annotations") if labels_from_body else ():
            if incoming.get(field_name):
                meta[field_name] = copy.deepcopy(incoming[field_name])
            else:
                meta.pop(field_name, None)
        meta.pop("resourceVersion", None)
        if incoming_rv:
            meta["resourceVersion"] = incoming_rv
        return kept, meta
    if "status" in current:
        obj["status"] = copy.deepcopy(current["status"])
    else:
        obj.pop("status", None)
    return obj, obj["metadata"]


class JsonPatchError(Exception):
    """A JSON patch operation that cannot be applied (answered 422, as the server does)."""


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise JsonPatchError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _container(doc: Any, tokens: list[str], path: str) -> Any:
    node = doc
    for token in tokens:
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise JsonPatchError(f"path {path!r} does not exist")
    return node


def _list_index(node: list[Any], token: str, path: str, *, insert: bool) -> int:
    if insert and token == "-":
        return len(node)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise JsonPatchError(f"invalid array index {token!r} in {path!r}")
    index = int(token)
    if index > len(node) or (not insert and index == len(node)):
        raise JsonPatchError(f"array index out of bounds in {path!r}")
    return index


def _get(doc: Any, path: str) -> Any:
    return _container(doc, _pointer(path), path)


def _remove(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        raise JsonPatchError("cannot remove the document root")
    parent = _container(doc, tokens[:-1], path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise JsonPatchError(f"path {path!r} does not exist")
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_list_index(parent, last, path, insert=False))
    raise JsonPatchError(f"path {path!r} does not exist")


def _add(doc: Any, path: str, value: Any, *, replace: bool = False) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return copy.deepcopy(value)
    parent = _container(doc, tokens[:-1], path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if replace and last not in parent:
            raise JsonPatchError(f"path {path!r} does not exist")
        parent[last] = copy.deepcopy(value)
    elif isinstance(parent, list):
        index = _list_index(parent, last, path, insert=not replace)
        if replace:
            parent[index] = copy.deepcopy(value)
        else:
            parent.insert(index, copy.deepcopy(value))
    else:
        raise JsonPatchError(f"path {path!r} does not exist")
    return doc


def json_patch(doc: Any, operations: Any) -> Any:
    """RFC 6902 JSON patch; returns a new document, raises ``JsonPatchError``."""
    result = copy.deepcopy(doc)
    for op in operations:
        if not isinstance(op, dict) or not isinstance(op.get("path"), str):
            raise JsonPatchError(f"malformed operation: {op!r}")
        kind, path = op.get("op"), op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise JsonPatchError(f"operation {kind!r} at {path!r} has no value")
        if kind == "add":
            result = _add(result, path, op["value"])
        elif kind == "remove":
            _remove(result, path)
        elif kind == "replace":
            result = _add(result, path, op["value"], replace=True)
        elif kind in ("move", "copy"):
            source = op.get("from")
            if not isinstance(source, str):
                raise JsonPatchError(f"operation {kind!r} at {path!r} has no 'from'")
            value = (
                _remove(result, source) if kind == "move" else copy.deepcopy(_get(result, source))
            )
            result = _add(result, path, value)
        elif kind == "test":
            if not _json_equal(_get(result, path), op["value"]):
                raise JsonPatchError(f"testing value {path} failed: test failed")
        else:
            raise JsonPatchError(f"unexpected kind of operation: {kind!r}")
    return result


def _apply_removals(previous: Any, current: Any) -> Any:
    """A merge patch that deletes what a manager applied before and no longer applies."""
    if not isinstance(previous, dict) or not isinstance(current, dict):
        return None
    patch: JsonObj = {}
    for key, value in previous.items():
        if key not in current:
            patch[key] = None
        else:
            nested = _apply_removals(value, current[key])
            if nested:
                patch[key] = nested
    return patch


# --------------------------------------------------------------------------- schema


def _check_int(bounds: tuple[int, int]) -> Callable[[object], bool]:
    def check(value: object) -> bool:
        if not isinstance(value, int) or isinstance(value, bool):
            return True  # a type error, reported by the type keyword
        return bounds[0] <= value <= bounds[1]

    return check


def _check_date_time(value: object) -> bool:
    # Stricter than the API server's strfmt (which also takes a few non-RFC 3339
    # layouts): koord-scheduler decodes these into metav1.Time, which needs RFC 3339.
    if not isinstance(value, str):
        return True
    if not _RFC3339.fullmatch(value):
        return False
    try:
        datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


_FORMATS = jsonschema.FormatChecker(formats=())
_FORMATS.checks("int32")(_check_int(_INT32))
_FORMATS.checks("int64")(_check_int(_INT64))
_FORMATS.checks("date-time")(_check_date_time)


def _to_json_schema(node: Any) -> Any:
    """OpenAPI v3 (Kubernetes dialect) → JSON Schema draft 4 for jsonschema."""
    if isinstance(node, list):
        return [_to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_json_schema(v) for k, v in node.items() if k != "description"}
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out and "type" not in out:
        out["type"] = ["integer", "string"]
    if out.pop("nullable", False):
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def _field_path(parts: Iterable[str | int]) -> str:
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


def _quote(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else json.dumps(value, sort_keys=True)


@dataclass(frozen=True)
class CrdSchema:
    """One served version of a CRD: names plus the structural schema it enforces."""

    group: str
    version: str
    kind: str
    list_kind: str
    plural: str
    singular: str
    scope: str
    openapi: JsonObj
    validator: Any = field(repr=False, compare=False)

    @classmethod
    def from_file(cls, path: Path | str) -> CrdSchema:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
        crds = [d for d in docs if d.get("kind") == "CustomResourceDefinition"]
        if len(crds) != 1:
            raise ValueError(f"{path}: expected exactly one CustomResourceDefinition")
        return cls.from_crd(crds[0])

    @classmethod
    def from_crd(cls, crd: JsonObj) -> CrdSchema:
        spec = crd["spec"]
        storage = [v for v in spec["versions"] if v.get("storage") and v.get("served")]
        if len(storage) != 1:
            raise ValueError("expected exactly one served storage version")
        openapi = storage[0]["schema"]["openAPIV3Schema"]
        names = spec["names"]
        schema = _to_json_schema(openapi)
        jsonschema.Draft4Validator.check_schema(schema)
        return cls(
            group=spec["group"],
            version=storage[0]["name"],
            kind=names["kind"],
            list_kind=names.get("listKind", names["kind"] + "List"),
            plural=names["plural"],
            singular=names.get("singular", names["kind"].lower()),
            scope=spec["scope"],
            openapi=openapi,
            validator=jsonschema.Draft4Validator(schema, format_checker=_FORMATS),
        )

    def prune(self, obj: JsonObj) -> list[str]:
        """Drop fields the schema does not know, in place; returns their paths.

        The root's apiVersion/kind/metadata are the server's business, not the
        schema's: metadata is pruned to ObjectMeta separately.
        """
        unknown: list[str] = []
        properties = self.openapi.get("properties", {})
        for key in list(obj):
            if key in ("apiVersion", "kind", "metadata"):
                continue
            if key in properties:
                _prune(obj[key], properties[key], [key], unknown)
            else:
                del obj[key]
                unknown.append(key)
        return unknown

    def default(self, obj: JsonObj) -> None:
        """Prune non-nullable nulls and apply defaults, in place, as the server does."""
        properties = self.openapi.get("properties", {})
        for key in list(obj):
            if key in properties and key not in ("apiVersion", "kind", "metadata"):
                if obj[key] is None and not _nullable(properties[key]):
                    del obj[key]
                else:
                    _default(obj[key], properties[key])

    def validate(self, obj: JsonObj) -> list[Cause]:
        causes: list[Cause] = []
        seen: set[tuple[str, str]] = set()
        errors = sorted(self.validator.iter_errors(obj), key=lambda e: list(map(str, e.path)))
        for error in errors:
            for cause in _causes(error):
                if (cause.field, cause.message) not in seen:
                    seen.add((cause.field, cause.message))
                    causes.append(cause)
        return causes


def _nullable(schema: JsonObj) -> bool:
    return bool(schema.get("nullable"))


def _is_object_schema(schema: JsonObj) -> bool:
    return schema.get("type") == "object" or "properties" in schema


def _prune(value: Any, schema: JsonObj, path: list[str | int], unknown: list[str]) -> None:
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            _prune(item, schema["items"], [*path, index], unknown)
        return
    if not isinstance(value, dict) or not _is_object_schema(schema):
        return
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    properties: JsonObj = schema.get("properties", {})
    additional = schema.get("additionalProperties")
    for key in list(value):
        if key in properties:
            _prune(value[key], properties[key], [*path, key], unknown)
        elif isinstance(additional, dict):
            _prune(value[key], additional, [*path, key], unknown)
        elif additional is True:
            continue
        else:
            del value[key]
            unknown.append(_field_path([*path, key]))


def _default(value: Any, schema: JsonObj) -> None:
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default(item, schema["items"])
        return
    if not isinstance(value, dict):
        return
    properties: JsonObj = schema.get("properties", {})
    additional = schema.get("additionalProperties")
    for key in list(value):
        sub = properties.get(key) or (additional if isinstance(additional, dict) else None)
        if sub is None:
            continue
        if value[key] is None and not _nullable(sub):
            if "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            else:
                del value[key]
                continue
        _default(value[key], sub)
    for key, sub in properties.items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
            _default(value[key], sub)


def _causes(error: Any) -> list[Cause]:
    """Translate one jsonschema error into the causes the real server would list."""
    parts = list(error.absolute_path)
    path = _field_path(parts)
    value = error.instance
    validator = error.validator
    expected = error.validator_value
    if validator == "required":
        missing = [name for name in expected if isinstance(value, dict) and name not in value]
        return [
            Cause(_field_path([*parts, name]), "FieldValueRequired", "Required value")
            for name in missing
        ]
    if validator in ("type", "anyOf"):
        if validator == "anyOf":
            types = [s.get("type") for s in expected if isinstance(s, dict) and "type" in s]
            expected = ",".join(str(t) for t in types)
        elif isinstance(expected, list):
            expected = ",".join(expected)
        actual = _json_type(value)
        message = (
            f'Invalid value: "{actual}": {path} in body must be of type {expected}: "{actual}"'
        )
        return [Cause(path, "FieldValueTypeInvalid", message)]
    if validator == "enum":
        allowed = ", ".join(_quote(v) for v in expected)
        message = f"Unsupported value: {_quote(value)}: supported values: {allowed}"
        return [Cause(path, "FieldValueNotSupported", message)]
    if validator == "format":
        shown = _quote(value)
        message = f"Invalid value: {shown}: {path} in body must be of type {expected}: {shown}"
        return [Cause(path, "FieldValueInvalid", message)]
    if validator == "pattern":
        message = f"Invalid value: {_quote(value)}: {path} in body should match '{expected}'"
        return [Cause(path, "FieldValueInvalid", message)]
    if validator == "maxLength":
        return [Cause(path, "FieldValueTooLong", f"Too long: may not be longer than {expected}")]
    if validator == "minLength":
        message = (
            f"Invalid value: {_quote(value)}: {path} in body should be at least {expected} "
            "chars long"
        )
        return [Cause(path, "FieldValueInvalid", message)]
    if validator == "minimum":
        message = (
            f"Invalid value: {_quote(value)}: {path} in body should be greater than or equal "
            f"to {expected}"
        )
        return [Cause(path, "FieldValueInvalid", message)]
    return [Cause(path, "FieldValueInvalid", f"Invalid value: {_quote(value)}: {error.message}")]


# --------------------------------------------------------------------------- metadata


def _qualified_name_errors(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if "/" in prefix:
        return "a qualified name must have at most one '/'"
    if key.count("/") == 1 and (
        not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix)
    ):
        return "prefix part must be a lowercase RFC 1123 subdomain"
    if not name or len(name) > 63 or not _QUALIFIED_NAME.fullmatch(name):
        return (
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must "
            "start and end with an alphanumeric character (at most 63 characters)"
        )
    return None


def validate_object_meta(meta: JsonObj) -> list[Cause]:
    """The ObjectMeta rules every resource shares (name, labels, annotations, owners)."""
    causes: list[Cause] = []
    name = meta.get("name", "")
    if not name:
        causes.append(
            Cause(
                "metadata.name",
                "FieldValueRequired",
                "Required value: name or generateName is required",
            )
        )
    elif len(name) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(name):
        causes.append(
            Cause(
                "metadata.name",
                "FieldValueInvalid",
                f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower '
                "case alphanumeric characters, '-' or '.', and must start and end with an "
                "alphanumeric character",
            )
        )
    for key, value in (meta.get("labels") or {}).items():
        problem = _qualified_name_errors(key)
        if problem:
            causes.append(
                Cause("metadata.labels", "FieldValueInvalid", f'Invalid value: "{key}": {problem}')
            )
        if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            causes.append(
                Cause(
                    "metadata.labels",
                    "FieldValueInvalid",
                    f'Invalid value: "{value}": a valid label must be an empty string or consist '
                    "of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                    "alphanumeric character (at most 63 characters)",
                )
            )
    annotations: JsonObj = meta.get("annotations") or {}
    for key in annotations:
        problem = _qualified_name_errors(key.lower())
        if problem:
            causes.append(
                Cause(
                    "metadata.annotations",
                    "FieldValueInvalid",
                    f'Invalid value: "{key}": {problem}',
                )
            )
    if sum(len(k) + len(v) for k, v in annotations.items()) > _MAX_ANNOTATIONS_BYTES:
        causes.append(
            Cause(
                "metadata.annotations",
                "FieldValueTooLong",
                "Too long: must have at most 262144 bytes",
            )
        )
    controllers = 0
    for index, ref in enumerate(meta.get("ownerReferences") or []):
        causes.extend(
            Cause(
                f"metadata.ownerReferences[{index}].{key}",
                "FieldValueInvalid",
                f'Invalid value: "": {key} must not be empty',
            )
            for key in ("apiVersion", "kind", "name", "uid")
            if not ref.get(key)
        )
        controllers += bool(ref.get("controller"))
    if controllers > 1:
        causes.append(
            Cause(
                "metadata.ownerReferences",
                "FieldValueInvalid",
                "Invalid value: []: Only one reference can have Controller set to true",
            )
        )
    return causes


def _check_meta_shape(meta: Any) -> None:
    """What Go's JSON decoding into ObjectMeta refuses outright (a 400, not a 422)."""
    if not isinstance(meta, dict):
        raise _bad_request(
            f"json: cannot unmarshal {_json_type(meta)} into Go struct field .metadata "
            "of type v1.ObjectMeta"
        )
    for key in ("labels", "annotations"):
        value = meta.get(key)
        if value is None:
            continue
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise _bad_request(
                "json: cannot unmarshal into Go struct field "
                f"ObjectMeta.metadata.{key} of type map[string]string"
            )
    refs = meta.get("ownerReferences")
    if refs is not None and (
        not isinstance(refs, list) or not all(isinstance(r, dict) for r in refs)
    ):
        raise _bad_request(
            "json: cannot unmarshal into Go struct field ObjectMeta.metadata.ownerReferences"
        )


# --------------------------------------------------------------------------- faults and stats


@dataclass
class FaultRule:
    """One switch in the fault injector; see ``FaultInjector`` for the verbs.

    ``status`` None means a latency-only rule. ``count`` None means unlimited; otherwise
    the rule disarms after firing that many times. ``ratio`` is the chance per
    matching request, rolled on the rule's own seeded RNG so a run is reproducible.
    ``method``/``path`` restrict the rule: method exact (case-insensitive), path a
    regular expression searched in the request path (no query string).
    """

    status: int | None = None
    statuses: tuple[int, ...] = ()
    count: int | None = None
    ratio: float = 1.0
    method: str | None = None
    path: str | None = None
    retry_after: int | None = None
    latency: float = 0.0
    after_commit: bool = False
    disconnect: bool = False
    message: str | None = None
    seed: int = 0
    fired: int = 0
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def matches(self, method: str, path: str) -> bool:
        if self.count is not None and self.count <= 0:
            return False
        if self.method is not None and self.method.upper() != method.upper():
            return False
        return self.path is None or re.search(self.path, path) is not None

    def roll(self) -> bool:
        """Decide whether this matching request is hit, and account for it."""
        if self.ratio < 1.0 and self.rng.random() >= self.ratio:
            return False
        self.fired += 1
        if self.count is not None:
            self.count -= 1
        return True

    def pick_status(self) -> int:
        if self.statuses:
            return self.rng.choice(self.statuses)
        return self.status or 500

    @property
    def exhausted(self) -> bool:
        return self.count is not None and self.count <= 0


@dataclass
class _Decision:
    latency: float = 0.0
    latency_after: float = 0.0
    failure: FaultRule | None = None
    status: int = 0


class FaultInjector:
    """What a test switches on to make the API server misbehave.

    Rules are evaluated in the order they were added. All matching latency rules add
    up; the first failure rule that fires answers the request. A failure rule with
    ``after_commit`` lets the request do its work (the write is stored and counted)
    and then answers the fault instead of the result: the ambiguous outcome a client
    sees when a response is lost.
    """

    def __init__(self) -> None:
        self.rules: list[FaultRule] = []

    def add(self, rule: FaultRule) -> FaultRule:
        self.rules.append(rule)
        return rule

    def fail_next(
        self,
        n: int = 1,
        status: int = 500,
        *,
        method: str | None = None,
        path: str | None = None,
        retry_after: int | None = None,
        after_commit: bool = False,
        message: str | None = None,
    ) -> FaultRule:
        """Answer the next ``n`` matching requests with ``status``."""
        return self.add(
            FaultRule(
                status=status,
                count=n,
                method=method,
                path=path,
                retry_after=retry_after,
                after_commit=after_commit,
                message=message,
            )
        )

    def fail_ratio(
        self,
        ratio: float,
        statuses: Iterable[int] = (500,),
        *,
        seed: int = 0,
        method: str | None = None,
        path: str | None = None,
        retry_after: int | None = None,
        count: int | None = None,
    ) -> FaultRule:
        """Fail each matching request with probability ``ratio``, status drawn from ``statuses``."""
        return self.add(
            FaultRule(
                statuses=tuple(statuses),
                ratio=ratio,
                seed=seed,
                method=method,
                path=path,
                retry_after=retry_after,
                count=count,
            )
        )

    def delay(
        self,
        seconds: float,
        *,
        method: str | None = None,
        path: str | None = None,
        count: int | None = None,
        ratio: float = 1.0,
        seed: int = 0,
        after_commit: bool = False,
    ) -> FaultRule:
        """Answer matching requests ``seconds`` late (before or after the work is done)."""
        return self.add(
            FaultRule(
                latency=seconds,
                method=method,
                path=path,
                count=count,
                ratio=ratio,
                seed=seed,
                after_commit=after_commit,
            )
        )

    def disconnect_next(
        self,
        n: int = 1,
        *,
        method: str | None = None,
        path: str | None = None,
        after_commit: bool = False,
    ) -> FaultRule:
        """Close the connection without an answer on the next ``n`` matching requests.

        aiohttp's client resends an idempotent request (GET, PUT, DELETE) once when a
        kept-alive connection closes before any answer, so a single drop is invisible
        to those: use ``n=2`` to make a GET fail. POST and PATCH are not resent.
        """
        return self.add(
            FaultRule(disconnect=True, count=n, method=method, path=path, after_commit=after_commit)
        )

    def remove(self, rule: FaultRule) -> None:
        with suppress(ValueError):
            self.rules.remove(rule)

    def clear(self) -> None:
        self.rules.clear()

    def decide(self, method: str, path: str) -> _Decision:
        decision = _Decision()
        for rule in list(self.rules):
            if not rule.matches(method, path):
                continue
            failing = rule.status is not None or rule.statuses or rule.disconnect
            if failing and decision.failure is not None:
                continue
            if not rule.roll():
                continue
            if failing:
                decision.failure = rule
                decision.status = 0 if rule.disconnect else rule.pick_status()
            elif rule.after_commit:
                decision.latency_after += rule.latency
            else:
                decision.latency += rule.latency
            if rule.exhausted:
                self.remove(rule)
        return decision


@dataclass(frozen=True)
class RequestRecord:
    """One line of the request log. ``status`` 0 means the connection was dropped."""

    method: str
    path: str
    query: str
    content_type: str
    status: int
    started: float
    duration: float
    fault: bool


class Stats:
    """Counters and the request log, for assertions like "exactly one write"."""

    def __init__(self, log_size: int = 100_000) -> None:
        self.log: deque[RequestRecord] = deque(maxlen=log_size)
        self.requests = 0
        self.rejections = 0
        self.errors = 0
        self.writes: Counter[tuple[str, str]] = Counter()
        self.changes: Counter[tuple[str, str]] = Counter()
        self.deletes: Counter[tuple[str, str]] = Counter()

    def writes_to(self, plural: str, name: str) -> int:
        """Committed POST/PUT/PATCH requests on one object, no-ops included."""
        return self.writes[(plural, name)]

    def changes_to(self, plural: str, name: str) -> int:
        """Committed writes that changed the object (gave it a new resourceVersion)."""
        return self.changes[(plural, name)]

    def total_writes(self, plural: str | None = None) -> int:
        return sum(n for (p, _), n in self.writes.items() if plural is None or p == plural)

    def matching(
        self, method: str | None = None, path: str | None = None, status: int | None = None
    ) -> list[RequestRecord]:
        """Logged requests by exact method, path regex (searched) and exact status."""
        return [
            r
            for r in self.log
            if (method is None or r.method == method.upper())
            and (path is None or re.search(path, r.path))
            and (status is None or r.status == status)
        ]

    def reset(self) -> None:
        self.log.clear()
        self.requests = self.rejections = self.errors = 0
        self.writes.clear()
        self.changes.clear()
        self.deletes.clear()


# --------------------------------------------------------------------------- store


@dataclass(frozen=True)
class _Resource:
    plural: str
    kind: str
    list_kind: str
    group: str
    version: str
    schema: CrdSchema | None
    custom: bool
    # Namespaced objects are stored under "<namespace>/<name>".
    namespaced: bool = False
    # A ``/status`` subresource: how a write through it (``status`` True) or through
    # the main resource (False) splits into what is stored; None: no subresource.
    status_split: StatusSplit | None = None
    # The type's create strategy clears ``.status`` (ResourceClaims; not Nodes).
    create_clears_status: bool = False
    # A DELETE answers the object as deleted, not a Status (the registry's
    # ReturnDeletedObject: ResourceClaims, as the differential test showed).
    returns_deleted_object: bool = False

    def key(self, namespace: str | None, name: str) -> str:
        return f"{namespace}/{name}" if self.namespaced else name

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind

    @property
    def patch_types(self) -> tuple[str, ...]:
        # CRs have no Go struct to drive a strategic merge: the real server refuses it.
        if self.custom:
            return (JSON_PATCH, MERGE_PATCH, APPLY_PATCH)
        return (JSON_PATCH, MERGE_PATCH, STRATEGIC_PATCH, APPLY_PATCH)

    def details(self, name: str, **extra: Any) -> JsonObj:
        details: JsonObj = {"name": name, "kind": self.plural}
        if self.group:
            details["group"] = self.group
        details.update(extra)
        return details

    def not_found(self, name: str) -> ApiError:
        return ApiError(
            404, "NotFound", f'{self.qualified} "{name}" not found', details=self.details(name)
        )

    def conflict(self, name: str, message: str | None = None) -> ApiError:
        message = message or (
            f'Operation cannot be fulfilled on {self.qualified} "{name}": the object has been '
            "modified; please apply your changes to the latest version and try again"
        )
        return ApiError(409, "Conflict", message, details=self.details(name))

    def invalid(self, name: str, causes: list[Cause]) -> ApiError:
        listed = [f"{c.field}: {c.message}" for c in causes]
        summary = listed[0] if len(listed) == 1 else "[" + ", ".join(listed) + "]"
        details: JsonObj = {
            "name": name,
            "kind": self.kind,
            "causes": [c.to_json() for c in causes],
        }
        if self.group:
            details["group"] = self.group
        return ApiError(
            422, "Invalid", f'{self.qualified_kind} "{name}" is invalid: {summary}', details=details
        )


@dataclass(frozen=True)
class _Event:
    rv: int
    type: str
    plural: str
    obj: JsonObj


@dataclass
class _Outcome:
    code: int
    body: JsonObj
    headers: dict[str, str] = field(default_factory=dict)


class KubeEmulator:
    """An in-process Kubernetes API server for Devices and Nodes.

    Use ``async with KubeEmulator.running() as emu:`` and point the client at
    ``emu.url``. Everything runs on the caller's asyncio event loop.
    """

    def __init__(
        self,
        crd_path: Path | str | None = None,
        *,
        token: str | None = None,
        gc_delay: float | None = 0.0,
        max_watch_seconds: float = 30.0,
        history_size: int = 1000,
        log_size: int = 100_000,
    ) -> None:
        """``token``: when set, requests must carry ``Authorization: Bearer <token>``.
        ``gc_delay``: seconds after a write or Node deletion before the garbage collector
        deletes Devices whose owner Node is gone or has another uid (None: never).
        ``max_watch_seconds``: the longest a watch stays open (real servers: 30-60 min).
        """
        self.crd = CrdSchema.from_file(crd_path or DEFAULT_CRD_PATH)
        self.token = token
        self.gc_delay = gc_delay
        self.max_watch_seconds = max_watch_seconds
        self.faults = FaultInjector()
        self.stats = Stats(log_size)
        self._resources: dict[str, _Resource] = {
            self.crd.plural: _Resource(
                plural=self.crd.plural,
                kind=self.crd.kind,
                list_kind=self.crd.list_kind,
                group=self.crd.group,
                version=self.crd.version,
                schema=self.crd,
                custom=True,
            ),
            NODES: _Resource(
                NODES, "Node", "NodeList", "", "v1", None, custom=False, status_split=_split_status
            ),
            # Pods and Events, namespaced: enough of them for the allocator's pod watch
            # (list/watch with field selectors) and the Events it posts. No schema:
            # the real server's validation of these types is not modelled.
            PODS: _Resource(PODS, "Pod", "PodList", "", "v1", None, custom=False, namespaced=True),
            EVENTS: _Resource(
                EVENTS, "Event", "EventList", "", "v1", None, custom=False, namespaced=True
            ),
        }
        self._objects: dict[str, dict[str, JsonObj]] = {p: {} for p in self._resources}
        self._applied: dict[tuple[str, str], dict[str, Any]] = {}
        # etcd's first revision is 1, so a real server never lists at resourceVersion
        # "0", which a watch reads as "any state" (current objects, no history): an
        # empty emulator listing at "0" made a watch from its list miss what followed
        # (tests/kube/test_differential.py).
        self._rv = 1
        self._history: deque[_Event] = deque(maxlen=history_size)
        self._history_floor = 0
        self._watchers: set[asyncio.Queue[_Event | None]] = set()
        self._runner: web.AppRunner | None = None
        self._url: str | None = None
        self._gc_handles: set[asyncio.TimerHandle] = set()

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    @asynccontextmanager
    async def running(
        cls,
        crd_path: Path | str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        **kwargs: Any,
    ) -> AsyncIterator[KubeEmulator]:
        emulator = cls(crd_path, **kwargs)
        await emulator.start(host, port)
        try:
            yield emulator
        finally:
            await emulator.stop()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application(client_max_size=3 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # Short shutdown: open watches are ended by stop() itself, nothing else lingers.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        bound = runner.addresses[0]
        self._url = f"http://{bound[0]}:{bound[1]}"
        return self._url

    async def stop(self) -> None:
        for handle in self._gc_handles:
            handle.cancel()
        self._gc_handles.clear()
        for queue in list(self._watchers):
            queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the emulator is not running")
        return self._url

    @property
    def resource_version(self) -> int:
        """The global counter: the resourceVersion of the latest write."""
        return self._rv

    # ------------------------------------------------------------------ direct access

    def add_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        *,
        uid: str | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> JsonObj:
        """Seed (or replace) a Node as the kubelet would have registered it."""
        node: JsonObj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "uid": uid or str(uuid.uuid4()),
                "labels": {"kubernetes.io/hostname": name, **(labels or {})},
            },
            "spec": {},
            "status": {},
        }
        if annotations:
            node["metadata"]["annotations"] = dict(annotations)
        return self.put_object(NODES, node)

    def add_pod(
        self,
        name: str,
        *,
        node: str,
        namespace: str = "default",
        containers: list[JsonObj] | None = None,
        annotations: Mapping[str, str] | None = None,
        phase: str = "Pending",
        scheduled_at: str | None = None,
        uid: str | None = None,
    ) -> JsonObj:
        """Seed (or replace) a Pod bound to ``node``, as the scheduler's binding leaves
        it: ``spec.nodeName`` set and a ``PodScheduled`` condition stamped."""
        stamp = scheduled_at or _now_rfc3339()
        pod: JsonObj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuid.uuid4())},
            "spec": {
                "nodeName": node,
                "containers": containers or [{"name": "main", "image": "busybox"}],
            },
            "status": {
                "phase": phase,
                "conditions": [
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp}
                ],
            },
        }
        if annotations:
            pod["metadata"]["annotations"] = dict(annotations)
        return self.put_object(PODS, pod)

    def get_object(self, plural: str, name: str) -> JsonObj | None:
        """A copy of the stored object, or None; no HTTP, nothing logged or counted.
        Namespaced objects are named ``<namespace>/<name>``."""
        obj = self._objects[plural].get(name)
        return copy.deepcopy(obj) if obj is not None else None

    def list_objects(self, plural: str) -> list[JsonObj]:
        return [copy.deepcopy(self._objects[plural][n]) for n in sorted(self._objects[plural])]

    def put_object(self, plural: str, obj: JsonObj) -> JsonObj:
        """Store an object as another writer would (an admin, koordlet), bypassing
        validation, faults and stats. Server fields are filled in; the write gets a
        new resourceVersion and is seen by watches and the garbage collector."""
        res = self._resources[plural]
        obj = copy.deepcopy(obj)
        obj.setdefault("apiVersion", res.api_version)
        obj.setdefault("kind", res.kind)
        meta = obj.setdefault("metadata", {})
        if res.namespaced:
            meta.setdefault("namespace", "default")
        old = self._objects[plural].get(res.key(meta.get("namespace"), meta["name"]))
        if old is not None:
            for key in _SYSTEM_META_FIELDS:
                if key in old["metadata"]:
                    meta.setdefault(key, old["metadata"][key])
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now_rfc3339())
        if res.custom:
            meta.setdefault("generation", 1)
        self._commit(res, obj, "MODIFIED" if old is not None else "ADDED")
        return copy.deepcopy(obj)

    def delete_object(self, plural: str, name: str) -> bool:
        """Delete as another actor would; returns whether it existed."""
        res = self._resources[plural]
        if name not in self._objects[plural]:
            return False
        self._delete(res, name)
        return True

    def collect_garbage(self) -> list[str]:
        """Delete Devices none of whose owners exist any more (by name and uid), as the
        garbage collector does; returns the names deleted. Only Node owners are
        resolved: a Device with an owner of another kind is left alone."""
        deleted: list[str] = []
        nodes = self._objects[NODES]
        for name, obj in list(self._objects[self.crd.plural].items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if not refs or any(
                r.get("kind") != "Node" or r.get("apiVersion") != "v1" for r in refs
            ):
                continue
            alive = [
                r
                for r in refs
                if r.get("name") in nodes
                and nodes[r["name"]]["metadata"].get("uid") == r.get("uid")
            ]
            if not alive:
                self._delete(self._resources[self.crd.plural], name)
                deleted.append(name)
        return deleted

    # ------------------------------------------------------------------ kubeconfig

    def kubeconfig(self, *, token: str | None = None, context: str = "kube-emulator") -> JsonObj:
        """A kubeconfig document pointing at this emulator (token defaults to ``self.token``)."""
        user: JsonObj = {}
        if token or self.token:
            user["token"] = token or self.token
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": {"server": self.url}}],
            "users": [{"name": context, "user": user}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": context}}],
            "current-context": context,
            "preferences": {},
        }

    def write_kubeconfig(
        self, path: Path | str, *, token: str | None = None, context: str = "kube-emulator"
    ) -> Path:
        target = Path(path)
        target.write_text(
            yaml.safe_dump(self.kubeconfig(token=token, context=context), sort_keys=False)
        )
        return target

    # ------------------------------------------------------------------ store internals

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _commit(self, res: _Resource, obj: JsonObj, event: str) -> None:
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        meta = obj["metadata"]
        self._objects[res.plural][res.key(meta.get("namespace"), meta["name"])] = obj
        self._publish(res, event, obj)
        self._schedule_gc()

    def _delete(self, res: _Resource, name: str) -> JsonObj:
        obj = self._objects[res.plural].pop(name)
        self._applied.pop((res.plural, name), None)
        # The DELETED event carries the deletion's own resourceVersion, as etcd's does.
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        self._publish(res, "DELETED", obj)
        if res.plural == NODES:
            self._schedule_gc()
        return obj

    def _publish(self, res: _Resource, kind: str, obj: JsonObj) -> None:
        event = _Event(self._rv, kind, res.plural, copy.deepcopy(obj))
        if self._history.maxlen is not None and len(self._history) == self._history.maxlen:
            self._history_floor = self._history[0].rv
        self._history.append(event)
        for queue in self._watchers:
            queue.put_nowait(event)

    def _schedule_gc(self) -> None:
        if self.gc_delay is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # seeded before start: the next write in the loop collects

        def run() -> None:
            self._gc_handles.discard(handle)
            self.collect_garbage()

        handle = loop.call_later(self.gc_delay, run)
        self._gc_handles.add(handle)

    # ------------------------------------------------------------------ HTTP

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        method, path = request.method, request.path
        self.stats.requests += 1
        status, fault = 500, False
        decision = _Decision()
        try:
            self._authenticate(request)
            decision = self.faults.decide(method, path)
            if decision.latency:
                await asyncio.sleep(decision.latency)
            rule = decision.failure
            if rule is not None and not rule.after_commit:
                fault = True
                return self._fault_response(request, rule, decision.status)
            response = await self._dispatch(request)
            if decision.latency_after:
                await asyncio.sleep(decision.latency_after)
            if rule is not None:
                fault = True
                return self._fault_response(request, rule, decision.status)
            status = response.status
            return response
        except ApiError as error:
            status = error.code
            return web.json_response(error.status(), status=error.code, headers=error.headers)
        finally:
            if fault:
                status = decision.status
                self.stats.rejections += 1
            if status >= 400 or status == 0:
                self.stats.errors += 1
            self.stats.log.append(
                RequestRecord(
                    method=method,
                    path=path,
                    query=request.query_string,
                    content_type=request.headers.get("Content-Type", ""),
                    status=status,
                    started=started,
                    duration=time.monotonic() - started,
                    fault=fault,
                )
            )

    def _authenticate(self, request: web.Request) -> None:
        if (
            self.token is not None
            and request.headers.get("Authorization") != f"Bearer {self.token}"
        ):
            raise ApiError(401, "Unauthorized", "Unauthorized")

    def _fault_response(
        self, request: web.Request, rule: FaultRule, status: int
    ) -> web.StreamResponse:
        if rule.disconnect:
            if request.transport is not None:
                request.transport.abort()
            # Nothing reaches the client; aiohttp discards this on the aborted transport.
            return web.Response(status=500)
        error = self._fault_error(request.path, status, rule)
        return web.json_response(error.status(), status=error.code, headers=error.headers)

    def _fault_error(self, path: str, status: int, rule: FaultRule) -> ApiError:
        res, name = self._route_resource(path)
        name = name or ""
        if status == 404 and res is not None:
            return res.not_found(name)
        if status == 409 and res is not None:
            return res.conflict(name)
        if status == 429:
            seconds = rule.retry_after if rule.retry_after is not None else 1
            return ApiError(
                429,
                "TooManyRequests",
                rule.message or "Too many requests, please try again later.",
                details={"retryAfterSeconds": seconds},
                headers={"Retry-After": str(seconds)},
            )
        reasons = {
            400: "BadRequest",
            401: "Unauthorized",
            403: "Forbidden",
            404: "NotFound",
            409: "Conflict",
            410: "Expired",
            500: "InternalError",
            503: "ServiceUnavailable",
            504: "Timeout",
        }
        messages = {
            500: "Internal error occurred: injected fault",
            503: "the server is currently unable to handle the request",
            504: "the server was unable to return a response in the time allotted",
        }
        headers = {"Retry-After": str(rule.retry_after)} if rule.retry_after is not None else {}
        details = {"retryAfterSeconds": rule.retry_after} if rule.retry_after is not None else None
        return ApiError(
            status,
            reasons.get(status, "Unknown"),
            rule.message or messages.get(status, "injected fault"),
            details=details,
            headers=headers,
        )

    _ROUTE = re.compile(
        r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
        r"/(?:namespaces/(?P<ns>[^/]+)/)?(?P<plural>[^/]+)(?:/(?P<name>[^/]+)"
        r"(?:/(?P<sub>status))?)?/?$"
    )

    def _route_resource(self, path: str) -> tuple[_Resource | None, str | None]:
        """The resource and the stored key (``ns/name`` for namespaced objects)."""
        res, name, namespace = self._route(path)
        if res is None or name is None:
            return res, None
        return res, res.key(namespace, name)

    def _route(self, path: str) -> tuple[_Resource | None, str | None, str | None]:
        match = self._ROUTE.match(path)
        if match is None:
            return None, None, None
        res = self._resources.get(match["plural"])
        if res is None:
            return None, None, None
        if match["core"]:
            if res.group:
                return None, None, None
        elif (match["group"], match["version"]) != (res.group, res.version):
            return None, None, None
        namespace = match["ns"]
        if namespace is not None and not res.namespaced:
            return None, None, None
        if res.namespaced and namespace is None and match["name"] is not None:
            # A namespaced object has no cluster-wide URL (only its list does).
            return None, None, None
        return res, match["name"], namespace

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        discovery = self._discovery(request.path)
        if discovery is not None:
            if request.method != "GET":
                raise ApiError(
                    405,
                    "MethodNotAllowed",
                    "the server does not allow this method on the requested resource",
                )
            return web.json_response(discovery)
        res, name = self._route_resource(request.path)
        if res is None:
            raise ApiError(
                404, "NotFound", "the server could not find the requested resource", details={}
            )
        namespace = self._route(request.path)[2]
        query = request.query
        method = request.method
        sub = self._subresource(request.path)
        if sub is not None:
            return await self._dispatch_status(request, res, name)
        if name is None and method == "GET" and query.get("watch", "").lower() in ("true", "1"):
            return await self._watch(request, res, namespace)
        dry_run = query.get("dryRun") == "All"
        if name is None:
            if method == "GET":
                outcome = self._list(res, query, namespace)
            elif method == "POST":
                if res.namespaced and namespace is None:
                    raise ApiError(
                        405,
                        "MethodNotAllowed",
                        "the server does not allow this method on the requested resource",
                    )
                body = await self._json_body(request)
                if res.namespaced and isinstance(body, dict):
                    meta = body.setdefault("metadata", {})
                    if isinstance(meta, dict):
                        if meta.get("namespace", namespace) != namespace:
                            raise _bad_request(
                                "the namespace of the provided object does not match the "
                                "namespace sent on the request"
                            )
                        meta["namespace"] = namespace
                outcome = self._create(res, body, query, dry_run)
            else:
                raise ApiError(
                    405,
                    "MethodNotAllowed",
                    "the server does not allow this method on the requested resource",
                )
        elif method == "GET":
            outcome = _Outcome(200, self._require(res, name))
        elif method == "PUT":
            outcome = self._update(res, name, await self._json_body(request), query, dry_run)
        elif method == "PATCH":
            outcome = await self._patch(request, res, name, dry_run)
        elif method == "DELETE":
            raw = await request.read()
            try:
                options = json.loads(raw) if raw.strip() else {}
            except ValueError as error:
                raise _bad_request(f"json: {error}") from None
            outcome = self._delete_request(
                res, name, options if isinstance(options, dict) else {}, dry_run
            )
        else:
            raise ApiError(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource",
            )
        return web.json_response(outcome.body, status=outcome.code, headers=outcome.headers)

    def _subresource(self, path: str) -> str | None:
        match = self._ROUTE.match(path)
        return match["sub"] if match is not None else None

    async def _dispatch_status(
        self, request: web.Request, res: _Resource, name: str | None
    ) -> web.StreamResponse:
        """``<plural>/<name>/status``: GET, PUT and PATCH (not server-side apply)."""
        if res.status_split is None or name is None:
            raise ApiError(
                404, "NotFound", "the server could not find the requested resource", details={}
            )
        method = request.method
        dry_run = request.query.get("dryRun") == "All"
        if method == "GET":
            outcome = _Outcome(200, self._require(res, name))
        elif method == "PUT":
            outcome = self._update(
                res, name, await self._json_body(request), request.query, dry_run, status=True
            )
        elif method == "PATCH":
            if request.content_type == APPLY_PATCH:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"server-side apply to {res.plural}/status is not modelled by the emulator",
                )
            outcome = await self._patch(request, res, name, dry_run, status=True)
        else:
            raise ApiError(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource",
            )
        return web.json_response(outcome.body, status=outcome.code, headers=outcome.headers)

    def _discovery(self, path: str) -> JsonObj | None:
        path = path.rstrip("/") or "/"
        devices = self._resources[self.crd.plural]
        group_version = {"groupVersion": devices.api_version, "version": devices.version}
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        if path == "/version":
            return dict(_SERVER_VERSION)
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": devices.group,
                        "versions": [group_version],
                        "preferredVersion": group_version,
                    }
                ],
            }
        if path == "/api/v1":
            return {
                "kind": "APIResourceList",
                "groupVersion": "v1",
                "resources": [
                    {
                        "name": NODES,
                        "singularName": "node",
                        "namespaced": False,
                        "kind": "Node",
                        "verbs": verbs,
                        "shortNames": ["no"],
                    },
                    {
                        "name": PODS,
                        "singularName": "pod",
                        "namespaced": True,
                        "kind": "Pod",
                        "verbs": verbs,
                        "shortNames": ["po"],
                    },
                    {
                        "name": EVENTS,
                        "singularName": "event",
                        "namespaced": True,
                        "kind": "Event",
                        "verbs": verbs,
                        "shortNames": ["ev"],
                    },
                ],
            }
        if path == f"/apis/{devices.api_version}":
            return {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": devices.api_version,
                "resources": [
                    {
                        "name": devices.plural,
                        "singularName": self.crd.singular,
                        "namespaced": False,
                        "kind": devices.kind,
                        "verbs": verbs,
                    }
                ],
            }
        return None

    async def _json_body(self, request: web.Request) -> Any:
        content_type = request.content_type
        if content_type not in ("application/json", ""):
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media types "
                "include: application/json, application/yaml, "
                "application/vnd.kubernetes.protobuf",
            )
        raw = await request.read()
        try:
            return json.loads(raw)
        except ValueError as error:
            raise _bad_request(f"json: {error}") from None

    def _require(self, res: _Resource, name: str) -> JsonObj:
        obj = self._objects[res.plural].get(name)
        if obj is None:
            raise res.not_found(name)
        return copy.deepcopy(obj)

    # ------------------------------------------------------------------ verbs

    def _list(
        self, res: _Resource, query: Mapping[str, str], namespace: str | None = None
    ) -> _Outcome:
        matches = _selector(query.get("labelSelector", ""), query.get("fieldSelector", ""))
        names = sorted(
            n
            for n, o in self._objects[res.plural].items()
            if matches(o) and (namespace is None or o["metadata"].get("namespace") == namespace)
        )
        start = query.get("continue", "")
        if start:
            try:
                after = json.loads(base64.urlsafe_b64decode(start.encode()))["start"]
            except (ValueError, KeyError, TypeError):
                raise _bad_request("invalid continue token") from None
            names = [n for n in names if n > after]
        meta: JsonObj = {"resourceVersion": str(self._rv)}
        limit = int(query.get("limit", "0") or 0)
        if 0 < limit < len(names):
            token = json.dumps({"start": names[limit - 1], "rv": self._rv}).encode()
            meta["continue"] = base64.urlsafe_b64encode(token).decode()
            meta["remainingItemCount"] = len(names) - limit
            names = names[:limit]
        items = [copy.deepcopy(self._objects[res.plural][n]) for n in names]
        if not res.custom:
            # Built-in lists carry kind/apiVersion once, on the list; CR lists on each item.
            for item in items:
                item.pop("apiVersion", None)
                item.pop("kind", None)
        body = {
            "apiVersion": res.api_version,
            "kind": res.list_kind,
            "metadata": meta,
            "items": items,
        }
        return _Outcome(200, body)

    def _check_type_meta(self, res: _Resource, body: Any) -> JsonObj:
        if not isinstance(body, dict):
            raise _bad_request(
                "couldn't get version/kind; json parse error: json: cannot unmarshal "
                f"{_json_type(body)} into Go value"
            )
        if not res.custom:
            # Typed endpoints default the type from the URL; CRs decode as unstructured,
            # which insists on a kind (the classic error of create_*_custom_object).
            body.setdefault("kind", res.kind)
        body.setdefault("apiVersion", res.api_version)
        kind, api_version = body.get("kind"), body.get("apiVersion")
        if not kind:
            raise _bad_request(f"Object 'Kind' is missing in '{json.dumps(body)[:200]}'")
        if kind != res.kind:
            raise _bad_request(
                f"the kind in the data ({kind}) does not match the expected kind ({res.kind})"
            )
        if api_version != res.api_version:
            raise _bad_request(
                f"the API version in the data ({api_version}) does not match the expected "
                f"API version ({res.api_version})"
            )
        _check_meta_shape(body.get("metadata", {}))
        return body

    def _normalize(self, res: _Resource, obj: JsonObj, query: Mapping[str, str]) -> dict[str, str]:
        """Prune, default and validate in the real server's order; returns warning headers."""
        meta: JsonObj = obj.setdefault("metadata", {})
        unknown = [f"metadata.{k}" for k in list(meta) if k not in _OBJECT_META_FIELDS]
        for key in unknown:
            del meta[key.removeprefix("metadata.")]
        if not res.namespaced:
            # Cluster-scoped: a namespace in the body is silently cleared.
            meta.pop("namespace", None)
        for key in ("labels", "annotations", "ownerReferences", "finalizers"):
            if meta.get(key) is None:
                meta.pop(key, None)
        if res.schema is not None:
            unknown += res.schema.prune(obj)
        mode = query.get("fieldValidation", "Warn")
        if unknown and mode == "Strict":
            details = ", ".join(f'unknown field "{u}"' for u in unknown)
            raise _bad_request(f"strict decoding error: {details}")
        headers: dict[str, str] = {}
        if unknown and mode != "Ignore":
            headers["Warning"] = ", ".join(f'299 - "unknown field \\"{u}\\""' for u in unknown)
        if res.schema is not None:
            res.schema.default(obj)
        causes = validate_object_meta(meta)
        if res.schema is not None:
            causes += res.schema.validate(obj)
        if causes:
            raise res.invalid(meta.get("name", ""), causes)
        return headers

    def _create(
        self, res: _Resource, body: Any, query: Mapping[str, str], dry_run: bool
    ) -> _Outcome:
        obj = copy.deepcopy(self._check_type_meta(res, body))
        meta: JsonObj = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if meta.get("resourceVersion"):
            # The real server answers this with a 500 from the storage layer.
            raise ApiError(
                500, "InternalError", "resourceVersion should not be set on objects to be created"
            )
        for key in (
            "uid",
            "generation",
            "creationTimestamp",
            "deletionTimestamp",
            "selfLink",
            "managedFields",
        ):
            meta.pop(key, None)
        if res.create_clears_status:
            obj.pop("status", None)
        headers = self._normalize(res, obj, query)
        name = res.key(meta.get("namespace"), meta["name"])
        if name in self._objects[res.plural]:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{res.qualified} "{name}" already exists',
                details=res.details(name),
            )
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now_rfc3339()
        if res.custom:
            meta["generation"] = 1
        if dry_run:
            meta["resourceVersion"] = ""
            return _Outcome(201, obj, headers)
        self._commit(res, obj, "ADDED")
        self.stats.writes[(res.plural, name)] += 1
        self.stats.changes[(res.plural, name)] += 1
        return _Outcome(201, copy.deepcopy(obj), headers)

    def _update(
        self,
        res: _Resource,
        name: str,
        body: Any,
        query: Mapping[str, str],
        dry_run: bool,
        *,
        from_patch: bool = False,
        status: bool = False,
    ) -> _Outcome:
        """PUT (or the result of a patch). ``status``: the ``/status`` subresource."""
        obj = copy.deepcopy(self._check_type_meta(res, body))
        meta: JsonObj = obj.setdefault("metadata", {})
        namespace, _, short = name.rpartition("/") if res.namespaced else ("", "", name)
        if meta.get("name", short) != short:
            raise _bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on "
                f"the URL ({short})"
            )
        meta["name"] = short
        if res.namespaced:
            meta["namespace"] = namespace
        current = self._objects[res.plural].get(name)
        if current is None:
            raise res.not_found(name)
        current_meta = current["metadata"]
        if res.status_split is not None:
            obj, meta = res.status_split(obj, current, status=status)
        rv = meta.get("resourceVersion", "")
        if not rv and res.custom and not from_patch:
            # CRs disallow unconditional update: a PUT must say which version it replaces.
            raise res.invalid(
                name,
                [
                    Cause(
                        "metadata.resourceVersion",
                        "FieldValueInvalid",
                        "Invalid value: 0x0: must be specified for an update",
                    )
                ],
            )
        if rv and rv != current_meta["resourceVersion"]:
            raise res.conflict(name)
        if meta.get("uid") and meta["uid"] != current_meta["uid"]:
            raise res.conflict(
                name,
                f'Operation cannot be fulfilled on {res.qualified} "{name}": Precondition failed: '
                f"UID in precondition: {meta['uid']}, UID in object meta: {current_meta['uid']}",
            )
        for key in _SYSTEM_META_FIELDS:
            meta.pop(key, None)
            if key in current_meta:
                meta[key] = current_meta[key]
        meta.pop("deletionTimestamp", None)
        meta.pop("managedFields", None)
        headers = self._normalize(res, obj, query)
        meta["resourceVersion"] = current_meta["resourceVersion"]
        content = {k: v for k, v in obj.items() if k != "metadata"}
        old_content = {k: v for k, v in current.items() if k != "metadata"}
        if res.custom and not _json_equal(content, old_content):
            meta["generation"] = current_meta.get("generation", 1) + 1
        if dry_run:
            return _Outcome(200, obj, headers)
        stat_key = (f"{res.plural}/status" if status else res.plural, name)
        self.stats.writes[stat_key] += 1
        if _json_equal(obj, current):
            # etcd3 storage skips identical writes: no new resourceVersion, no event.
            return _Outcome(200, copy.deepcopy(current), headers)
        self._commit(res, obj, "MODIFIED")
        self.stats.changes[stat_key] += 1
        return _Outcome(200, copy.deepcopy(obj), headers)

    async def _patch(
        self,
        request: web.Request,
        res: _Resource,
        name: str,
        dry_run: bool,
        *,
        status: bool = False,
    ) -> _Outcome:
        content_type = request.content_type
        if content_type not in res.patch_types:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media types include: "
                + ", ".join(res.patch_types),
            )
        raw = await request.read()
        try:
            patch = yaml.safe_load(raw) if content_type == APPLY_PATCH else json.loads(raw)
        except (ValueError, yaml.YAMLError) as error:
            raise _bad_request(f"error decoding patch: {error}") from None
        query = request.query
        if content_type == APPLY_PATCH:
            return self._apply(res, name, patch, query, dry_run)
        current = self._require(res, name)
        if content_type == JSON_PATCH:
            if not isinstance(patch, list):
                raise _bad_request(
                    f"json: cannot unmarshal {_json_type(patch)} into Go value of type "
                    "jsonpatch.Patch"
                )
            try:
                patched = json_patch(current, patch)
            except JsonPatchError as error:
                raise ApiError(422, "Invalid", str(error)) from None
        else:
            if not isinstance(patch, dict):
                raise _bad_request(
                    "couldn't get version/kind; json parse error: json: cannot unmarshal "
                    f"{_json_type(patch)} into Go value"
                )
            engine = strategic_merge_patch if content_type == STRATEGIC_PATCH else merge_patch
            patched = engine(current, patch)
        return self._update(res, name, patched, query, dry_run, from_patch=True, status=status)

    def _apply(
        self, res: _Resource, name: str, config: Any, query: Mapping[str, str], dry_run: bool
    ) -> _Outcome:
        """Server-side apply for a single field manager.

        Fields this manager applied before and leaves out now are removed; everything
        it applies is merged (lists replaced whole, as for atomic lists). Ownership by
        other managers and conflicts are not tracked: ``force`` changes nothing.
        """
        manager = query.get("fieldManager", "")
        if not manager:
            raise _bad_request(
                'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: '
                "is required for apply patch"
            )
        config = self._check_type_meta(res, config)
        if config.get("metadata", {}).get("name", name) != name:
            raise _bad_request("the name of the object does not match the name on the URL")
        key = (res.plural, name)
        current = self._objects[res.plural].get(name)
        if current is None:
            outcome = self._create(
                res,
                {**config, "metadata": {**config.get("metadata", {}), "name": name}},
                query,
                dry_run,
            )
        else:
            previous = self._applied.get(key, {}).get(manager)
            base = merge_patch(copy.deepcopy(current), _apply_removals(previous, config) or {})
            patched = merge_patch(base, config)
            outcome = self._update(res, name, patched, query, dry_run, from_patch=True)
        if not dry_run:
            self._applied.setdefault(key, {})[manager] = copy.deepcopy(config)
        return outcome

    def _delete_request(
        self, res: _Resource, name: str, options: JsonObj, dry_run: bool
    ) -> _Outcome:
        current = self._require(res, name)
        preconditions = options.get("preconditions") or {}
        want_uid, want_rv = preconditions.get("uid"), preconditions.get("resourceVersion")
        if want_uid and want_uid != current["metadata"]["uid"]:
            raise res.conflict(
                name,
                f'Operation cannot be fulfilled on {res.qualified} "{name}": Precondition failed: '
                f"UID in precondition: {want_uid}, "
                f"UID in object meta: {current['metadata']['uid']}",
            )
        if want_rv and want_rv != current["metadata"]["resourceVersion"]:
            raise res.conflict(
                name,
                f'Operation cannot be fulfilled on {res.qualified} "{name}": Precondition failed: '
                f"ResourceVersion in precondition: {want_rv}, ResourceVersion in object meta: "
                f"{current['metadata']['resourceVersion']}",
            )
        if not dry_run:
            deleted = self._delete(res, name)
            self.stats.deletes[(res.plural, name)] += 1
            if res.returns_deleted_object:
                return _Outcome(200, copy.deepcopy(deleted))
        elif res.returns_deleted_object:
            return _Outcome(200, copy.deepcopy(current))
        body: JsonObj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": res.details(name, uid=current["metadata"]["uid"]),
        }
        return _Outcome(200, body)

    async def _watch(
        self, request: web.Request, res: _Resource, namespace: str | None = None
    ) -> web.StreamResponse:
        """A chunked stream of JSON events, one per line, until timeoutSeconds or stop()."""
        query = request.query
        selected = _selector(query.get("labelSelector", ""), query.get("fieldSelector", ""))

        def matches(obj: JsonObj) -> bool:
            in_namespace = namespace is None or obj["metadata"].get("namespace") == namespace
            return in_namespace and selected(obj)

        timeout = min(
            float(query.get("timeoutSeconds", self.max_watch_seconds)), self.max_watch_seconds
        )
        since = query.get("resourceVersion", "")
        initial: list[JsonObj] = []
        if since in ("", "0"):
            initial = [
                {"type": "ADDED", "object": copy.deepcopy(o)}
                for _, o in sorted(self._objects[res.plural].items())
                if matches(o)
            ]
        elif not since.isdigit() or int(since) < self._history_floor:
            error = ApiError(
                410, "Expired", f"too old resource version: {since} ({self._history_floor})"
            )
            initial = [{"type": "ERROR", "object": error.status()}]
            timeout = 0
        else:
            initial = [
                {"type": e.type, "object": copy.deepcopy(e.obj)}
                for e in self._history
                if e.rv > int(since) and e.plural == res.plural and matches(e.obj)
            ]
        queue: asyncio.Queue[_Event | None] = asyncio.Queue()
        self._watchers.add(queue)
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        try:
            await response.prepare(request)
            for event in initial:
                await response.write(json.dumps(event).encode() + b"\n")
            deadline = asyncio.get_running_loop().time() + timeout
            while (remaining := deadline - asyncio.get_running_loop().time()) > 0:
                try:
                    item = await asyncio.wait_for(queue.get(), remaining)
                except TimeoutError:
                    break
                if item is None:
                    break
                if item.plural == res.plural and matches(item.obj):
                    line = json.dumps({"type": item.type, "object": item.obj})
                    await response.write(line.encode() + b"\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away (a cancelled watch): nothing to answer
        finally:
            self._watchers.discard(queue)
        return response


# --------------------------------------------------------------------------- selectors

_SELECTOR_TERM = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9_./-]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9_.-]*)|\s+(?P<set>in|notin)\s*\((?P<values>[^)]*)\))?\s*$"
)


def _split_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    if current.strip():
        terms.append(current)
    return terms


def _selector(labels: str, fields: str) -> Callable[[JsonObj], bool]:
    """Label selectors (=, ==, !=, in, notin, exists, !exists) and metadata.name fields."""
    checks: list[Callable[[JsonObj], bool]] = []
    for term in _split_terms(labels):
        match = _SELECTOR_TERM.match(term)
        if match is None or (match["neg"] and (match["op"] or match["set"])):
            raise _bad_request(f"unable to parse requirement: invalid label selector: {term!r}")
        checks.append(_label_check(match))
    for term in _split_terms(fields):
        match = re.fullmatch(r"\s*([A-Za-z.]+)\s*(==|=|!=)\s*([^,]*)\s*", term)
        if match is None:
            raise _bad_request(f"invalid field selector: {term!r}")
        if match[1] not in _FIELDS:
            raise _bad_request(f"field label not supported: {match[1]}")
        checks.append(_field_check(match[1], match[3], equal=match[2] != "!="))
    return lambda obj: all(check(obj) for check in checks)


# The field selectors the real server accepts for the kinds served here (every kind
# takes metadata.name and metadata.namespace; pods add spec.nodeName and status.phase).
_FIELDS: Final = frozenset({"metadata.name", "metadata.namespace", "spec.nodeName", "status.phase"})


def _field_check(path: str, wanted: str, *, equal: bool) -> Callable[[JsonObj], bool]:
    section, _, key = path.partition(".")

    def check(obj: JsonObj) -> bool:
        part = obj.get(section)
        value = part.get(key, "") if isinstance(part, dict) else ""
        return (str(value) == wanted) == equal

    return check


def _label_check(match: re.Match[str]) -> Callable[[JsonObj], bool]:
    key = match["key"]

    def labels(obj: JsonObj) -> dict[str, str]:
        found: dict[str, str] = obj.get("metadata", {}).get("labels") or {}
        return found

    if match["set"]:
        values = {v.strip() for v in match["values"].split(",")}
        if match["set"] == "in":
            return lambda o: labels(o).get(key) in values
        return lambda o: labels(o).get(key) not in values
    if match["op"]:
        value, equal = match["value"], match["op"] != "!="
        return lambda o: (labels(o).get(key) == value) == equal
    if match["neg"]:
        return lambda o: key not in labels(o)
    return lambda o: key in labels(o)


# --------------------------------------------------------------------------- standalone


async def _serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with KubeEmulator.running(
        args.crd, host=args.host, port=args.port, token=args.token
    ) as emu:
        for node in args.node:
            emu.add_node(node)
        if args.kubeconfig:
            emu.write_kubeconfig(args.kubeconfig)
        # The URL line is the readiness signal scripts wait for.
        print(f"kube-emulator listening on {emu.url}", flush=True)
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), args.duration or None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="In-process Kubernetes API emulator (Devices, Nodes)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--crd", type=Path, default=DEFAULT_CRD_PATH)
    parser.add_argument("--node", action="append", default=[], help="seed a Node (repeatable)")
    parser.add_argument("--token", default=None, help="require this bearer token")
    parser.add_argument("--kubeconfig", type=Path, default=None, help="write a kubeconfig here")
    parser.add_argument(
        "--duration", type=float, default=0.0, help="seconds to serve (0: until signalled)"
    )
    asyncio.run(_serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()


@asynccontextmanager
async def cluster_with_node(node: str, kubeconfig: Path) -> AsyncIterator[KubeEmulator]:
    """An emulator that knows ``node``, and a kubeconfig for it written to ``kubeconfig``."""
    async with KubeEmulator.running() as emulator:
        emulator.add_node(node)
        emulator.write_kubeconfig(kubeconfig)
        yield emulator
