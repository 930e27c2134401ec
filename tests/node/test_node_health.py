"""A GPU's health reaches the real kubelet and the pod that holds it (issue 35, test 3),
with gpulet serving both kubelet APIs (``dra.mode=both``).

An XID 79 (the GPU fell off the bus) is injected into the mock NVML:

- on the GPU a device-plugin pod holds: gpulet's ListAndWatch says Unhealthy, kubelet's
  allocatable ``nvidia.com/gpu`` drops from 7 (8 less the GPU the DRA pod's claim holds,
  not offered whole to the device manager in mode ``both``) to 6, and the pod's
  ``status.containerStatuses[].allocatedResourcesStatus`` says that device is
  ``Unhealthy`` (``ResourceHealthStatus``, beta and on by default in 1.37.2);
- on the GPU a DRA pod's claim holds: the device is tainted ``gpu.gpulet.io/xid=79`` in
  the node's ResourceSlice, and, through gpulet's ``DRAResourceHealth`` stream
  (NodeWatchResources), the pod's ``allocatedResourcesStatus`` says that device is
  ``Unhealthy``.

Clearing the faults (``gpulet health clear``) brings both back: allocatable 7, no taint,
both devices ``Healthy`` in the pods' status.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpulet_common.dra import cdi
from support.agent_process import Agent
from support.control_plane_fixtures import unique_name
from support.node import Pods, RealNode, pod_manifest
from support.node_gpulet import (
    DRIVER,
    apply_device_classes,
    claim_of,
    claimed_pod,
    devices,
    dra_registered,
    dra_settings,
    env_of,
    gpulet_cli,
    ledger,
    start_agent,
    wait_logged,
    wait_running,
    wait_slice_tainted,
)
from support.waiting import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

GPU = "nvidia.com/gpu"
SCRIPT = "env; echo ---; ls -l /dev/nvidia*"


@pytest.fixture(scope="module")
def agent(real_node: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    apply_device_classes(real_node.plane)
    workdir: Path = tmp_path_factory.mktemp("health-agent")
    kubeconfig = real_node.plane.write_kubeconfig(workdir / "kubeconfig")
    agent = start_agent(
        real_node,
        workdir,
        *dra_settings("both", kubeconfig),
    )
    try:
        anyio.run(
            lambda: wait_until(
                lambda: real_node.allocatable(GPU) == "8" and dra_registered(agent),
                timeout_s=60,
            )
        )
        yield agent
    except BaseException:
        print(agent.output()[-5000:])
        raise
    finally:
        agent.stop()


def resource_health(pods: Pods, name: str) -> dict[str, str]:
    """``allocatedResourcesStatus`` of the pod's container: resourceID -> health."""
    pod = pods.get(name)
    assert pod is not None
    out: dict[str, str] = {}
    for status in pod.get("status", {}).get("containerStatuses") or []:
        for entry in status.get("allocatedResourcesStatus") or []:
            for res in entry.get("resources") or []:
                out[str(res["resourceID"])] = str(res.get("health", ""))
    return out


def taints(node: RealNode, device: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = devices(node)[device].get("taints") or []
    return found


async def test_an_xid_79_reaches_kubelet_the_slice_and_both_pods_status_and_clears(
    real_node: RealNode, agent: Agent, pods: Pods
) -> None:
    dp = unique_name("dp")
    pods.create(pod_manifest(dp, real_node.name, script=SCRIPT, limits={GPU: "1"}))
    await wait_running(pods, dp)
    dp_uuid = env_of(await wait_logged(pods, dp))["NVIDIA_VISIBLE_DEVICES"]
    await wait_slice_tainted(real_node, dp_uuid)
    dra = claimed_pod(real_node, pods, "gpu.gpulet.io", SCRIPT)
    await wait_running(pods, dra)
    index = {g["uuid"]: g["index"] for g in ledger(agent)["gpus"]}
    dp_gpu = index[dp_uuid]
    claim = claim_of(real_node, pods, dra)
    device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
    dra_gpu = int(device.removeprefix("gpu-"))
    # kubelet names a DRA device in the pod's status by its CDI device ID.
    dra_id = cdi.device_id(DRIVER, claim["metadata"]["uid"], device)
    assert dp_gpu != dra_gpu
    # The DRA pod's GPU is not offered whole to kubelet's device manager (mode both).
    await wait_until(lambda: real_node.allocatable(GPU) == "7", timeout_s=60, interval_s=0.2)

    for gpu in (dp_gpu, dra_gpu):
        gpulet_cli(agent, "mock", "inject", "--gpu", str(gpu), "--xid", "79")
    await wait_until(
        lambda: real_node.allocatable(GPU) == "6",
        timeout_s=60,
        interval_s=0.2,
        what="kubelet's allocatable nvidia.com/gpu: 6",
    )
    await wait_until(
        lambda: any(t["key"] == f"{DRIVER}/xid" for t in taints(real_node, device)),
        timeout_s=60,
        interval_s=0.2,
        what=f"{device} tainted in the slice",
    )
    [taint] = [t for t in taints(real_node, device) if t["key"] == f"{DRIVER}/xid"]
    assert taint["value"] == "79"
    await wait_until(
        lambda: resource_health(pods, dp).get(dp_uuid) == "Unhealthy",
        timeout_s=60,
        interval_s=0.2,
        what="the device-plugin pod's GPU Unhealthy in its status",
    )
    await wait_until(
        lambda: resource_health(pods, dra).get(dra_id) == "Unhealthy",
        timeout_s=60,
        interval_s=0.2,
        what=f"the DRA pod's {dra_id} Unhealthy in its status (DRAResourceHealth): "
        f"{resource_health(pods, dra)}",
    )

    for gpu in (dp_gpu, dra_gpu):
        gpulet_cli(agent, "health", "clear", "--gpu", str(gpu), "--by", "test")
    await wait_until(
        lambda: real_node.allocatable(GPU) == "7",
        timeout_s=60,
        interval_s=0.2,
        what="allocatable back to 7",
    )
    await wait_until(
        lambda: not any(t["key"] == f"{DRIVER}/xid" for t in taints(real_node, device)),
        timeout_s=60,
        interval_s=0.2,
        what="the taint gone",
    )
    await wait_until(
        lambda: (
            resource_health(pods, dp).get(dp_uuid) == "Healthy"
            and resource_health(pods, dra).get(dra_id) == "Healthy"
        ),
        timeout_s=60,
        interval_s=0.2,
        what="both pods' devices Healthy again",
    )
    pods.delete(dp)
    pods.delete(dra)
