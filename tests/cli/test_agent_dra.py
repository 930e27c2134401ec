"""DRA end to end through `gpulet run` with ``dra.mode=dra`` (issue 26).

The agent runs on the mock NVML against the API emulator (resource.k8s.io/v1 from
support.kube_emulator_dra): the reporter publishes the node's ResourceSlices, the
allocator service runs the DRA kubelet plugin (``dra.plugin_host``, the default;
``device-plugin`` puts it in the device-plugin service, deciding over NATS), which the
fake DRA kubelet registers and calls. A claim the emulator holds allocated (as kube-scheduler leaves
it) is prepared with CDI IDs, its GPU reserved in the allocator's one ledger, so the
device plugin's Allocate of that GPU is refused.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpulet_allocator import protocol as p
from gpulet_common import subjects
from gpulet_common.bus import Bus
from gpulet_common.dra import cdi
from gpulet_common.refusal import Refused
from gpulet_common.settings.nats import NatsSettings
from support.agent_process import Agent
from support.fake_dra_kubelet import registered
from support.kube_emulator import KubeEmulator
from support.kube_emulator_dra import add_claim, dra_emulator, slices
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

NODE = "test.node"
DRIVER = "gpu.gpulet.io"


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with dra_emulator(NODE) as emulator:
        yield emulator


def allocated_claim(emu: KubeEmulator, name: str, device: str) -> str:
    """A claim as kube-scheduler leaves it: allocated one whole GPU of this node."""
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
    claim = add_claim(
        emu,
        {
            "metadata": {"name": name, "namespace": "default"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [result]}}},
        },
    )
    return str(claim["metadata"]["uid"])


def devices(emu: KubeEmulator) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices(emu) for d in s["spec"].get("devices", [])}


async def reserve_claim_requests(bus: Bus) -> int:
    """How many ``reserve-claim`` requests the allocator's NATS endpoint answered."""
    msg = await bus.client.request(f"$SRV.STATS.{p.SERVICE_NAME}", b"", timeout=5)
    endpoints = json.loads(msg.data)["endpoints"]
    return sum(e["num_requests"] for e in endpoints if e["name"] == p.ENDPOINT_RESERVE_CLAIM)


