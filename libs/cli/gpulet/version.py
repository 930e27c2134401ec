"""``gpulet --version``: what an operator puts in a bug report or checks in a rollout.

Three facts, one per line: gpulet's version, the schema version of its NATS messages,
and the NVML driver version when this host has a driver.

The driver is asked through ``ctypes`` directly (not pynvml, not the adapter): when
the library cannot be loaded, nothing is initialised and the answer is "none". When it
loads, ``nvmlInit`` runs in a daemon thread that is waited on for
:data:`DRIVER_TIMEOUT_S` at most, so a wedged driver makes ``--version`` say so instead
of hanging.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

DRIVER_TIMEOUT_S = 3.0
_NVML_SUCCESS = 0
_VERSION_BUFFER = 80  # NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE


def _ask_driver(library: str, answer: list[str]) -> None:
    try:
        lib = ctypes.CDLL(library)
    except OSError:
        answer.append(f"none ({library} not found)")
        return
    try:
        init = getattr(lib, "nvmlInit_v2", None) or lib.nvmlInit
    except AttributeError:
        answer.append(f"unknown ({library} has no nvmlInit)")
        return
    code = init()
    if code != _NVML_SUCCESS:
        answer.append(f"unknown (nvmlInit returned {code})")
        return
    try:
        buffer = ctypes.create_string_buffer(_VERSION_BUFFER)
        code = lib.nvmlSystemGetDriverVersion(buffer, ctypes.c_uint(_VERSION_BUFFER))
        if code == _NVML_SUCCESS:
            answer.append(buffer.value.decode(errors="replace"))
        else:
            answer.append(f"unknown (nvmlSystemGetDriverVersion returned {code})")
    finally:
        lib.nvmlShutdown()


def driver_version(
    library: str = "libnvidia-ml.so.1", *, timeout_s: float = DRIVER_TIMEOUT_S
) -> str:
    """The NVML driver version, or ``none (...)``/``unknown (...)`` saying why not."""
    answer: list[str] = []
    thread = threading.Thread(target=_ask_driver, args=(library, answer), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not answer:
        return f"unknown (NVML did not answer within {timeout_s:g}s)"
    return answer[0]


def version_text(library: str = "libnvidia-ml.so.1") -> str:
    from gpulet_common import __version__
    from gpulet_common.messages import SCHEMA_VERSION

    return (
        f"gpulet {__version__}\n"
        f"message schema {SCHEMA_VERSION}\n"
        f"NVML driver {driver_version(library)}\n"
    )


class VersionAction(argparse.Action):
    """``--version``: print :func:`version_text` and exit 0 (computed only when asked)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print gpulet's, the message schema's and the driver's version")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any, **_kwargs: Any) -> None:
        # The library the nvml backend would load (nvml.library), when the environment
        # names one; --version reads no config file.
        library = os.environ.get("GPULET_NVML__LIBRARY") or "libnvidia-ml.so.1"
        sys.stdout.write(version_text(library))
        parser.exit(0)
