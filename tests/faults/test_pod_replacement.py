"""State survives a pod replacement (issue 12): a fatal XID and an allocation.

The deployed pod keeps its state on the node (hostPath ``/var/lib/gpulet``, see
deploy/kustomize/base/daemonset.yaml): the health state and JetStream, the allocator's
checkpoint. Here the "pod" is a real ``gpulet run`` process (embedded nats-server with
JetStream, mock NVML, every service) whose working and temporary directories are a
fresh directory per pod (what an emptyDir gives), while ``--state-dir`` is the same
"host" directory for both. A fake kubelet (device plugin and PodResources gRPC) plays
the node's kubelet, and stays across the replacement, as a node's kubelet does.

1. The first pod: kubelet allocates GPU 5 to a pod; GPU 2 gets XID 79
   (``gpulet mock inject --gpu 2 --xid 79``), a fatal, sticky condition.
2. The pod is replaced (SIGTERM, then a new process). Its mock NVML starts fresh: it
   no longer shows the XID, as NVML does not after the process that saw it is gone.
3. The second pod: GPU 2 is still unhealthy (health state, the allocator, the Device it
   writes) and the allocation is still held (allocator state; a new Allocate of GPU 5
   is refused, a kubelet retry of the old one gets the same answer).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import grpc
import pytest

from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as dp
from gpulet_common.embedded_nats import free_port
from support.fake_kubelet import FakeContainer, FakeKubelet, FakePod, running_fake_kubelet

pytestmark = pytest.mark.anyio

GPULET = [sys.executable, "-m", "gpulet"]
NODE = "replaced.node"
GPU = "nvidia.com/gpu"
BROKEN, HELD = 2, 5


class Pod:
    """One ``gpulet run`` process: a fresh pod dir, the node's state dir."""

    def __init__(self, host_state: Path, plugin_dir: Path, pod_resources: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpulet-pod-"))  # the emptyDir
        self.nats_port, self.http_port = free_port(), free_port()
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        self.log_path = self.dir / "agent.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULET_", "KUBE"))}
        env.update({"TMPDIR": str(self.dir), "HOME": str(self.dir)})
        settings = {
            "nats.embedded_port": self.nats_port,
            "reporter.mode": "offline",
            "collector.sample_period_s": 0.2,
            "allocator.plugin.plugin_dir": f"{plugin_dir}/",
            "allocator.pod_resources_socket": str(pod_resources),
            "allocator.release_interval_s": 0.5,
            "allocator.release_grace_s": 1.0,
        }
        sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    *GPULET,
                    "run",
                    "--nvml",
                    "mock",
                    "--node",
                    NODE,
                    "--state-dir",
                    str(host_state),
                    "--metrics-port",
                    str(self.http_port),
                    *sets,
                ],
                cwd=self.dir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def readyz(self) -> tuple[int, dict[str, Any]]:
        url = f"http://127.0.0.1:{self.http_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                return int(resp.status), json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return int(exc.code), json.loads(exc.read())

    async def wait_ready(self, within: float = 30) -> None:
        with anyio.fail_after(within):
            while True:
                assert self.proc.poll() is None, self.output()
                try:
                    status, _ = await anyio.to_thread.run_sync(self.readyz)
                except OSError:
                    status = 0
                if status == 200:
                    return
                await anyio.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)  # the emptyDir goes with the pod


@contextmanager
def running_pod(host_state: Path, plugin_dir: Path, pod_resources: Path) -> Iterator[Pod]:
    pod = Pod(host_state, plugin_dir, pod_resources)
    try:
        yield pod
    finally:
        pod.stop()


def gpulet(pod: Pod, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [*GPULET, *args, "--nats", pod.nats_url, "--node", NODE],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("GPULET_")},
    )
    assert done.returncode == 0, (args, done.stdout, done.stderr, pod.output())
    if "--json" not in args:
        return {"stdout": done.stdout}
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


async def cli(pod: Pod, *args: str) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(lambda: gpulet(pod, *args))


async def eventually(check: Any, what: str, within: float = 20) -> Any:
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await anyio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {last!r}")


def device_health(host_state: Path) -> dict[str, bool]:
    devices = list((host_state / "reporter").glob("device-*.json"))
    if not devices:
        return {}
    obj = json.loads(devices[0].read_text())
    return {d["id"]: bool(d["health"]) for d in obj["spec"]["devices"]}


def device_reason(host_state: Path, uuid: str) -> str:
    [device] = list((host_state / "reporter").glob("device-*.json"))
    obj = json.loads(device.read_text())
    [entry] = [d for d in obj["spec"]["devices"] if d["id"] == uuid]
    return str(entry["conditions"][0]["reason"])


async def allocator_state(pod: Pod) -> dict[str, Any]:
    return await cli(pod, "allocator", "state", "--json")


async def wait_listed(kubelet: FakeKubelet, n: int) -> list[str]:
    await kubelet.wait_registered(GPU, timeout_s=30)
    await kubelet.wait_devices(GPU, lambda d: len(d) == n, timeout_s=30)
    return [d.ID for d in kubelet.devices(GPU)]