@pytest.mark.parametrize("host", ["allocator", "device-plugin"])
async def test_gpulet_run_in_dra_mode_serves_claims_from_the_one_ledger(
    emu: KubeEmulator, short_dir: Path, tmp_path: Path, host: str
) -> None:
    agent = dra_agent(
        emu,
        short_dir,
        tmp_path,
        "dra",
        dra__plugin_host=host,
        dra__quiet_window_s=0.05,
        allocator__plugin__dev_root=short_dir / "dev",
    )
    try:
        # The slices: every GPU of the mock, a device of our driver.
        await wait_until(
            lambda: len(devices(emu)) == 8, timeout_s=90, interval_s=0.05, what="8 devices"
        )
        assert {s["spec"]["driver"] for s in slices(emu)} == {DRIVER}
        gpu0 = devices(emu)["gpu-0"]
        uuid = gpu0["attributes"]["uuid"]["string"]

        claim = add_claim(
            emu,
            {
                "metadata": {"name": "one-gpu", "namespace": "default"},
                "spec": {},
                "status": {
                    "allocation": {
                        "devices": {
                            "results": [
                                {
                                    "request": "gpu",
                                    "driver": DRIVER,
                                    "pool": NODE,
                                    "device": "gpu-0",
                                    "consumedCapacity": {"cores": "100", "memory": "1Gi"},
                                }
                            ]
                        }
                    }
                },
            },
        )
        uid = claim["metadata"]["uid"]
        async with registered(short_dir / "registry", DRIVER) as kubelet:
            answer = await kubelet.prepare(("default", uid, "one-gpu"))
            entry = answer.claims[uid]
            assert entry.error == ""
            [device] = entry.devices
            assert device.device_name == "gpu-0"
            assert list(device.cdi_device_ids) == [cdi.device_id(DRIVER, uid, "gpu-0")]
            spec_path = cdi.spec_file(short_dir / "cdi", DRIVER, uid)
            # The driver's user space, from the mock's driver root under the state dir.
            spec = json.loads(spec_path.read_text())
            root = (tmp_path / "state" / "mock-driver-root").resolve()
            mounts = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
            # The scenario's driver (nvlink-pairs-8gpu.toml: 535.161.08).
            lib = "/usr/lib/x86_64-linux-gnu/libcuda.so.535.161.08"
            assert mounts[lib] == f"{root}{lib}"
            assert await anyio.Path(mounts[lib]).is_file()
            # The same GPU is refused to the device plugin (the allocator's Allocate).
            settings = NatsSettings(url=agent.nats_url, request_timeout_s=5.0)
            async with Bus.connect(settings, name="test", max_initial_attempts=20) as bus:
                with pytest.raises(Refused) as refused:
                    await bus.request(
                        subjects.allocator_endpoint(NODE, p.ENDPOINT_ALLOCATE),
                        p.AllocateRequest(resource="nvidia.com/gpu", containers=[[uuid]]),
                        p.ALLOCATE_REQUEST,
                        p.ALLOCATE_REPLY,
                    )
                assert refused.value.code == "insufficient_capacity"
                assert uid in refused.value.message
                # Over NATS only where the device-plugin service hosts the plugin.
                assert await reserve_claim_requests(bus) == (host == "device-plugin")
            # Unprepare gives it back.
            undone = await kubelet.unprepare(("default", uid, "one-gpu"))
            assert undone.claims[uid].error == ""
            # SIGTERM with kubelet still connected to the plugin: a clean stop within 2 s.
            started = time.monotonic()
            agent.proc.send_signal(signal.SIGTERM)
            code = await anyio.to_thread.run_sync(agent.proc.wait, 5)
            elapsed = time.monotonic() - started
            assert code == 0, agent.output()
            assert elapsed < 2.0, f"shutdown took {elapsed:.2f}s"
            assert "Traceback" not in agent.output()
    finally:
        await anyio.to_thread.run_sync(agent.stop)


def dra_agent(
    emu: KubeEmulator, short_dir: Path, tmp_path: Path, mode: str, **more: object
) -> Agent:
    """``gpulet run`` in DRA ``mode`` on the NVLink-pairs node, its reporter and DRA
    plugin writing to the emulator, every directory of its own; ``more`` settings
    (``allocator__plugin__dev_root=...`` for ``allocator.plugin.dev_root``) beside."""
    kubeconfig = emu.write_kubeconfig(tmp_path / "kubeconfig")
    settings = {
        "dra.mode": mode,
        "dra.kubeconfig": kubeconfig,
        "dra.cdi_dir": short_dir / "cdi",
        "dra.plugins_registry": short_dir / "registry",
        "dra.plugins_dir": short_dir / "plugins",
        "reporter.mode": "cluster",
        "reporter.kubeconfig": kubeconfig,
        **{key.replace("__", "."): value for key, value in more.items()},
    }
    args = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    return Agent(tmp_path, "--nvml", "mock:nvlink-pairs-8gpu", *args, node=NODE)


def both_modes_agent(emu: KubeEmulator, short_dir: Path, tmp_path: Path) -> Agent:
    """:func:`dra_agent` in mode ``both``, the device plugin's socket dir of its own."""
    return dra_agent(
        emu,
        short_dir,
        tmp_path,
        "both",
        dra__quiet_window_s=0.05,
        reporter__request_retry_s=0.2,
        allocator__plugin__plugin_dir=short_dir / "device-plugins",
    )


def device_plugin_tainted(emu: KubeEmulator, name: str) -> bool:
    """The slice's device ``name`` carries the device plugin's taint."""
    device = devices(emu).get(name, {})
    return any(t["key"] == f"{DRIVER}/device-plugin" for t in device.get("taints", []))


