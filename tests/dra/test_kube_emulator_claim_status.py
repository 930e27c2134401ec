"""The emulator's ``resourceclaims/status`` subresource, driven by the unmodified
kubernetes-asyncio client, as kube-scheduler writes an allocation: create the claim
(its ``.status`` cleared), then PUT or PATCH ``/status`` (only ``.status`` changes, the
``resourceVersion`` a precondition); a write of the claim itself keeps the stored
``.status``. bench/dra.py's fake kubelet process creates its claims this way.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.rest import ApiException

from support.kube_emulator import APPLY_PATCH, MERGE_PATCH, KubeEmulator
from support.kube_emulator_dra import RESOURCE_CLAIMS, enable_dra

pytestmark = pytest.mark.anyio

NS = "default"
NAME = "c"
KEY = f"{NS}/{NAME}"
RESULT = {"request": "gpu", "driver": "gpu.gpulet.io", "pool": "node-1", "device": "gpu-0"}
ALLOCATION = {"devices": {"results": [RESULT]}}
SPEC = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}}


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator.running() as emulator:
        enable_dra(emulator)
        yield emulator


@pytest.fixture
async def api(emu: KubeEmulator) -> AsyncIterator[Any]:
    """ResourceV1Api, untyped: its calls take plain dict bodies and ``_content_type``,
    which its stubs do not list."""
    async with client.ApiClient(client.Configuration(host=emu.url)) as api_client:
        yield client.ResourceV1Api(api_client)


def claim(**extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": NAME, "labels": {"app": "x"}},
        "spec": copy.deepcopy(SPEC),
        **extra,
    }


def stored(emu: KubeEmulator) -> dict[str, Any]:
    obj = emu.get_object(RESOURCE_CLAIMS, KEY)
    assert obj is not None
    return obj


def rv(emu: KubeEmulator) -> str:
    return str(stored(emu)["metadata"]["resourceVersion"])


async def test_a_create_clears_status_and_a_status_put_sets_only_status(
    emu: KubeEmulator, api: Any
) -> None:
    await api.create_namespaced_resource_claim(
        NS, claim(status={"allocation": ALLOCATION}), _preload_content=False
    )
    assert "status" not in stored(emu)
    body = copy.deepcopy(stored(emu))
    body["status"] = {"allocation": ALLOCATION}
    # What the status strategy ignores: spec, labels.
    body["spec"]["devices"]["requests"][0]["name"] = "other"
    body["metadata"]["labels"] = {"app": "changed"}
    before = rv(emu)
    await api.replace_namespaced_resource_claim_status(NAME, NS, body, _preload_content=False)
    after = stored(emu)
    assert after["status"] == {"allocation": ALLOCATION}
    assert after["spec"] == SPEC
    assert after["metadata"]["labels"] == {"app": "x"}
    assert int(rv(emu)) > int(before)
    assert emu.stats.writes_to("resourceclaims/status", KEY) == 1
    assert emu.stats.writes_to(RESOURCE_CLAIMS, KEY) == 1  # the create


async def test_the_status_resource_version_is_a_precondition(emu: KubeEmulator, api: Any) -> None:
    await api.create_namespaced_resource_claim(NS, claim(), _preload_content=False)
    stale = copy.deepcopy(stored(emu))
    await api.patch_namespaced_resource_claim(
        NAME, NS, {"metadata": {"labels": {"b": "1"}}}, _content_type=MERGE_PATCH
    )
    stale["status"] = {"allocation": ALLOCATION}
    with pytest.raises(ApiException) as caught:
        await api.replace_namespaced_resource_claim_status(NAME, NS, stale)
    assert caught.value.status == 409
    assert "status" not in stored(emu)


async def test_a_write_of_the_claim_keeps_the_stored_status(emu: KubeEmulator, api: Any) -> None:
    await api.create_namespaced_resource_claim(NS, claim(), _preload_content=False)
    await api.patch_namespaced_resource_claim_status(
        NAME, NS, {"status": {"allocation": ALLOCATION}}, _content_type=MERGE_PATCH
    )
    assert stored(emu)["status"] == {"allocation": ALLOCATION}
    await api.patch_namespaced_resource_claim(
        NAME, NS, {"metadata": {"labels": {"b": "1"}}, "status": None}, _content_type=MERGE_PATCH
    )
    after = stored(emu)
    assert after["status"] == {"allocation": ALLOCATION}
    assert after["metadata"]["labels"] == {"app": "x", "b": "1"}
    assert emu.stats.writes_to("resourceclaims/status", KEY) == 1


async def test_status_of_a_missing_claim_and_apply_are_refused(emu: KubeEmulator, api: Any) -> None:
    with pytest.raises(ApiException) as caught:
        await api.patch_namespaced_resource_claim_status(
            "missing", NS, {"status": {}}, _content_type=MERGE_PATCH
        )
    assert caught.value.status == 404
    await api.create_namespaced_resource_claim(NS, claim(), _preload_content=False)
    with pytest.raises(ApiException) as caught:
        await api.patch_namespaced_resource_claim_status(
            NAME, NS, json.dumps({"status": {}}), _content_type=APPLY_PATCH, field_manager="t"
        )
    assert caught.value.status == 415
