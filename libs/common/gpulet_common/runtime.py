"""What every service receives: settings, the bus, a meter, the status board and NVML.

In ``gpulet run`` all services share one :class:`Runtime`, so one NVML (or one mock
GPU node) serves them all. In sidecar mode each process builds its own. Each service
starts from :class:`RuntimeService`: its name, the runtime, its settings section and
the node, set in one place. NVML's bindings and the mock are imported when NVML is
first opened, so a sidecar whose service never reads GPUs (reporter, allocator, device
plugin) never loads them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import anyio
from opentelemetry import metrics

from gpulet_common.bus import Bus
from gpulet_common.settings import Settings
from gpulet_common.settings.nvml import NvmlSettings
from gpulet_common.telemetry import ComponentState, StatusBoard

if TYPE_CHECKING:
    from gpulet_common.nvml.adapter import NvmlAdapter

log = logging.getLogger("gpulet.nvml")

# Opening NVML again while a service runs degraded without it: first after this long,
# doubling up to the maximum (s); the defaults of nvml.retry_min_s / retry_max_s.
NVML_RETRY_MIN_S = 5.0
NVML_RETRY_MAX_S = 300.0

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class NvmlHandle:
    adapter: NvmlAdapter | None
    # Why there is no adapter: shown in logs, /readyz and the published inventory.
    reason: str | None
    backend: str
    # NVML is expected here but not up yet (the driver is not loaded yet, or the
    # backend nvml or mock was asked for): a service is not ready until it starts.
    waiting: bool = False

    @property
    def state(self) -> ComponentState:
        """A service's state while it has no NVML: not ready while NVML is expected."""
        return "starting" if self.waiting else "degraded"

    @property
    def detail(self) -> str:
        reason = self.reason or "NVML unavailable"
        return f"waiting for NVML (retrying with back-off): {reason}" if self.waiting else reason


class NvmlProvider:
    """Opens NVML once per process, off the event loop, and shares it."""

    def __init__(self, settings: NvmlSettings) -> None:
        self._settings = settings
        self._handle: NvmlHandle | None = None
        self._lock = anyio.Lock()
        self._thread_lock = threading.Lock()
        #: Times NVML was opened (tried), for status and tests.
        self.opens = 0

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

    async def wait_available(
        self, on_retry: Callable[[NvmlHandle], None] | None = None
    ) -> NvmlAdapter:
        """Retry opening NVML with back-off until it works (a driver that loads later).

        The one retry loop of every service that runs degraded without NVML: first after
        ``nvml.retry_min_s``, doubling up to ``nvml.retry_max_s``. Each failed try is
        logged by the loader, rate-limited. ``on_retry`` gets the handle of every
        failed try (the reason may change: library found, driver not loaded yet).
        """
        delay = min(self._settings.retry_min_s, self._settings.retry_max_s)
        tries = 0
        while True:
            await anyio.sleep(delay)
            tries += 1
            handle = await self.get(retry=True)
            if handle.adapter is not None:
                log.info("NVML became available (%s) after %d tries", handle.backend, tries)
                return handle.adapter
            if on_retry is not None:
                on_retry(handle)
            delay = min(delay * 2, self._settings.retry_max_s)

    def _open(self) -> NvmlHandle:
        from gpulet_common.nvml.loader import open_nvml_waiting  # pynvml: only if used

        with self._thread_lock:
            self.opens += 1
            adapter, reason, waiting = open_nvml_waiting(self._settings)
            backend = "none" if adapter is None else adapter.backend
            return NvmlHandle(adapter, reason, backend, waiting)

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