async def test_gpulet_run_in_both_modes_taints_what_the_device_plugin_holds(
    emu: KubeEmulator, short_dir: Path, tmp_path: Path
) -> None:
    agent = both_modes_agent(emu, short_dir, tmp_path)

    def tainted(name: str) -> bool:
        return device_plugin_tainted(emu, name)

    try:
        await wait_until(
            lambda: len(devices(emu)) == 8, timeout_s=90, interval_s=0.05, what="8 devices"
        )
        assert not any(tainted(n) for n in devices(emu))
        uuid = devices(emu)["gpu-3"]["attributes"]["uuid"]["string"]
        settings = NatsSettings(url=agent.nats_url, request_timeout_s=5.0)
        async with Bus.connect(settings, name="test", max_initial_attempts=20) as bus:
            # The device plugin's Allocate (as kubelet's would reach the allocator).
            await bus.request(
                subjects.allocator_endpoint(NODE, p.ENDPOINT_ALLOCATE),
                p.AllocateRequest(resource="nvidia.com/gpu", containers=[[uuid]]),
                p.ALLOCATE_REQUEST,
                p.ALLOCATE_REPLY,
            )
            await wait_until(
                lambda: tainted("gpu-3"), timeout_s=20, interval_s=0.05, what="the taint"
            )
            assert [n for n in devices(emu) if tainted(n)] == ["gpu-3"]
            # A claim for that GPU (a scheduler that did not see the taint yet) is
            # refused in Prepare, for that claim only: the one ledger.
            held_uid = allocated_claim(emu, "held-gpu", "gpu-3")
            free_uid = allocated_claim(emu, "free-gpu", "gpu-4")
            async with registered(short_dir / "registry", DRIVER) as kubelet:
                answer = await kubelet.prepare(
                    ("default", held_uid, "held-gpu"), ("default", free_uid, "free-gpu")
                )
            assert "insufficient_capacity" not in answer.claims[free_uid].error
            assert answer.claims[free_uid].devices[0].cdi_device_ids
            assert uuid in answer.claims[held_uid].error
            assert not answer.claims[held_uid].devices
            # Released, the taint goes again.
            await bus.request(
                subjects.allocator_endpoint(NODE, p.ENDPOINT_RELEASE),
                p.ReleaseRequest(resource="nvidia.com/gpu", device_ids=[uuid]),
                p.RELEASE_REQUEST,
                p.RELEASE_REPLY,
            )
            await wait_until(
                lambda: not tainted("gpu-3"), timeout_s=20, interval_s=0.05, what="no taint"
            )
    finally:
        await anyio.to_thread.run_sync(agent.stop)


async def test_a_restart_never_lowers_the_device_plugin_taint(
    emu: KubeEmulator, short_dir: Path, tmp_path: Path
) -> None:
    """Defect: a restarted reporter wrote the slice with no held GPU before the
    allocator's first ``held`` answer, and the scheduler gave the held GPU to a claim.
    The slice is sampled every 50 ms across several restarts: never untainted."""
    agent = both_modes_agent(emu, short_dir, tmp_path)

    def tainted(name: str) -> bool:
        return device_plugin_tainted(emu, name)

    try:
        await wait_until(
            lambda: len(devices(emu)) == 8, timeout_s=90, interval_s=0.05, what="8 devices"
        )
        uuid = devices(emu)["gpu-2"]["attributes"]["uuid"]["string"]
        settings = NatsSettings(url=agent.nats_url, request_timeout_s=5.0)
        async with Bus.connect(settings, name="test", max_initial_attempts=20) as bus:
            await bus.request(
                subjects.allocator_endpoint(NODE, p.ENDPOINT_ALLOCATE),
                p.AllocateRequest(resource="nvidia.com/gpu", containers=[[uuid]]),
                p.ALLOCATE_REQUEST,
                p.ALLOCATE_REPLY,
            )
        await wait_until(lambda: tainted("gpu-2"), timeout_s=20, interval_s=0.05, what="taint")
        samples = untainted = 0
        for _ in range(3):
            await anyio.to_thread.run_sync(agent.restart)
            # Sample from the stop until the new agent is ready, and 3 s beyond (the
            # gap was 1.3 s after the stop, for 4.9 s).
            ready_at: float | None = None
            for _ in range(1200):  # at most 60 s of samples
                samples += 1
                if not tainted("gpu-2"):
                    untainted += 1
                agent.check_running()
                if ready_at is None:
                    answer = await anyio.to_thread.run_sync(agent.readyz)
                    if answer is not None and answer[0] == 200:
                        ready_at = time.monotonic()
                elif time.monotonic() - ready_at > 3.0:
                    break
                await anyio.sleep(0.05)
            assert ready_at is not None, agent.output()[-4000:]
        assert untainted == 0, f"{untainted} of {samples} samples showed gpu-2 untainted"
        assert len(devices(emu)) == 8
    finally:
        await anyio.to_thread.run_sync(agent.stop)


