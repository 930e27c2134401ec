"""What the test host has, and how a test makes the host look the way it needs.

A test never depends on what the host happens to have:

* :data:`HIDDEN_DRIVER` is an NVML library path that does not exist. A test of a
  machine *without* NVML sets ``nvml.library`` to it (:func:`without_driver`), and the
  real backend then finds no library on any host, GPU machines included.
* :data:`needs_driver` marks the tests that read the real driver; they run only where
  ``libnvidia-ml.so.1`` loads, and they only read from the GPU.
"""

from __future__ import annotations

import ctypes

import pytest

HIDDEN_DRIVER = "/nonexistent/gpulet-tests/libnvidia-ml.so.1"


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


DRIVER_PRESENT = _driver_present()

needs_driver = pytest.mark.skipif(
    not DRIVER_PRESENT, reason="needs the NVIDIA driver (libnvidia-ml.so.1 does not load here)"
)


def without_driver() -> list[str]:
    """``--set`` overrides that make the real NVML backend find no library."""
    return [f"nvml.library={HIDDEN_DRIVER}"]
