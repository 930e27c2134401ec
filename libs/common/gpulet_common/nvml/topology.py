"""The NVML adapter's topology piece: NVLink state and PCIe levels between GPUs.

NVLink state
------------
The inventory counts, per pair of GPUs, the NVLinks that are *active*
(``nvmlDeviceGetNvLinkState`` per link, then the far end's PCI bus id and device type).
The adapter remembers, by UUID, every link it has seen active and where it led. A
remembered link that reads inactive later is *down*: it leaves the pair's ``nvlinks``
(so the allocator stops counting it) and is counted in the pair's ``nvlinks_down``
and listed in the GPU's ``nvlinks_down``. A link never seen active (no bridge or
cable, or down since before this process started) is neither: NVML cannot tell it
from a link that does not exist. The slow path (:mod:`.sampling`) re-reads the state
of the remembered links only (one call per link; none on a GPU without NVLink), at the
first slow read, when the GPU's NVLink error counters of that slow read moved (a
failing link goes through replays and recovery first) or when
``nvlink_state_every_s`` has passed since the last read, and keeps the set of active
ones, :meth:`NvLinkReader.nvlinks_up`; the collector compares it with the inventory it
published and rebuilds the inventory when they differ. A GPU whose link scan failed
has unknown links (``nvlinks_up`` None), not "none up".

PCIe levels come from ``nvmlDeviceGetTopologyCommonAncestor``; a pair whose level
cannot be read has ``level=None``.
"""

from __future__ import annotations

import time
from typing import Any, Final

from gpulet_common.nvml.calls import (
    FIELD_UNSUPPORTED,
    U_NVLINK_STATE,
    UNAVAILABLE_AFTER_INIT,
    Backend,
    GpuHandle,
    NvmlCalls,
    log,
    text,
)
from gpulet_common.nvml.errors import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_INVALID_ARGUMENT
from gpulet_common.pci import nvml_bus_id

# The slow fields that count NVLink errors: when one moves, link state is re-read.
NVLINK_ERROR_FIELDS: Final = (
    "nvlink_crc_flit_errors",
    "nvlink_crc_data_errors",
    "nvlink_replay_errors",
    "nvlink_recovery_errors",
)


class LinkScan:
    """One GPU's NVLinks as one inventory scan read them."""

    __slots__ = ("direct", "down", "down_direct", "down_switch", "switch", "up")

    def __init__(self) -> None:
        # Active links per peer bus id, and active links into NVSwitches.
        self.direct: dict[str, int] = {}
        self.switch = 0
        # Links seen active before that are inactive now, counted the same way.
        self.down_direct: dict[str, int] = {}
        self.down_switch = 0
        self.up: list[int] = []
        self.down: list[int] = []


def normalize_bus_id(bus_id: str) -> str:
    """A PCI bus id in NVML's canonical form ``DDDDDDDD:BB:DD.F``, upper case.

    NVML reports the 8-digit domain form, sysfs and some tools the 4-digit one; link
    peers are matched on this form so both compare equal (:mod:`gpulet_common.pci`;
    what is not a bus id is kept as it is, upper case).
    """
    return nvml_bus_id(bus_id) or bus_id.strip().upper()


def pair_links(a: LinkScan, b: LinkScan, bus_a: str, bus_b: str) -> tuple[int, int]:
    """(active, down) NVLinks between two GPUs, from both GPUs' scans.

    Direct links count from both ends (one side's scan may have failed): the larger
    count. Through NVSwitches every pair reaches the other with the smaller of the
    two GPUs' switch links; the switch links down are what that leaves out.
    """
    up = max(a.direct.get(bus_b, 0), b.direct.get(bus_a, 0))
    down = max(a.down_direct.get(bus_b, 0), b.down_direct.get(bus_a, 0))
    switch_up = min(a.switch, b.switch) if a.switch and b.switch else 0
    a_all, b_all = a.switch + a.down_switch, b.switch + b.down_switch
    switch_all = min(a_all, b_all) if a_all and b_all else 0
    return up + switch_up, down + switch_all - switch_up


