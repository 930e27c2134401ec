"""The parts of the real node in the tests (tests/support/node.py): binaries, images,
configuration files, mock NVIDIA device nodes, and what the kubelet changes outside its
own directory.

Binaries: kubelet, containerd (with its runc shim and ctr) and crictl are built from
their Go modules (tools/k8s/{kubelet,containerd,crictl}) by ``scripts/k8s-bins.sh``,
like the control plane; runc, the CNI plugins (bridge, host-local, loopback) and
busybox-static are Debian's (.ci/run installs them).

Images: no registry can be reached, so the sandbox (pause) image and the test image are
built here with buildah ``FROM scratch`` around Debian's static busybox, in a storage of
their own (vfs, under the cache dir: never podman's), and saved as docker archives in
``~/.cache/gpulet/node-images/<key>/`` (the key hashes busybox and the recipe), once per
machine. Every node imports them into its own containerd (namespace ``k8s.io``), and
pods use ``imagePullPolicy: Never``. The pause image's process is busybox ``sleep``:
containerd stops a sandbox with SIGKILL, so it needs no signal handling.

Mock device nodes (:func:`make_mock_devices`): character devices with NVIDIA's numbers
under a dev root of the node's own: ``nvidia<N>`` 195:N, ``nvidiactl`` 195:255,
``nvidia-modeset`` 195:254, the ``nvidia-uvm`` pair and the MIG capability nodes
``nvidia-caps/nvidia-cap<N>``. The last two get a major at driver load (listed in
/proc/devices as ``nvidia-uvm`` and ``nvidia-caps``); the mock takes
:data:`UVM_MAJOR` and :data:`CAPS_MAJOR`, majors this machine class leaves unused. Opening
them fails (there is no driver): the tests check existence, type and numbers.

Host state the kubelet touches (:class:`HostState`): with ``protectKernelDefaults:
false`` it sets the sysctls of :data:`KUBELET_SYSCTLS` itself (they are saved and put
back); its device-plugin directory is fixed at ``/var/lib/kubelet/device-plugins``
whatever ``--root-dir`` says (its socket and checkpoint are removed when the node
stops); it makes the ``kubepods`` cgroups in every v1 hierarchy (the empty ones are
removed); the CNI bridge is deleted.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from support.control_plane import binary_paths

NODE_BINARIES = ("kubelet", "containerd", "containerd-shim-runc-v2", "ctr", "crictl")
RUNC = "/usr/sbin/runc"
CNI_BIN_DIR = "/usr/lib/cni"
CNI_PLUGINS = ("bridge", "host-local", "loopback")
BUSYBOX = "/bin/busybox"
DEBIAN_PACKAGES = "runc containernetworking-plugins busybox-static buildah"

PAUSE_IMAGE = "localhost/gpulet-pause:test"
TEST_IMAGE = "localhost/gpulet-busybox:test"
# Bump when the recipe below changes: it is part of the images' cache key.
IMAGE_RECIPE = "1"

NVIDIA_MAJOR = 195
CTL_MINOR = 255
MODESET_MINOR = 254
UVM_MAJOR = 511  # /dev/nvidia-uvm 511:0, /dev/nvidia-uvm-tools 511:1
CAPS_MAJOR = 508  # /dev/nvidia-caps/nvidia-cap<N> 508:N

DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
CGROUP_ROOT = Path("/sys/fs/cgroup")
BRIDGE = "gpulet-node0"
POD_SUBNET = "10.232.0.0/24"
LOCK_FILE = Path("/tmp/gpulet-real-node.lock")


class MissingParts(RuntimeError):
    """A part of the real node is missing (not built, not installed)."""


def node_binaries() -> dict[str, Path]:
    """The built binaries and Debian's, by name; :class:`MissingParts` names what is not
    there and how to get it."""
    paths = binary_paths()
    found = {name: paths.get(name, Path("/nonexistent")) for name in NODE_BINARIES}
    missing = [f"{n} ({p})" for n, p in found.items() if not os.access(p, os.X_OK)]
    if missing:
        raise MissingParts(
            f"the real node's binaries are not built: {', '.join(missing)}. "
            "Build them with `scripts/k8s-bins.sh` (make test does this when they are missing)."
        )
    debian = {"runc": Path(RUNC), "busybox": Path(BUSYBOX)}
    debian.update({f"cni-{p}": Path(CNI_BIN_DIR) / p for p in CNI_PLUGINS})
    absent = [f"{n} ({p})" for n, p in debian.items() if not os.access(p, os.X_OK)]
    if shutil.which("buildah") is None:
        absent.append("buildah")
    if Path(BUSYBOX).exists() and not _static(Path(BUSYBOX)):
        absent.append(f"a static {BUSYBOX} (Debian's busybox is dynamic: busybox-static)")
    if absent:
        raise MissingParts(
            f"the real node's Debian parts are missing: {', '.join(absent)}: "
            f"apt-get install {DEBIAN_PACKAGES} (.ci/run installs them)"
        )
    return {**found, **debian}


def _static(binary: Path) -> bool:
    """A 64-bit little-endian ELF without an interpreter (no PT_INTERP program header):
    it runs in an image that holds nothing else."""
    import struct

    data = binary.read_bytes()[: 1 << 16]
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return False
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        at = phoff + i * phentsize
        if at + 4 > len(data):
            return False
        if struct.unpack_from("<I", data, at)[0] == 3:  # PT_INTERP
            return False
    return True


# ---------------------------------------------------------------------- images


def images_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpulet" / "node-images"


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def image_archives() -> dict[str, Path]:
    """Docker archives of :data:`PAUSE_IMAGE` and :data:`TEST_IMAGE`, built once per
    machine (and again when busybox or the recipe changes)."""
    digest = hashlib.sha256(Path(BUSYBOX).read_bytes() + IMAGE_RECIPE.encode()).hexdigest()
    target = images_cache() / digest[:16]
    archives = {PAUSE_IMAGE: target / "pause.tar", TEST_IMAGE: target / "busybox.tar"}
    if all(p.exists() for p in archives.values()):
        return archives
    with file_lock(images_cache() / ".lock"):
        if all(p.exists() for p in archives.values()):
            return archives
        work = Path(tempfile.mkdtemp(prefix="images-", dir=images_cache()))
        try:
            rootfs = work / "rootfs"
            (rootfs / "bin").mkdir(parents=True)
            shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
            for applet in ("sh", "sleep", "ls", "env", "cat"):
                (rootfs / "bin" / applet).symlink_to("busybox")
            storage = [
                f"--root={work / 'storage'}",
                f"--runroot={work / 'run'}",
                "--storage-driver=vfs",
            ]
            built = work / "out"
            built.mkdir()
            for image, name, entrypoint in (
                (PAUSE_IMAGE, "pause.tar", ["/bin/busybox", "sleep", "2147483647"]),
                (TEST_IMAGE, "busybox.tar", ["/bin/sh"]),
            ):
                ctr = _buildah(*storage, "from", "scratch").strip()
                _buildah(*storage, "copy", ctr, str(rootfs), "/")
                _buildah(*storage, "config", f"--entrypoint={json.dumps(entrypoint)}", ctr)
                _buildah(*storage, "commit", "-q", ctr, image)
                _buildah(*storage, "push", "-q", image, f"docker-archive:{built / name}:{image}")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            built.rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return archives


def _buildah(*args: str) -> str:
    proc = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"buildah {' '.join(args)} failed: {proc.stderr[-2000:]}")
    return proc.stdout


# ---------------------------------------------------------------------- mock devices


def make_mock_devices(dev_root: Path, gpus: int = 8, caps: int = 2) -> None:
    """NVIDIA's character devices under ``dev_root`` (see the module's docstring)."""
    nodes = {f"nvidia{i}": (NVIDIA_MAJOR, i) for i in range(gpus)}
    nodes["nvidiactl"] = (NVIDIA_MAJOR, CTL_MINOR)
    nodes["nvidia-modeset"] = (NVIDIA_MAJOR, MODESET_MINOR)
    nodes["nvidia-uvm"] = (UVM_MAJOR, 0)
    nodes["nvidia-uvm-tools"] = (UVM_MAJOR, 1)
    nodes.update({f"nvidia-caps/nvidia-cap{i}": (CAPS_MAJOR, i) for i in range(1, caps + 1)})
    for name, (major, minor) in nodes.items():
        path = dev_root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(path, 0o666)


# ---------------------------------------------------------------------- host state


def node_ip() -> str:
    """This machine's first global IPv4 address: the kubelet refuses a loopback one."""
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "scope", "global"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    raise MissingParts("no global IPv4 address on this machine: the kubelet needs a node IP")


