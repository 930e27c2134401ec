"""The driver's user space for the CDI specs: found once per driver version, kept.

:class:`DriverFilesKeeper` follows the node read model: when the inventory names a
driver version it has not looked for yet, it runs
:func:`gpulet_common.dra.driverfiles.discover` in a worker thread (file I/O, a few
milliseconds) and hands the edits to the DRA plugin (``DraPlugin.driver_edits``), which
adds them to every CDI spec it writes from then on. The plugin serves kubelet once the
first look is done (or :data:`FIRST_WAIT_S` passed without an inventory); a later
driver version is looked for in the background, Prepare never waits for it.

The driver root (``[dra] driver_root``): empty means ``/`` with the real NVML, and with
the mock NVML a mock driver root made under the state directory
(:mod:`gpulet_common.mock_nvml.driver_root`), so the mock's specs name files that
exist. ``driver_root_seen`` is where this process sees that root, when it is not where
the host has it; ``cdi_hook_path`` the host path of ``nvidia-cdi-hook``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc

from gpulet_common.dra import driverfiles
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.mock_nvml import driver_root as mock_root
from gpulet_common.nodeview import NodeChange, NodeView
from gpulet_common.settings.dra import DraSettings

log = logging.getLogger("gpulet.dra.driver")

FIRST_WAIT_S = 10.0


def driver_root(settings: DraSettings, *, mock: bool, state_dir: str) -> str:
    if settings.driver_root:
        return settings.driver_root
    if mock:
        return str(Path(state_dir or ".").resolve() / "mock-driver-root")
    return "/"


class DriverFilesKeeper:
    def __init__(
        self,
        view: NodeView,
        settings: DraSettings,
        apply: Callable[[driverfiles.DriverFiles], None],
        *,
        mock: bool = False,
        state_dir: str = "",
    ) -> None:
        self._view = view
        self._settings = settings
        self._apply = apply
        self._mock = mock
        self.root = driver_root(settings, mock=mock, state_dir=state_dir)
        self.files: driverfiles.DriverFiles | None = None
        self._wanted = anyio.Event()
        self._log = RateLimitedLog(log, per_minute=2)

    def _version(self) -> str:
        inventory = self._view.inventory
        return (inventory.driver_version or "") if inventory is not None else ""

    def _on_change(self, _change: NodeChange) -> None:
        version = self._version()
        if version and (self.files is None or self.files.version != version):
            self._wanted.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Started once the first driver version was looked for, or after
        :data:`FIRST_WAIT_S` without an inventory (kubelet must not wait for ever on a
        plugin that waits for the collector); the first Prepare then has the files."""
        if not self._settings.driver_files:
            task_status.started()
            return
        self._view.listen(self._on_change)
        self._on_change(NodeChange(inventory=True))
        started = False
        while True:
            if not started:
                with anyio.move_on_after(FIRST_WAIT_S):
                    await self._wanted.wait()
                if not self._wanted.is_set():
                    task_status.started()
                    started = True
            await self._wanted.wait()
            self._wanted = anyio.Event()
            version = self._version()
            files = await anyio.to_thread.run_sync(self._discover, version)
            self.files = files
            self._apply(files)
            if files.missing:
                self._log.warning(
                    "driver %s under %s: not found: %s (containers get no %s)",
                    version,
                    self.root,
                    ", ".join(files.missing),
                    ", ".join(files.missing),
                )
            if not files.hook and files.libraries:
                self._log.warning(
                    "no nvidia-cdi-hook under %s nor dra.cdi_hook_path: CDI specs carry the "
                    "driver's libraries without the ldcache update (docs/dra.md)",
                    self.root,
                )
            if not started:
                task_status.started()
                started = True

    def nvidia_smi(self, files: driverfiles.DriverFiles) -> str:
        """The driver's nvidia-smi as this process runs it (under where it sees the
        root), or "" when the driver has none."""
        for path in files.binaries:
            if path.rsplit("/", 1)[-1] == "nvidia-smi":
                seen = self._settings.driver_root_seen or self.root
                return str(Path(seen) / path.lstrip("/"))
        return ""

    def _discover(self, version: str) -> driverfiles.DriverFiles:
        s = self._settings
        if self._mock and not s.driver_root:
            mock_root.make(Path(self.root), version)
        return driverfiles.discover(
            self.root, version, seen=s.driver_root_seen, hook=s.cdi_hook_path
        )
