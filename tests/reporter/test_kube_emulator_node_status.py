"""The emulator's ``nodes/status`` subresource and its strategic merge of conditions,
driven by the unmodified kubernetes-asyncio client.

The reporter's node condition (:mod:`gpulet_reporter.node_health`) relies on what the
real API server does here: a PATCH of ``nodes/<name>/status`` changes only
``.status``, a PATCH of the Node ignores ``.status``, a strategic merge patch merges
``status.conditions`` by ``type`` (so other writers' conditions survive) while
``spec.taints`` is atomic (replaced whole, hence the reporter's read-modify-write with
a resourceVersion precondition).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.rest import ApiException

from support.kube_emulator import (
    APPLY_PATCH,
    MERGE_PATCH,
    NODES,
    STRATEGIC_PATCH,
    KubeEmulator,
)

pytestmark = pytest.mark.anyio

NODE = "node-1"
READY = {
    "type": "Ready",
    "status": "True",
    "reason": "KubeletReady",
    "message": "kubelet is posting ready status",
    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}


def ours(status: str = "True", reason: str = "AllGPUsHealthy") -> dict[str, Any]:
    return {
        "type": "GpuletGPUHealthy",
        "status": status,
        "reason": reason,
        "message": "",
        "lastHeartbeatTime": "2026-01-01T00:01:00Z",
        "lastTransitionTime": "2026-01-01T00:01:00Z",
    }


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator.running() as emulator:
        node = emulator.add_node(NODE)
        node["status"] = {
            "conditions": [READY],
            "addresses": [{"type": "Hostname", "address": NODE}],
        }
        node["spec"] = {"taints": [{"key": "other.io/x", "effect": "NoSchedule"}]}
        emulator.put_object(NODES, node)
        yield emulator


@pytest.fixture
async def core(emu: KubeEmulator) -> AsyncIterator[client.CoreV1Api]:
    async with client.ApiClient(client.Configuration(host=emu.url)) as api:
        yield client.CoreV1Api(api)


def stored(emu: KubeEmulator) -> dict[str, Any]:
    obj = emu.get_object(NODES, NODE)
    assert obj is not None
    return obj


def rv(emu: KubeEmulator) -> int:
    return int(stored(emu)["metadata"]["resourceVersion"])


async def patch_status(core: client.CoreV1Api, body: Any, content_type: str, **kw: Any) -> Any:
    """The client's runtime takes ``_content_type`` but its stubs do not list it, so the
    call goes through an untyped reference (as in test_kube_emulator.py)."""
    patch: Any = core.patch_node_status
    return await patch(NODE, body, _content_type=content_type, **kw)


async def patch_node(core: client.CoreV1Api, body: Any, content_type: str) -> Any:
    patch: Any = core.patch_node
    return await patch(NODE, body, _content_type=content_type)


async def replace_status(core: client.CoreV1Api, body: dict[str, Any]) -> Any:
    replace: Any = core.replace_node_status  # a plain dict body, as the server sees it
    return await replace(NODE, body)


def error_body(error: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(error.body or b"{}")
    return body


async def test_strategic_merge_of_conditions_merges_by_type_and_keeps_others(
    emu: KubeEmulator, core: client.CoreV1Api
) -> None:
    before = rv(emu)
    await patch_status(core, {"status": {"conditions": [ours()]}}, STRATEGIC_PATCH)
    conditions = stored(emu)["status"]["conditions"]
    # A new condition goes first, as apimachinery's strategic merge orders it (checked
    # against the real server by tests/kube/test_differential.py).
    assert conditions == [ours(), READY]
    assert rv(emu) > before
    # The same type again: merged in place (not added again), the others untouched.
    changed = {"type": "GpuletGPUHealthy", "status": "False", "reason": "GPUsUnhealthy"}
    await patch_status(core, {"status": {"conditions": [changed]}}, STRATEGIC_PATCH)
    assert stored(emu)["status"]["conditions"] == [{**ours(), **changed}, READY]
    assert stored(emu)["status"]["addresses"] == [{"type": "Hostname", "address": NODE}]
    # Counted under nodes/status, not as writes to the Node itself.
    assert emu.stats.writes_to("nodes/status", NODE) == 2
    assert emu.stats.changes_to("nodes/status", NODE) == 2
    assert emu.stats.writes_to(NODES, NODE) == 0
    # A patch that changes nothing commits nothing: no new resourceVersion.
    same = rv(emu)
    await patch_status(core, {"status": {"conditions": [changed]}}, STRATEGIC_PATCH)
    assert rv(emu) == same
    assert emu.stats.changes_to("nodes/status", NODE) == 2
    # $patch: delete removes one element by its key.
    await patch_status(
        core,
        {"status": {"conditions": [{"type": "GpuletGPUHealthy", "$patch": "delete"}]}},
        STRATEGIC_PATCH,
    )
    assert stored(emu)["status"]["conditions"] == [READY]


async def test_a_merge_patch_replaces_the_conditions_list(
    emu: KubeEmulator, core: client.CoreV1Api
) -> None:
    """Why the reporter uses a strategic merge patch: a JSON merge patch has no merge
    keys, so it would drop the kubelet's Ready condition."""
    await patch_status(core, {"status": {"conditions": [ours()]}}, MERGE_PATCH)
    assert stored(emu)["status"]["conditions"] == [ours()]


