"""The time-slicing inputs of the allocator: the node label and the configs file.

Two things can change the replicas without a restart (rules:
:mod:`gpulet_allocator.timeslicing`), and both land in the core's
:class:`~gpulet_allocator.decide.timeslice.TimeSlicing`:

* the node label ``sharing.time_slicing.node_label``, watched by
  :class:`~.node_label.NodeLabelFollower` (the Kubernetes I/O lives there alone);
* ``sharing.time_slicing.configs_file`` (a mounted ConfigMap, say): checked every
  ``configs_poll_s`` (size and mtime), read off the event loop, bounded, decoded
  totally into named configs. A file that is missing, too large or does not decode
  keeps the configs in force and says why (``problem``, on ``/readyz``).

On a change that moves the plan, ``on_change`` is called (the service wakes the
device plugin's and the reporter's long polls).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Final

import anyio
import msgspec

from gpulet_allocator.decide.timeslice import TimeSlicing
from gpulet_allocator.service.node_label import NodeLabelFollower
from gpulet_common.logutil import RateLimitedLog
from gpulet_common.runtime import Runtime
from gpulet_common.settings.sharing import TimeSlicingConfig
from gpulet_common.untrusted import json_typed, toml_typed

log = logging.getLogger("gpulet.allocator.sharing")

MAX_FILE_BYTES: Final = 1 << 20
Configs = dict[str, TimeSlicingConfig]
_JSON = msgspec.json.Decoder(Configs)


def decode_configs(data: bytes, path: Path) -> Configs:
    """The named configs of a file's bytes (JSON when it ends in .json, else TOML),
    decoded totally (:mod:`gpulet_common.untrusted`: a 200k-deep TOML array is a
    refusal, not a ``RecursionError``); UntrustedDocumentError (a ValueError) with the
    reason when they do not decode."""
    if path.suffix == ".json":
        return json_typed(data, _JSON, max_bytes=MAX_FILE_BYTES, what="configs")
    return toml_typed(data, Configs, max_bytes=MAX_FILE_BYTES, what="configs")


def _read(path: Path) -> bytes:
    with path.open("rb") as handle:
        return handle.read(MAX_FILE_BYTES + 1)


class SharingInputs:
    """Feeds ``time_slicing`` from the node label and the configs file."""

    def __init__(
        self,
        runtime: Runtime,
        time_slicing: TimeSlicing,
        on_change: Callable[[], None],
        on_problem: Callable[[], None],
    ) -> None:
        # The Node is read with the allocator's kube settings (the handshake's).
        settings = runtime.settings.sharing.time_slicing
        kube, node = runtime.settings.allocator.handshake, runtime.node
        self._settings = settings
        self._time_slicing = time_slicing
        self._on_change = on_change
        self._on_problem = on_problem
        self.label = NodeLabelFollower(
            node,
            settings.node_label,
            kube,
            self._on_label,
            on_problem=on_problem,
            poll_s=settings.configs_poll_s,
        )
        self._path = Path(settings.configs_file).expanduser()
        #: Why the configs file is not in force ("" when it is, or there is none).
        self.file_problem = ""
        self._seen: tuple[int, int] | None = None
        self._log = RateLimitedLog(log, per_minute=4)

    @property
    def problem(self) -> str:
        """Why time-slicing does not do what it is asked ("" when it does)."""
        return self.label.problem or self.file_problem or self._time_slicing.problem

    async def run(self) -> None:
        """Follow the file and the label; returns at once without any config."""
        if not self._settings.enabled:
            return
        async with anyio.create_task_group() as tg:
            if self._settings.configs_file:
                # The file first: the label's config may live there.
                await self.check_file()
                tg.start_soon(self._poll_file)
            tg.start_soon(self.label.run)

    async def _poll_file(self) -> None:
        while True:
            await anyio.sleep(self._settings.configs_poll_s)
            await self.check_file()

    async def check_file(self) -> None:
        """Read the configs file if it changed; hand its configs to the core."""
        path = self._path
        try:
            st = await anyio.Path(path).stat()
            identity = (st.st_size, st.st_mtime_ns)
            if identity == self._seen:
                return
            configs = decode_configs(await anyio.to_thread.run_sync(_read, path), path)
        except (OSError, ValueError) as exc:  # UntrustedDocumentError is a ValueError
            self._set_file_problem(f"time-slicing configs file {path} not used: {exc}")
            return
        self._seen = identity
        self._set_file_problem("")
        said = self._time_slicing.problem
        if self._time_slicing.set_file_configs(configs):
            self._on_change()
        if self._time_slicing.problem != said:
            self._on_problem()

    def _on_label(self, value: str | None) -> None:
        said = self._time_slicing.problem
        if self._time_slicing.select(value):
            self._on_change()
        if self._time_slicing.problem != said:
            self._on_problem()

    def _set_file_problem(self, problem: str) -> None:
        if problem and problem != self.file_problem:
            self._log.warning("%s; keeping the configs in force", problem)
        if problem != self.file_problem:
            self.file_problem = problem
            self._on_problem()
