"""The CDI spec of a prepared claim: what the container gets, written atomically.

One transient spec per claim (``cncf-tags/container-device-interface``), in
``<cdi_dir>/<vendor>-<class>_<claimUID>.json`` (``/var/run/cdi`` by default), kind
``<driver>/gpu`` (``gpu.gpulet.io/gpu``). Each allocated device is a CDI device
``<claimUID>-<device>`` (``…=8f1c…-gpu-3``). A container gets the CDI devices of the
requests it names (kubelet passes each request's IDs), so everything that says which
GPUs a container has goes on the devices' own edits, per request, as NVIDIA's driver
does; the spec-wide edits apply to every container of the claim, whatever request it
names, and carry only what is the same for all.

Each device's edits:

* its device node ``/dev/nvidia<minor>``; a MIG device's parent's and the capability
  nodes of its GPU and compute instance (``/dev/nvidia-caps/nvidia-cap<n>``), where the
  driver has them;
* ``NVIDIA_VISIBLE_DEVICES`` = the GPU (or MIG) UUIDs of the devices that serve the
  same requests, in device order (so r1's container never sees r2's GPU; CDI merges an
  environment variable last-wins, so a container naming several requests of one claim
  sees one request's list, and all their device nodes);
* for a share: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (the share's cores) and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``<ordinal>=<MiB>M`` per shared GPU, the
  ordinal being its place in that ``NVIDIA_VISIBLE_DEVICES``), and the MPS pipe
  directory, mounted, when one is configured: the device plugin's enforcement.

The spec's own edits: ``GPULET_ALLOCATION_ID`` = the claim's allocation in the ledger,
the control device nodes (``nvidiactl``, ``nvidia-uvm``, ``nvidia-uvm-tools``,
``nvidia-modeset``) that exist on the node, and the driver's user space
(``driver_edits``, :mod:`.driverfiles`: read-only mounts of its libraries, binaries,
firmware and sockets, and the ``nvidia-cdi-hook`` hooks).

Writing (:func:`write_spec`): through the one safe writer,
:func:`gpulet_common.safefile.write_atomic` (a temporary file of a random name created
``O_EXCL|O_NOFOLLOW`` in the directory opened ``O_NOFOLLOW``, fsynced, renamed over the
spec, the directory fsynced): a container runtime reading the directory sees the old
spec or the new one, never half of one, and no planted symlink is followed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec

from gpulet_common import mps
from gpulet_common.safefile import write_atomic

# The lowest CDI version with what the spec uses (``hostPath`` of a device node is
# 0.5.0's), as the CDI library's MinimumRequiredVersion picks: a runtime refuses a spec
# newer than it knows, and containerd 1.7 and podman 4.3 know 0.5.0 at most (podman
# 4.3.1 answered "invalid version 0.6.0", tests/image/test_image_cdi.py).
CDI_VERSION: Final = "0.5.0"
CLASS: Final = "gpu"
ALLOCATION_ENV: Final = "GPULET_ALLOCATION_ID"
CONTROL_DEVICES: Final = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
SPEC_MODE: Final = 0o644
#: A CDI directory gpulet has to make: the container runtime reads it (exactly this
#: mode, whatever the umask; one that exists is left as it is).
DIR_MODE: Final = 0o755
JsonObj = dict[str, Any]


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a claim as the decision core reserved it."""

    device: str  # the DRA device name, gpu-<minor>
    uuid: str
    minor: int
    # A share: the cores (percent) and memory (MiB) it was given; None for whole GPUs.
    cores: int | None = None
    memory_mib: int | None = None
    # A MIG device: the host paths of its capability nodes (``/dev/nvidia-caps/…``),
    # added to its device node, the parent's ``/dev/nvidia<minor>``.
    extra_nodes: tuple[str, ...] = ()
    # The claim's requests this device serves: its environment lists the GPUs of the
    # same requests only (a container that names one request sees that request's).
    requests: tuple[str, ...] = ()


def kind(driver: str) -> str:
    return f"{driver}/{CLASS}"


def device_name(claim_uid: str, device: str) -> str:
    return f"{check_uid(claim_uid)}-{device}"


def device_id(driver: str, claim_uid: str, device: str) -> str:
    """The fully qualified CDI device ID kubelet hands to the runtime."""
    return f"{kind(driver)}={device_name(claim_uid, device)}"


_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,62}$")


def check_uid(claim_uid: str) -> str:
    """``claim_uid`` if it is safe in a file name and a CDI device name, else ValueError
    (it comes from kubelet's request: never let it name another path)."""
    if not _UID.fullmatch(claim_uid):
        raise ValueError(f"claim UID {claim_uid[:80]!r} is not a UID")
    return claim_uid


def spec_file(cdi_dir: str | Path, driver: str, claim_uid: str) -> Path:
    return Path(cdi_dir) / f"{driver}-{CLASS}_{check_uid(claim_uid)}.json"


def _groups(devices: Sequence[PreparedDevice]) -> dict[tuple[str, ...], list[PreparedDevice]]:
    """The devices by the requests they serve, in device order."""
    groups: dict[tuple[str, ...], list[PreparedDevice]] = {}
    for d in devices:
        groups.setdefault(d.requests, []).append(d)
    return groups


