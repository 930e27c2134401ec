"""DRA end to end on the real control plane (issue 26, "How it is judged").

``gpulet run`` in ``dra.mode=dra`` on the mock NVML (8 GPUs, NVLink pairs) publishes its
ResourceSlices to the real kube-apiserver (v1.37, tools/k8s) for a Ready Node of its
own; deploy/'s DeviceClasses are applied as they are. Pods ask for GPUs through
ResourceClaimTemplates (the examples of docs/dra.md); the real resourceclaim controller
makes the claims and the real kube-scheduler allocates them from gpulet's slices and
binds the pods to the node. There is no kubelet: the project's fake DRA kubelet then
calls the agent's kubelet plugin (NodePrepareResources) for each claim, as kubelet
would, and gets the CDI IDs. Health: an XID 79 injected into the mock (over NATS) taints
the GPU ``NoSchedule`` in its slice, the real scheduler leaves a claim for it pending,
and the health service's clear removes the taint so the claim is placed, with no
restart.

One agent, Node and namespace serve the whole module (a start is seconds on a shared
machine); each test holds its devices until it ends and deletes its pods, so the
scheduler sees the others' claims (as it must) and tests do not depend on each other's
order: each asks for what only it can get, or names its GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from gpulet_common import codec, mps, subjects
from gpulet_common.bus import Bus
from gpulet_common.dra import cdi
from gpulet_common.messages import HealthClearRequest, MockInjectRequest
from gpulet_common.settings.nats import NatsSettings
from support.agent_process import Agent
from support.control_plane import ControlPlane
from support.control_plane_fixtures import unique_name
from support.fake_dra_kubelet import registered
from support.gpulet_on_kube import NAMESPACE as GPULET_NS
from support.gpulet_on_kube import SERVICE_ACCOUNT as GPULET_SA
from support.gpulet_on_kube import agent_pod
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

DRIVER = "gpu.gpulet.io"
ROOT = Path(__file__).resolve().parents[2]
DEVICE_CLASSES = ROOT / "deploy" / "kustomize" / "components" / "dra" / "deviceclasses.yaml"
RESOURCE = "/apis/resource.k8s.io/v1"
GPUS = 8


@dataclass
class DraNode:
    plane: ControlPlane
    node: str
    namespace: str
    agent: Agent
    sockets: Path

    @property
    def registry(self) -> Path:
        return self.sockets / "registry"

    @property
    def cdi_dir(self) -> Path:
        return self.sockets / "cdi"

    def devices(self) -> dict[str, dict[str, Any]]:
        """The node's devices of our driver, as the API server holds them."""
        body = self.plane.must(
            "GET",
            f"{RESOURCE}/resourceslices",
            query={"fieldSelector": f"spec.nodeName={self.node},spec.driver={DRIVER}"},
        )
        return {d["name"]: d for s in body["items"] for d in s["spec"].get("devices", [])}