async def test_status_patch_changes_status_and_labels_and_node_patch_ignores_status(
    emu: KubeEmulator, core: client.CoreV1Api
) -> None:
    """Through nodes/status the spec stays as stored, but labels change too (the node
    status strategy resets only .spec, as the real server does:
    tests/kube/test_differential.py)."""
    labels = dict(stored(emu)["metadata"]["labels"])
    await patch_status(
        core,
        {
            "metadata": {"labels": {"sneaky": "yes"}},
            "spec": {"taints": None},
            "status": {"conditions": [ours()]},
        },
        STRATEGIC_PATCH,
    )
    node = stored(emu)
    assert node["metadata"]["labels"] == {**labels, "sneaky": "yes"}
    assert node["spec"]["taints"] == [{"key": "other.io/x", "effect": "NoSchedule"}]
    assert node["status"]["conditions"] == [ours(), READY]
    # The main resource: the label sticks, the status part is ignored.
    before = rv(emu)
    await patch_node(
        core,
        {"metadata": {"labels": {"mine": "yes"}}, "status": {"conditions": None}},
        MERGE_PATCH,
    )
    node = stored(emu)
    assert node["metadata"]["labels"]["mine"] == "yes"
    assert node["status"]["conditions"] == [ours(), READY]
    assert rv(emu) > before
    # A Node patch that only touches status is a no-op: no new resourceVersion.
    same = rv(emu)
    await patch_node(core, {"status": {"phase": "x"}}, MERGE_PATCH)
    assert rv(emu) == same
    assert "phase" not in stored(emu)["status"]
    # GET of the subresource reads the whole Node, as the real server answers.
    read = await core.read_node_status(NODE)
    assert read.metadata.labels["mine"] == "yes"


async def test_status_put_and_patch_honour_a_resource_version_precondition(
    emu: KubeEmulator, core: client.CoreV1Api
) -> None:
    stale = str(rv(emu))
    await patch_node(core, {"metadata": {"labels": {"bump": "1"}}}, MERGE_PATCH)
    with pytest.raises(ApiException) as raised:
        await patch_status(
            core,
            {"metadata": {"resourceVersion": stale}, "status": {"conditions": [ours()]}},
            STRATEGIC_PATCH,
        )
    assert raised.value.status == 409
    body = stored(emu)
    body["metadata"]["resourceVersion"] = stale
    body["status"]["conditions"] = [ours()]
    with pytest.raises(ApiException) as raised:
        await replace_status(core, body)
    assert raised.value.status == 409
    body["metadata"]["resourceVersion"] = str(rv(emu))
    body["metadata"]["labels"]["taken"] = "yes"
    await replace_status(core, body)
    assert stored(emu)["status"]["conditions"] == [ours()]
    # The node status strategy resets only .spec: the label goes in too.
    assert stored(emu)["metadata"]["labels"]["taken"] == "yes"


async def test_taints_are_atomic_and_a_stale_read_modify_write_conflicts(
    emu: KubeEmulator, core: client.CoreV1Api
) -> None:
    node = stored(emu)
    ours_taint = {"key": "gpulet.io/gpu-unhealthy", "effect": "NoSchedule"}
    # Strategic merge: spec.taints has no merge key, the list is replaced whole.
    await patch_node(core, {"spec": {"taints": [ours_taint]}}, STRATEGIC_PATCH)
    assert stored(emu)["spec"]["taints"] == [ours_taint]
    # A read-modify-write from the stale read: 409, nothing lost.
    with pytest.raises(ApiException) as raised:
        await patch_node(
            core,
            {
                "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                "spec": {"taints": [*node["spec"]["taints"], ours_taint]},
            },
            MERGE_PATCH,
        )
    assert raised.value.status == 409
    assert error_body(raised.value)["reason"] == "Conflict"
    assert stored(emu)["spec"]["taints"] == [ours_taint]


async def test_status_subresource_errors(emu: KubeEmulator, core: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as raised:
        await patch_status(core, {"status": {"conditions": [{"status": "True"}]}}, STRATEGIC_PATCH)
    assert raised.value.status == 400
    assert "merge key" in error_body(raised.value)["message"]
    with pytest.raises(ApiException) as raised:
        await core.read_node_status("absent")
    assert raised.value.status == 404
    with pytest.raises(ApiException) as raised:
        await patch_status(core, {"status": {}}, APPLY_PATCH, field_manager="m")
    assert raised.value.status == 415
    with pytest.raises(ApiException) as raised:
        await core.delete_node(NODE + "/status")
    assert raised.value.status in (404, 405)
