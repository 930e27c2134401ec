"""gpulet's DRA driver on a real node (issue 35, test 2): the real scheduler allocates,
the real kubelet calls gpulet's NodePrepareResources and NodeUnprepareResources, and
containerd applies the CDI spec gpulet wrote.

- A pod with a claim from a ResourceClaimTemplate (class ``gpu.gpulet.io``) runs: its
  container's env has ``NVIDIA_VISIBLE_DEVICES`` = the UUID of the device the scheduler
  allocated, and ``/dev/nvidia<minor>`` of that device (195:minor) plus ``nvidiactl``
  are there: the CDI edits (env and device nodes) reached the container, and only
  Prepare writes them.
- Deleting the pod makes kubelet call NodeUnprepareResources: the claim's CDI spec file
  is removed and its GPU is free in gpulet's ledger.
- A pod asking ``nvidia.com/gpu: 1`` in its limits runs on DRA through the DeviceClass
  with ``extendedResourceName`` (KEP-5004): there is no device plugin on this node.

One node and one agent (``dra.mode=dra``) serve the module.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from support.agent_process import Agent
from support.control_plane_fixtures import unique_name
from support.node import Pods, RealNode, pod_manifest
from support.node_gpulet import (
    DRIVER,
    RESOURCE,
    apply_device_classes,
    char_devices,
    claim_of,
    claimed_pod,
    devices,
    dra_registered,
    dra_settings,
    env_of,
    ledger,
    start_agent,
    wait_logged,
    wait_running,
)
from support.node_parts import CTL_MINOR, NVIDIA_MAJOR
from support.waiting import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

SCRIPT = "env; echo ---; ls -l /dev/nvidia*"


@pytest.fixture(scope="module")
def agent(real_node: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    plane = real_node.plane
    apply_device_classes(plane)
    workdir = tmp_path_factory.mktemp("dra-agent")
    kubeconfig = plane.write_kubeconfig(workdir / "kubeconfig")
    agent = start_agent(
        real_node,
        workdir,
        *dra_settings("dra", kubeconfig),
    )
    try:
        anyio.run(
            lambda: wait_until(
                lambda: len(devices(real_node)) == 8 and dra_registered(agent),
                timeout_s=60,
                interval_s=0.2,
                what="gpulet's 8 devices in the node's ResourceSlices, its driver registered",
            )
        )
        yield agent
    except BaseException:
        print(agent.output()[-5000:])
        raise
    finally:
        agent.stop()
        plane.request(
            "DELETE",
            f"{RESOURCE}/resourceslices",
            query={"fieldSelector": f"spec.nodeName={real_node.name}"},
        )


async def test_kubelet_prepares_the_claim_and_containerd_applies_the_cdi_spec(
    real_node: RealNode, agent: Agent, pods: Pods
) -> None:
    name = claimed_pod(real_node, pods, "gpu.gpulet.io", SCRIPT)
    await wait_running(pods, name)
    claim = claim_of(real_node, pods, name)
    results = claim["status"]["allocation"]["devices"]["results"]
    assert [(r["driver"], r["pool"]) for r in results] == [(DRIVER, real_node.name)]
    device = results[0]["device"]
    minor = int(device.removeprefix("gpu-"))
    uuid = devices(real_node)[device]["attributes"]["uuid"]["string"]
    spec = real_node.cdi_dir / f"{DRIVER}-gpu_{claim['metadata']['uid']}.json"
    assert spec.exists(), sorted(p.name for p in real_node.cdi_dir.iterdir())
    log = await wait_logged(pods, name)
    env = env_of(log)
    assert env["NVIDIA_VISIBLE_DEVICES"] == uuid
    nodes = char_devices(log)
    assert nodes[f"/dev/nvidia{minor}"] == (NVIDIA_MAJOR, minor)
    assert nodes["/dev/nvidiactl"] == (NVIDIA_MAJOR, CTL_MINOR)
    assert {p for p in nodes if p.removeprefix("/dev/nvidia").isdigit()} == {f"/dev/nvidia{minor}"}
    held = [a for a in ledger(agent)["allocations"] if a["gpus"] == [uuid]]
    assert held, ledger(agent)

    pods.delete(name)
    await wait_until(
        lambda: pods.get(name) is None, timeout_s=60, interval_s=0.2, what=f"{name} gone"
    )
    await wait_until(
        lambda: not spec.exists(), timeout_s=30, interval_s=0.2, what="the CDI spec removed"
    )
    await wait_until(
        lambda: not any(a["gpus"] == [uuid] for a in ledger(agent)["allocations"]),
        timeout_s=30,
        interval_s=0.5,
        what="the claim's GPU free in the ledger",
    )


async def test_a_plain_nvidia_gpu_limit_runs_on_dra_through_the_extended_resource_class(
    real_node: RealNode, agent: Agent, pods: Pods
) -> None:
    assert real_node.allocatable("nvidia.com/gpu") is None  # no device plugin here
    name = unique_name("ext")
    manifest = pod_manifest(name, None, script=SCRIPT, limits={"nvidia.com/gpu": "1"})
    manifest["spec"]["nodeSelector"] = {"kubernetes.io/hostname": real_node.name}
    pods.create(manifest)
    await wait_running(pods, name)
    pod = pods.get(name)
    assert pod is not None
    ext = pod["status"].get("extendedResourceClaimStatus") or {}
    assert ext.get("resourceClaimName"), pod["status"]
    log = await wait_logged(pods, name)
    uuids = env_of(log)["NVIDIA_VISIBLE_DEVICES"].split(",")
    assert len(uuids) == 1
    by_uuid = {d["attributes"]["uuid"]["string"]: n for n, d in devices(real_node).items()}
    minor = int(by_uuid[uuids[0]].removeprefix("gpu-"))
    assert char_devices(log)[f"/dev/nvidia{minor}"] == (NVIDIA_MAJOR, minor)
    pods.delete(name)
    await wait_until(
        lambda: pods.get(name) is None, timeout_s=60, interval_s=0.2, what=f"{name} gone"
    )