class HostState:
    """What the kubelet changes outside its root, saved before it starts and put back."""

    def __init__(self) -> None:
        self.sysctls: dict[str, str] = {}
        self.had_var_lib_kubelet = Path("/var/lib/kubelet").exists()

    def save(self) -> None:
        for name in KUBELET_SYSCTLS:
            with suppress(OSError):
                self.sysctls[name] = (Path("/proc/sys") / name).read_text().strip()
        clear_device_plugin_dir()

    def restore(self) -> None:
        for name, value in self.sysctls.items():
            with suppress(OSError):
                (Path("/proc/sys") / name).write_text(value + "\n")
        clear_device_plugin_dir()
        if not self.had_var_lib_kubelet:
            shutil.rmtree("/var/lib/kubelet", ignore_errors=True)
        remove_kubepods_cgroups()
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)


def clear_device_plugin_dir() -> None:
    """The kubelet's socket and device checkpoint in its fixed directory (a stale
    checkpoint would give the next node's kubelet another node's pods)."""
    if not DEVICE_PLUGIN_DIR.is_dir():
        return
    for entry in DEVICE_PLUGIN_DIR.iterdir():
        with suppress(OSError):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def remove_kubepods_cgroups() -> None:
    """The empty ``kubepods`` cgroups the kubelet made, deepest first (a cgroup that
    still has a process stays, and says so by refusing the rmdir)."""
    if not CGROUP_ROOT.is_dir():
        return
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / "kubepods"
        if not top.is_dir():
            continue
        for dirpath, _dirnames, _files in sorted(os.walk(top), key=lambda w: -len(w[0])):
            with suppress(OSError):
                os.rmdir(dirpath)


