"""A mock driver root: the files of an NVIDIA driver's user space, fake but laid out as a
real driver installs them, so that the CDI generation (:mod:`gpulet_common.dra.driverfiles`)
is tested without a GPU.

:func:`make` writes, under ``root``, for the scenario's driver version ``V``:

* ``usr/lib/x86_64-linux-gnu/<lib>.so.V`` for each library of
  :data:`~gpulet_common.dra.driverfiles.LIBRARIES`, its soname link ``<lib>.so.1``,
  and ``etc/ld.so.cache`` naming the links (as ``ldconfig`` would);
* an older driver's ``libcuda.so.<older>`` beside them (never to be taken);
* ``usr/bin/<binary>`` for each of :data:`~gpulet_common.dra.driverfiles.BINARIES`,
  a shell script that logs its arguments to ``var/log/mock-<binary>.log``;
* ``lib/firmware/nvidia/V/gsp_ga10x.bin`` and ``gsp_tu10x.bin``;
* ``run/nvidia-persistenced/socket``, a unix socket.

The files' contents say what they are (they are not ELF files; nothing loads them).
Idempotent: making it again over an existing root rewrites the same files.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Final

from gpulet_common.dra import driverfiles, ldcache

LIB_DIR: Final = "usr/lib/x86_64-linux-gnu"
OLDER: Final = "470.1.1"


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def make(root: Path, version: str) -> Path:
    """Lay out a mock driver root of ``version`` under ``root``; returns ``root``."""
    libs = root / LIB_DIR
    entries: list[tuple[str, str]] = []
    for stem in driverfiles.LIBRARIES:
        _write(libs / f"{stem}.{version}", f"mock {stem} {version}\n")
        link = libs / f"{stem}.1"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f"{stem}.{version}")
        entries.append((f"{stem}.1", f"/{LIB_DIR}/{stem}.1"))
    _write(libs / f"libcuda.so.{OLDER}", f"mock libcuda.so {OLDER}\n")
    _write(root / "etc/ld.so.cache", "")
    (root / "etc/ld.so.cache").write_bytes(ldcache.write(entries))
    for name in driverfiles.BINARIES:
        # Each logs the arguments it got to <root>/var/log/mock-<name>.log.
        log = f'"$(dirname "$0")/../../var/log/mock-{name}.log"'
        _write(
            root / "usr/bin" / name,
            f'#!/bin/sh\necho "$@" >> {log}\necho mock {name} {version}\n',
            0o755,
        )
    (root / "var/log").mkdir(parents=True, exist_ok=True)
    for name in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        _write(root / "lib/firmware/nvidia" / version / name, f"mock {name}\n")
    sock_path = root / "run/nvidia-persistenced/socket"
    sock_path.parent.mkdir(parents=True, exist_ok=True)
    if not sock_path.is_socket():
        sock_path.unlink(missing_ok=True)
        if len(os.fsencode(sock_path)) < 108:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.bind(str(sock_path))
    return root
