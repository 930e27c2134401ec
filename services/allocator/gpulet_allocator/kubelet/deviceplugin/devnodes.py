"""Device specs for NVIDIA device files, limited to those that exist on the node.

Why
---
A ``DeviceSpec`` whose host file is missing makes the container runtime fail the
container, so a spec is only handed out for a file that exists: ``/dev/nvidiaN`` of
each allocated GPU plus the control files (``nvidiactl``, ``nvidia-uvm``,
``nvidia-uvm-tools``, ``nvidia-modeset``) that this driver created. The modeset and
uvm-tools files are often absent, which is why NVIDIA checks them one by one too.

``dev_root`` is where the files are looked up (``/host/dev`` when the plugin runs in a
container with the host's /dev mounted there, a tmp dir in tests); ``host_dev`` is
what kubelet must be told (the host's ``/dev``); ``container_dev`` is where the files
appear inside the container (``/dev``). Only a node whose device files live elsewhere
than the host's /dev has ``host_dev`` != ``container_dev``: the mock dev root of the
real-node tests (tests/support/node.py), whose ``<root>/nvidia3`` must still be
``/dev/nvidia3`` in the container.

A MIG device also needs the capability nodes of its GPU instance and compute
instance: the driver names them in ``<capabilities>/gpu<minor>/mig/gi<g>/access`` and
``.../gi<g>/ci<c>/access`` (``DeviceFileMinor: <n>`` of ``nvidia-caps/nvidia-cap<n>``),
where ``/proc/driver/nvidia/capabilities`` exists (``capabilities``, injectable for
tests). A file that is missing, unreadable or malformed gives no spec.

Each answer is remembered for ``recheck_s`` (1 s by default): a stat per file per
Allocate was 7 % of the plugin's CPU under a burst of calls, while the files only
appear or vanish when the driver is (re)loaded or ``nvidia-modprobe`` creates the uvm
files, and a second's delay in noticing that is harmless.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Final

from gpulet_allocator.protocol import DeviceSpec

CONTROL_DEVICES: Final = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")


class DeviceNodes:
    def __init__(
        self,
        dev_root: str | Path = "/dev",
        host_dev: str = "/dev",
        permissions: str = "rw",
        container_dev: str | None = None,
        *,
        recheck_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        capabilities: str | Path = "/proc/driver/nvidia/capabilities",
    ) -> None:
        self.capabilities = Path(capabilities)
        self.dev_root = Path(dev_root)
        self.host_dev = PurePosixPath(host_dev)
        # None: the same as host_dev (the usual node).
        self.container_dev = PurePosixPath(host_dev if container_dev is None else container_dev)
        self.permissions = permissions
        self._recheck_s = recheck_s
        self._clock = clock
        # relative name -> (exists, when it was looked at)
        self._seen: dict[str, tuple[bool, float]] = {}
        self._specs: dict[str, DeviceSpec] = {}

    def _exists(self, relative: str) -> bool:
        now = self._clock()
        seen = self._seen.get(relative)
        if seen is not None and now - seen[1] < self._recheck_s:
            return seen[0]
        exists = os.path.exists(os.path.join(self.dev_root, relative))
        if len(self._seen) > 4096:
            # Names come from the allocator's answers; never let them grow without end.
            self._seen.clear()
        self._seen[relative] = (exists, now)
        return exists

    def _spec(self, name: str) -> DeviceSpec | None:
        if not self._exists(name):
            return None
        spec = self._specs.get(name)
        if spec is None:
            spec = DeviceSpec(
                container_path=str(self.container_dev / name),
                host_path=str(self.host_dev / name),
                permissions=self.permissions,
            )
            # Only nvidiaN and the control files: bounded by the node's GPUs.
            self._specs[name] = spec
        return spec

    def control_names(self) -> list[str]:
        """The control files that exist, by name (in :data:`CONTROL_DEVICES` order)."""
        return [name for name in CONTROL_DEVICES if self._exists(name)]

    def control_specs(self) -> list[DeviceSpec]:
        return [s for name in CONTROL_DEVICES if (s := self._spec(name)) is not None]

    def gpu_specs(self, minors: Iterable[int]) -> list[DeviceSpec]:
        return [s for m in sorted(set(minors)) if (s := self._spec(f"nvidia{m}")) is not None]

    def specs_for_gpus(self, minors: Iterable[int]) -> list[DeviceSpec]:
        """Everything a container needs to use the given GPUs; empty without GPUs."""
        gpu = self.gpu_specs(minors)
        return [*gpu, *self.control_specs()] if gpu else []

    def mig_specs(self, minor: int, gi: int, ci: int) -> list[DeviceSpec]:
        """The capability nodes of MIG device gi/ci of GPU ``minor`` that exist."""
        base = self.capabilities / f"gpu{minor}" / "mig" / f"gi{gi}"
        specs: list[DeviceSpec] = []
        for access in (base / "access", base / f"ci{ci}" / "access"):
            cap = _cap_minor(access)
            if cap is not None and (spec := self._spec(f"nvidia-caps/nvidia-cap{cap}")):
                specs.append(spec)
        return specs

    def existing(self, specs: Sequence[DeviceSpec]) -> list[DeviceSpec]:
        """Drop specs under ``host_dev`` whose file is missing; keep others as given."""
        kept: list[DeviceSpec] = []
        for spec in specs:
            host = PurePosixPath(spec.host_path)
            if host.is_relative_to(self.host_dev) and not self._exists(
                str(host.relative_to(self.host_dev))
            ):
                continue
            kept.append(spec)
        return kept


def _cap_minor(path: Path) -> int | None:
    """``DeviceFileMinor: <n>`` of a capability file; None if missing or malformed."""
    try:
        with open(path, "rb") as f:
            text = f.read(4096).decode("ascii", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "DeviceFileMinor" and value.strip().isdigit():
            return int(value.strip())
    return None