def _visible_env(
    group: Sequence[PreparedDevice], mps_pipe_directory: str, mps_root: str = ""
) -> tuple[list[str], list[JsonObj]]:
    """The environment (and mounts) of the devices of one request: what a container
    that names this request, and no other, must see."""
    env = ["NVIDIA_VISIBLE_DEVICES=" + ",".join(d.uuid for d in group)]
    mounts: list[JsonObj] = []
    shares = [(i, d) for i, d in enumerate(group) if d.cores is not None or d.memory_mib]
    if shares:
        cores = [d.cores for _, d in shares if d.cores is not None]
        if cores:
            env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={min(cores)}")
        limits = [f"{i}={d.memory_mib}M" for i, d in shares if d.memory_mib]
        if limits:
            env.append("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=" + ",".join(limits))
        if mps_root:
            # The share's GPU's own control daemon (one pipe per container: the first
            # share's GPU when a request holds shares of several).
            uuid = shares[0][1].uuid
            env.append(f"CUDA_MPS_PIPE_DIRECTORY={mps.CONTAINER_PIPE}")
            for host, container in (
                (mps.pipe_dir(mps_root, uuid), mps.CONTAINER_PIPE),
                (mps.log_dir(mps_root, uuid), mps.CONTAINER_LOG),
            ):
                mounts.append(
                    {"hostPath": host, "containerPath": container, "options": ["rbind", "rw"]}
                )
        elif mps_pipe_directory:
            env.append(f"CUDA_MPS_PIPE_DIRECTORY={mps_pipe_directory}")
            mounts.append(
                {
                    "hostPath": mps_pipe_directory,
                    "containerPath": mps_pipe_directory,
                    "options": ["rbind", "rw"],
                }
            )
    return env, mounts


def build_spec(
    driver: str,
    claim_uid: str,
    allocation: str,
    devices: Sequence[PreparedDevice],
    *,
    dev_root: str | Path = "/dev",
    host_dev: str = "/dev",
    mps_pipe_directory: str = "",
    mps_root: str = "",
    control: Sequence[str] | None = None,
    driver_edits: JsonObj | None = None,
    container_dev: str | None = None,
) -> JsonObj:
    """The spec's JSON document; control nodes only where ``dev_root`` has them.

    A device node's ``hostPath`` is under ``host_dev``, its ``path`` in the container
    the same name under ``container_dev`` (None: ``host_dev``, the usual node; another
    only where the node's device files live elsewhere, as a mock dev root). A MIG
    device's ``extra_nodes`` are host paths: one under ``host_dev`` is mapped the same way.

    ``control``: the names of :data:`CONTROL_DEVICES` known to exist (the caller's
    cached look-up, as the DRA plugin's); None: looked up in ``dev_root`` now."""
    if control is None:
        root = Path(dev_root)
        control = [name for name in CONTROL_DEVICES if (root / name).exists()]
    inside = host_dev if container_dev is None else container_dev
    nodes = [_node(f"{host_dev}/{name}", host_dev, inside) for name in control]
    edits: JsonObj = {}
    if allocation:  # a claim of admin access only owns nothing: no allocation to name
        edits["env"] = [f"{ALLOCATION_ENV}={allocation}"]
    if nodes:
        edits["deviceNodes"] = nodes
    for key in ("mounts", "hooks"):
        if (driver_edits or {}).get(key):
            edits[key] = list((driver_edits or {})[key])
    out: list[JsonObj] = []
    for group in _groups(devices).values():
        env, mounts = _visible_env(group, mps_pipe_directory, mps_root)
        for d in group:
            device_edits: JsonObj = {
                "env": env,
                "deviceNodes": [
                    _node(path, host_dev, inside)
                    for path in (f"{host_dev}/nvidia{d.minor}", *d.extra_nodes)
                ],
            }
            if mounts:
                device_edits["mounts"] = mounts
            out.append({"name": device_name(claim_uid, d.device), "containerEdits": device_edits})
    order = {device_name(claim_uid, d.device): i for i, d in enumerate(devices)}
    out.sort(key=lambda body: order[body["name"]])
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind(driver),
        "devices": out,
        "containerEdits": edits,
    }


def _node(host_path: str, host_dev: str, container_dev: str) -> JsonObj:
    """A CDI device node: ``host_path``, seen at the same name under ``container_dev``."""
    path = host_path
    if container_dev != host_dev and host_path.startswith(host_dev.rstrip("/") + "/"):
        path = container_dev.rstrip("/") + host_path[len(host_dev.rstrip("/")) :]
    return {"path": path, "hostPath": host_path, "permissions": "rw"}


def write_spec(cdi_dir: str | Path, driver: str, claim_uid: str, spec: JsonObj) -> Path:
    path = spec_file(cdi_dir, driver, claim_uid)
    # As json.dumps(spec, indent=2, sort_keys=True) wrote it (non-ASCII as UTF-8, not
    # \u escapes), 15 times faster: this is on Prepare's path.
    data = msgspec.json.format(msgspec.json.encode(spec, order="sorted"), indent=2) + b"\n"
    write_atomic(path, data, mode=SPEC_MODE, dir_mode=DIR_MODE)
    return path


def remove_spec(cdi_dir: str | Path, driver: str, claim_uid: str) -> bool:
    """Remove the claim's spec; False when there was none. Raises other OSErrors."""
    path = spec_file(cdi_dir, driver, claim_uid)
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        os.unlink(path.name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    else:
        os.fsync(dir_fd)
        return True
    finally:
        os.close(dir_fd)
