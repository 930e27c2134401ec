"""The API emulator against the real kube-apiserver: the same scripted requests to both,
the answers compared (status code, the object that results, whether the
resourceVersion moved, watch events).

The emulator stays for what a real server cannot easily do (429s, dropped connections,
latency, faults before or after a commit); this test keeps it honest about everything
else the reporter and the allocator depend on: Device creates and replaces, a stale
resourceVersion, merge and JSON patches (with ``test``), no-op writes, CRD validation and
pruning, Node label and taint patches, the ``nodes/status`` split, a ResourceClaim's
``status`` split (an allocation written as kube-scheduler writes it), 404s and 409s, and
the watch stream of a Device.

Objects are compared after :func:`normalize` drops what differs by nature (uids,
resourceVersions, timestamps, managedFields). The differences that stay are in
:data:`KNOWN_DIFFERENCES`, each with why; a step not listed there must agree.
"""

from __future__ import annotations

import copy
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import pytest

from support.control_plane import ControlPlane
from support.control_plane_fixtures import unique_name
from support.kube_emulator import KubeEmulator
from support.kube_emulator_dra import enable_dra

pytestmark = pytest.mark.anyio

DEVICES = "/apis/scheduling.koordinator.sh/v1alpha1/devices"
JSON = "application/json"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"

# Step label -> why the emulator's answer may differ from the real server's there.
KNOWN_DIFFERENCES: dict[str, str] = {}
# What normalize() takes out of both answers because the emulator does not model it,
# and why that stays.
NORMALIZED_AWAY = {
    "the node.kubernetes.io/not-ready taint": (
        "the TaintNodesByCondition admission plugin puts it on every Node created; "
        "admission plugins are not modelled (gpulet never creates Nodes, and the "
        "emulator's tests seed their Nodes with the taints they are about)"
    ),
    "an empty status or spec": "the real server answers an empty status (and spec) of a new Node",
}
NOT_READY = "node.kubernetes.io/not-ready"


@dataclass
class Answer:
    status: int
    body: Any


class Target:
    """One server, spoken to over HTTP(S) with aiohttp."""

    def __init__(self, name: str, url: str, token: str | None, ssl_context: Any) -> None:
        self.name = name
        self.url = url
        self.token = token
        self.ssl = ssl_context
        self.session: aiohttp.ClientSession | None = None
        self.vars: dict[str, str] = {}

    async def request(
        self, method: str, path: str, body: Any = None, content_type: str = JSON
    ) -> Answer:
        assert self.session is not None
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(self.fill(body))
            headers["Content-Type"] = content_type
        async with self.session.request(
            method, self.url + self.fill(path), data=data, headers=headers, ssl=self.ssl
        ) as resp:
            raw = await resp.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors="replace")
        return Answer(resp.status, parsed)

    def fill(self, value: Any) -> Any:
        """``{name}`` placeholders in strings replaced by this target's variables."""
        if isinstance(value, str):
            for key, sub in self.vars.items():
                value = value.replace("{" + key + "}", sub)
            return value
        if isinstance(value, list):
            return [self.fill(v) for v in value]
        if isinstance(value, dict):
            return {k: self.fill(v) for k, v in value.items()}
        return value


VOLATILE_META = {
    "uid",
    "resourceVersion",
    "creationTimestamp",
    "managedFields",
    "generation",
    "deletionTimestamp",
}


def normalize(body: Any) -> Any:
    """What may be compared between the two servers."""
    if not isinstance(body, dict):
        return body
    out = copy.deepcopy(body)
    if out.get("kind") == "Status":
        # The message text is the server's own prose; the code, reason and what the
        # causes name are compared.
        details = out.get("details") or {}
        return {
            "code": out.get("code"),
            "reason": out.get("reason"),
            "causes": sorted(c.get("field", "") for c in details.get("causes") or []),
        }
    spec = out.get("spec")
    if isinstance(spec, dict) and out.get("kind") == "Node":
        taints = [t for t in spec.get("taints") or [] if t.get("key") != NOT_READY]
        if taints:
            spec["taints"] = taints
        else:
            spec.pop("taints", None)
    for key in ("spec", "status"):
        if out.get(key) == {}:
            del out[key]
    meta = out.get("metadata") or {}
    for key in VOLATILE_META:
        meta.pop(key, None)
    for ref in meta.get("ownerReferences") or []:
        ref.pop("uid", None)
    status = out.get("status")
    if isinstance(status, dict) and out.get("kind") == "Node":
        for cond in status.get("conditions") or []:
            cond.pop("lastHeartbeatTime", None)
            cond.pop("lastTransitionTime", None)
        # What the test put in status (kubelet's part) is compared; the rest is the
        # server's defaulting of a Node's status (daemonEndpoints, nodeInfo, ...).
        out["status"] = {k: status[k] for k in ("conditions", "capacity") if k in status}
    for key in ("spec", "status"):
        if out.get(key) == {}:
            del out[key]
    return out


