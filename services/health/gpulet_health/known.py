"""The GPUs this node is expected to have, remembered in the health service's state dir.

Why
---
A GPU that is lost or gone while the agent is down must not just drop out of every
view: the health service raises ``gpu_missing`` for it at start (:mod:`.rules`). For
that it must know which GPUs the node had. The ``gpu_health`` KV bucket knows them
(every GPU's state carries its :class:`~gpulet_common.messages.GpuInfo`), but JetStream
may be gone (a fresh NATS, an external one without persistence); this file, in the
state dir next to the event buffer, is the second memory.

File
----
``<state_dir>/health/gpus.json``: JSON ``{"version": 1, "node": ..., "gpus": [GpuInfo...]}``
(no topology), written atomically (:func:`gpulet_common.statefile.write_atomic`)
whenever the set or a GPU's identity changes. A GPU stays in it until the operator
forgets it (clearing its ``missing``/``removed`` condition while it is not present).
A corrupt file is kept under a unique name and reported; the KV bucket still counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import msgspec

from gpulet_common.messages import GpuInfo
from gpulet_common.statefile import quarantine, write_atomic
from gpulet_common.untrusted import json_typed

log = logging.getLogger("gpulet.health.known")

VERSION = 1


class KnownGpusFile(msgspec.Struct, frozen=True, kw_only=True):
    version: int = VERSION
    node: str = ""
    gpus: list[GpuInfo] = []


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(KnownGpusFile)


@dataclass(frozen=True, slots=True)
class LoadedGpus:
    gpus: list[GpuInfo]
    detail: str


class KnownGpus:
    def __init__(self, path: Path, node: str) -> None:
        self.path = path
        self._node = node
        self._written: list[GpuInfo] | None = None
        self.writes = 0

    def load(self) -> LoadedGpus:
        """The GPUs a previous run knew; never raises (blocking: call off the loop)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return LoadedGpus([], f"{self.path} does not exist yet")
        except OSError as exc:
            return LoadedGpus([], f"cannot read {self.path}: {exc}")
        try:
            stored = self._decode(data)
        except ValueError as exc:
            try:
                copy = quarantine(self.path)
                kept = f"kept as {copy.name}"
            except OSError as copy_exc:
                kept = f"could not keep a copy: {copy_exc}"
            return LoadedGpus([], f"{self.path} is unusable ({exc}); {kept}")
        self._written = _plain(stored.gpus)
        return LoadedGpus(list(stored.gpus), f"{len(stored.gpus)} GPU(s) from {self.path}")

    def _decode(self, data: bytes) -> KnownGpusFile:
        """The file's content; ValueError for anything this build cannot use."""
        try:
            stored = json_typed(data, _decoder, what="known GPUs")
        except ValueError as exc:  # UntrustedDocumentError: bad, deep or huge
            raise ValueError(str(exc)) from exc
        if stored.version != VERSION:
            raise ValueError(f"version {stored.version}, this build reads {VERSION}")
        if stored.node and stored.node != self._node:
            raise ValueError(f"it is node {stored.node!r}'s, not {self._node!r}'s")
        return stored

    def changed(self, gpus: list[GpuInfo]) -> bool:
        return _plain(gpus) != self._written

    def save(self, gpus: list[GpuInfo]) -> None:
        """Write the list if it changed; raises OSError (blocking: call off the loop)."""
        plain = _plain(gpus)
        if plain == self._written:
            return
        write_atomic(self.path, _encoder.encode(KnownGpusFile(node=self._node, gpus=plain)))
        self._written = plain
        self.writes += 1


def _plain(gpus: list[GpuInfo]) -> list[GpuInfo]:
    return [msgspec.structs.replace(g, topology=[]) if g.topology else g for g in gpus]
