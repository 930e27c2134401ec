"""CDI specs of prepared claims: content, the CDI project's JSON schema, atomic writes.

The schema files are verbatim copies of the CDI project's (tests/dra/data/cdi-schema,
SOURCE.md names the commits). A real CDI consumer (podman resolving the spec) is the
image tests' job (issue 26's end-to-end part).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulet_common import mps
from gpulet_common.dra import cdi
from gpulet_common.safefile import UnsafePathError
from support.cdi_schema import check

DRIVER = "gpu.gpulet.io"
UID = "8f1c2d3e-0000-4000-8000-00000000abcd"


def fake_dev(tmp_path: Path, *names: str) -> Path:
    root = tmp_path / "dev"
    root.mkdir()
    for name in names:
        (root / name).touch()
    return root


def test_a_whole_gpu_claim(tmp_path: Path) -> None:
    dev = fake_dev(tmp_path, "nvidiactl", "nvidia-uvm", "nvidia3")
    devices = [cdi.PreparedDevice("gpu-3", "GPU-3", 3), cdi.PreparedDevice("gpu-5", "GPU-5", 5)]
    spec = cdi.build_spec(DRIVER, UID, "alloc-1", devices, dev_root=dev)
    check(spec)
    assert spec["kind"] == "gpu.gpulet.io/gpu"
    assert [d["name"] for d in spec["devices"]] == [f"{UID}-gpu-3", f"{UID}-gpu-5"]
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"] == "/dev/nvidia3"
    assert spec["containerEdits"]["env"] == ["GPULET_ALLOCATION_ID=alloc-1"]
    # One request (no names): both devices say both GPUs.
    for device in spec["devices"]:
        assert device["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=GPU-3,GPU-5"]
    # Only the control files that exist (a missing one would fail the container).
    assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
    ]
    assert cdi.device_id(DRIVER, UID, "gpu-3") == f"gpu.gpulet.io/gpu={UID}-gpu-3"


def test_a_mock_dev_root_is_the_hosts_side_and_dev_the_containers(tmp_path: Path) -> None:
    # The real-node tests' mock: the device files live under a dev root of their own,
    # and the container must still see /dev/nvidia<minor> (tests/node).
    dev = fake_dev(tmp_path, "nvidiactl", "nvidia-uvm", "nvidia3")
    cap = f"{dev}/nvidia-caps/nvidia-cap21"
    devices = [cdi.PreparedDevice("gpu-3", "GPU-3", 3, extra_nodes=(cap, "/elsewhere/x"))]
    spec = cdi.build_spec(
        DRIVER, UID, "alloc-1", devices, dev_root=dev, host_dev=str(dev), container_dev="/dev"
    )
    check(spec)
    pairs = [
        (n["hostPath"], n["path"]) for n in spec["devices"][0]["containerEdits"]["deviceNodes"]
    ]
    assert pairs == [
        (f"{dev}/nvidia3", "/dev/nvidia3"),
        (cap, "/dev/nvidia-caps/nvidia-cap21"),
        ("/elsewhere/x", "/elsewhere/x"),  # not under host_dev: taken as it is
    ]
    assert [(n["hostPath"], n["path"]) for n in spec["containerEdits"]["deviceNodes"]] == [
        (f"{dev}/nvidiactl", "/dev/nvidiactl"),
        (f"{dev}/nvidia-uvm", "/dev/nvidia-uvm"),
    ]


def test_a_share_gets_the_device_plugins_mps_limits(tmp_path: Path) -> None:
    share = cdi.PreparedDevice("gpu-1", "GPU-1", 1, cores=30, memory_mib=20 * 1024)
    spec = cdi.build_spec(
        DRIVER, UID, "alloc-2", [share], dev_root=tmp_path, mps_pipe_directory="/run/mps"
    )
    check(spec)
    env = spec["devices"][0]["containerEdits"]["env"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30" in env
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M" in env
    assert "CUDA_MPS_PIPE_DIRECTORY=/run/mps" in env
    assert spec["devices"][0]["containerEdits"]["mounts"][0]["hostPath"] == "/run/mps"


def test_spec_files_are_written_atomically_and_removed(tmp_path: Path) -> None:
    cdi_dir = tmp_path / "cdi"
    spec = cdi.build_spec(DRIVER, UID, "a", [cdi.PreparedDevice("gpu-0", "GPU-0", 0)])
    path = cdi.write_spec(cdi_dir, DRIVER, UID, spec)
    assert path == cdi_dir / f"gpu.gpulet.io-gpu_{UID}.json"
    assert json.loads(path.read_text()) == spec
    assert oct(path.stat().st_mode & 0o777) == oct(cdi.SPEC_MODE)
    # Rewriting replaces the file (a new inode), leaving no temporary behind.
    inode = path.stat().st_ino
    cdi.write_spec(cdi_dir, DRIVER, UID, {**spec, "devices": []})
    assert path.stat().st_ino != inode
    assert sorted(p.name for p in cdi_dir.iterdir()) == [path.name]
    assert cdi.remove_spec(cdi_dir, DRIVER, UID)
    assert not cdi.remove_spec(cdi_dir, DRIVER, UID)
    assert list(cdi_dir.iterdir()) == []


def test_the_spec_file_is_the_sorted_indented_json_it_always_was(tmp_path: Path) -> None:
    dev = fake_dev(tmp_path, "nvidiactl", "nvidia-uvm")
    share = cdi.PreparedDevice("gpu-1", "GPU-1", 1, cores=30, memory_mib=1024)
    spec = cdi.build_spec(DRIVER, UID, "a", [share], dev_root=dev, mps_pipe_directory="/m")
    path = cdi.write_spec(tmp_path / "cdi", DRIVER, UID, spec)
    assert path.read_bytes() == json.dumps(spec, indent=2, sort_keys=True).encode() + b"\n"


def test_control_files_named_by_the_caller_are_taken_as_they_are(tmp_path: Path) -> None:
    """The DRA plugin passes its cached look-up (a stat per file per Prepare otherwise)."""
    dev = fake_dev(tmp_path, "nvidiactl", "nvidia-uvm")
    gpu = [cdi.PreparedDevice("gpu-0", "GPU-0", 0)]
    looked_up = cdi.build_spec(DRIVER, UID, "a", gpu, dev_root=dev)
    given = cdi.build_spec(DRIVER, UID, "a", gpu, dev_root=dev, control=["nvidiactl", "nvidia-uvm"])
    assert given == looked_up
    none = cdi.build_spec(DRIVER, UID, "a", gpu, dev_root=dev, control=[])
    assert "deviceNodes" not in none["containerEdits"]


def test_a_symlinked_cdi_dir_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "cdi").symlink_to(target)
    with pytest.raises(OSError, match=r"(?i)symlink"):
        cdi.write_spec(tmp_path / "cdi", DRIVER, UID, {"devices": []})
    assert list(target.iterdir()) == []


def test_a_planted_symlink_is_refused_not_followed(tmp_path: Path) -> None:
    """The one safe writer fails closed on a link at the spec's path (the claim's
    Prepare then fails with that reason) and never writes through it."""
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (cdi_dir / cdi.spec_file(cdi_dir, DRIVER, UID).name).symlink_to(victim)
    with pytest.raises(UnsafePathError, match="symlink"):
        cdi.write_spec(cdi_dir, DRIVER, UID, {"devices": []})
    assert victim.read_text() == "keep"


@pytest.mark.parametrize("uid", ["../etc", "a/b", "", "-x", "x" * 64, "a b", "ü"])
def test_a_uid_that_is_not_one_never_names_a_path(tmp_path: Path, uid: str) -> None:
    with pytest.raises(ValueError, match="not a UID"):
        cdi.write_spec(tmp_path, DRIVER, uid, {"devices": []})
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_the_old_spec_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cdi.write_spec(tmp_path, DRIVER, UID, {"old": True})

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError, match="No space"):
        cdi.write_spec(tmp_path, DRIVER, UID, {"new": True})
    monkeypatch.undo()
    files = list(tmp_path.iterdir())
    assert [p.name for p in files] == [cdi.spec_file(tmp_path, DRIVER, UID).name]
    assert json.loads(files[0].read_text()) == {"old": True}


@given(
    st.lists(
        st.tuples(
            st.integers(0, 255),
            st.one_of(st.none(), st.integers(1, 100)),
            st.one_of(st.none(), st.integers(1, 200_000)),
        ),
        min_size=1,
        max_size=8,
        unique_by=lambda t: t[0],
    )
)
@settings(max_examples=60, deadline=None)
def test_every_spec_passes_the_cdi_schema(gpus: list[tuple[int, int | None, int | None]]) -> None:
    devices = [
        cdi.PreparedDevice(f"gpu-{m}", f"GPU-{m}", m, cores=c, memory_mib=mem) for m, c, mem in gpus
    ]
    check(cdi.build_spec(DRIVER, UID, "alloc", devices, mps_pipe_directory="/run/mps"))


def injected(spec: dict[str, Any], names: list[str]) -> tuple[dict[str, str], list[str]]:
    """What a CDI runtime gives a container for the devices ``names`` of ``spec``: the
    spec-wide edits, then each device's, in order; an environment variable set twice
    keeps the last value (the CDI library's ContainerEdits.Apply). (env, device paths)"""
    env: dict[str, str] = {}
    nodes: list[str] = []
    by_name = {d["name"]: d for d in spec["devices"]}
    for edits in [spec["containerEdits"], *(by_name[n]["containerEdits"] for n in names)]:
        for entry in edits.get("env", []):
            key, _, value = entry.partition("=")
            env[key] = value
        nodes += [n["path"] for n in edits.get("deviceNodes", [])]
    return env, nodes


def test_a_container_that_names_one_request_sees_only_its_gpus(tmp_path: Path) -> None:
    """Requests r1 (gpu-1) and r2 (gpu-3, a share): kubelet hands a container naming r1
    only r1's CDI device; nothing spec-wide may tell it about r2's GPU."""
    dev = fake_dev(tmp_path, "nvidiactl")
    devices = [
        cdi.PreparedDevice("gpu-1", "GPU-1", 1, requests=("r1",)),
        cdi.PreparedDevice("gpu-3", "GPU-3", 3, cores=30, memory_mib=1024, requests=("r2",)),
    ]
    spec = cdi.build_spec(DRIVER, UID, "a", devices, dev_root=dev, mps_pipe_directory="/m")
    check(spec)
    env, nodes = injected(spec, [f"{UID}-gpu-1"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-1"
    assert not any(k.startswith("CUDA_MPS_") for k in env)
    assert nodes == ["/dev/nvidiactl", "/dev/nvidia1"]
    assert "GPU-3" not in json.dumps(spec["containerEdits"])
    env, nodes = injected(spec, [f"{UID}-gpu-3"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-3"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M"
    assert nodes == ["/dev/nvidiactl", "/dev/nvidia3"]


def test_a_share_mounts_its_gpus_own_mps_daemon(tmp_path: Path) -> None:
    """With gpulet's per-GPU control daemons (gpulet_common.mps), a share's device edits
    point the container at its GPU's pipe, mounted, and its log; a whole GPU gets none."""
    share = cdi.PreparedDevice("gpu-1", "GPU-1", 1, cores=30, memory_mib=1024, requests=("s",))
    whole = cdi.PreparedDevice("gpu-2", "GPU-2", 2, requests=("w",))
    spec = cdi.build_spec(DRIVER, UID, "a", [share, whole], control=[], mps_root="/run/gpulet/mps")
    check(spec)
    edits = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    shared = edits[f"{UID}-gpu-1"]
    assert f"CUDA_MPS_PIPE_DIRECTORY={mps.CONTAINER_PIPE}" in shared["env"]
    assert {m["containerPath"]: m["hostPath"] for m in shared["mounts"]} == {
        mps.CONTAINER_PIPE: "/run/gpulet/mps/GPU-1/pipe",
        mps.CONTAINER_LOG: "/run/gpulet/mps/GPU-1/log",
    }
    assert "mounts" not in edits[f"{UID}-gpu-2"]
