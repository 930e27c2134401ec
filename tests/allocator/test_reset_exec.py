"""The reset executor (remediate/reset_exec.py): the nvidia-smi command it builds and
runs (a stand-in nvidia-smi script: exit status, output, a hang killed at the
timeout), and NVIDIA's rule on what may be reset alone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpulet_allocator.service.remediate.reset_exec import (
    NvidiaSmiExecutor,
    alone_problem,
    nvidia_smi_argv,
)
from support.waiting import wait_until

pytestmark = pytest.mark.anyio


def test_argv_is_nvidia_smi_gpu_reset_of_the_bus_id() -> None:
    assert nvidia_smi_argv("nvidia-smi", "00000000:3B:00.0") == [
        "nvidia-smi",
        "--gpu-reset",
        "-i",
        "00000000:3B:00.0",
    ]
    assert nvidia_smi_argv("/usr/bin/nvidia-smi", "0000:3b:00.0")[-1] == "0000:3b:00.0"


@pytest.mark.parametrize("bad", ["", "0", "--help", "0000:3b:00.0 -r", "0000:3b:00.9", "all"])
def test_argv_refuses_anything_but_a_bus_id(bad: str) -> None:
    with pytest.raises(ValueError, match="not a PCI bus id"):
        nvidia_smi_argv("nvidia-smi", bad)


def fake_nvidia_smi(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "nvidia-smi"
    script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


async def test_reset_runs_the_command(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, 'echo "GPU 00000000:3B:00.0 was successfully reset."')
    outcome = await NvidiaSmiExecutor(str(smi), 5.0).reset("00000000:3B:00.0")
    assert outcome.ok, outcome.detail
    assert "successfully reset" in outcome.detail
    assert (tmp_path / "args").read_text().strip() == "--gpu-reset -i 00000000:3B:00.0"


async def test_a_refused_reset_fails_with_what_nvidia_smi_said(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(
        tmp_path, 'echo "Unable to reset GPU: in use by another client" >&2; exit 255'
    )
    outcome = await NvidiaSmiExecutor(str(smi), 5.0).reset("00000000:3B:00.0")
    assert not outcome.ok
    assert not outcome.hung
    assert "exited 255" in outcome.detail
    assert "in use by another client" in outcome.detail


async def test_a_hung_reset_is_killed_at_the_timeout(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, f"echo $$ > {tmp_path}/pid\nexec sleep 60")
    outcome = await NvidiaSmiExecutor(str(smi), 0.5).reset("00000000:3B:00.0")
    assert outcome.hung
    assert not outcome.ok
    pid = int((tmp_path / "pid").read_text())

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    await wait_until(gone, timeout_s=10.0, what="the hung nvidia-smi killed")


async def test_a_missing_nvidia_smi_fails(tmp_path: Path) -> None:
    outcome = await NvidiaSmiExecutor(str(tmp_path / "none"), 5.0).reset("0000:3b:00.0")
    assert not outcome.ok


def test_reset_alone_rules() -> None:
    assert alone_problem([], nvswitch=False, compute_major=8) is None
    assert alone_problem([], nvswitch=True, compute_major=9) is None  # Hopper + FM
    assert "every GPU and NVSwitch" in (alone_problem([], nvswitch=True, compute_major=8) or "")
    peers = alone_problem(["0000:3c:00.0", "0000:3c:00.0"], nvswitch=False, compute_major=9)
    assert peers is not None
    assert "NVLink peers reset with it (0000:3c:00.0)" in peers
