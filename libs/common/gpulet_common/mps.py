"""Where a GPU's MPS control daemon lives, one fact for the allocator (which runs the
daemons), the device plugin's answers and the DRA plugin's CDI specs (which mount them).

Each GPU that holds shares gets a daemon of its own (``CUDA_VISIBLE_DEVICES`` its UUID)
with ``<root>/<GPU UUID>/pipe`` and ``<root>/<GPU UUID>/log``; a share's container gets
the pipe directory at :data:`CONTAINER_PIPE` (``CUDA_MPS_PIPE_DIRECTORY``) and the log
directory at :data:`CONTAINER_LOG`. An operator's own daemon (``allocator.mps.
pipe_directory``) is mounted at its own path instead, and gpulet runs none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from gpulet_common.settings import Settings

CONTAINER_PIPE: Final = "/tmp/nvidia-mps"
CONTAINER_LOG: Final = "/tmp/nvidia-log"
DEFAULT_ROOT: Final = "/run/gpulet/mps"
CONTROL_BINARY: Final = "nvidia-cuda-mps-control"


def mock_backend(settings: Settings) -> bool:
    return settings.nvml.backend == "mock"


def root(settings: Settings) -> str:
    """The daemons' root directory as configured, or its default."""
    mps = settings.allocator.mps
    if mps.root_directory:
        return mps.root_directory
    if mock_backend(settings):
        return str(Path(settings.state_dir or ".").resolve() / "mps")
    return DEFAULT_ROOT


def managed(settings: Settings) -> bool:
    """Whether gpulet runs the daemons (not when an operator's pipe directory is set)."""
    mps = settings.allocator.mps
    return mps.enabled and mps.daemons and not mps.pipe_directory


def pipe_dir(root_dir: str, gpu_uuid: str) -> str:
    return f"{root_dir}/{gpu_uuid}/pipe"


def log_dir(root_dir: str, gpu_uuid: str) -> str:
    return f"{root_dir}/{gpu_uuid}/log"
