"""Shares enforced with MPS: the allocator runs a control daemon per GPU that holds
shares (the mock nvidia-cuda-mps-control, which logs the commands it gets), gives it
the GPU's limits, mounts its pipe into the share's container, restarts it when it dies
(a fault of that GPU's shares meanwhile), and stops it with the GPU's last share."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

from gpulet_allocator import protocol as p
from gpulet_common import mps, subjects
from gpulet_common.settings import Settings
from gpulet_common.settings.allocator import MpsSettings
from support import reference
from support.allocator_stack import CORE, allocator_stack
from support.waiting import wait_until

pytestmark = pytest.mark.anyio


def mock_control(tmp_path: Path) -> str:
    """The mock control daemon as one executable (the setting names a binary)."""
    script = tmp_path / "nvidia-cuda-mps-control"
    script.write_text(
        f'#!/bin/sh\nexec {sys.executable} -m gpulet_common.mock_nvml.mps_control "$@"\n'
    )
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def mps_settings(settings: Settings, tmp_path: Path) -> Settings:
    root = tmp_path / "mps"
    allocator = msgspec.structs.replace(
        settings.allocator,
        mps=MpsSettings(root_directory=str(root), control_binary=mock_control(tmp_path)),
    )
    return msgspec.structs.replace(settings, allocator=allocator)


def control_log(root: str, uuid: str) -> str:
    path = Path(mps.log_dir(root, uuid)) / "control.log"
    return path.read_text() if path.exists() else ""


def daemon_pid(root: str, uuid: str) -> int | None:
    try:
        return int((Path(mps.pipe_dir(root, uuid)) / "daemon.pid").read_text())
    except (OSError, ValueError):
        return None


async def test_a_share_gets_its_gpus_daemon_with_its_limits(mps_settings: Settings) -> None:
    root = mps_settings.allocator.mps.root_directory
    async with allocator_stack(mps_settings, inventory=reference.nvlink_pairs_8()) as stack:
        assert stack.allocator is not None
        supervisor = stack.allocator.mps
        assert supervisor is not None
        core_ids = [d.ID for d in stack.kubelet.devices(CORE)][:30]
        response = await stack.kubelet.allocate(CORE, [core_ids])
        answer = response.container_responses[0]
        uuid = dict(answer.envs)["NVIDIA_VISIBLE_DEVICES"]
        # The container is pointed at its GPU's daemon, whose pipe is mounted.
        assert dict(answer.envs)["CUDA_MPS_PIPE_DIRECTORY"] == mps.CONTAINER_PIPE
        mounts = {m.container_path: m.host_path for m in answer.mounts}
        assert mounts[mps.CONTAINER_PIPE] == mps.pipe_dir(root, uuid)
        assert await anyio.Path(mounts[mps.CONTAINER_PIPE]).is_dir()  # before any container
        await wait_until(
            lambda: "CMD: set_default_active_thread_percentage 30" in control_log(root, uuid),
            timeout_s=20,
            what="the daemon got the share's cores",
        )
        assert f"for {uuid}" in control_log(root, uuid)  # CUDA_VISIBLE_DEVICES
        # The defaults: the largest share of the GPU (one share: its memory, here the
        # card's, as a cores-only share has all of it).
        assert "CMD: set_default_device_pinned_mem_limit 0 " in control_log(root, uuid)
        # A dead daemon is a fault of that GPU's shares, and is started again.
        pid = daemon_pid(root, uuid)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        supervisor.changed()
        await wait_until(lambda: uuid in supervisor.faults, timeout_s=20, what="the fault")
        assert "MPS control daemon down" in supervisor.problem
        await wait_until(
            lambda: uuid not in supervisor.faults and daemon_pid(root, uuid) not in (None, pid),
            timeout_s=30,
            what="the daemon started again",
        )
        assert control_log(root, uuid).count("mock MPS control daemon") == 2
        # The last share goes: the daemon is told to quit.
        await stack.bus.request(
            subjects.allocator_endpoint(stack.node, p.ENDPOINT_RELEASE),
            p.ReleaseRequest(resource=CORE, device_ids=core_ids),
            p.RELEASE_REQUEST,
            p.RELEASE_REPLY,
        )
        await wait_until(
            lambda: control_log(root, uuid).rstrip().endswith("CMD: quit"),
            timeout_s=20,
            what="quit",
        )
        await wait_until(lambda: uuid not in supervisor.running, what="not running")
        assert daemon_pid(root, uuid) is None
