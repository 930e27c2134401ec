"""The NVIDIA driver's user space, found on the node as the NVIDIA Container Toolkit
finds it (``nvcdi``), and the CDI edits that give it to a container.

A container with ``/dev/nvidia0`` and no ``libcuda`` cannot use the GPU: on a plain CDI
runtime (containerd 2 or CRI-O with runc, podman) nothing else adds the driver's files.
:func:`discover` looks under the driver root (``/`` for a driver installed on the host,
``/run/nvidia/driver`` for the GPU operator's driver container), for one driver
version:

* **libraries** of the compute and utility capabilities (:data:`LIBRARIES`:
  ``libcuda``, ``libnvidia-ml``, ``libnvidia-ptxjitcompiler``, ``libnvidia-nvvm``, ...):
  through the root's linker cache (:mod:`.ldcache`), each soname's file followed to the
  file named ``<lib>.so.<driver version>`` (a library of another version, left by an
  older driver, is not taken); without a cache, the usual library directories are
  searched for that file name;
* **binaries** (:data:`BINARIES`: ``nvidia-smi``, ``nvidia-debugdump``,
  ``nvidia-persistenced``, ``nvidia-cuda-mps-control``, ``nvidia-cuda-mps-server``) in
  the usual ``bin`` directories, mounted at ``/usr/bin/<name>``;
* **firmware** ``/lib/firmware/nvidia/<version>/*.bin`` (the GSP firmware);
* **IPC sockets** where present: the persistence daemon's and the fabric manager's.

:func:`container_edits` turns them into read-only bind mounts (``ro``, ``nosuid``,
``nodev``, ``rbind``, ``rprivate``, as nvcdi mounts them) and, when the
``nvidia-cdi-hook`` binary of the NVIDIA Container Toolkit is there, its two
``createContainer`` hooks: ``create-symlinks`` (the ``lib*.so`` development links) and
``update-ldcache`` (so the container's linker finds the libraries by soname). Without
the hook a container finds the libraries only by their full versioned name or through
``LD_LIBRARY_PATH``: docs/dra.md says what the node needs.

Paths: gpulet may see the driver root somewhere else than the host does (a container
with the host's ``/`` mounted at ``/host``): ``seen`` is where it looks, ``root`` the
host's path, which the mounts' ``hostPath`` use. Every path found must stay under the
root (a symlink out of it is ignored). Blocking file I/O: call from a worker thread,
once per driver version (the DRA plugin caches the result).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final

from gpulet_common.dra import ldcache

LIBRARIES: Final = (
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-cfg.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-gpucomp.so",
    "libnvidia-opencl.so",
    "libnvidia-allocator.so",
    "libnvidia-pkcs11.so",
    "libnvidia-pkcs11-openssl3.so",
)
BINARIES: Final = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
LIBRARY_DIRS: Final = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib64",
    "lib/x86_64-linux-gnu",
)
BINARY_DIRS: Final = ("usr/bin", "usr/sbin", "bin", "sbin", "usr/local/bin")
SOCKETS: Final = (
    "run/nvidia-persistenced/socket",
    "var/run/nvidia-persistenced/socket",
    "run/nvidia-fabricmanager/socket",
    "var/run/nvidia-fabricmanager/socket",
)
HOOK_CANDIDATES: Final = ("usr/bin/nvidia-cdi-hook", "usr/local/nvidia/toolkit/nvidia-cdi-hook")
MOUNT_OPTIONS: Final = ("ro", "nosuid", "nodev", "rbind", "rprivate")
SOCKET_OPTIONS: Final = ("ro", "nosuid", "nodev", "rbind", "noexec")
MAX_FIRMWARE: Final = 64
JsonObj = dict[str, Any]


@dataclass(frozen=True)
class DriverFiles:
    """What was found, as container paths (``/usr/lib/...``) relative to the root."""

    version: str
    root: str  # the host's path of the driver root
    libraries: tuple[str, ...] = ()
    binaries: tuple[str, ...] = ()
    firmware: tuple[str, ...] = ()
    sockets: tuple[str, ...] = ()
    # The host path of nvidia-cdi-hook, empty when none was found or configured.
    hook: str = ""
    missing: tuple[str, ...] = field(default=())


def _inside(seen: Path, path: str) -> str | None:
    """``path`` (a path inside the root) followed through symlinks within ``seen``,
    as a root-relative absolute path; None when it leaves the root or is no file."""
    try:
        real = Path(os.path.realpath(seen / path.lstrip("/")))
        base = Path(os.path.realpath(seen))
        rel = real.relative_to(base)
    except (OSError, ValueError):
        return None
    if not real.is_file():
        return None
    return "/" + str(PurePosixPath(*rel.parts))


def _libraries(seen: Path, version: str) -> tuple[list[str], list[str]]:
    found: dict[str, str] = {}
    try:
        entries = ldcache.parse((seen / "etc/ld.so.cache").read_bytes()[: 64 << 20])
    except (OSError, ldcache.LdCacheError):
        entries = []
    for entry in entries:
        if not entry.lib64:
            continue
        stem = entry.soname.partition(".so")[0] + ".so"
        if stem not in LIBRARIES or stem in found:
            continue
        real = _inside(seen, entry.path)
        if real is not None and real.endswith(f"{stem}.{version}"):
            found[stem] = real
    for stem in LIBRARIES:
        if stem in found:
            continue
        for directory in LIBRARY_DIRS:
            real = _inside(seen, f"{directory}/{stem}.{version}")
            if real is not None:
                found[stem] = real
                break
    missing = [stem for stem in LIBRARIES[:3] if stem not in found]
    return [found[s] for s in LIBRARIES if s in found], missing


def _first(seen: Path, candidates: list[str]) -> str | None:
    for candidate in candidates:
        real = _inside(seen, candidate)
        if real is not None:
            return real
    return None


def _firmware(seen: Path, version: str) -> list[str]:
    directory = seen / "lib/firmware/nvidia" / version
    try:
        names = sorted(p.name for p in directory.iterdir() if p.name.endswith(".bin"))
    except OSError:
        return []
    out = []
    for name in names[:MAX_FIRMWARE]:
        real = _inside(seen, f"lib/firmware/nvidia/{version}/{name}")
        if real is not None:
            out.append(real)
    return out


def _sockets(seen: Path) -> list[str]:
    out: list[str] = []
    for candidate in SOCKETS:
        path = seen / candidate
        try:
            if path.is_socket() and not path.is_symlink():
                name = "/" + candidate.removeprefix("var/")
                if name not in out:
                    out.append(name)
        except OSError:
            continue
    return out


def discover(root: str, version: str, *, seen: str = "", hook: str = "") -> DriverFiles:
    """The driver's files under ``root`` (looked for under ``seen``, default ``root``)
    for driver ``version``. ``hook``: the host path of ``nvidia-cdi-hook`` to use as it
    is; empty: looked for in the root's usual places."""
    where = Path(seen or root)
    if not version or "/" in version or version.startswith("."):
        return DriverFiles(version, root, missing=("a driver version",))
    libraries, missing = _libraries(where, version)
    binaries = []
    for name in BINARIES:
        found = _first(where, [f"{d}/{name}" for d in BINARY_DIRS])
        if found is not None:
            binaries.append(found)
    if not hook:
        found = _first(where, list(HOOK_CANDIDATES))
        hook = _host(root, found) if found is not None else ""
    return DriverFiles(
        version=version,
        root=root,
        libraries=tuple(libraries),
        binaries=tuple(binaries),
        firmware=tuple(_firmware(where, version)),
        sockets=tuple(_sockets(where)),
        hook=hook,
        missing=tuple(missing),
    )


