"""The NVML adapter's inventory piece: the node's GPUs with their pairwise topology.

Inventory when a GPU misbehaves
-------------------------------
A GPU whose identity (handle, UUID) cannot be read, or that is lost, is left out of
``gpus`` and logged: without a UUID it cannot be addressed like the others. It is not
dropped: real NVML still counts a lost GPU, so the inventory carries NVML's count
(``nvml_count``) and lists such a GPU in ``unreadable`` by index, with whatever
identity could still be read (:meth:`InventoryReader.unreadable`), for the health
service to raise. A GPU whose secondary fields fail (serial, thresholds, ...) is
included with those fields ``None``. A topology query that fails gives ``level=None``
for that pair. The skipped GPUs and why are also returned by
:meth:`InventoryReader.inventory_report`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Final

import msgspec

from gpulet_common.messages import CELSIUS_RANGE, GpuInfo, Inventory, PeerLink, UnreadableGpu
from gpulet_common.nvml.calls import Backend, GpuHandle, log, text, within
from gpulet_common.nvml.errors import GpuLostError, NvmlCallError, NvmlError
from gpulet_common.nvml.topology import LinkScan, NvLinkReader, normalize_bus_id, pair_links

# Room for 4096 CPUs in the affinity bit mask (64-bit words): NVML fills what exists.
_CPU_SET_WORDS: Final = 64


def _affinity_cpus(words: Any) -> list[int]:
    cpus: list[int] = []
    for word_index, word in enumerate(words):
        word = int(word)
        base = word_index * 64
        while word:
            low = word & -word
            cpus.append(base + low.bit_length() - 1)
            word ^= low
    return cpus


class InventoryReader(NvLinkReader):
    """The node's GPUs: identity, static facts and pairwise topology."""

    def __init__(self, nvml_module: Any, backend: Backend = "nvml") -> None:
        super().__init__(nvml_module, backend)
        # The GPUs the last inventory left out, with why (logged once per change).
        self._left_out: dict[int, str] = {}
        # Each index's identity as last read (UUID, PCI bus ID, name): what a GPU lost
        # since is reported by when NVML no longer answers for it.
        self._identity: dict[int, tuple[str, str, str]] = {}
        bind, const = self._bind, self._const
        self._f_name = bind("nvmlDeviceGetName")
        self._f_minor = bind("nvmlDeviceGetMinorNumber")
        self._f_pci = bind("nvmlDeviceGetPciInfo")
        self._f_numa = bind("nvmlDeviceGetNumaNodeId")
        self._f_affinity_scope = bind("nvmlDeviceGetCpuAffinityWithinScope")
        self._f_affinity = bind("nvmlDeviceGetCpuAffinity")
        self._f_serial = bind("nvmlDeviceGetSerial")
        self._f_board_id = bind("nvmlDeviceGetBoardId")
        self._f_compute_cap = bind("nvmlDeviceGetCudaComputeCapability")
        self._f_module_id = bind("nvmlDeviceGetModuleId")
        self._f_ecc_mode = bind("nvmlDeviceGetEccMode")
        self._f_threshold = bind("nvmlDeviceGetTemperatureThreshold")
        self._c_threshold_shutdown = const("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", 0)
        self._c_threshold_slowdown = const("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1)
        self._c_threshold_mem_max = const("NVML_TEMPERATURE_THRESHOLD_MEM_MAX", 2)
        self._c_threshold_gpu_max = const("NVML_TEMPERATURE_THRESHOLD_GPU_MAX", 3)
        self._c_affinity_scope_node = const("NVML_AFFINITY_SCOPE_NODE", 0)
        self._c_feature_enabled = const("NVML_FEATURE_ENABLED", 1)

    def gpu_info(self, index: int) -> GpuInfo:
        """Static facts about one GPU, without topology (see :meth:`inventory`)."""
        gpu = self._gpus.get(index) or self._load(index)
        return self._gpu_info(gpu)

    def _gpu_info(self, gpu: GpuHandle) -> GpuInfo:
        opt = self._opt
        name = opt(gpu, self._f_name)
        memory = opt(gpu, self._f_memory)
        pci = opt(gpu, self._f_pci)
        minor = opt(gpu, self._f_minor)
        numa = opt(gpu, self._f_numa)
        serial = opt(gpu, self._f_serial)
        board_id = opt(gpu, self._f_board_id)
        capability = opt(gpu, self._f_compute_cap)
        module_id = opt(gpu, self._f_module_id)
        ecc_mode = opt(gpu, self._f_ecc_mode)
        supported_events = opt(gpu, self._f_supported_events)
        threshold = self._f_threshold
        shutdown = opt(gpu, threshold, self._c_threshold_shutdown)
        slowdown = opt(gpu, threshold, self._c_threshold_slowdown)
        gpu_max = opt(gpu, threshold, self._c_threshold_gpu_max)
        mem_max = opt(gpu, threshold, self._c_threshold_mem_max)
        info = GpuInfo(
            uuid=gpu.uuid,
            index=gpu.index,
            minor=int(minor) if minor is not None else None,
            name=text(name) if name is not None else "",
            memory_total_bytes=int(memory.total) if memory is not None else 0,
            pci_bus_id=text(pci.busId) if pci is not None else "",
            # Some platforms answer -1 rather than NOT_SUPPORTED when there is no NUMA.
            numa_node=int(numa) if numa is not None and int(numa) >= 0 else None,
            cpu_affinity=self._cpu_affinity(gpu),
            serial=text(serial) if serial is not None else None,
            board_id=int(board_id) if board_id is not None else None,
            compute_capability=(
                (int(capability[0]), int(capability[1])) if capability is not None else None
            ),
            ecc_enabled=(
                int(ecc_mode[0]) == self._c_feature_enabled if ecc_mode is not None else None
            ),
            temp_shutdown_c=within(shutdown, CELSIUS_RANGE),
            temp_slowdown_c=within(slowdown, CELSIUS_RANGE),
            temp_gpu_max_c=within(gpu_max, CELSIUS_RANGE),
            temp_mem_max_c=within(mem_max, CELSIUS_RANGE),
            supported_events=int(supported_events) if supported_events is not None else None,
            module_id=int(module_id) if module_id is not None else None,
        )
        return self._extend_info(gpu, info)

    def _cpu_affinity(self, gpu: GpuHandle) -> list[int]:
        words = self._opt(gpu, self._f_affinity_scope, _CPU_SET_WORDS, self._c_affinity_scope_node)
        if words is None:
            words = self._opt(gpu, self._f_affinity, _CPU_SET_WORDS)
        return _affinity_cpus(words) if words is not None else []

    def inventory(self, node: str, generation: int) -> Inventory:
        """The node's GPUs with their pairwise topology; see :meth:`inventory_report`."""
        return self.inventory_report(node, generation)[0]

    def inventory_report(self, node: str, generation: int) -> tuple[Inventory, dict[int, str]]:
        """The inventory, and the GPUs left out of it with the reason (by index).

        Re-fetches every handle: the GPU count or order may have changed since the last
        inventory. Raises :class:`NvmlUnavailable` only when NVML as a whole fails.
        """
        system = self.system_info()
        count = self.device_count()
        self.invalidate()
        skipped: dict[int, str] = {}
        unreadable: list[UnreadableGpu] = []
        found: list[tuple[GpuHandle, GpuInfo]] = []
        for index in range(count):
            try:
                gpu = self._load(index)
                info = self._gpu_info(gpu)
                found.append((gpu, info))
                self._identity[index] = (info.uuid, info.pci_bus_id, info.name)
            except (GpuLostError, NvmlCallError) as exc:
                # Once per change of state: the collector looks again and again.
                again = self._left_out.get(index) == str(exc)
                log.log(
                    logging.DEBUG if again else logging.WARNING,
                    "GPU %d left out of the inventory: %s",
                    index,
                    exc,
                )
                skipped[index] = str(exc)
                unreadable.append(self.unreadable(index, exc))
        for index in sorted(set(self._left_out) - set(skipped)):
            if index < count:
                log.info("GPU %d is in the inventory again", index)
        self._left_out = skipped

        links: list[LinkScan] = []
        for gpu, _ in found:
            try:
                links.append(self._nvlinks(gpu))
            except (GpuLostError, NvmlCallError) as exc:
                log.warning("NVLinks of GPU %d unknown: %s", gpu.index, exc)
                links.append(LinkScan())
                with self._lock:
                    # Unknown, not "none up": the collector must not rebuild the
                    # inventory again and again to compare with it.
                    self._nvlink_up.pop(gpu.uuid, None)

        buses = [normalize_bus_id(info.pci_bus_id) for _, info in found]
        peers: list[list[PeerLink]] = [[] for _ in found]
        for a in range(len(found)):
            gpu_a = found[a][0]
            for b in range(a + 1, len(found)):
                gpu_b = found[b][0]
                level = self._common_ancestor(gpu_a, gpu_b)
                nvlinks, down = pair_links(links[a], links[b], buses[a], buses[b])
                # The same link seen from each end: each GPU's entry names the other.
                for here, there in ((a, gpu_b), (b, gpu_a)):
                    peers[here].append(
                        PeerLink(
                            peer_uuid=there.uuid,
                            peer_index=there.index,
                            level=level,
                            nvlinks=nvlinks,
                            nvlinks_down=down,
                        )
                    )

        gpus = [
            msgspec.structs.replace(
                info,
                topology=sorted(peers[i], key=lambda p: p.peer_index),
                nvlinks_up=links[i].up,
                nvlinks_down=links[i].down,
            )
            for i, (_, info) in enumerate(found)
        ]
        inventory = Inventory(
            node=node,
            generation=generation,
            driver_version=system.driver_version,
            cuda_driver_version=system.cuda_driver_version,
            nvml_version=system.nvml_version,
            gpus=gpus,
            nvml_backend=self.backend,
            published_at=time.time(),
            nvml_count=count,
            unreadable=unreadable,
        )
        return inventory, skipped

    def unreadable(self, index: int, error: NvmlError) -> UnreadableGpu:
        """What can still be read of a GPU that NVML counts but that could not be listed.

        A lost GPU stays in ``nvmlDeviceGetCount``; its handle, or the calls on it,
        fail with GPU_IS_LOST. Each identity field is tried on its own (a driver may
        still answer the PCI info it knew from the probe); what fails stays None.
        """
        uuid = error.uuid if isinstance(error, GpuLostError) else None
        bus = name = None
        handle = self._try(self._f_handle_by_index, index)
        if handle is not None:
            if uuid is None:
                raw = self._try(self._f_uuid, handle)
                uuid = text(raw) if raw else None
            pci = self._try(self._f_pci, handle)
            bus = text(pci.busId) if pci is not None else None
            raw = self._try(self._f_name, handle)
            name = text(raw) if raw else None
        # What an earlier scan read at this index (the GPU before it was lost), where
        # NVML no longer says: the UUID ties the entry to the GPU the node had, instead
        # of a placeholder without a bus ID or memory. Not when NVML names another GPU.
        known = self._identity.get(index)
        if known is not None and uuid in (None, known[0]):
            uuid, bus, name = known[0], bus or known[1] or None, name or known[2] or None
        return UnreadableGpu(
            index=index,
            uuid=uuid,
            pci_bus_id=bus,
            name=name,
            lost=isinstance(error, GpuLostError),
            reason=str(error),
        )
