"""Where the plugin learns the GPUs of the node and their health.

Why
---
``ListAndWatch`` must send the full device list at once and again after every change.
Kubelet only ever wants the *latest* list, so the source is level-triggered: a
versioned snapshot plus "wait until the version moves past N". Slow watchers then
skip intermediate states instead of queueing them, and any number of watchers (one
per resource and kubelet connection) share one source without per-watcher buffers.

Layers
------
:class:`DeviceListSource` is what :mod:`.server` consumes. :class:`DeviceList` is
the in-process implementation: the plugin service, following the node's inventory and
GPU health through a :class:`~gpulet_common.nodeview.NodeView`, calls
:meth:`DeviceList.publish` with the whole list on every change.
Recovery is a first-class change: a GPU marked healthy again is re-advertised, which
the reference plugins never do (NVIDIA #234, #1014).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import anyio
import msgspec

from gpulet_allocator.kubelet.deviceplugin.resources import PluginGpu


class DeviceSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    gpus: tuple[PluginGpu, ...]


class DeviceListSource(Protocol):
    def snapshot(self) -> DeviceSnapshot:
        """The current GPUs; never blocks."""
        ...

    async def wait_for_change(self, after_version: int) -> DeviceSnapshot:
        """Return the first snapshot whose version is greater than ``after_version``."""
        ...


class DeviceList:
    """In-memory :class:`DeviceListSource` fed by :meth:`publish` (the whole list).

    Must be used from the event loop thread (publishers and watchers alike).
    """

    def __init__(self, gpus: Iterable[PluginGpu] = ()) -> None:
        self._snapshot = DeviceSnapshot(version=0, gpus=tuple(gpus))
        # Created lazily: an anyio Event needs a running event loop.
        self._changed: anyio.Event | None = None

    def snapshot(self) -> DeviceSnapshot:
        return self._snapshot

    async def wait_for_change(self, after_version: int) -> DeviceSnapshot:
        while self._snapshot.version <= after_version:
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()
        return self._snapshot

    def publish(self, gpus: Iterable[PluginGpu]) -> bool:
        """Replace the GPU list; returns whether anything changed."""
        new = tuple(gpus)
        if new == self._snapshot.gpus:
            return False
        self._snapshot = DeviceSnapshot(version=self._snapshot.version + 1, gpus=new)
        if self._changed is not None:
            # Swap before set: a watcher woken now that loops again must wait on a
            # fresh event, not spin on the one already set.
            changed, self._changed = self._changed, None
            changed.set()
        return True