async def test_a_replaced_pod_keeps_a_fatal_xid_and_the_allocations(tmp_path: Path) -> None:
    host_state = tmp_path / "host" / "var-lib-gpulet"
    short = Path(tempfile.mkdtemp(prefix="gpl-"))  # unix socket paths are short
    plugin_dir = short / "device-plugins"
    plugin_dir.mkdir()
    pod_resources = short / "pod-resources.sock"
    try:
        async with running_fake_kubelet(plugin_dir, pod_resources_socket=pod_resources) as kubelet:
            with running_pod(host_state, plugin_dir, pod_resources) as first:
                await first.wait_ready()
                listed = await wait_listed(kubelet, 8)
                state = await allocator_state(first)
                uuids = {g["index"]: g["uuid"] for g in state["gpus"]}
                assert set(listed) == set(uuids.values())
                # Kubelet admits a pod that gets GPU 5, and lists it from then on.
                answer = await kubelet.allocate(GPU, [[uuids[HELD]]])
                allocation = answer.container_responses[0].annotations["gpulet.io/allocation"]
                kubelet.pods = [
                    FakePod("trainer", containers=[FakeContainer("main", {GPU: [uuids[HELD]]})])
                ]
                # GPU 2 falls off the bus.
                await cli(first, "mock", "inject", "--gpu", str(BROKEN), "--xid", "79")

                async def unhealthy_everywhere() -> bool:
                    health = await cli(first, "health", "state", "--json")
                    gpus = {g["gpu_uuid"]: g for g in health["gpus"]}
                    alloc = await allocator_state(first)
                    seen = {g["uuid"]: g["healthy"] for g in alloc["gpus"]}
                    return (
                        not gpus[uuids[BROKEN]]["healthy"]
                        and seen[uuids[BROKEN]] is False
                        and device_health(host_state).get(uuids[BROKEN]) is False
                    )

                await eventually(unhealthy_everywhere, "GPU 2 unhealthy in the first pod")
                before = await allocator_state(first)
                assert [a["id"] for a in before["allocations"]] == [allocation]

            # The pod is gone, and so is everything but the node's state dir. The
            # Device file is removed too, so that what it says next is the new pod's.
            for device in (host_state / "reporter").glob("device-*.json"):
                device.unlink()
            replaced = time.monotonic()
            with running_pod(host_state, plugin_dir, pod_resources) as second:
                await second.wait_ready()
                ready_s = time.monotonic() - replaced
                # The Device the new pod writes (a file: cheap to poll closely).
                with anyio.fail_after(30):
                    while device_health(host_state).get(uuids[BROKEN]) is not False:  # noqa: ASYNC110
                        await anyio.sleep(0.02)
                device_s = time.monotonic() - replaced
                await wait_listed(kubelet, 8)

                async def still_unhealthy() -> dict[str, Any] | None:
                    health = await cli(second, "health", "state", "--json")
                    gpus: dict[str, dict[str, Any]] = {g["gpu_uuid"]: g for g in health["gpus"]}
                    alloc = await allocator_state(second)
                    seen = {g["uuid"]: g["healthy"] for g in alloc["gpus"]}
                    if (
                        seen.get(uuids[BROKEN]) is False
                        and device_health(host_state).get(uuids[BROKEN]) is False
                    ):
                        return gpus[uuids[BROKEN]]
                    return None

                broken = await eventually(still_unhealthy, "GPU 2 still unhealthy")
                assert device_reason(host_state, uuids[BROKEN]) == "Xid79"
                assert broken["healthy"] is False
                assert [c["condition"] for c in broken["conditions"]] == ["xid:79"]
                # The mock NVML of the new pod shows no XID: only the kept state knows.
                assert all(
                    healthy
                    for uuid, healthy in device_health(host_state).items()
                    if uuid != uuids[BROKEN]
                )

                after = await allocator_state(second)
                assert [a["id"] for a in after["allocations"]] == [allocation]
                assert after["allocations"][0]["gpus"] == [uuids[HELD]]
                assert after["ready"] is True
                # GPU 5 is not handed out again; kubelet's retry of the pod gets it back.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await kubelet.allocate(GPU, [[uuids[HELD], uuids[0]]])
                assert "insufficient_capacity" in (refused.value.details() or "")
                retry = await kubelet.allocate(GPU, [[uuids[HELD]]])
                assert retry.container_responses[0].annotations["gpulet.io/allocation"] == (
                    allocation
                )
                assert isinstance(retry, dp.AllocateResponse)
                print(
                    f"FIGURES pod replacement: new pod ready {ready_s:.2f} s after the old "
                    f"one stopped; its Device says GPU {BROKEN} (XID 79) unhealthy "
                    f"{device_s:.2f} s after; allocations kept "
                    f"{len(after['allocations'])}/{len(before['allocations'])}"
                )
    finally:
        shutil.rmtree(short, ignore_errors=True)
