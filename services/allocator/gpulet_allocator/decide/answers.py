"""What a container is told: the answer to one grant, from the books.

``NVIDIA_VISIBLE_DEVICES`` (the UUIDs), the allocation's ID (env and annotation), for a
share its MPS limits, and CDI device names when enabled. Each answer sets only the
limit of its own resource (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` for cores,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for memory); a share koord-scheduler decided
carries both, as it accounted them.
"""

from __future__ import annotations

from gpulet_allocator.decide.books import ALLOCATION_ANNOTATION, ALLOCATION_ENV, Books
from gpulet_allocator.decide.engine import ShareAllocation, WholeAllocation
from gpulet_allocator.protocol import MEMORY_UNIT_MIB, ContainerAllocation, Mount
from gpulet_allocator.state.records import Grant
from gpulet_common import mps as mps_paths
from gpulet_common.refusal import Refused
from gpulet_common.settings.allocator import CdiSettings, MpsSettings


class Answers:
    def __init__(
        self, books: Books, mps: MpsSettings, cdi: CdiSettings, *, mps_root: str = ""
    ) -> None:
        self._books = books
        self._mps = mps
        self._cdi = cdi
        # gpulet's per-GPU control daemons (gpulet_common.mps); empty: none.
        self._mps_root = mps_root

    def answer(self, grant: Grant) -> ContainerAllocation:
        alloc = self._books.ledger.get(grant.allocation)
        if alloc is None:
            raise Refused("internal", f"grant {grant.key} has lost its allocation")
        cards = list(alloc.devices) if isinstance(alloc, WholeAllocation) else [alloc.device]
        # A time-slicing replica gives its GPU, as NVIDIA's plugin does.
        gpus = list(dict.fromkeys(self._books.ledger.gpu_of(c) for c in cards))
        envs = {"NVIDIA_VISIBLE_DEVICES": ",".join(gpus), ALLOCATION_ENV: grant.allocation}
        mounts: list[Mount] = []
        if isinstance(alloc, ShareAllocation) and self._mps.enabled:
            if grant.mps_cores:
                # A share koord-scheduler decided: both limits, as it accounted them.
                envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(grant.mps_cores)
                envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={grant.mps_memory_mib}M"
            elif grant.kind == "core":
                envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(alloc.cores)
            elif grant.kind == "memory":
                # One visible device, so it is ordinal 0 inside the container.
                mib = alloc.memory_units * MEMORY_UNIT_MIB
                envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={mib}M"
            if self._mps_root:
                # The GPU's own control daemon (gpulet_allocator.service.mps).
                gpu = gpus[0]
                envs["CUDA_MPS_PIPE_DIRECTORY"] = mps_paths.CONTAINER_PIPE
                mounts.append(
                    Mount(
                        container_path=mps_paths.CONTAINER_PIPE,
                        host_path=mps_paths.pipe_dir(self._mps_root, gpu),
                    )
                )
                mounts.append(
                    Mount(
                        container_path=mps_paths.CONTAINER_LOG,
                        host_path=mps_paths.log_dir(self._mps_root, gpu),
                    )
                )
            elif self._mps.pipe_directory:
                envs["CUDA_MPS_PIPE_DIRECTORY"] = self._mps.pipe_directory
                mounts.append(
                    Mount(
                        container_path=self._mps.pipe_directory,
                        host_path=self._mps.pipe_directory,
                    )
                )
        cdi: list[str] = []
        if self._cdi.enabled:
            for uuid in gpus:
                info = self._books.gpus.get(uuid)
                name = str(info.index) if self._cdi.device_name == "index" and info else uuid
                cdi.append(f"{self._cdi.kind}={name}")
        return ContainerAllocation(
            gpus=gpus,
            envs=envs,
            mounts=mounts,
            annotations={ALLOCATION_ANNOTATION: grant.allocation},
            cdi_devices=cdi,
        )
