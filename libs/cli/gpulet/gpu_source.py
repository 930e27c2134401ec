"""Whose GPUs a state directory describes, and what ``gpulet run`` does when it changes.

Why
---
Everything in a state directory is about one set of GPUs: the GPUs the health service
expects (``health/gpus.json``, and the ``gpu_health`` KV bucket in the embedded
nats-server's store, ``nats/``), the allocator's checkpoint, the reporter's files. Run
another mock scenario on the same directory (``make run`` after ``make run
ARGS="--nvml mock:a100-mig-mixed"``) and the old scenario's GPUs would come back as
missing, unhealthy GPUs of this one.

What it does
------------
``<state_dir>/nvml-source`` names the source of the GPUs the directory describes:
``mock:<scenario>`` or ``nvml`` (``--nvml auto`` decides only once NVML starts, so it
neither checks nor records). When ``gpulet run`` with its own nats-server starts on a
directory that names another source, the directory's content is moved, whole, into
``<state_dir>/previous-<source>/`` (replacing an older copy of the same source) and the
run starts clean; :func:`switch_source` returns the line that says so, which the CLI
logs. Nothing is deleted but an older copy of the same source. ``gpulet serve`` (a
sidecar of the DaemonSet, whose NATS is elsewhere) never moves anything: the node's
GPUs do not change scenario.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from gpulet_common.config import ConfigError
from gpulet_common.safefile import write_atomic
from gpulet_common.settings import Settings

SOURCE_FILE = "nvml-source"
PREVIOUS_PREFIX = "previous-"
# Bounds what is read back from the file (it is ours, but a state dir is a hostPath).
MAX_SOURCE_CHARS = 300


def gpu_source(settings: Settings) -> str | None:
    """``mock:<scenario>``, ``nvml``, or None when the backend is decided at run time."""
    backend = settings.nvml.backend
    if backend == "mock":
        return f"mock:{settings.nvml.scenario}"
    if backend == "nvml":
        return "nvml"
    return None


def _describe(source: str) -> str:
    kind, _, scenario = source.partition(":")
    return f"mock scenario {scenario!r}" if kind == "mock" else "the real NVML"


def _token(source: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", source.replace(":", "-"))[:100] or "unknown"


def switch_source(settings: Settings) -> str | None:
    """Record the source of this run's GPUs in the state directory; when it held another
    source's, move that state aside first. The line to log when it did, else None; a
    :class:`ConfigError` when the directory will not let it (a link for the file...)."""
    source = gpu_source(settings)
    if source is None:
        return None
    state = Path(settings.state_dir)
    try:
        return _switch(state, source)
    except OSError as exc:
        raise ConfigError("state_dir", f"cannot record whose GPUs {state} holds: {exc}") from None


def _switch(state: Path, source: str) -> str | None:
    marker = state / SOURCE_FILE
    previous: str | None = None
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        pass
    else:
        with os.fdopen(fd, "rb") as f:
            previous = f.read(MAX_SOURCE_CHARS).decode(errors="replace").strip()
    said = None
    if previous and previous != source:
        aside = state / f"{PREVIOUS_PREFIX}{_token(previous)}"
        if aside.is_symlink() or aside.is_file():
            aside.unlink()
        elif aside.exists():
            shutil.rmtree(aside)
        aside.mkdir()
        for entry in sorted(state.iterdir()):
            if entry.name != aside.name and not entry.name.startswith(PREVIOUS_PREFIX):
                entry.rename(aside / entry.name)
        said = (
            f"the state directory {state} held the GPUs of {_describe(previous)}, this run "
            f"is {_describe(source)}: forgetting those GPUs (their health, NATS store and "
            f"allocations are kept in {aside}); starting clean"
        )
    if previous != source:
        write_atomic(marker, (source + "\n").encode())
    return said
