"""The Device CRD and the Kubernetes API emulator, driven by the unmodified client.

Why: the reporter's tests trust the emulator to behave like an API server, so the
emulator itself is tested only through kubernetes-asyncio as shipped: if the client
sends something the emulator misreads (a content type, a query parameter), these
tests see it the way the reporter would. The CRD is checked against the shape of
Koordinator's upstream schema, because koord-scheduler decodes our objects.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.rest import ApiException

from support.kube_emulator import (
    APPLY_PATCH,
    DEFAULT_CRD_PATH,
    DEVICES,
    EVENTS,
    JSON_PATCH,
    MERGE_PATCH,
    NODES,
    PODS,
    STRATEGIC_PATCH,
    CrdSchema,
    KubeEmulator,
)

G, V, P = "scheduling.koordinator.sh", "v1alpha1", "devices"
DEVICE_PATH = f"/apis/{G}/{V}/devices"

pytestmark = pytest.mark.anyio


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator.running() as emulator:
        yield emulator


@pytest.fixture
async def api(emu: KubeEmulator) -> AsyncIterator[client.ApiClient]:
    async with client.ApiClient(client.Configuration(host=emu.url)) as api_client:
        yield api_client


@pytest.fixture
def objects(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


def gpu(index: int = 0, **overrides: Any) -> dict[str, Any]:
    info: dict[str, Any] = {
        "type": "gpu",
        "id": f"GPU-{index:08d}-0000-0000-0000-000000000000",
        "minor": index,
        "health": True,
        "resources": {
            "koordinator.sh/gpu-core": "100",
            "koordinator.sh/gpu-memory": "80Gi",
            "koordinator.sh/gpu-memory-ratio": "100",
        },
        "topology": {"socketID": -1, "nodeID": 0, "pcieID": "pci0000:3a", "busID": "0000:3b:00.0"},
    }
    info.update(overrides)
    return info


def device(name: str = "node-1", owner_uid: str | None = None, **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {"node.koordinator.sh/gpu-vendor": "nvidia"},
    }
    if owner_uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "name": name,
                "uid": owner_uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return {
        "apiVersion": f"{G}/{V}",
        "kind": "Device",
        "metadata": meta,
        "spec": spec or {"devices": [gpu(0)]},
    }


def status_of(error: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(error.body or b"{}")
    return body


async def patch_device(
    objects: client.CustomObjectsApi,
    name: str,
    body: Any,
    *,
    content_type: str,
    **options: Any,
) -> Any:
    """PATCH a Device with an explicit content type.

    The client's runtime takes ``_content_type`` but its stubs do not list it, so the
    call goes through an untyped reference.
    """
    patch: Any = objects.patch_cluster_custom_object
    return await patch(G, V, P, name, body, _content_type=content_type, **options)


# --------------------------------------------------------------------------- the CRD


KOORDINATOR_SHAPE = [
    # Field, type, format, required-ness of koordinator-sh/koordinator's
    # config/crd/bases/scheduling.koordinator.sh_devices.yaml, descriptions aside.
    ". object",
    ".apiVersion string",
    ".kind string",
    ".metadata object",
    ".spec object",
    ".spec.devices array",
    ".spec.devices[] object",
    ".spec.devices[].conditions array",
    ".spec.devices[].conditions[] object",
    ".spec.devices[].conditions[].lastTransitionTime string date-time required",
    ".spec.devices[].conditions[].message string required",
    ".spec.devices[].conditions[].observedGeneration integer int64",
    ".spec.devices[].conditions[].reason string required",
    ".spec.devices[].conditions[].status string required",
    ".spec.devices[].conditions[].type string required",
    ".spec.devices[].health boolean required",
    ".spec.devices[].id string",
    ".spec.devices[].labels object",
    ".spec.devices[].labels{} string",
    ".spec.devices[].minor integer int32",
    ".spec.devices[].moduleID integer int32",
    ".spec.devices[].resources object",
    ".spec.devices[].resources{} int-or-string",
    ".spec.devices[].topology object",
    ".spec.devices[].topology.busID string",
    ".spec.devices[].topology.nodeID integer int32 required",
    ".spec.devices[].topology.pcieID string required",
    ".spec.devices[].topology.socketID integer int32 required",
    ".spec.devices[].type string",
    ".spec.devices[].vfGroups array",
    ".spec.devices[].vfGroups[] object",
    ".spec.devices[].vfGroups[].labels object",
    ".spec.devices[].vfGroups[].labels{} string",
    ".spec.devices[].vfGroups[].vfs array",
    ".spec.devices[].vfGroups[].vfs[] object",
    ".spec.devices[].vfGroups[].vfs[].busID string",
    ".spec.devices[].vfGroups[].vfs[].minor integer int32 required",
    ".status object",
    ".status.allocations array",
    ".status.allocations[] object",
    ".status.allocations[].entries array",
    ".status.allocations[].entries[] object",
    ".status.allocations[].entries[].minors array",
    ".status.allocations[].entries[].minors[] integer int32",
    ".status.allocations[].entries[].name string",
    ".status.allocations[].entries[].namespace string",
    ".status.allocations[].entries[].uuid string",
    ".status.allocations[].type string",
]


def _shape(schema: dict[str, Any], path: str = "", required: bool = False) -> Iterator[str]:
    kind = schema.get("type") or (
        "int-or-string" if schema.get("x-kubernetes-int-or-string") else "?"
    )
    fmt = f" {schema['format']}" if "format" in schema else ""
    yield f"{path or '.'} {kind}{fmt}" + (" required" if required else "")
    needed = set(schema.get("required", []))
    for key, sub in schema.get("properties", {}).items():
        yield from _shape(sub, f"{path}.{key}", key in needed)
    if isinstance(schema.get("items"), dict):
        yield from _shape(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _shape(schema["additionalProperties"], f"{path}{{}}")


def _structural_problems(schema: dict[str, Any], path: str = "") -> Iterator[str]:
    """The structural-schema rules the API server enforces on a v1 CRD."""
    int_or_string = schema.get("x-kubernetes-int-or-string")
    if "type" not in schema and not int_or_string:
        yield f"{path or '.'}: no type"
    if int_or_string and schema.get("type"):
        yield f"{path}: int-or-string must not have a type"
    if "properties" in schema and "additionalProperties" in schema:
        yield f"{path}: properties and additionalProperties are mutually exclusive"
    for sub in schema.get("anyOf", []):
        if set(sub) - {"type"} or sub.get("type") not in ("integer", "string"):
            yield f"{path}: anyOf may only carry the int-or-string types"
    if "default" in schema:
        probe = CrdSchema.from_crd(
            {
                "spec": {
                    "group": "x.io",
                    "scope": "Cluster",
                    "names": {"kind": "X", "plural": "xs"},
                    "versions": [
                        {
                            "name": "v1",
                            "served": True,
                            "storage": True,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "properties": {"v": schema},
                                }
                            },
                        }
                    ],
                }
            }
        )
        if probe.validate({"v": schema["default"]}):
            yield f"{path}: default does not validate"
    for key, sub in schema.get("properties", {}).items():
        yield from _structural_problems(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _structural_problems(schema[key], f"{path}[{key}]")


def test_crd_is_a_valid_custom_resource_definition() -> None:
    crd = yaml.safe_load(DEFAULT_CRD_PATH.read_text())
    kubernetes_validate.validate(crd, kubernetes_validate.latest_version(), strict=True)
    spec = crd["spec"]
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["metadata"]["name"] == f"{spec['names']['plural']}.{spec['group']}"
    assert (spec["group"], spec["scope"]) == (G, "Cluster")
    assert spec["names"]["kind"] == "Device"
    assert spec["names"]["plural"] == "devices"
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == (V, True, True)
    # Upstream has no status subresource: adding one would make koordlet's Updates
    # silently drop status, so it must stay absent.
    assert "subresources" not in version
    schema = version["schema"]["openAPIV3Schema"]
    assert schema["properties"]["metadata"] == {"type": "object"}
    assert list(_structural_problems(schema)) == []


def test_crd_has_koordinators_shape() -> None:
    crd = yaml.safe_load(DEFAULT_CRD_PATH.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert sorted(_shape(schema)) == sorted(KOORDINATOR_SHAPE)
    devices = schema["properties"]["spec"]["properties"]["devices"]["items"]
    assert devices["properties"]["health"]["default"] is False
    conditions = devices["properties"]["conditions"]["items"]["properties"]
    assert conditions["status"]["enum"] == ["True", "False", "Unknown"]


# --------------------------------------------------------------------------- CRUD


async def test_create_get_replace_and_patch(
    emu: KubeEmulator, objects: client.CustomObjectsApi
) -> None:
    created = await objects.create_cluster_custom_object(G, V, P, device())
    meta = created["metadata"]
    assert meta["uid"]
    assert meta["creationTimestamp"].endswith("Z")
    assert meta["generation"] == 1
    first_rv = int(meta["resourceVersion"])

    got = await objects.get_cluster_custom_object(G, V, P, "node-1")
    assert got == created

    got["spec"]["devices"].append(gpu(1))
    replaced = await objects.replace_cluster_custom_object(G, V, P, "node-1", got)
    assert int(replaced["metadata"]["resourceVersion"]) > first_rv
    assert replaced["metadata"]["generation"] == 2
    assert replaced["metadata"]["uid"] == meta["uid"]

    merged = await patch_device(
        objects,
        "node-1",
        {"metadata": {"labels": {"node.koordinator.sh/gpu-model": "A100-SXM4-80GB"}}},
        content_type=MERGE_PATCH,
    )
    assert merged["metadata"]["labels"] == {
        "node.koordinator.sh/gpu-vendor": "nvidia",
        "node.koordinator.sh/gpu-model": "A100-SXM4-80GB",
    }
    # A metadata-only change leaves generation alone.
    assert merged["metadata"]["generation"] == 2

    patched = await objects.patch_cluster_custom_object(
        G,
        V,
        P,
        "node-1",
        [
            {
                "op": "test",
                "path": "/metadata/resourceVersion",
                "value": merged["metadata"]["resourceVersion"],
            },
            {"op": "replace", "path": "/spec/devices/1/health", "value": False},
        ],
    )
    assert [d["health"] for d in patched["spec"]["devices"]] == [True, False]
    assert patched["metadata"]["generation"] == 3
    assert emu.get_object(DEVICES, "node-1") == patched
    assert emu.stats.writes_to(DEVICES, "node-1") == 4

    listed = await objects.list_cluster_custom_object(G, V, P)
    assert listed["kind"] == "DeviceList"
    assert [i["metadata"]["name"] for i in listed["items"]] == ["node-1"]
    assert listed["metadata"]["resourceVersion"] == str(emu.resource_version)

    deleted = await objects.delete_cluster_custom_object(G, V, P, "node-1")
    assert (deleted["kind"], deleted["status"]) == ("Status", "Success")
    assert emu.get_object(DEVICES, "node-1") is None


async def test_patch_content_types_the_client_sends(
    emu: KubeEmulator, objects: client.CustomObjectsApi, core: client.CoreV1Api
) -> None:
    await objects.create_cluster_custom_object(G, V, P, device())
    emu.add_node("node-1")
    # kubernetes-asyncio picks json-patch for a dict body too (the first type the
    # operation lists): a real server cannot decode an object as a JSON patch. The
    # reporter must pass _content_type=MERGE_PATCH for dict patches of Devices.
    with pytest.raises(ApiException) as raised:
        await objects.patch_cluster_custom_object(
            G, V, P, "node-1", {"metadata": {"labels": {"a": "b"}}}
        )
    assert raised.value.status == 400
    assert "jsonpatch.Patch" in status_of(raised.value)["message"]
    await objects.patch_cluster_custom_object(
        G, V, P, "node-1", [{"op": "add", "path": "/metadata/labels/a", "value": "b"}]
    )
    await core.patch_node("node-1", {"metadata": {"labels": {"a": "b"}}})
    await core.patch_node("node-1", [{"op": "remove", "path": "/metadata/labels/a"}])
    with pytest.raises(ApiException) as raised:
        await patch_device(objects, "node-1", {"metadata": {}}, content_type=STRATEGIC_PATCH)
    assert raised.value.status == 415
    sent = [
        (r.method, "devices" if "/devices" in r.path else "nodes", r.content_type, r.status)
        for r in emu.stats.log
    ]
    assert sent == [
        ("POST", "devices", "application/json", 201),
        ("PATCH", "devices", JSON_PATCH, 400),
        ("PATCH", "devices", JSON_PATCH, 200),
        ("PATCH", "nodes", STRATEGIC_PATCH, 200),
        ("PATCH", "nodes", JSON_PATCH, 200),
        ("PATCH", "devices", STRATEGIC_PATCH, 415),
    ]


async def test_node_label_patch_and_seeded_node(emu: KubeEmulator, core: client.CoreV1Api) -> None:
    seeded = emu.add_node("node-1", {"zone": "a"}, uid="0b7c1c8e-0000-4000-8000-000000000001")
    node = await core.read_node("node-1")
    assert node.metadata.uid == seeded["metadata"]["uid"]
    patched = await core.patch_node(
        "node-1",
        {"metadata": {"labels": {"nvidia.com/gpu.count": "8", "zone": None}}},
    )
    assert patched.metadata.labels == {
        "kubernetes.io/hostname": "node-1",
        "nvidia.com/gpu.count": "8",
    }
    assert emu.stats.writes_to(NODES, "node-1") == 1
    with pytest.raises(ApiException) as raised:
        await core.patch_node("node-1", {"metadata": {"labels": {"bad": "has space"}}})
    assert raised.value.status == 422
    listed = await core.list_node(label_selector="nvidia.com/gpu.count=8")
    assert [n.metadata.name for n in listed.items] == ["node-1"]
    assert (await core.list_node(label_selector="!nvidia.com/gpu.count")).items == []


# --------------------------------------------------------------------------- errors


async def test_stale_resource_version_conflicts(
    emu: KubeEmulator, objects: client.CustomObjectsApi
) -> None:
    stale = await objects.create_cluster_custom_object(G, V, P, device())
    await patch_device(
        objects, "node-1", {"spec": {"devices": [gpu(0, health=False)]}}, content_type=MERGE_PATCH
    )
    with pytest.raises(ApiException) as raised:
        await objects.replace_cluster_custom_object(G, V, P, "node-1", stale)
    assert raised.value.status == 409
    assert status_of(raised.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'Operation cannot be fulfilled on devices.scheduling.koordinator.sh "node-1": '
        "the object has been modified; please apply your changes to the latest version "
        "and try again",
        "reason": "Conflict",
        "details": {"name": "node-1", "group": G, "kind": "devices"},
        "code": 409,
    }
    with pytest.raises(ApiException) as raised:
        await patch_device(
            objects,
            "node-1",
            {"metadata": {"resourceVersion": stale["metadata"]["resourceVersion"]}},
            content_type=MERGE_PATCH,
        )
    assert raised.value.status == 409
    with pytest.raises(ApiException) as raised:
        await objects.create_cluster_custom_object(G, V, P, device())
    assert status_of(raised.value)["reason"] == "AlreadyExists"
    unconditional = device()
    with pytest.raises(ApiException) as raised:
        await objects.replace_cluster_custom_object(G, V, P, "node-1", unconditional)
    assert raised.value.status == 422  # CRs refuse an update without resourceVersion
    assert emu.stats.writes_to(DEVICES, "node-1") == 2


async def test_not_found(objects: client.CustomObjectsApi, core: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as raised:
        await objects.get_cluster_custom_object(G, V, P, "ghost")
    assert raised.value.status == 404
    body = status_of(raised.value)
    assert body["reason"] == "NotFound"
    assert body["message"] == 'devices.scheduling.koordinator.sh "ghost" not found'
    with pytest.raises(ApiException) as raised:
        await core.read_node("ghost")
    assert status_of(raised.value)["message"] == 'nodes "ghost" not found'


async def test_429_carries_retry_after(emu: KubeEmulator, objects: client.CustomObjectsApi) -> None:
    emu.faults.fail_next(1, 429, retry_after=7, path=DEVICE_PATH)
    with pytest.raises(ApiException) as raised:
        await objects.list_cluster_custom_object(G, V, P)
    assert raised.value.status == 429
    assert raised.value.headers is not None
    assert raised.value.headers["Retry-After"] == "7"
    assert status_of(raised.value)["details"]["retryAfterSeconds"] == 7
    await objects.list_cluster_custom_object(G, V, P)
    assert (emu.stats.requests, emu.stats.rejections) == (2, 1)


async def test_500_and_fault_scoping(
    emu: KubeEmulator, objects: client.CustomObjectsApi, core: client.CoreV1Api
) -> None:
    emu.add_node("node-1")
    emu.faults.fail_next(2, 500, method="POST", path="/devices$")
    await core.read_node("node-1")  # another path: untouched
    for _ in range(2):
        with pytest.raises(ApiException) as raised:
            await objects.create_cluster_custom_object(G, V, P, device())
        assert raised.value.status == 500
        assert status_of(raised.value)["reason"] == "InternalError"
    await objects.create_cluster_custom_object(G, V, P, device())
    assert emu.faults.rules == []
    assert emu.stats.writes_to(DEVICES, "node-1") == 1
    assert [r.status for r in emu.stats.matching(method="POST")] == [500, 500, 201]


async def test_fault_after_commit_is_an_ambiguous_success(
    emu: KubeEmulator, objects: client.CustomObjectsApi
) -> None:
    emu.faults.fail_next(1, 503, method="POST", after_commit=True)
    with pytest.raises(ApiException) as raised:
        await objects.create_cluster_custom_object(G, V, P, device())
    assert raised.value.status == 503
    assert emu.get_object(DEVICES, "node-1") is not None
    assert emu.stats.writes_to(DEVICES, "node-1") == 1


async def test_slow_answers(emu: KubeEmulator, core: client.CoreV1Api) -> None:
    emu.add_node("node-1")
    emu.faults.delay(0.3, count=1)
    with pytest.raises(asyncio.TimeoutError):
        await core.read_node("node-1", _request_timeout=0.1)
    emu.faults.delay(0.2, count=1)
    started = time.monotonic()
    await core.read_node("node-1")
    assert time.monotonic() - started >= 0.2


async def test_dropped_connection(emu: KubeEmulator, core: client.CoreV1Api) -> None:
    emu.add_node("node-1")
    await core.read_node("node-1")
    # aiohttp retries an idempotent request once when a kept-alive connection closes
    # before an answer, so one drop is invisible to a GET; two are not.
    emu.faults.disconnect_next(2, method="GET")
    with pytest.raises(Exception, match="disconnected"):
        await core.read_node("node-1")
    assert [r.status for r in emu.stats.log] == [200, 0, 0]


async def test_ratio_faults_are_reproducible() -> None:
    async def run(seed: int) -> list[int]:
        async with KubeEmulator.running() as emulator:
            emulator.add_node("node-1")
            emulator.faults.fail_ratio(0.3, (429, 500, 503), seed=seed)
            async with client.ApiClient(client.Configuration(host=emulator.url)) as api_client:
                core = client.CoreV1Api(api_client)
                statuses = []
                for _ in range(40):
                    try:
                        await core.read_node("node-1")
                        statuses.append(200)
                    except ApiException as error:
                        statuses.append(error.status)
            assert emulator.stats.rejections == sum(s != 200 for s in statuses)
            return statuses

    first, again, other = await run(7), await run(7), await run(8)
    assert first == again
    assert first != other
    assert 4 <= sum(s != 200 for s in first) <= 20
    assert {s for s in first if s != 200} <= {429, 500, 503}


# --------------------------------------------------------------------------- validation


async def test_invalid_device_is_rejected_with_causes(
    emu: KubeEmulator, objects: client.CustomObjectsApi
) -> None:
    bad = device(
        devices=[
            gpu(0, health="yes"),
            gpu(1, minor="abc"),
            gpu(2, topology={"socketID": 0, "pcieID": "pci0000:00"}),
            gpu(3, minor=2**31),
            gpu(
                4,
                conditions=[
                    {
                        "type": "Healthy",
                        "status": "Maybe",
                        "reason": "Xid79",
                        "message": "",
                        "lastTransitionTime": "yesterday",
                    }
                ],
            ),
            gpu(5, resources={"koordinator.sh/gpu-core": "lots"}),
        ]
    )
    with pytest.raises(ApiException) as raised:
        await objects.create_cluster_custom_object(G, V, P, bad)
    assert raised.value.status == 422
    body = status_of(raised.value)
    assert body["reason"] == "Invalid"
    assert body["message"].startswith('Device.scheduling.koordinator.sh "node-1" is invalid: [')
    causes = {(c["field"], c["reason"]) for c in body["details"]["causes"]}
    assert causes == {
        ("spec.devices[0].health", "FieldValueTypeInvalid"),
        ("spec.devices[1].minor", "FieldValueTypeInvalid"),
        ("spec.devices[2].topology.nodeID", "FieldValueRequired"),
        ("spec.devices[3].minor", "FieldValueInvalid"),
        ("spec.devices[4].conditions[0].status", "FieldValueNotSupported"),
        ("spec.devices[4].conditions[0].lastTransitionTime", "FieldValueInvalid"),
        ("spec.devices[5].resources.koordinator.sh/gpu-core", "FieldValueInvalid"),
    }
    health = next(c for c in body["details"]["causes"] if c["field"].endswith("health"))
    assert health["message"] == (
        'Invalid value: "string": spec.devices[0].health in body must be of type boolean: "string"'
    )
    assert emu.stats.total_writes() == 0
    assert emu.get_object(DEVICES, "node-1") is None


async def test_invalid_patch_leaves_the_object_alone(
    emu: KubeEmulator, objects: client.CustomObjectsApi
) -> None:
    created = await objects.create_cluster_custom_object(G, V, P, device())
    with pytest.raises(ApiException) as raised:
        await objects.patch_cluster_custom_object(
            G, V, P, "node-1", [{"op": "remove", "path": "/spec/devices/0/topology/nodeID"}]
        )
    assert raised.value.status == 422
    with pytest.raises(ApiException) as raised:
        await objects.patch_cluster_custom_object(
            G, V, P, "node-1", [{"op": "test", "path": "/metadata/resourceVersion", "value": "999"}]
        )
    assert raised.value.status == 422
    assert emu.get_object(DEVICES, "node-1") == created


async def test_unknown_fields_are_pruned_and_defaults_applied(
    emu: KubeEmulator, objects: client.CustomObjectsApi
) -> None:
    body = device(devices=[{**gpu(0), "vendorSecret": "x", "health": None}])
    body["spec"]["extra"] = {"a": 1}
    body["status"] = {"allocations": [], "note": "x"}
    body["metadata"]["bogus"] = "x"
    body["metadata"]["namespace"] = "default"
    created, code, headers = await objects.create_cluster_custom_object_with_http_info(
        G, V, P, body
    )
    assert code == 201
    stored = emu.get_object(DEVICES, "node-1")
    assert stored == created
    assert "vendorSecret" not in created["spec"]["devices"][0]
    assert "extra" not in created["spec"]
    assert created["status"] == {"allocations": []}
    assert "bogus" not in created["metadata"]
    assert "namespace" not in created["metadata"]
    # A null for a non-nullable field is dropped, then the default applies.
    assert created["spec"]["devices"][0]["health"] is False
    assert 'unknown field \\"spec.devices[0].vendorSecret\\"' in headers["Warning"]

    strict = device("node-2")
    strict["spec"]["extra"] = 1
    with pytest.raises(ApiException) as raised:
        await objects.create_cluster_custom_object(G, V, P, strict, field_validation="Strict")
    assert raised.value.status == 400
    assert "strict decoding error" in status_of(raised.value)["message"]


# --------------------------------------------------------------------------- semantics


async def test_no_op_update_keeps_resource_version(
    emu: KubeEmulator, objects: client.CustomObjectsApi
) -> None:
    created = await objects.create_cluster_custom_object(G, V, P, device())
    same = await objects.replace_cluster_custom_object(G, V, P, "node-1", created)
    assert same["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    assert emu.stats.writes_to(DEVICES, "node-1") == 2
    assert emu.stats.changes_to(DEVICES, "node-1") == 1


async def test_server_side_apply_single_manager(
    emu: KubeEmulator, objects: client.CustomObjectsApi
) -> None:
    config = device()
    config["metadata"]["labels"]["node.koordinator.sh/gpu-model"] = "A100-SXM4-80GB"
    created = await patch_device(
        objects, "node-1", config, field_manager="gpulet", content_type=APPLY_PATCH
    )
    # An apply that creates answers 201, which the client's patch maps to no data.
    assert created is None
    assert emu.stats.matching(method="PATCH", status=201)
    applied = await objects.get_cluster_custom_object(G, V, P, "node-1")
    assert applied["metadata"]["labels"]["node.koordinator.sh/gpu-model"] == "A100-SXM4-80GB"
    del config["metadata"]["labels"]["node.koordinator.sh/gpu-model"]
    reapplied = await patch_device(
        objects, "node-1", config, field_manager="gpulet", content_type=APPLY_PATCH
    )
    assert reapplied["metadata"]["labels"] == {"node.koordinator.sh/gpu-vendor": "nvidia"}
    with pytest.raises(ApiException) as raised:
        await patch_device(objects, "node-1", config, content_type=APPLY_PATCH)
    assert raised.value.status == 400  # apply needs a fieldManager


async def test_owner_garbage_collection(
    emu: KubeEmulator, objects: client.CustomObjectsApi, core: client.CoreV1Api
) -> None:
    node = emu.add_node("node-1")
    await objects.create_cluster_custom_object(G, V, P, device(owner_uid=node["metadata"]["uid"]))
    await objects.create_cluster_custom_object(G, V, P, device("node-2", owner_uid="not-a-node"))
    await asyncio.sleep(0.01)
    assert emu.get_object(DEVICES, "node-1") is not None
    assert emu.get_object(DEVICES, "node-2") is None  # owner missing: collected
    await core.delete_node("node-1")
    await asyncio.sleep(0.01)
    assert emu.get_object(DEVICES, "node-1") is None


async def test_watch_streams_events(emu: KubeEmulator, objects: client.CustomObjectsApi) -> None:
    created = await objects.create_cluster_custom_object(G, V, P, device())
    since = created["metadata"]["resourceVersion"]

    async def writer() -> None:
        await asyncio.sleep(0.05)
        emu.put_object(DEVICES, {**created, "spec": {"devices": [gpu(0, health=False)]}})
        emu.delete_object(DEVICES, "node-1")

    task = asyncio.create_task(writer())
    seen = []
    async with watch.Watch() as stream:
        async for event in stream.stream(
            objects.list_cluster_custom_object, G, V, P, resource_version=since, timeout_seconds=2
        ):
            seen.append((event["type"], event["raw_object"]["spec"]["devices"][0]["health"]))
            if event["type"] == "DELETED":
                break
    await task
    assert seen == [("MODIFIED", False), ("DELETED", False)]


async def test_list_pagination_and_discovery(
    emu: KubeEmulator, api: client.ApiClient, objects: client.CustomObjectsApi
) -> None:
    for index in range(5):
        emu.add_node(f"node-{index}")
        await objects.create_cluster_custom_object(G, V, P, device(f"node-{index}"))
    names: list[str] = []
    token = None
    for _ in range(5):
        paging: dict[str, Any] = {"_continue": token} if token else {}
        page = await objects.list_cluster_custom_object(G, V, P, limit=2, **paging)
        names += [i["metadata"]["name"] for i in page["items"]]
        token = page["metadata"].get("continue")
        if not token:
            break
    assert names == [f"node-{i}" for i in range(5)]
    groups = await client.ApisApi(api).get_api_versions()
    assert [g.name for g in groups.groups] == [G]
    version = await client.VersionApi(api).get_code()
    assert version.major == "1"


async def test_kubeconfig_loading(tmp_path: Path) -> None:
    async with KubeEmulator.running(token="s3cret") as emulator:
        emulator.add_node("node-1")
        path = emulator.write_kubeconfig(tmp_path / "kubeconfig")
        configuration = client.Configuration()
        await config.load_kube_config(config_file=str(path), client_configuration=configuration)
        async with client.ApiClient(configuration) as api_client:
            nodes = await client.CoreV1Api(api_client).list_node()
        assert [n.metadata.name for n in nodes.items] == ["node-1"]

        anonymous = emulator.write_kubeconfig(tmp_path / "anon", token="wrong")
        configuration = client.Configuration()
        await config.load_kube_config(
            config_file=str(anonymous), client_configuration=configuration
        )
        async with client.ApiClient(configuration) as api_client:
            with pytest.raises(ApiException) as raised:
                await client.CoreV1Api(api_client).list_node()
        assert raised.value.status == 401


def test_runs_standalone() -> None:
    tests_dir = Path(__file__).resolve().parents[1]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "support.kube_emulator",
            "--port",
            "0",
            "--duration",
            "5",
            "--node",
            "n1",
        ],
        cwd=tests_dir,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tests_dir)},
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("kube-emulator listening on http://127.0.0.1:")
        url = line.split()[-1]
        with urllib.request.urlopen(f"{url}/api/v1/nodes", timeout=5) as answer:
            nodes = json.load(answer)
        assert [n["metadata"]["name"] for n in nodes["items"]] == ["n1"]
    finally:
        process.terminate()
        assert process.wait(timeout=5) == 0


# --------------------------------------------------------------------------- pods, events


async def test_pods_by_node_field_selector_list_and_watch(
    emu: KubeEmulator, core: client.CoreV1Api
) -> None:
    """What the allocator's pod watch relies on: spec.nodeName selects, the list's
    resourceVersion starts a watch that sees later changes of this node's pods only,
    a resourceVersion older than the history is 410 Gone."""
    emu.add_pod("a", node="gpu-1", namespace="ml")
    emu.add_pod("b", node="gpu-2", namespace="ml")
    listed = await core.list_pod_for_all_namespaces(field_selector="spec.nodeName=gpu-1")
    assert [p.metadata.name for p in listed.items] == ["a"]
    in_ns = await core.list_namespaced_pod("ml", field_selector="spec.nodeName!=gpu-1")
    assert [p.metadata.name for p in in_ns.items] == ["b"]
    assert (await core.list_namespaced_pod("other")).items == []
    with pytest.raises(ApiException) as bad:
        await core.list_pod_for_all_namespaces(field_selector="spec.schedulerName=x")
    assert bad.value.status == 400
    since = listed.metadata.resource_version

    async def writer() -> None:
        await asyncio.sleep(0.05)
        emu.add_pod("c", node="gpu-2", namespace="ml")  # another node: not seen
        emu.add_pod("d", node="gpu-1", namespace="dev")
        emu.delete_object(PODS, "ml/a")

    task = asyncio.create_task(writer())
    seen = []
    async with watch.Watch() as stream:
        async for event in stream.stream(
            core.list_pod_for_all_namespaces,
            field_selector="spec.nodeName=gpu-1",
            resource_version=since,
            timeout_seconds=2,
        ):
            seen.append((event["type"], event["raw_object"]["metadata"]["name"]))
            if event["type"] == "DELETED":
                break
    await task
    assert seen == [("ADDED", "d"), ("DELETED", "a")]
    pod = await core.read_namespaced_pod("d", "dev")
    assert pod.spec.node_name == "gpu-1"
    with pytest.raises(ApiException) as missing:
        await core.read_namespaced_pod("d", "ml")
    assert missing.value.status == 404


async def test_watch_from_a_forgotten_version_is_gone() -> None:
    async with KubeEmulator.running(history_size=2) as small:
        for index in range(5):
            small.add_pod(f"p{index}", node="n")
        async with client.ApiClient(client.Configuration(host=small.url)) as api:
            response: Any = await client.CoreV1Api(api).list_pod_for_all_namespaces(
                watch=True, resource_version="1", timeout_seconds=1, _preload_content=False
            )
            line = await response.content.readline()
            response.release()
    event = json.loads(line)
    assert event["type"] == "ERROR"
    assert event["object"]["code"] == 410


async def test_events_are_created_in_their_namespace(
    emu: KubeEmulator, core: client.CoreV1Api
) -> None:
    pod = emu.add_pod("a", node="gpu-1", namespace="ml")
    body: Any = {
        "metadata": {"name": "a.1234", "namespace": "ml"},
        "involvedObject": {
            "kind": "Pod",
            "name": "a",
            "namespace": "ml",
            "uid": pod["metadata"]["uid"],
        },
        "reason": "Test",
        "message": "hello",
        "type": "Warning",
    }
    await core.create_namespaced_event("ml", body)
    stored = emu.get_object(EVENTS, "ml/a.1234")
    assert stored is not None
    assert stored["message"] == "hello"
    assert stored["metadata"]["resourceVersion"]
    with pytest.raises(ApiException) as clash:
        await core.create_namespaced_event("ml", body)
    assert clash.value.status == 409
    with pytest.raises(ApiException) as wrong_ns:
        await core.create_namespaced_event("dev", body)
    assert wrong_ns.value.status == 400
