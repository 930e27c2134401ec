"""Choosing and opening the NVML backend named in the settings.

Why a loader
------------
Every service starts the same way: read :class:`~gpulet_common.settings.NvmlSettings`,
get an :class:`~gpulet_common.nvml.adapter.NvmlAdapter` or a reason why there is none.
A node without a GPU driver (a laptop, CI, a mis-scheduled pod) must not crash the
service: it runs *degraded*, publishes the reason, and the reason tells the operator
how to get a working setup without a GPU (``--nvml mock[:scenario]``).

Backends: ``nvml`` is the real library through ``pynvml``; ``mock`` is the in-repo
:mod:`gpulet_common.mock_nvml` driven by a scenario; ``auto`` is ``nvml`` when it
loads and degraded otherwise -- never the mock, so production never silently reports
fake GPUs.

The real backend loads the library named by ``nvml.library`` itself (``ctypes``)
before pynvml would: pynvml only knows the default name, and a host must be able to
be *made* driverless -- a path that does not exist is exactly "no NVML here", whatever
the host has. pynvml keeps one library per process; once loaded, it stays.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from typing import Literal

from gpulet_common.logutil import RateLimitedLog
from gpulet_common.nvml.adapter import NvmlAdapter
from gpulet_common.nvml.errors import NVML_ERROR_DRIVER_NOT_LOADED, NvmlUnavailable
from gpulet_common.settings.nvml import NvmlSettings

log = logging.getLogger("gpulet.nvml")
_degraded_log = RateLimitedLog(log, per_minute=2)

MOCK_HINT = (
    "to run without a GPU, start with --nvml mock[:scenario] (e.g. --nvml mock:dgx-h100; "
    "`gpulet mock scenarios` lists the scenarios)"
)


def parse_nvml_flag(value: str) -> tuple[Literal["auto", "nvml", "mock"], str | None]:
    """``--nvml`` flag value to (backend, scenario): ``mock:t4`` gives ("mock", "t4").

    Raises ValueError for an unknown backend or a scenario given to a real backend.
    """
    backend, sep, scenario = value.partition(":")
    backend = backend.strip().lower()
    if backend == "mock":
        return "mock", (scenario.strip() or None) if sep else None
    if backend in ("auto", "nvml"):
        if sep:
            raise ValueError(f"--nvml {value!r}: only the mock backend takes a scenario")
        return ("auto" if backend == "auto" else "nvml"), None
    raise ValueError(f"--nvml {value!r}: expected auto, nvml or mock[:scenario]")


def open_mock(scenario: str, latency: str | None = None) -> NvmlAdapter:
    """An initialised adapter over a fresh mock NVML playing ``scenario``.

    ``latency`` names a per-call latency profile (``none``, ``h100``); None or
    ``scenario`` keeps the scenario's own.

    Raises :class:`gpulet_common.mock_nvml.ScenarioError` for a bad scenario: that is
    a configuration error to fix, not a reason to run degraded.
    """
    from gpulet_common.mock_nvml import MockNvml

    profile = None if latency in (None, "scenario") else latency
    adapter = NvmlAdapter(MockNvml(scenario, latency=profile), backend="mock")
    adapter.init()
    return adapter


def open_nvml(settings: NvmlSettings) -> tuple[NvmlAdapter | None, str | None]:
    """(adapter, None) when NVML works, (None, reason) when the service must run degraded."""
    adapter, reason, _ = open_nvml_waiting(settings)
    return adapter, reason


def open_nvml_waiting(settings: NvmlSettings) -> tuple[NvmlAdapter | None, str | None, bool]:
    """:func:`open_nvml`, and whether NVML is *expected* here but not up yet: the
    backend ``nvml`` or ``mock`` was asked for, or the library loaded but its driver
    is not (``DRIVER_NOT_LOADED``, a node still booting). A service then says it is
    not ready, with the reason, until NVML starts; ``auto`` on a host without the
    library is a node without GPUs, and runs degraded (ready)."""
    if settings.backend == "mock":
        try:
            return open_mock(settings.scenario, settings.mock_latency), None, False
        except NvmlUnavailable as exc:
            return None, _degraded(settings, exc.reason), True
    try:
        pynvml = importlib.import_module("pynvml")
    except ImportError as exc:
        reason = f"the NVML Python bindings (nvidia-ml-py) are not installed: {exc}"
        return None, _degraded(settings, reason), settings.backend == "nvml"
    try:
        library = ctypes.CDLL(settings.library)
    except OSError as exc:
        reason = (
            f"NVML library not found ({settings.library} could not be loaded: {exc}; no "
            "NVIDIA driver on this host, or the container was not started with the NVIDIA "
            "runtime)"
        )
        return None, _degraded(settings, reason), settings.backend == "nvml"
    if getattr(pynvml, "nvmlLib", None) is None:
        # Hand pynvml the library we loaded, so that it does not search for its default.
        setattr(pynvml, "nvmlLib", library)  # noqa: B010 - untyped module attribute
    adapter = NvmlAdapter(pynvml, backend="nvml")
    try:
        adapter.init()
    except NvmlUnavailable as exc:
        waiting = settings.backend == "nvml" or exc.code == NVML_ERROR_DRIVER_NOT_LOADED
        return None, _degraded(settings, exc.reason), waiting
    return adapter, None, False


def _degraded(settings: NvmlSettings, reason: str) -> str:
    full = f"NVML unavailable: {reason}"
    if settings.backend != "mock":
        full += f"; {MOCK_HINT}"
    if settings.backend == "nvml":
        full = f"backend 'nvml' requested but {full}"
    # Once per try, and the tries go on while the service runs: bounded.
    _degraded_log.warning("%s", full)
    return full