def unmount_under(root: Path) -> None:
    """Unmount everything mounted under ``root`` (overlay rootfs, netns, shm), deepest
    first, lazily: containerd leaves them when it stops."""
    prefix = str(root.resolve()) + "/"
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                mounts.append(point)
    for point in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


# ---------------------------------------------------------------------- configuration


def containerd_config(root: Path, cdi_dir: Path) -> str:
    """containerd 2.x, config version 3: every path under ``root``; see docs/testing.md
    for why each setting is there."""
    return f"""version = 3
root = "{root}/root"
state = "{root}/state"

[grpc]
  address = "{root}/containerd.sock"

[ttrpc]
  address = "{root}/containerd.sock.ttrpc"

[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"

[plugins."io.containerd.shim.v1.manager"]
  socket_dir = "{root}/s"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins."io.containerd.cri.v1.runtime"]
  cdi_spec_dirs = ["{cdi_dir}"]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        Root = "{root}/runc"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{CNI_BIN_DIR}"]
    conf_dir = "{root}/cni/net.d"
"""


def cni_conflist(root: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": "gpulet-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET}]],
                    "dataDir": str(root / "cni" / "ipam"),
                },
            }
        ],
    }


def kubelet_config(
    root: Path, *, ip: str, port: int, healthz_port: int, ca_file: Path
) -> dict[str, Any]:
    """The KubeletConfiguration; see docs/testing.md for why each setting is there."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "protectKernelDefaults": False,
        "failSwapOn": False,
        "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": f"unix://{root}/containerd.sock",
        "podLogsDir": str(root / "pod-logs"),
        "volumePluginDir": str(root / "volume-plugins"),
        "address": ip,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "Webhook"},
        # Changes (a device plugin's capacity) reach the Node within a second.
        "nodeStatusUpdateFrequency": "1s",
        # Never collect the test images (they cannot be pulled again).
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "serializeImagePulls": False,
        "registerNode": True,
    }