@dataclass
class Step:
    label: str
    method: str
    path: str
    body: Any = None
    content_type: str = JSON


def device(gpus: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "scheduling.koordinator.sh/v1alpha1",
        "kind": "Device",
        "metadata": {
            "name": "{node}",
            "labels": {"node.koordinator.sh/gpu-model": "H100"},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": "{node}", "uid": "{node_uid}"}
            ],
            **meta,
        },
        "spec": {"devices": gpus},
    }


GPU = {
    "type": "gpu",
    "id": "GPU-0",
    "minor": 0,
    "health": True,
    "resources": {"koordinator.sh/gpu-core": "100", "koordinator.sh/gpu-memory": "80Gi"},
    "topology": {"socketID": 0, "nodeID": 0, "pcieID": "pci0000:17", "busID": "0000:18:00.0"},
}
CONDITION = {
    "type": "GpuletGPUHealthy",
    "status": "True",
    "reason": "AllGPUsHealthy",
    "message": "all 1 GPUs healthy",
    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}
READY = {
    "type": "Ready",
    "status": "True",
    "reason": "KubeletReady",
    "message": "ready",
    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}
NODE = "/api/v1/nodes/{node}"
DEVICE = DEVICES + "/{node}"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
CLAIM = CLAIMS + "/{node}"
# Everything the real server would default is spelled out, so that both hold the same.
ALLOCATION = {
    "allocation": {
        "devices": {
            "results": [
                {"request": "gpu", "driver": "gpu.gpulet.io", "pool": "{node}", "device": "gpu-0"}
            ]
        }
    }
}


def claim(status: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "{node}", "namespace": "default", **meta},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "gpu.gpulet.io",
                            "allocationMode": "ExactCount",
                            "count": 1,
                        },
                    }
                ]
            }
        },
    }
    if status is not None:
        body["status"] = status
    return body


