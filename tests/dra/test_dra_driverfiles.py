"""The driver's user space in the CDI spec: the linker cache read as glibc writes it,
the mock driver root's files found by driver version, and the spec that gives them to
a container (read-only mounts, nvidia-cdi-hook's hooks), valid by the CDI schema."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

import pytest

from gpulet_common.dra import cdi, driverfiles, ldcache
from gpulet_common.mock_nvml import driver_root
from gpulet_common.mock_nvml.scenario import SystemSpec
from support.cdi_schema import check

VERSION = SystemSpec().driver_version  # the mock scenarios' default driver
UID = "8f1c2d3e-0000-4000-8000-00000000abcd"
LIB = "/usr/lib/x86_64-linux-gnu"


def ldconfig_p() -> list[tuple[str, str]]:
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, check=True).stdout
    pairs = []
    for line in out.splitlines()[1:]:
        left, arrow, path = line.partition(" => ")
        if arrow:
            pairs.append((left.strip().split(" (")[0], path.strip()))
    return pairs


def test_the_host_linker_cache_reads_as_ldconfig_prints_it() -> None:
    """The real /etc/ld.so.cache of this machine, against glibc's own ldconfig -p."""
    entries = ldcache.parse(Path("/etc/ld.so.cache").read_bytes())
    assert [(e.soname, e.path) for e in entries] == ldconfig_p()
    assert entries
    assert all(e.lib64 for e in entries if "x86_64" in e.path)


@pytest.mark.parametrize(
    "data", [b"", b"garbage", b"glibc-ld.so.cache1.1", b"x" * 7 + ldcache.MAGIC + b"\0" * 64]
)
def test_a_broken_cache_is_refused_or_read_as_far_as_it_goes(data: bytes) -> None:
    with contextlib.suppress(ldcache.LdCacheError):
        assert ldcache.parse(data) == []
    # Entries whose strings run off the end are skipped, not read past it.
    whole = ldcache.write([("libcuda.so.1", f"{LIB}/libcuda.so.1")])
    assert ldcache.parse(whole[:-5]) == []


def test_the_mock_driver_roots_files_are_found_by_version(short_dir: Path) -> None:
    root = driver_root.make(short_dir / "driver", VERSION)
    found = driverfiles.discover(str(root), VERSION)
    assert found.missing == ()
    assert found.libraries == tuple(f"{LIB}/{s}.{VERSION}" for s in driverfiles.LIBRARIES)
    assert f"{LIB}/libcuda.so.{driver_root.OLDER}" not in found.libraries
    assert found.binaries == tuple(f"/usr/bin/{b}" for b in driverfiles.BINARIES)
    assert found.firmware == (
        f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
        f"/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin",
    )
    assert found.sockets == ("/run/nvidia-persistenced/socket",)
    assert found.hook == ""  # no toolkit in the mock root
    # Another version is not this driver's: nothing of it.
    other = driverfiles.discover(str(root), "999.1.1")
    assert other.libraries == ()
    assert "libcuda.so" in other.missing


def test_without_a_linker_cache_the_library_dirs_are_searched(tmp_path: Path) -> None:
    root = driver_root.make(tmp_path / "driver", VERSION)
    (root / "etc/ld.so.cache").unlink()
    found = driverfiles.discover(str(root), VERSION)
    assert f"{LIB}/libcuda.so.{VERSION}" in found.libraries


def test_a_symlink_out_of_the_root_is_not_followed(tmp_path: Path) -> None:
    root = driver_root.make(tmp_path / "driver", VERSION)
    outside = tmp_path / f"libnvidia-ml.so.{VERSION}"
    outside.write_text("not the driver's")
    lib = root / LIB.lstrip("/") / f"libnvidia-ml.so.{VERSION}"
    lib.unlink()
    lib.symlink_to(outside)
    found = driverfiles.discover(str(root), VERSION)
    assert not any("libnvidia-ml" in p for p in found.libraries)
    assert found.missing == ("libnvidia-ml.so",)


def test_the_spec_mounts_the_driver_read_only_with_the_hooks(short_dir: Path) -> None:
    seen = driver_root.make(short_dir / "driver", VERSION)
    hook = seen / "usr/bin/nvidia-cdi-hook"
    hook.write_text("#!/bin/sh\n")
    hook.chmod(0o755)
    # The host has the root at /run/nvidia/driver; gpulet sees it at `seen`.
    found = driverfiles.discover("/run/nvidia/driver", VERSION, seen=str(seen))
    assert found.hook == "/run/nvidia/driver/usr/bin/nvidia-cdi-hook"
    edits = driverfiles.container_edits(found)
    spec = cdi.build_spec(
        "gpu.gpulet.io",
        UID,
        "a",
        [cdi.PreparedDevice("gpu-0", "GPU-0", 0)],
        control=[],
        driver_edits=edits,
    )
    check(spec)
    mounts = {m["containerPath"]: m for m in spec["containerEdits"]["mounts"]}
    cuda = mounts[f"{LIB}/libcuda.so.{VERSION}"]
    assert cuda["hostPath"] == f"/run/nvidia/driver{LIB}/libcuda.so.{VERSION}"
    assert cuda["options"] == ["ro", "nosuid", "nodev", "rbind", "rprivate"]
    assert mounts["/usr/bin/nvidia-smi"]["hostPath"] == "/run/nvidia/driver/usr/bin/nvidia-smi"
    assert f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin" in mounts
    assert "ro" in mounts["/run/nvidia-persistenced/socket"]["options"]
    symlinks, ldconfig = spec["containerEdits"]["hooks"]
    assert symlinks["hookName"] == ldconfig["hookName"] == "createContainer"
    assert symlinks["path"] == found.hook
    assert symlinks["args"][:2] == ["nvidia-cdi-hook", "create-symlinks"]
    assert f"libcuda.so.1::{LIB}/libcuda.so" in symlinks["args"]
    assert ldconfig["args"] == ["nvidia-cdi-hook", "update-ldcache", "--folder", LIB]
    # Without the hook binary: the mounts, no hooks.
    hook.unlink()
    bare = driverfiles.container_edits(driverfiles.discover(str(seen), VERSION))
    assert "hooks" not in bare
    assert len(bare["mounts"]) == len(mounts)