async def test_a_whole_gpu_configured_for_mps_gets_its_control_daemon(
    emu: KubeEmulator, short_dir: Path, tmp_path: Path
) -> None:
    """A claim's GpuConfig with sharing.strategy MPS on a whole GPU: while the claim is
    prepared the allocator runs that GPU's control daemon (the mock's) with the config's
    limits, the CDI spec mounts its pipe, and Unprepare ends it."""
    agent = dra_agent(
        emu, short_dir, tmp_path, "dra", allocator__plugin__dev_root=short_dir / "dev"
    )
    try:
        await wait_until(
            lambda: len(devices(emu)) == 8, timeout_s=90, interval_s=0.05, what="8 devices"
        )
        uuid = devices(emu)["gpu-1"]["attributes"]["uuid"]["string"]
        parameters = {
            "apiVersion": "gpu.gpulet.io/v1alpha1",
            "kind": "GpuConfig",
            "sharing": {
                "strategy": "MPS",
                "mpsConfig": {
                    "defaultActiveThreadPercentage": 25,
                    "defaultPinnedDeviceMemoryLimit": "4Gi",
                },
            },
        }
        result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1"}
        claim = add_claim(
            emu,
            {
                "metadata": {"name": "mps", "namespace": "default"},
                "spec": {},
                "status": {
                    "allocation": {
                        "devices": {
                            "results": [result],
                            "config": [
                                {
                                    "source": "FromClaim",
                                    "opaque": {"driver": DRIVER, "parameters": parameters},
                                }
                            ],
                        }
                    }
                },
            },
        )
        uid = claim["metadata"]["uid"]
        root = (tmp_path / "state" / "mps").resolve()
        log = root / uuid / "log" / "control.log"

        def logged() -> str:
            return log.read_text() if log.exists() else ""

        async with registered(short_dir / "registry", DRIVER) as kubelet:
            answer = await kubelet.prepare(("default", uid, "mps"))
            assert answer.claims[uid].error == ""
            spec = json.loads(cdi.spec_file(short_dir / "cdi", DRIVER, uid).read_text())
            [edits] = [d["containerEdits"] for d in spec["devices"]]
            assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in edits["env"]
            mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
            assert mounts["/tmp/nvidia-mps"] == f"{root}/{uuid}/pipe"
            await wait_until(
                lambda: (
                    "CMD: set_default_active_thread_percentage 25" in logged()
                    and "CMD: set_default_device_pinned_mem_limit 0 4096M" in logged()
                ),
                timeout_s=30,
                interval_s=0.1,
                what="the daemon's limits",
            )
            undone = await kubelet.unprepare(("default", uid, "mps"))
            assert undone.claims[uid].error == ""
            await wait_until(
                lambda: logged().rstrip().endswith("CMD: quit"),
                timeout_s=30,
                interval_s=0.1,
                what="the daemon told to quit",
            )
    finally:
        await anyio.to_thread.run_sync(agent.stop)