@contextlib.contextmanager
def dra_node_on(
    plane: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
    *,
    scenario: str = "nvlink-pairs-8gpu",
    devices: int = GPUS,
    mode: str = "dra",
) -> Iterator[DraNode]:
    """The agent on ``scenario`` for a Node of its own, once its ``devices`` devices are
    in the API server (tests/kube/test_dra_mig_real.py starts one on a MIG node)."""
    for obj in yaml.safe_load_all(DEVICE_CLASSES.read_text()):
        resp = plane.apply(obj)
        assert resp.ok, resp.raw[:1000]
    node = unique_name("dra-node")
    namespace = unique_name("dra")
    plane.add_node(node)
    plane.create_namespace(namespace)
    workdir = tmp_path_factory.mktemp("dra-agent")
    kubeconfig = plane.write_kubeconfig(workdir / "kubeconfig")
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    sockets = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))
    agent = Agent(
        workdir,
        "--nvml",
        f"mock:{scenario}",
        "--set",
        f"dra.mode={mode}",
        "--set",
        f"allocator.plugin.plugin_dir={sockets / 'device-plugins'}",
        "--set",
        f"dra.kubeconfig={kubeconfig}",
        "--set",
        f"dra.cdi_dir={sockets / 'cdi'}",
        "--set",
        f"dra.plugins_registry={sockets / 'registry'}",
        "--set",
        f"dra.plugins_dir={sockets / 'plugins'}",
        "--set",
        "dra.quiet_window_s=0.05",
        "--set",
        "reporter.mode=cluster",
        "--set",
        f"reporter.kubeconfig={kubeconfig}",
        "--set",
        "reporter.request_retry_s=0.2",
        "--set",
        f"allocator.plugin.dev_root={sockets / 'dev'}",
        node=node,
    )
    dra = DraNode(plane, node, namespace, agent, sockets)
    try:
        anyio.run(
            lambda: wait_until(
                lambda: len(dra.devices()) == devices,
                timeout_s=60,
                interval_s=0.1,
                what=f"{devices} devices in the real API server",
            )
        )
        yield dra
    except BaseException:
        print(agent.output()[-5000:])
        raise
    finally:
        agent.stop()
        plane.request("DELETE", f"/api/v1/namespaces/{namespace}")
        plane.request("DELETE", f"/api/v1/nodes/{node}")
        plane.request(
            "DELETE",
            f"{RESOURCE}/resourceslices",
            query={"fieldSelector": f"spec.nodeName={node}"},
        )
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.fixture(scope="module")
def dra_node(
    kube_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DraNode]:
    with dra_node_on(kube_cluster, tmp_path_factory) as dra:
        yield dra


def claim_template(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": spec}},
    }


def exactly(request: str, device_class: str, **more: Any) -> dict[str, Any]:
    return {"name": request, "exactly": {"deviceClassName": device_class, **more}}


def cel(expression: str) -> dict[str, Any]:
    return {"cel": {"expression": expression}}