def _host(root: str, path: str) -> str:
    return str(PurePosixPath(root) / path.lstrip("/"))


def _mount(root: str, path: str, container: str, options: tuple[str, ...]) -> JsonObj:
    return {"hostPath": _host(root, path), "containerPath": container, "options": list(options)}


def container_edits(files: DriverFiles) -> JsonObj:
    """The CDI ``containerEdits`` giving a container the driver's files (empty when
    none were found)."""
    mounts = [_mount(files.root, p, p, MOUNT_OPTIONS) for p in files.libraries]
    mounts += [
        _mount(files.root, p, f"/usr/bin/{PurePosixPath(p).name}", MOUNT_OPTIONS)
        for p in files.binaries
    ]
    mounts += [_mount(files.root, p, p, MOUNT_OPTIONS) for p in files.firmware]
    mounts += [_mount(files.root, p, p, SOCKET_OPTIONS) for p in files.sockets]
    edits: JsonObj = {}
    if mounts:
        edits["mounts"] = mounts
    if files.hook and files.libraries:
        folders = sorted({str(PurePosixPath(p).parent) for p in files.libraries})
        links: list[str] = []
        for p in files.libraries:
            path = PurePosixPath(p)
            stem = path.name.partition(".so")[0] + ".so"
            links += ["--link", f"{stem}.1::{path.parent / stem}"]
        edits["hooks"] = [
            {
                "hookName": "createContainer",
                "path": files.hook,
                "args": ["nvidia-cdi-hook", "create-symlinks", *links],
            },
            {
                "hookName": "createContainer",
                "path": files.hook,
                "args": [
                    "nvidia-cdi-hook",
                    "update-ldcache",
                    *[arg for folder in folders for arg in ("--folder", folder)],
                ],
            },
        ]
    return edits
