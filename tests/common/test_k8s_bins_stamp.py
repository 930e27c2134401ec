"""scripts/k8s-bins.sh's cache validity: the Go that built a set is in the set's stamp
file, not in its key, so a Go upgrade rebuilds while a cache built before the stamp
existed stays valid (accepted once, then stamped).

Run on an empty cache of the script's own key layout (``--paths``) with placeholder
binaries and a stand-in ``go`` on PATH that answers ``go env GOVERSION``: nothing is
built, no real Go or cache is touched (``--check`` never builds).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from support.control_plane import K8S_BINS

STAMP = ".built-with"


def run(cache: Path, fake_bin: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "GPULET_K8S_CACHE": str(cache),
        "PATH": f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    return subprocess.run(
        ["bash", str(K8S_BINS), *args], env=env, capture_output=True, text=True, timeout=60
    )


def fake_go(fake_bin: Path, version: str) -> None:
    fake_bin.mkdir(exist_ok=True)
    go = fake_bin / "go"
    go.write_text(
        '#!/bin/sh\nif [ "$1 $2" = "env GOVERSION" ]; then echo ' + version + "; exit 0; fi\n"
        'echo "stand-in go: $*" >&2\nexit 3\n'
    )
    go.chmod(0o755)


def cached_dirs(cache: Path, fake_bin: Path) -> set[Path]:
    """Every module's cache dir, filled with placeholder binaries (no stamp)."""
    paths = run(cache, fake_bin, "--paths")
    assert paths.returncode == 0, paths.stderr
    dirs = set()
    for line in paths.stdout.splitlines():
        _, _, path = line.partition("=")
        binary = Path(path)
        binary.parent.mkdir(parents=True, exist_ok=True)
        binary.write_text("#!/bin/sh\n")
        binary.chmod(0o755)
        dirs.add(binary.parent)
    return dirs


def test_the_go_version_is_stamped_and_a_go_upgrade_invalidates_the_cache(
    tmp_path: Path,
) -> None:
    cache, fake_bin = tmp_path / "cache", tmp_path / "bin"
    fake_go(fake_bin, "go1.26.8")
    dirs = cached_dirs(cache, fake_bin)
    assert len(dirs) == 6  # kube, etcd, helm, kubelet, containerd, crictl
    # Built before stamps named the Go: still valid (the key did not change), and
    # stamped with today's Go on that first use.
    check = run(cache, fake_bin, "--check")
    assert check.returncode == 0, check.stderr
    assert {(d / STAMP).read_text() for d in dirs} == {"go=go1.26.8\n"}
    assert run(cache, fake_bin, "--check").returncode == 0
    # A Go upgrade: every set is stale (the keys, hence --paths, are unchanged).
    fake_go(fake_bin, "go1.27.1")
    before = run(cache, fake_bin, "--paths").stdout
    stale = run(cache, fake_bin, "--check")
    assert stale.returncode == 1
    assert "was built by go1.26.8, a build now would use go1.27.1" in stale.stderr
    assert run(cache, fake_bin, "--paths").stdout == before
    assert {(d / STAMP).read_text() for d in dirs} == {"go=go1.26.8\n"}  # not rewritten
    # A stamp without a Go version is accepted once and rewritten.
    for d in dirs:
        (d / STAMP).write_text("built=yesterday\n")
    assert run(cache, fake_bin, "--check").returncode == 0
    assert {(d / STAMP).read_text() for d in dirs} == {"go=go1.27.1\n"}
    # A missing binary is missing whatever the stamp says.
    some = sorted(dirs)[0]
    next(p for p in some.iterdir() if p.name != STAMP).unlink()
    assert run(cache, fake_bin, "--check").returncode == 1
