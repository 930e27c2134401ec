"""Shares that are enforced: an MPS control daemon per GPU that holds shares.

A share's container is told its limits (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``), but they bind only through an MPS server, which
needs the control daemon ``nvidia-cuda-mps-control`` of that GPU. :class:`MpsSupervisor`
runs one per GPU whose ledger card holds shares, whichever adapter made them (the
device plugin's shares and DRA claims' are in the one ledger), so both go one path, and
one per whole GPU that a prepared DRA claim configured for MPS (:meth:`also_want`):

* **start**: ``nvidia-cuda-mps-control -d`` with ``CUDA_VISIBLE_DEVICES=<GPU UUID>``,
  ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY`` under the root
  (:mod:`gpulet_common.mps`; the same paths the CDI specs and Allocate answers mount
  into share containers). The daemon runs detached: a restart of gpulet leaves it (and
  the clients using it) alone, and finds it again by its control pipe;
* **limits**: after a start and whenever the GPU's shares change, its defaults are set
  with the client commands ``set_default_active_thread_percentage <p>`` and
  ``set_default_device_pinned_mem_limit 0 <MiB>M``: the largest share of that GPU, so a
  client without its own variables gets no more than any share holds; each client's own
  share is its environment's;
* **supervision**: every :data:`CHECK_S` a client command ``get_server_list`` asks each
  daemon; one that does not answer is dead: a fault of that GPU's shares
  (:attr:`MpsSupervisor.faults`: the DRA plugin's health stream reports the GPU
  unhealthy, ``/readyz`` says so) until a restart (with back-off) brings it back;
* **stop**: ``quit`` when the GPU's last share goes.

Every command has a deadline (:data:`COMMAND_TIMEOUT_S`); nothing here blocks the event
loop. Without the binary (no driver on this node), nothing is started and the status
says the shares are not enforced.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio

from gpulet_allocator.decide.engine import DeviceState
from gpulet_allocator.protocol import MEMORY_UNIT_MIB
from gpulet_common import mps
from gpulet_common.logutil import RateLimitedLog

log = logging.getLogger("gpulet.allocator.mps")

CHECK_S: Final = 5.0
COMMAND_TIMEOUT_S: Final = 5.0
RESTART_MAX_S: Final = 60.0


@dataclass(frozen=True)
class Limits:
    """A GPU's daemon defaults: the largest share's cores (percent) and memory (MiB)."""

    cores: int
    memory_mib: int


def limits_of(device: DeviceState) -> Limits | None:
    if not device.shares:
        return None
    return Limits(
        cores=max(s.cores for s in device.shares),
        memory_mib=max(s.memory_units for s in device.shares) * MEMORY_UNIT_MIB,
    )


def control_command(binary: str, *, mock: bool) -> list[str] | None:
    """The control binary's argv, or None when it is not there."""
    if binary:
        return [binary]
    if mock:
        return [sys.executable, "-m", "gpulet_common.mock_nvml.mps_control"]
    found = shutil.which(mps.CONTROL_BINARY)
    return [found] if found else None