SCRIPT = [
    Step(
        "create node",
        "POST",
        "/api/v1/nodes",
        {"metadata": {"name": "{node}", "labels": {"team": "ml"}}},
    ),
    Step(
        "kubelet status",
        "PATCH",
        NODE + "/status",
        {"status": {"conditions": [READY], "capacity": {"cpu": "8"}}},
        MERGE,
    ),
    Step("get missing device", "GET", DEVICE),
    Step("create device", "POST", DEVICES, device([GPU])),
    Step("create it again", "POST", DEVICES, device([GPU])),
    Step("get device", "GET", DEVICE),
    Step(
        "replace with a stale resourceVersion",
        "PUT",
        DEVICE,
        {**device([GPU]), "metadata": {**device([GPU])["metadata"], "resourceVersion": "1"}},
    ),
    Step("replace without a resourceVersion", "PUT", DEVICE, device([{**GPU, "health": False}])),
    Step(
        "replace with the current resourceVersion",
        "PUT",
        DEVICE,
        device([{**GPU, "health": False}], resourceVersion="{rv}"),
    ),
    Step(
        "replace with the same content",
        "PUT",
        DEVICE,
        device([{**GPU, "health": False}], resourceVersion="{rv}"),
    ),
    Step("merge patch a label", "PATCH", DEVICE, {"metadata": {"labels": {"a": "b"}}}, MERGE),
    Step("the same merge patch", "PATCH", DEVICE, {"metadata": {"labels": {"a": "b"}}}, MERGE),
    Step("merge patch null removes", "PATCH", DEVICE, {"metadata": {"labels": {"a": None}}}, MERGE),
    Step(
        "json patch with a failing test",
        "PATCH",
        DEVICE,
        [
            {"op": "test", "path": "/spec/devices/0/health", "value": True},
            {"op": "replace", "path": "/spec/devices/0/health", "value": True},
        ],
        JSON_PATCH,
    ),
    Step(
        "json patch with a passing test",
        "PATCH",
        DEVICE,
        [
            {"op": "test", "path": "/spec/devices/0/health", "value": False},
            {"op": "replace", "path": "/spec/devices/0/health", "value": True},
        ],
        JSON_PATCH,
    ),
    Step(
        "json patch of a missing path",
        "PATCH",
        DEVICE,
        [{"op": "replace", "path": "/spec/nothing/here", "value": 1}],
        JSON_PATCH,
    ),
    Step(
        "json patch with a stale resourceVersion test",
        "PATCH",
        DEVICE,
        [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"}],
        JSON_PATCH,
    ),
    Step(
        "merge patch with a stale resourceVersion",
        "PATCH",
        DEVICE,
        {"metadata": {"resourceVersion": "1", "labels": {"c": "d"}}},
        MERGE,
    ),
    Step(
        "an invalid device",
        "PATCH",
        DEVICE,
        {"spec": {"devices": [{**GPU, "minor": "zero"}]}},
        MERGE,
    ),
    Step(
        "unknown fields are pruned",
        "PATCH",
        DEVICE,
        {"spec": {"devices": [{**GPU, "colour": "green"}], "extra": 1}},
        MERGE,
    ),
    Step(
        "strategic patch of node labels",
        "PATCH",
        NODE,
        {"metadata": {"labels": {"nvidia.com/gpu.product": "H100"}}},
        STRATEGIC,
    ),
    Step(
        "merge patch of node taints with a stale resourceVersion",
        "PATCH",
        NODE,
        {
            "metadata": {"resourceVersion": "1"},
            "spec": {"taints": [{"key": "gpulet.io/gpu-unhealthy", "effect": "NoSchedule"}]},
        },
        MERGE,
    ),
    Step(
        "merge patch of node taints",
        "PATCH",
        NODE,
        {"spec": {"taints": [{"key": "gpulet.io/gpu-unhealthy", "effect": "NoSchedule"}]}},
        MERGE,
    ),
    Step(
        "strategic patch of a condition keeps Ready",
        "PATCH",
        NODE + "/status",
        {"status": {"conditions": [CONDITION]}},
        STRATEGIC,
    ),
    Step(
        "the same condition again",
        "PATCH",
        NODE + "/status",
        {"status": {"conditions": [CONDITION]}},
        STRATEGIC,
    ),
    Step(
        "a node patch ignores status",
        "PATCH",
        NODE,
        {"metadata": {"labels": {"x": "y"}}, "status": {"conditions": []}},
        MERGE,
    ),
    Step(
        "a status patch ignores labels",
        "PATCH",
        NODE + "/status",
        {"metadata": {"labels": {"z": "w"}}, "status": {"capacity": {"cpu": "16"}}},
        MERGE,
    ),
    Step(
        "a merge patch replaces the conditions list",
        "PATCH",
        NODE + "/status",
        {"status": {"conditions": [CONDITION]}},
        MERGE,
    ),
    Step(
        "status of a missing node",
        "PATCH",
        "/api/v1/nodes/{node}-missing/status",
        {"status": {}},
        MERGE,
    ),
    # A ResourceClaim's status, as kube-scheduler writes an allocation and the DRA
    # bench (bench/dra_kubelet.py) does through the emulator.
    Step("create a claim with a status", "POST", CLAIMS, claim(status=ALLOCATION)),
    Step("get the claim", "GET", CLAIM),
    Step("a claim patch ignores status", "PATCH", CLAIM, {"status": ALLOCATION}, MERGE),
    Step(
        "allocate through status",
        "PATCH",
        CLAIM + "/status",
        {"metadata": {"labels": {"ignored": "yes"}}, "status": ALLOCATION},
        MERGE,
    ),
    Step(
        "a claim patch keeps the status",
        "PATCH",
        CLAIM,
        {"metadata": {"labels": {"a": "b"}}},
        MERGE,
    ),
    Step(
        "a status write with a stale resourceVersion",
        "PATCH",
        CLAIM + "/status",
        {"metadata": {"resourceVersion": "1"}, "status": {"allocation": None}},
        MERGE,
    ),
    Step(
        "replace the claim's status",
        "PUT",
        CLAIM + "/status",
        claim(status={}, resourceVersion="{crv}"),
    ),
    Step("delete the claim", "DELETE", CLAIM),
    Step("delete device", "DELETE", DEVICE),
    Step("delete it again", "DELETE", DEVICE),
    Step("get deleted device", "GET", DEVICE),
]


@dataclass
class Outcome:
    status: int
    body: Any
    rv_moved: bool | None


async def play(target: Target, node: str) -> dict[str, Outcome]:
    target.vars["node"] = node
    outcomes: dict[str, Outcome] = {}
    rv: dict[str, str] = {}
    for step in SCRIPT:
        answer = await target.request(step.method, step.path, step.body, step.content_type)
        if step.label == "create node":
            target.vars["node_uid"] = answer.body["metadata"]["uid"]
        moved = None
        if 200 <= answer.status < 300 and isinstance(answer.body, dict):
            meta = answer.body.get("metadata") or {}
            kind = answer.body.get("kind", "")
            if "resourceVersion" in meta and kind in ("Device", "Node", "ResourceClaim"):
                moved = rv.get(kind) != meta["resourceVersion"]
                rv[kind] = meta["resourceVersion"]
                if kind == "Device":
                    target.vars["rv"] = meta["resourceVersion"]
                if kind == "ResourceClaim":
                    target.vars["crv"] = meta["resourceVersion"]
        outcomes[step.label] = Outcome(answer.status, normalize(answer.body), moved)
    return outcomes


async def watch_events(target: Target, node: str, since: str) -> list[str]:
    """The Device's watch events from ``since`` on, until the server's timeout."""
    answer_types: list[str] = []
    assert target.session is not None
    headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
    url = (
        f"{target.url}{DEVICES}?watch=1&fieldSelector=metadata.name%3D{node}"
        f"&resourceVersion={since}&timeoutSeconds=1"
    )
    async with target.session.get(url, headers=headers, ssl=target.ssl) as resp:
        assert resp.status == 200
        answer_types.extend(
            [json.loads(line)["type"] async for line in resp.content if line.strip()]
        )
    return answer_types


@pytest.fixture
async def emulator() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator.running() as emu:
        enable_dra(emu)
        yield emu


async def test_the_emulator_answers_as_the_real_server_does(
    gpulet_access: ControlPlane, emulator: KubeEmulator
) -> None:
    plane = gpulet_access
    real = Target(
        "real",
        plane.url,
        plane.admin.token,
        ssl.create_default_context(cafile=str(plane.pki / "ca.crt")),
    )
    emu = Target("emulator", emulator.url, None, None)
    node = unique_name("diff")
    results: dict[str, dict[str, Outcome]] = {}
    starts: dict[str, str] = {}
    async with aiohttp.ClientSession() as session:
        for target in (real, emu):
            target.session = session
            listed = await target.request("GET", DEVICES)
            starts[target.name] = listed.body["metadata"]["resourceVersion"]
            results[target.name] = await play(target, node)
        events = {t.name: await watch_events(t, node, starts[t.name]) for t in (real, emu)}
        await real.request("DELETE", f"/api/v1/nodes/{node}")

    differences = []
    for step in SCRIPT:
        a, b = results["real"][step.label], results["emulator"][step.label]
        if (a.status, a.body, a.rv_moved) != (b.status, b.body, b.rv_moved):
            if step.label in KNOWN_DIFFERENCES:
                continue
            differences.append(
                f"{step.label}:\n  real     {a.status} rv_moved={a.rv_moved} {a.body}\n"
                f"  emulator {b.status} rv_moved={b.rv_moved} {b.body}"
            )
    assert events["real"] == events["emulator"], events
    assert not differences, "\n".join(differences)
    # The script exercised what it claims to: refusals and successes on both.
    statuses = {o.status for o in results["real"].values()}
    assert {200, 201, 404, 409, 422} <= statuses
    _ = anyio  # the test runs on anyio's asyncio backend