class Scheduled:
    """A pod with one claim from a template, scheduled by the real scheduler."""

    def __init__(self, dra: DraNode, template: dict[str, Any]) -> None:
        self.dra = dra
        self.ns = dra.namespace
        self.name = unique_name("pod")
        tname = unique_name("tpl")
        template["metadata"]["name"] = tname
        template["metadata"]["namespace"] = self.ns
        dra.plane.must("POST", f"{RESOURCE}/namespaces/{self.ns}/resourceclaimtemplates", template)
        dra.plane.must(
            "POST",
            f"/api/v1/namespaces/{self.ns}/pods",
            {
                "metadata": {"name": self.name},
                "spec": {
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": tname}],
                    "containers": [
                        {
                            "name": "app",
                            "image": "registry.invalid/app:1",
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                },
            },
        )

    def pod(self) -> dict[str, Any]:
        pod: dict[str, Any] = self.dra.plane.must(
            "GET", f"/api/v1/namespaces/{self.ns}/pods/{self.name}"
        )
        return pod

    def claim_name(self) -> str | None:
        statuses = self.pod().get("status", {}).get("resourceClaimStatuses") or []
        return next((s.get("resourceClaimName") for s in statuses if s["name"] == "gpu"), None)

    def claim(self) -> dict[str, Any]:
        name = self.claim_name()
        assert name, self.pod().get("status")
        claim: dict[str, Any] = self.dra.plane.must(
            "GET", f"{RESOURCE}/namespaces/{self.ns}/resourceclaims/{name}"
        )
        return claim

    def bound(self) -> bool:
        return bool(self.pod()["spec"].get("nodeName"))

    def why_not(self) -> str:
        pod = self.pod()
        conds = pod.get("status", {}).get("conditions") or []
        return f"pod: {conds}; claim: {self.claim_name()}"

    async def wait_bound(self) -> dict[str, Any]:
        try:
            await wait_until(
                self.bound, timeout_s=60, interval_s=0.1, what=f"pod {self.name} bound"
            )
        except BaseException:
            print(self.why_not())
            raise
        assert self.pod()["spec"]["nodeName"] == self.dra.node
        claim = self.claim()
        return claim

    def unschedulable(self) -> bool:
        conds = self.pod().get("status", {}).get("conditions") or []
        return any(
            c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds
        )

    def delete(self) -> None:
        self.dra.plane.request(
            "DELETE",
            f"/api/v1/namespaces/{self.ns}/pods/{self.name}",
            query={"gracePeriodSeconds": "0"},
        )


def results(claim: dict[str, Any]) -> list[dict[str, Any]]:
    allocation = claim["status"]["allocation"]
    found: list[dict[str, Any]] = allocation["devices"]["results"]
    return found


def assert_ours(dra: DraNode, claim: dict[str, Any], count: int) -> list[str]:
    found = results(claim)
    assert len(found) == count, found
    for result in found:
        assert result["driver"] == DRIVER
        assert result["pool"] == dra.node
        assert result["device"] in dra.devices()
    node_terms = claim["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"]
    assert dra.node in str(node_terms)
    return [r["device"] for r in found]


async def prepare(dra: DraNode, claim: dict[str, Any]) -> list[str]:
    """The fake kubelet's NodePrepareResources for the claim: its CDI IDs, one device each."""
    uid = claim["metadata"]["uid"]
    name = claim["metadata"]["name"]
    async with registered(dra.registry, DRIVER) as kubelet:
        answer = await kubelet.prepare((dra.namespace, uid, name))
    entry = answer.claims[uid]
    assert entry.error == ""
    ids: list[str] = []
    for device in entry.devices:
        assert list(device.cdi_device_ids) == [cdi.device_id(DRIVER, uid, device.device_name)]
        assert device.pool_name == dra.node
        ids.extend(device.cdi_device_ids)
    assert cdi.spec_file(dra.cdi_dir, DRIVER, uid).is_file()
    return ids


def spec_env(dra: DraNode, claim: dict[str, Any], *devices: str) -> dict[str, str]:
    """The environment the claim's CDI spec (as Prepare wrote it) gives a container that
    gets ``devices`` (default: all of the claim's): the spec-wide edits, then each
    device's, a variable set twice keeping the last value (as a CDI runtime does)."""
    uid = claim["metadata"]["uid"]
    spec = json.loads(cdi.spec_file(dra.cdi_dir, DRIVER, uid).read_text())
    wanted = {f"{uid}-{d}" for d in devices}
    edits = [spec["containerEdits"]] + [
        d["containerEdits"] for d in spec["devices"] if not devices or d["name"] in wanted
    ]
    return {k: v for e in edits for k, _, v in (x.partition("=") for x in e.get("env", []))}


def text_of(path: Path) -> str:
    """A file's text, empty while it does not exist."""
    return path.read_text() if path.exists() else ""


def uuids(dra: DraNode, names: list[str]) -> set[str]:
    return {dra.devices()[n]["attributes"]["uuid"]["string"] for n in names}


async def unprepare(dra: DraNode, claim: dict[str, Any]) -> None:
    uid = claim["metadata"]["uid"]
    async with registered(dra.registry, DRIVER) as kubelet:
        answer = await kubelet.unprepare((dra.namespace, uid, claim["metadata"]["name"]))
    assert answer.claims[uid].error == ""


async def test_one_gpu_by_product_name(dra_node: DraNode) -> None:
    dra = dra_node
    product = dra.devices()["gpu-0"]["attributes"]["productName"]["string"]
    pod = Scheduled(
        dra,
        claim_template(
            "one",
            {
                "requests": [
                    exactly(
                        "gpu",
                        "gpu.gpulet.io",
                        selectors=[
                            cel(f"device.attributes['{DRIVER}'].productName == '{product}'")
                        ],
                    )
                ]
            },
        ),
    )
    try:
        claim = await pod.wait_bound()
        [device] = assert_ours(dra, claim, 1)
        assert dra.devices()[device]["attributes"]["productName"]["string"] == product
        assert len(await prepare(dra, claim)) == 1
        env = spec_env(dra, claim)
        assert set(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == uuids(dra, [device])
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
        await unprepare(dra, claim)
    finally:
        pod.delete()


async def test_a_product_no_gpu_has_is_not_scheduled(dra_node: DraNode) -> None:
    # The selector is evaluated for real: a product the node lacks leaves the pod pending.
    pod = Scheduled(
        dra_node,
        claim_template(
            "none",
            {
                "requests": [
                    exactly(
                        "gpu",
                        "gpu.gpulet.io",
                        selectors=[cel(f"device.attributes['{DRIVER}'].productName == 'B300'")],
                    )
                ]
            },
        ),
    )
    try:
        await wait_until(pod.unschedulable, timeout_s=60, interval_s=0.1, what="unschedulable")
        assert not pod.bound()
    finally:
        pod.delete()


async def test_two_gpus_on_one_nvlink_island(dra_node: DraNode) -> None:
    dra = dra_node
    islands = {n: d["attributes"]["nvlinkIsland"]["int"] for n, d in dra.devices().items()}
    # The mock's pairs: a claim for two GPUs at random would cross islands often.
    assert len(set(islands.values())) > 1
    pod = Scheduled(
        dra,
        claim_template(
            "two",
            {
                "requests": [
                    exactly("gpus", "gpu.gpulet.io", allocationMode="ExactCount", count=2)
                ],
                "constraints": [{"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkIsland"}],
            },
        ),
    )
    try:
        claim = await pod.wait_bound()
        first, second = assert_ours(dra, claim, 2)
        assert first != second
        assert islands[first] == islands[second]
        assert len(await prepare(dra, claim)) == 2
        env = spec_env(dra, claim)
        assert set(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == uuids(dra, [first, second])
        await unprepare(dra, claim)
    finally:
        pod.delete()


async def test_two_shares_of_one_gpu(dra_node: DraNode) -> None:
    dra = dra_node
    first = Scheduled(
        dra,
        claim_template(
            "share",
            {
                "requests": [
                    exactly(
                        "share",
                        "gpu-share.gpulet.io",
                        capacity={"requests": {"cores": "30", "memory": "20Gi"}},
                    )
                ]
            },
        ),
    )
    second: Scheduled | None = None
    try:
        claim = await first.wait_bound()
        [device] = assert_ours(dra, claim, 1)
        [result] = results(claim)
        assert result.get("shareID"), result
        consumed = result["consumedCapacity"]
        assert consumed["cores"] == "30"
        assert consumed["memory"] == "20Gi"
        uuid = dra.devices()[device]["attributes"]["uuid"]["string"]
        total = dra.devices()[device]["capacity"]["memory"]["value"]

        def same_gpu(cores: str, memory: str) -> Scheduled:
            return Scheduled(
                dra,
                claim_template(
                    "share2",
                    {
                        "requests": [
                            exactly(
                                "share",
                                "gpu-share.gpulet.io",
                                selectors=[cel(f"device.attributes['{DRIVER}'].uuid == '{uuid}'")],
                                capacity={"requests": {"cores": cores, "memory": memory}},
                            )
                        ]
                    },
                ),
            )

        # The mock's GPUs are V100s of 32510 MiB: a second 20 GiB does not fit beside
        # the first, and the real scheduler, counting consumed capacity, leaves it pending.
        assert total == "32510Mi", total
        too_big = same_gpu("30", "20Gi")
        try:
            await wait_until(
                too_big.unschedulable, timeout_s=60, interval_s=0.1, what="unschedulable"
            )
            assert not too_big.bound()
        finally:
            too_big.delete()
        # A second share that fits, of the same GPU, beside the first.
        second = same_gpu("50", "8Gi")
        other = await second.wait_bound()
        [other_device] = assert_ours(dra, other, 1)
        [other_result] = results(other)
        assert other_device == device
        assert other_result["shareID"] != result["shareID"]
        # Both prepared at once, each with its own CDI ID.
        ids = await prepare(dra, claim)
        other_ids = await prepare(dra, other)
        assert len(ids) == len(other_ids) == 1
        assert ids != other_ids
        # Prepare applies each share's two halves as the device plugin's shares do.
        env, other_env = spec_env(dra, claim), spec_env(dra, other)
        assert env["NVIDIA_VISIBLE_DEVICES"] == other_env["NVIDIA_VISIBLE_DEVICES"] == uuid
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
        assert other_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert other_env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
        # Enforced: the GPU's MPS control daemon (the mock's, under the agent's state
        # dir) runs with the largest share's defaults, and its pipe is in the spec.
        root = (dra.agent.state_dir / "mps").resolve()
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == mps.CONTAINER_PIPE
        spec = json.loads(cdi.spec_file(dra.cdi_dir, DRIVER, claim["metadata"]["uid"]).read_text())
        [edits] = [d["containerEdits"] for d in spec["devices"]]
        mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
        assert mounts[mps.CONTAINER_PIPE] == mps.pipe_dir(str(root), uuid)
        control_log = Path(mps.log_dir(str(root), uuid)) / "control.log"
        await wait_until(
            lambda: "CMD: set_default_active_thread_percentage 50" in text_of(control_log),
            timeout_s=30,
            interval_s=0.1,
            what="the daemon's defaults: the largest share",
        )
        await unprepare(dra, claim)
        await unprepare(dra, other)
    finally:
        first.delete()
        if second is not None:
            second.delete()


async def test_xid_79_taints_the_gpu_and_clearing_brings_it_back(dra_node: DraNode) -> None:
    dra = dra_node
    gpu, name = 5, "gpu-5"
    taint_key = f"{DRIVER}/xid"

    def tainted() -> bool:
        return any(t["key"] == taint_key for t in dra.devices()[name].get("taints") or [])

    def only_that_gpu() -> Scheduled:
        return Scheduled(
            dra,
            claim_template(
                "gpu5",
                {
                    "requests": [
                        exactly(
                            "gpu",
                            "gpu.gpulet.io",
                            selectors=[cel(f"device.attributes['{DRIVER}'].index == {gpu}")],
                        )
                    ]
                },
            ),
        )

    def held_by_a_claim() -> bool:
        body = dra.plane.must("GET", f"{RESOURCE}/namespaces/{dra.namespace}/resourceclaims")
        return any(
            r["device"] == name
            for c in body["items"]
            for r in ((c.get("status") or {}).get("allocation") or {})
            .get("devices", {})
            .get("results", [])
        )

    # Only the taint may keep the next claim from that GPU: no claim of an earlier test
    # (deleted with its pod, deallocated by the controller) still holds it.
    await wait_until(
        lambda: not held_by_a_claim(), timeout_s=60, interval_s=0.1, what=f"{name} free"
    )
    settings = NatsSettings(url=dra.agent.nats_url, request_timeout_s=5.0)
    async with Bus.connect(settings, name="test", max_initial_attempts=20) as bus:
        reply = await bus.request(
            subjects.mock_inject(dra.node),
            MockInjectRequest(gpu=gpu, fault="xid", value=79.0),
            codec.MOCK_INJECT_REQUEST,
            codec.MOCK_INJECT_REPLY,
        )
        assert reply.applied, reply
        await wait_until(tainted, timeout_s=30, interval_s=0.1, what="the XID taint")
        [taint] = [t for t in dra.devices()[name]["taints"] if t["key"] == taint_key]
        assert taint["value"] == "79"
        assert taint["effect"] == "NoSchedule"
        blocked = only_that_gpu()
        try:
            await wait_until(
                blocked.unschedulable, timeout_s=60, interval_s=0.1, what="unschedulable"
            )
            assert not blocked.bound()
            # Cleared, the taint goes and the scheduler places the claim: no restart.
            await bus.request(
                subjects.health_clear(dra.node),
                HealthClearRequest(gpu=str(gpu), requested_by="test"),
                codec.HEALTH_CLEAR_REQUEST,
                codec.HEALTH_STATE,
            )
            await wait_until(lambda: not tainted(), timeout_s=30, interval_s=0.1, what="no taint")
            claim = await blocked.wait_bound()
            assert assert_ours(dra, claim, 1) == [name]
        finally:
            blocked.delete()


async def test_each_request_sees_its_own_gpu_and_the_claim_says_which(dra_node: DraNode) -> None:
    """Requests r1 and r2 of one claim: a container naming r1 gets r1's CDI device,
    whose edits name r1's GPU only; status.devices on the real API server names each
    prepared GPU's UUID, Ready."""
    dra = dra_node
    pod = Scheduled(
        dra,
        claim_template(
            "two-requests",
            {"requests": [exactly("r1", "gpu.gpulet.io"), exactly("r2", "gpu.gpulet.io")]},
        ),
    )
    try:
        claim = await pod.wait_bound()
        by_request = {r["request"]: r["device"] for r in results(claim)}
        assert set(by_request) == {"r1", "r2"}
        await prepare(dra, claim)
        env_r1 = spec_env(dra, claim, by_request["r1"])
        env_r2 = spec_env(dra, claim, by_request["r2"])
        assert env_r1["NVIDIA_VISIBLE_DEVICES"] == "".join(uuids(dra, [by_request["r1"]]))
        assert env_r2["NVIDIA_VISIBLE_DEVICES"] == "".join(uuids(dra, [by_request["r2"]]))

        def status_devices() -> list[dict[str, Any]]:
            return list((pod.claim().get("status") or {}).get("devices") or [])

        await wait_until(
            lambda: len(status_devices()) == 2, timeout_s=30, interval_s=0.1, what="status"
        )
        for entry in status_devices():
            assert entry["driver"] == DRIVER
            assert entry["pool"] == dra.node
            assert entry["data"]["uuid"] == "".join(uuids(dra, [entry["device"]]))
            [ready] = entry["conditions"]
            assert (ready["type"], ready["status"], ready["reason"]) == (
                "Ready",
                "True",
                "Prepared",
            )
        await unprepare(dra, claim)
    finally:
        pod.delete()


def pinned(name: str, gpu: int, **more: Any) -> dict[str, Any]:
    """A template for the GPU of index ``gpu``."""
    return claim_template(
        name,
        {
            "requests": [
                exactly(
                    "gpu",
                    "gpu.gpulet.io",
                    selectors=[cel(f"device.attributes['{DRIVER}'].index == {gpu}")],
                    **more,
                )
            ]
        },
    )


async def test_two_gpus_fully_nvlinked(dra_node: DraNode) -> None:
    """On nvlink-pairs-8gpu, nvlinkIsland joins each quad (the pairs of a quad share 1
    link); with GPUs 0 and 3 taken, matchAttribute on nvlinkIsland would pair 1 and 2
    (1 link), on nvlinkFullIsland it gets a 4-link pair of the other quad."""
    dra = dra_node
    attrs = {n: d["attributes"] for n, d in dra.devices().items()}
    held = [Scheduled(dra, pinned(f"hold{i}", i)) for i in (0, 3)]
    pod: Scheduled | None = None
    try:
        for holder in held:
            await holder.wait_bound()
        pod = Scheduled(
            dra,
            claim_template(
                "full",
                {
                    "requests": [
                        exactly("gpus", "gpu.gpulet.io", allocationMode="ExactCount", count=2)
                    ],
                    "constraints": [
                        {"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkFullIsland"}
                    ],
                },
            ),
        )
        claim = await pod.wait_bound()
        first, second = assert_ours(dra, claim, 2)
        a, b = attrs[first], attrs[second]
        assert a["nvlinkFullIsland"]["int"] == b["nvlinkFullIsland"]["int"]
        # A 4-link pair of the scenario: (4,5) or (6,7), never (1,2).
        assert a["index"]["int"] // 2 == b["index"]["int"] // 2, (first, second)
        assert a["nvlinkFullLinks"]["int"] == b["nvlinkFullLinks"]["int"] == 4
    finally:
        for holder in held:
            holder.delete()
        if pod is not None:
            pod.delete()


async def test_an_admin_claim_gets_a_busy_gpu(dra_node: DraNode) -> None:
    """A monitoring pod's adminAccess claim for a GPU another claim holds whole: the
    real scheduler allocates it (it asks for 0 cores and 0 memory, which the pool's
    request policies allow), and Prepare gives it the GPU without owning it."""
    dra = dra_node
    gpu = 7
    busy = Scheduled(dra, pinned("busy", gpu))
    admin_ns = unique_name("admin")
    dra.plane.create_namespace(admin_ns)
    dra.plane.must(
        "PATCH",
        f"/api/v1/namespaces/{admin_ns}",
        {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}},
        content_type="application/merge-patch+json",
    )
    admin_dra = dataclasses.replace(dra, namespace=admin_ns)
    watcher: Scheduled | None = None
    try:
        busy_claim = await busy.wait_bound()
        assert assert_ours(dra, busy_claim, 1) == [f"gpu-{gpu}"]
        await prepare(dra, busy_claim)
        watcher = Scheduled(
            admin_dra,
            pinned(
                "watch", gpu, adminAccess=True, capacity={"requests": {"cores": "0", "memory": "0"}}
            ),
        )
        claim = await watcher.wait_bound()
        [result] = results(claim)
        assert result["device"] == f"gpu-{gpu}"
        assert result.get("adminAccess") is True
        await prepare(admin_dra, claim)
        env = spec_env(admin_dra, claim)
        assert env["NVIDIA_VISIBLE_DEVICES"] == "".join(uuids(dra, [f"gpu-{gpu}"]))
        await unprepare(admin_dra, claim)
        await unprepare(dra, busy_claim)
    finally:
        busy.delete()
        if watcher is not None:
            watcher.delete()
        dra.plane.request("DELETE", f"/api/v1/namespaces/{admin_ns}")


DRA_RBAC = ROOT / "deploy" / "kustomize" / "components" / "dra" / "rbac.yaml"


async def test_the_status_write_needs_only_the_components_rbac(
    dra_node: DraNode, gpulet_access: ControlPlane
) -> None:
    """status.devices as the DaemonSet writes it: gpulet's ServiceAccount with the dra
    component's ClusterRole and a token bound to a pod on the claim's node may write it
    (resourceclaims/status update + resourceclaims/driver associated-node:update); a
    token of another node's pod may not."""
    dra = dra_node
    plane = gpulet_access
    for obj in yaml.safe_load_all(DRA_RBAC.read_text()):
        resp = plane.apply(obj)
        assert resp.ok, resp.raw[:1000]
    other = unique_name("other-node")
    plane.add_node(other)
    here = plane.token_for(GPULET_NS, GPULET_SA, pod=agent_pod(plane, dra.node))
    there = plane.token_for(GPULET_NS, GPULET_SA, pod=agent_pod(plane, other))
    pod = Scheduled(dra, pinned("status-rbac", 4))
    try:
        claim = await pod.wait_bound()
        [device] = assert_ours(dra, claim, 1)
        [allocated] = results(claim)
        name = claim["metadata"]["name"]
        path = f"{RESOURCE}/namespaces/{dra.namespace}/resourceclaims/{name}/status"
        entry = {
            "driver": DRIVER,
            "pool": dra.node,
            "device": device,
            "shareID": allocated["shareID"],  # every result of a shared device has one
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Prepared",
                    "message": "",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
            "data": {"uuid": "".join(uuids(dra, [device]))},
        }

        def write(token: str) -> tuple[int, str]:
            current = plane.must("GET", path.removesuffix("/status"))
            body = {**current, "status": {**current["status"], "devices": [entry]}}
            resp = plane.request("PUT", path, body, token=token)
            return resp.status, resp.raw.decode(errors="replace")

        status, text = write(there)
        assert status == 422, text[:1000]
        assert "arbitrary-node:update" in text  # the other node's token is refused
        assert "must be an allocated device" not in text
        statuses: list[int] = []

        def allowed() -> bool:  # RBAC reaches the authorizer a moment after the apply
            statuses.append(write(here)[0])
            return statuses[-1] == 200

        await wait_until(allowed, timeout_s=30, interval_s=0.2, what="the write allowed")
        assert pod.claim()["status"]["devices"][0]["data"]["uuid"] == entry["data"]["uuid"]
    finally:
        pod.delete()
        plane.request("DELETE", f"/api/v1/nodes/{other}")
        for node in (dra.node, other):
            plane.request("DELETE", f"/api/v1/namespaces/{GPULET_NS}/pods/gpulet-{node}")