class MpsSupervisor:
    def __init__(
        self,
        root: str,
        command: Sequence[str] | None,
        devices: Callable[[], list[DeviceState]],
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.root = root
        self._command = list(command) if command else None
        self._devices = devices
        self._on_change = on_change
        #: GPU UUID -> the limits its running daemon was given.
        self.running: dict[str, Limits] = {}
        #: GPU UUID -> why its daemon is not serving its shares (dead, cannot start).
        self.faults: dict[str, str] = {}
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._wake = anyio.Event()
        self._log = RateLimitedLog(log, per_minute=6)
        self._also: Callable[[], Mapping[str, tuple[int, int]]] = dict

    def also_want(self, source: Callable[[], Mapping[str, tuple[int, int]]]) -> None:
        """Daemons for these GPUs too (UUID -> cores %, memory MiB): whole GPUs a DRA
        claim configured for MPS (``GpuConfig`` ``sharing.strategy: MPS``)."""
        self._also = source

    @property
    def problem(self) -> str:
        if self._command is None and self.wanted():
            return "MPS shares are not enforced: no nvidia-cuda-mps-control on this node"
        if self.faults:
            return "MPS control daemon down for " + ", ".join(sorted(self.faults))
        return ""

    def changed(self) -> None:
        """The ledger may have changed: reconcile soon. The directories of a GPU that
        holds shares are made at once (two mkdirs), before a container that mounts them
        can be created from the answer just given."""
        for uuid in self.wanted():
            self._make_dirs(uuid)
        self._wake.set()

    def _make_dirs(self, uuid: str) -> str:
        """Make the GPU's pipe and log directories; the problem, or ""."""
        for path in (mps.pipe_dir(self.root, uuid), mps.log_dir(self.root, uuid)):
            try:
                Path(path).mkdir(parents=True, exist_ok=True, mode=0o755)
            except OSError as exc:
                return f"cannot make {path}: {exc}"
        return ""

    def wanted(self) -> dict[str, Limits]:
        out = {}
        for device in self._devices():
            limits = limits_of(device)
            if limits is not None:
                out[device.uuid] = limits
        for uuid, (cores, memory_mib) in self._also().items():
            out.setdefault(uuid, Limits(cores=cores, memory_mib=memory_mib))
        return out

    def _env(self, uuid: str) -> dict[str, str]:
        return {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": uuid,
            "CUDA_MPS_PIPE_DIRECTORY": mps.pipe_dir(self.root, uuid),
            "CUDA_MPS_LOG_DIRECTORY": mps.log_dir(self.root, uuid),
        }

    async def _run(self, uuid: str, args: Sequence[str], stdin: str = "") -> bool:
        """Run the control binary; True when it exited 0 within the deadline."""
        assert self._command is not None
        try:
            with anyio.fail_after(COMMAND_TIMEOUT_S):
                done = await anyio.run_process(
                    [*self._command, *args],
                    input=stdin.encode(),
                    env=self._env(uuid),
                    check=False,
                )
        except (OSError, TimeoutError) as exc:
            self._log.warning("MPS control of %s: %s", uuid, exc)
            return False
        return done.returncode == 0

    async def run(self) -> None:
        while True:
            await self.reconcile()
            with anyio.move_on_after(CHECK_S):
                await self._wake.wait()
            self._wake = anyio.Event()

    async def reconcile(self) -> None:
        if self._command is None:
            return
        wanted = self.wanted()
        before = dict(self.faults)
        for uuid in sorted(set(self.running) - set(wanted)):
            await self._stop(uuid)
        for uuid in sorted(set(self.faults) - set(wanted)):
            self.faults.pop(uuid, None)
        for uuid, limits in sorted(wanted.items()):
            if uuid in self.running and await self._run(uuid, [], "get_server_list\n"):
                if self.running[uuid] != limits and await self._set(uuid, limits):
                    self.running[uuid] = limits
                continue
            if uuid in self.running:
                del self.running[uuid]
                self.faults[uuid] = "the MPS control daemon stopped answering"
                log.warning(
                    "GPU %s: the MPS control daemon is gone; its shares are unenforced", uuid
                )
            await self._start(uuid, limits)
        if self.faults != before:
            self._on_change()

    async def _start(self, uuid: str, limits: Limits) -> None:
        now = anyio.current_time()
        if now < self._retry_at.get(uuid, 0.0):
            return
        problem = self._make_dirs(uuid)
        if problem:
            self.faults[uuid] = problem
            return
        # A daemon that outlived a gpulet restart answers: adopt it.
        alive = await self._run(uuid, [], "get_server_list\n")
        if (alive or await self._run(uuid, ["-d"])) and await self._set(uuid, limits):
            self.running[uuid] = limits
            self.faults.pop(uuid, None)
            self._failures.pop(uuid, None)
            log.info("GPU %s: MPS control daemon %s", uuid, "adopted" if alive else "started")
            return
        failures = self._failures[uuid] = self._failures.get(uuid, 0) + 1
        self._retry_at[uuid] = now + min(RESTART_MAX_S, 2.0**failures)
        self.faults[uuid] = "the MPS control daemon cannot be started"

    async def _set(self, uuid: str, limits: Limits) -> bool:
        commands = f"set_default_active_thread_percentage {limits.cores}\n"
        if limits.memory_mib > 0:  # 0: no memory limit was asked for
            commands += f"set_default_device_pinned_mem_limit 0 {limits.memory_mib}M\n"
        return await self._run(uuid, [], commands)

    async def _stop(self, uuid: str) -> None:
        await self._run(uuid, [], "quit\n")
        self.running.pop(uuid, None)
        self.faults.pop(uuid, None)
        log.info("GPU %s: its last share is gone; MPS control daemon stopped", uuid)
