"""gpulet's device plugin on a real node (issue 35, test 1): the real kubelet (v1.37.2)
registers it, admits pods through its Allocate answers, and containerd and runc give
the container what gpulet said.

- Registration: ``nvidia.com/gpu`` is 8 in the Node's capacity and allocatable, and the
  share resources (``gpulet.io/gpu-core`` 100 per GPU, ``gpulet.io/gpu-memory``) are
  there too.
- A pod asking ``nvidia.com/gpu: 2`` runs (kubelet asked GetPreferredAllocation, then
  Allocate). Inside it, ``NVIDIA_VISIBLE_DEVICES`` names two GPUs of one NVLink pair, and
  ``ls -l /dev/nvidia*`` shows exactly their character devices (195:minor) plus
  ``nvidiactl`` (195:255) and the ``nvidia-uvm`` pair: the device specs named the mock
  dev root's nodes and mapped them to /dev.
- A share pod (30 cores, 8 memory units) runs with both MPS limits in its env: kubelet's
  two Allocate calls (one per resource) were joined into one share on one GPU.
- Deleting the pods frees their GPUs in gpulet's ledger (the allocator reads kubelet's
  PodResources under the node's root).

One node and one agent serve the module (starting them is seconds).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from support.agent_process import Agent
from support.control_plane_fixtures import unique_name
from support.node import Pods, RealNode, pod_manifest
from support.node_gpulet import char_devices, env_of, ledger, start_agent, wait_logged, wait_running
from support.node_parts import CTL_MINOR, NVIDIA_MAJOR, UVM_MAJOR
from support.waiting import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

GPU = "nvidia.com/gpu"
CORE = "gpulet.io/gpu-core"
MEMORY = "gpulet.io/gpu-memory"
PAIRS = ({0, 1}, {2, 3}, {4, 5}, {6, 7})  # the scenario's 4-link NVLink pairs
SCRIPT = "env; echo ---; ls -l /dev/nvidia* /dev/nvidia-caps"


@pytest.fixture(scope="module")
def agent(real_node: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    agent = start_agent(real_node, tmp_path_factory.mktemp("dp-agent"))
    try:
        yield agent
    except BaseException:
        print(agent.output()[-5000:])
        raise
    finally:
        agent.stop()


async def test_gpulet_registers_and_kubelet_reports_eight_gpus_and_the_shares(
    real_node: RealNode, agent: Agent
) -> None:
    # Each resource registers on its own, and kubelet reports each when it has it.
    await wait_until(
        lambda: (
            (real_node.allocatable(GPU), real_node.allocatable(CORE)) == ("8", "800")
            and real_node.allocatable(MEMORY) is not None
        ),
        timeout_s=60,
        interval_s=0.2,
        what="nvidia.com/gpu: 8 and the share resources in the Node's allocatable",
    )
    assert real_node.capacity(GPU) == "8"
    memory = real_node.allocatable(MEMORY)
    assert memory is not None
    # 256 MiB units: 126 of each V100's 32,510 MiB.
    assert int(memory) == 8 * (32510 // 256), memory


async def test_a_two_gpu_pod_gets_an_nvlink_pair_and_only_its_device_nodes(
    real_node: RealNode, agent: Agent, pods: Pods
) -> None:
    await wait_until(lambda: real_node.allocatable(GPU) == "8", timeout_s=60, interval_s=0.2)
    name = unique_name("two")
    pods.create(pod_manifest(name, real_node.name, script=SCRIPT, limits={GPU: "2"}))
    await wait_running(pods, name)
    log = await wait_logged(pods, name)
    state = ledger(agent)
    index = {g["uuid"]: g["index"] for g in state["gpus"]}
    env = env_of(log)
    uuids = env["NVIDIA_VISIBLE_DEVICES"].split(",")
    minors = {index[u] for u in uuids}
    assert minors in PAIRS, (uuids, minors)
    assert env["GPULET_ALLOCATION_ID"] in {a["id"] for a in state["allocations"]}
    devices = char_devices(log)
    expected = {f"/dev/nvidia{m}": (NVIDIA_MAJOR, m) for m in minors}
    expected["/dev/nvidiactl"] = (NVIDIA_MAJOR, CTL_MINOR)
    expected["/dev/nvidia-uvm"] = (UVM_MAJOR, 0)
    expected["/dev/nvidia-uvm-tools"] = (UVM_MAJOR, 1)
    expected["/dev/nvidia-modeset"] = (NVIDIA_MAJOR, 254)
    assert devices == expected, log
    pods.delete(name)
    await wait_until(
        lambda: not ledger(agent)["allocations"],
        timeout_s=60,
        interval_s=0.5,
        what="the deleted pod's GPUs freed in the ledger",
    )


async def test_a_share_pod_runs_with_both_mps_limits_on_one_gpu(
    real_node: RealNode, agent: Agent, pods: Pods
) -> None:
    await wait_until(lambda: real_node.allocatable(CORE) == "800", timeout_s=60, interval_s=0.2)
    name = unique_name("share")
    pods.create(pod_manifest(name, real_node.name, script=SCRIPT, limits={CORE: "30", MEMORY: "8"}))
    await wait_running(pods, name)
    log = await wait_logged(pods, name)
    env = env_of(log)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    uuids = env["NVIDIA_VISIBLE_DEVICES"].split(",")
    assert len(uuids) == 1
    state = ledger(agent)
    shares = [a for a in state["allocations"] if a["kind"] == "share"]
    assert len(shares) == 1, state["allocations"]
    assert shares[0]["gpus"] == uuids
    assert (shares[0]["cores"], shares[0]["memory_units"]) == (30, 8)
    minor = {g["uuid"]: g["index"] for g in state["gpus"]}[uuids[0]]
    gpu_nodes = {p for p in char_devices(log) if re.fullmatch(r"/dev/nvidia\d+", p)}
    assert gpu_nodes == {f"/dev/nvidia{minor}"}, log
    pods.delete(name)
    await wait_until(
        lambda: not ledger(agent)["allocations"],
        timeout_s=60,
        interval_s=0.5,
        what="the share freed in the ledger",
    )
