"""Restarts on a real node (issue 35, test 5), with gpulet serving both kubelet APIs
(``dra.mode=both``: the device plugin and the DRA kubelet plugin over one ledger).

- A kubelet restart: gpulet registers both plugins again without a restart of its own
  (the device plugin registers a second time and ``nvidia.com/gpu`` is back at 7 in
  allocatable: 8 less the GPU the DRA pod's claim holds, which gpulet does not offer
  whole to kubelet's device manager; kubelet deleted the node's
  ResourceSlices when it started and they are back; a new DRA pod is prepared, which
  kubelet only does for a registered driver). The running pods keep their containers
  (same IDs, still running).
- A gpulet restart while pods run: the ledger comes back from its checkpoint, agrees with
  kubelet's device-plugin checkpoint (the same GPUs for the same pods), and a pod that
  then asks for every GPU left gets none that another pod holds.
- A containerd restart: the pods' containers survive (same IDs, still running) and the
  node stays Ready.

The tests run in file order and share the pods they start (a restart test needs pods
that were running before it); each checks its own condition from what it finds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from support.agent_process import Agent
from support.control_plane_fixtures import unique_name
from support.node import Pods, RealNode, pod_manifest
from support.node_gpulet import (
    apply_device_classes,
    claimed_pod,
    devices,
    dra_registered,
    dra_settings,
    env_of,
    ledger,
    start_agent,
    wait_logged,
    wait_running,
    wait_slice_tainted,
)
from support.node_parts import DEVICE_PLUGIN_DIR
from support.waiting import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

GPU = "nvidia.com/gpu"
SCRIPT = "env; echo ---; ls -l /dev/nvidia*"


class Gpulet:
    """The agent, restartable on the same state dir (its ledger's checkpoint)."""

    def __init__(self, node: RealNode, workdir: Path) -> None:
        self.node = node
        self.workdir = workdir
        self.kubeconfig = node.plane.write_kubeconfig(workdir / "kubeconfig")
        self.agent = self._start()

    def _start(self) -> Agent:
        return start_agent(
            self.node,
            self.workdir,
            *dra_settings("both", self.kubeconfig),
        )

    def restart(self) -> None:
        self.agent.stop()
        self.agent = self._start()


@pytest.fixture(scope="module")
def gpulet(real_node: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gpulet]:
    apply_device_classes(real_node.plane)
    g = Gpulet(real_node, tmp_path_factory.mktemp("restart-agent"))
    try:
        anyio.run(
            lambda: wait_until(
                lambda: real_node.allocatable(GPU) == "8" and dra_registered(g.agent),
                timeout_s=60,
            )
        )
        yield g
    except BaseException:
        print(g.agent.output()[-5000:])
        raise
    finally:
        g.agent.stop()


@pytest.fixture(scope="module")
def running(gpulet: Gpulet, real_node: RealNode, pods: Pods) -> dict[str, str]:
    """A device-plugin pod (1 GPU) and a DRA pod, running: name -> container ID. The DRA
    pod is created once the slice shows the device-plugin pod's GPU as held."""
    dp = unique_name("dp")
    pods.create(pod_manifest(dp, real_node.name, script=SCRIPT, limits={GPU: "1"}))

    async def both_running() -> str:
        await wait_running(pods, dp)
        uuid = env_of(await wait_logged(pods, dp))["NVIDIA_VISIBLE_DEVICES"]
        await wait_slice_tainted(real_node, uuid)
        dra = claimed_pod(real_node, pods, "gpu.gpulet.io", SCRIPT)
        await wait_running(pods, dra)
        return dra

    dra = anyio.run(both_running)
    return {name: container_id(pods, name) for name in (dp, dra)}


def registrations(node: RealNode) -> int:
    """How often kubelet (this node's, all its runs) took gpulet's nvidia.com/gpu plugin."""
    log = (node.root / "kubelet.log").read_text(errors="replace")
    return log.count(
        f'"Got registration request from device plugin with resource" resourceName="{GPU}"'
    )


def container_id(pods: Pods, name: str) -> str:
    pod = pods.get(name)
    assert pod is not None
    return str(pod["status"]["containerStatuses"][0]["containerID"])


def still_running(pods: Pods, before: dict[str, str]) -> bool:
    return all(pods.running(n) and container_id(pods, n) == cid for n, cid in before.items())


def checkpoint_devices() -> dict[str, set[str]]:
    """kubelet's device-plugin checkpoint: pod UID -> device IDs of nvidia.com/gpu."""
    data = json.loads((DEVICE_PLUGIN_DIR / "kubelet_internal_checkpoint").read_text())
    out: dict[str, set[str]] = {}
    for entry in data["Data"]["PodDeviceEntries"] or []:
        if entry["ResourceName"] != GPU:
            continue
        ids = {i for per_numa in entry["DeviceIDs"].values() for i in per_numa}
        out.setdefault(entry["PodUID"], set()).update(ids)
    return out


def whole_gpus(state: dict[str, Any]) -> list[set[str]]:
    return [set(a["gpus"]) for a in state["allocations"] if a["kind"] == "whole"]


async def test_a_kubelet_restart_re_registers_both_plugins_and_pods_keep_running(
    real_node: RealNode, gpulet: Gpulet, pods: Pods, running: dict[str, str]
) -> None:
    # The DRA pod's GPU is not offered whole to the device plugin's pods (mode both).
    await wait_until(lambda: real_node.allocatable(GPU) == "7", timeout_s=60, interval_s=0.2)
    real_node.stop_kubelet()
    real_node.start_kubelet()
    await wait_until(
        lambda: registrations(real_node) == 2,
        timeout_s=60,
        interval_s=0.2,
        what="the device plugin's second registration with kubelet",
    )
    await wait_until(
        lambda: real_node.allocatable(GPU) == "7",
        timeout_s=60,
        interval_s=0.2,
        what=f"nvidia.com/gpu: 7 again (now {real_node.allocatable(GPU)})",
    )
    await wait_until(
        lambda: len(devices(real_node)) == 8,
        timeout_s=60,
        interval_s=0.2,
        what="the node's ResourceSlices published again",
    )
    assert still_running(pods, running), {n: pods.why(n) for n in running}
    # The DRA driver is registered again: kubelet prepares a new claim.
    fresh = claimed_pod(real_node, pods, "gpu.gpulet.io", SCRIPT)
    await wait_running(pods, fresh)
    assert env_of(await wait_logged(pods, fresh))["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
    pods.delete(fresh)
    await wait_until(lambda: pods.get(fresh) is None, timeout_s=60, interval_s=0.2)


async def test_a_gpulet_restart_gives_no_gpu_a_second_owner(
    real_node: RealNode, gpulet: Gpulet, pods: Pods, running: dict[str, str]
) -> None:
    await wait_until(lambda: real_node.allocatable(GPU) == "7", timeout_s=60, interval_s=0.2)
    before = ledger(gpulet.agent)
    registered = registrations(real_node)
    gpulet.restart()
    await wait_until(
        lambda: registrations(real_node) > registered,
        timeout_s=60,
        interval_s=0.2,
        what="the restarted device plugin registered",
    )
    await wait_until(
        lambda: real_node.allocatable(GPU) == "7",
        timeout_s=60,
        interval_s=0.2,
        what=f"nvidia.com/gpu: 7 again (now {real_node.allocatable(GPU)})",
    )
    after = ledger(gpulet.agent)
    assert sorted(map(sorted, whole_gpus(after))) == sorted(map(sorted, whole_gpus(before)))
    # kubelet's checkpoint and the ledger agree on the device-plugin pod's GPU.
    dp = next(n for n in running if n.startswith("dp-"))
    pod = pods.get(dp)
    assert pod is not None
    held = checkpoint_devices()[pod["metadata"]["uid"]]
    assert held in whole_gpus(after), (held, after["allocations"])
    # A pod asking for every GPU left gets only free ones.
    taken = set().union(*whole_gpus(after))
    rest = unique_name("rest")
    pods.create(
        pod_manifest(rest, real_node.name, script=SCRIPT, limits={GPU: str(8 - len(taken))})
    )
    await wait_running(pods, rest)
    got = set(env_of(await wait_logged(pods, rest))["NVIDIA_VISIBLE_DEVICES"].split(","))
    assert len(got) == 8 - len(taken)
    assert not got & taken, (got, taken)
    pods.delete(rest)
    assert still_running(pods, running)


async def test_a_containerd_restart_leaves_the_pods_running(
    real_node: RealNode, gpulet: Gpulet, pods: Pods, running: dict[str, str]
) -> None:
    real_node.restart_containerd()
    await wait_until(real_node.ready, timeout_s=60, interval_s=0.2, what="node Ready")
    assert real_node.crictl("ps", "--quiet", "--state", "Running").split()
    await wait_until(
        lambda: still_running(pods, running),
        timeout_s=30,
        interval_s=0.2,
        what="the pods' containers running, unchanged",
    )
