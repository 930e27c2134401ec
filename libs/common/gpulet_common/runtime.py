"""What every service receives: settings, the bus, a meter, the status board and NVML.

In ``gpulet run`` all services share one :class:`Runtime`, so one NVML (or one mock
GPU node) serves them all. In sidecar mode each process builds its own. Each service
starts from :class:`RuntimeService`: its name, the runtime, its settings section and
the node, set in one place.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
from opentelemetry import metrics

from gpulet_common.bus import Bus
from gpulet_common.nvml.adapter import NvmlAdapter
from gpulet_common.nvml.loader import open_nvml
from gpulet_common.settings import Settings
from gpulet_common.settings.nvml import NvmlSettings
from gpulet_common.telemetry import StatusBoard

log = logging.getLogger("gpulet.nvml")

# Opening NVML again while a service runs degraded without it: first after this long,
# doubling up to the maximum (s).
NVML_RETRY_MIN_S = 5.0
NVML_RETRY_MAX_S = 300.0

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class NvmlHandle:
    adapter: NvmlAdapter | None
    # Why there is no adapter: shown in logs, /readyz and the published inventory.
    reason: str | None
    backend: str


class NvmlProvider:
    """Opens NVML once per process, off the event loop, and shares it."""

    def __init__(self, settings: NvmlSettings) -> None:
        self._settings = settings
        self._handle: NvmlHandle | None = None
        self._lock = anyio.Lock()
        self._thread_lock = threading.Lock()

    @classmethod
    def preopened(cls, settings: NvmlSettings, adapter: NvmlAdapter) -> NvmlProvider:
        """A provider over an adapter opened by the caller (tests, embedding)."""
        provider = cls(settings)
        provider._handle = NvmlHandle(adapter, None, adapter.backend)
        return provider

    async def get(self, *, retry: bool = False) -> NvmlHandle:
        """The shared NVML; with ``retry``, try again if it was unavailable."""
        async with self._lock:
            if self._handle is None or (retry and self._handle.adapter is None):
                self._handle = await anyio.to_thread.run_sync(self._open)
            return self._handle

    async def wait_available(self) -> NvmlAdapter:
        """Retry opening NVML with back-off until it works (a driver that loads later).

        The one retry loop of every service that runs degraded without NVML: first after
        ``NVML_RETRY_MIN_S``, doubling up to ``NVML_RETRY_MAX_S``.
        """
        delay = NVML_RETRY_MIN_S
        while True:
            await anyio.sleep(delay)
            handle = await self.get(retry=True)
            if handle.adapter is not None:
                log.info("NVML became available (%s)", handle.backend)
                return handle.adapter
            delay = min(delay * 2, NVML_RETRY_MAX_S)

    def _open(self) -> NvmlHandle:
        with self._thread_lock:
            adapter, reason = open_nvml(self._settings)
            backend = "none" if adapter is None else adapter.backend
            return NvmlHandle(adapter, reason, backend)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None and handle.adapter is not None:
            handle.adapter.shutdown()


@dataclass(slots=True)
class Runtime:
    settings: Settings
    bus: Bus
    status: StatusBoard
    nvml: NvmlProvider
    meter: metrics.Meter = field(default_factory=lambda: metrics.get_meter("gpulet"))

    @property
    def node(self) -> str:
        return self.settings.node_name


class RuntimeService(Generic[S]):
    """The start of every service: its ``name`` (its line on ``/readyz``), the
    :class:`Runtime` it runs in, its section of the settings and the node it serves."""

    name: str

    def __init__(self, runtime: Runtime, settings: S) -> None:
        self._rt = runtime
        self._settings = settings
        self._node = runtime.node