class NvLinkReader(NvmlCalls):
    """NVLink state and PCIe levels between GPUs (the inventory's topology)."""

    def __init__(self, nvml_module: Any, backend: Backend = "nvml") -> None:
        super().__init__(nvml_module, backend)
        # NVLinks ever seen active, per UUID: link id -> (far end's bus id, is a switch);
        # and the active links at the last read of their state (inventory or slow path).
        self._nvlink_seen: dict[str, dict[int, tuple[str, bool]]] = {}
        self._nvlink_up: dict[str, frozenset[int]] = {}
        self._nvlink_read_at: dict[str, float] = {}  # time.monotonic() of that read
        bind = self._bind
        self._f_common_ancestor = bind("nvmlDeviceGetTopologyCommonAncestor")
        self._f_nvlink_state = bind("nvmlDeviceGetNvLinkState")
        self._f_nvlink_remote_pci = bind("nvmlDeviceGetNvLinkRemotePciInfo")
        self._f_nvlink_remote_type = bind("nvmlDeviceGetNvLinkRemoteDeviceType")
        self._c_nvlink_max_links = self._const("NVML_NVLINK_MAX_LINKS", 18)
        self._c_nvlink_switch = self._const("NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)

    def _nvlinks(self, gpu: GpuHandle) -> LinkScan:
        """Active and down NVLinks of one GPU, per peer bus id and into NVSwitches.

        On NVSwitch systems (DGX/HGX) a GPU's links end at switches, never at a peer,
        and every GPU reaches every other one through the fabric; the pair count is
        then the smaller of the two GPUs' switch links (what ``nvidia-smi topo`` shows
        as NV18 on a DGX H100). A link is *down* when this adapter saw it active
        before (module docstring); it is counted where it led when it was up.
        """
        state = self._f_nvlink_state
        remote_pci = self._f_nvlink_remote_pci
        remote_type = self._f_nvlink_remote_type
        scan = LinkScan()
        if state is None or remote_pci is None:
            return scan
        handle = gpu.handle
        with self._lock:
            seen = dict(self._nvlink_seen.get(gpu.uuid, {}))
        for link in range(self._c_nvlink_max_links):
            try:
                if not state(handle, link):
                    known = seen.get(link)
                    if known is not None:
                        scan.down.append(link)
                        if known[1]:
                            scan.down_switch += 1
                        else:
                            scan.down_direct[known[0]] = scan.down_direct.get(known[0], 0) + 1
                    continue
                bus = normalize_bus_id(text(remote_pci(handle, link).busId))
            except self._error_type as exc:
                code = self._code(exc)
                if code in FIELD_UNSUPPORTED:
                    if link == 0:  # no NVLink on this GPU at all
                        break
                    continue
                if code == NVML_ERROR_INVALID_ARGUMENT:  # beyond this GPU's last link
                    break
                raise self._translate(exc, "nvmlDeviceGetNvLinkState", gpu.index, gpu.uuid) from exc
            kind = None
            if remote_type is not None:
                try:
                    kind = remote_type(handle, link)
                except self._error_type as exc:
                    if self._code(exc) == NVML_ERROR_GPU_IS_LOST:
                        raise self._translate(
                            exc, "nvmlDeviceGetNvLinkRemoteDeviceType", gpu.index, gpu.uuid
                        ) from exc
            to_switch = kind == self._c_nvlink_switch
            seen[link] = (bus, to_switch)
            scan.up.append(link)
            if to_switch:
                scan.switch += 1
            else:
                scan.direct[bus] = scan.direct.get(bus, 0) + 1
        with self._lock:
            self._nvlink_seen[gpu.uuid] = seen
            self._nvlink_up[gpu.uuid] = frozenset(scan.up)
            self._nvlink_read_at[gpu.uuid] = time.monotonic()
        return scan

    def _nvlink_state_due(self, gpu: GpuHandle, before: dict[str, Any], every_s: float) -> bool:
        """Whether this slow read re-reads link state: the first slow read (no counters
        to compare with yet), the error counters moved since the previous slow read,
        or ``every_s`` has passed since the last state read."""
        if before.get("slow_fields_at") is None or any(
            gpu.slow.get(field) != before.get(field) for field in NVLINK_ERROR_FIELDS
        ):
            return True
        last = self._nvlink_read_at.get(gpu.uuid)
        return last is None or time.monotonic() - last >= every_s

    def _read_nvlink_state(self, gpu: GpuHandle) -> None:
        """Re-read the state of the links seen active before (the slow path).

        One ``nvmlDeviceGetNvLinkState`` per remembered link, nothing on a GPU without
        NVLink. A link whose state cannot be read keeps its last known state; a lost
        GPU or NVML gone raise as in :meth:`sample`.
        """
        fn = self._f_nvlink_state
        if fn is None or gpu.unsupported & U_NVLINK_STATE:
            return
        with self._lock:
            links = sorted(self._nvlink_seen.get(gpu.uuid, {}))
            before = self._nvlink_up.get(gpu.uuid, frozenset())
        if not links:
            return
        up = set(before)
        for link in links:
            try:
                active = bool(fn(gpu.handle, link))
            except self._error_type as exc:
                code = self._code(exc)
                if code == NVML_ERROR_GPU_IS_LOST or code in UNAVAILABLE_AFTER_INIT:
                    self._field_failed(gpu, U_NVLINK_STATE, fn, exc)
                log.debug("GPU %d: state of NVLink %d unknown: %s", gpu.index, link, exc)
                continue
            if active:
                up.add(link)
            else:
                up.discard(link)
        with self._lock:
            self._nvlink_up[gpu.uuid] = frozenset(up)
            self._nvlink_read_at[gpu.uuid] = time.monotonic()

    def nvlinks_up(self, uuid: str) -> frozenset[int] | None:
        """The GPU's active NVLinks at the last read (None: never read)."""
        return self._nvlink_up.get(uuid)

    def _common_ancestor(self, a: GpuHandle, b: GpuHandle) -> int | None:
        fn = self._f_common_ancestor
        if fn is None:
            return None
        try:
            return int(fn(a.handle, b.handle))
        except self._error_type as exc:
            if self._code(exc) not in FIELD_UNSUPPORTED:
                log.warning("topology of GPU %d and GPU %d unknown: %s", a.index, b.index, exc)
            return None
