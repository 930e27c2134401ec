"""dcgm-exporter's dialect: the ``DCGM_FI_*`` metrics, names, types, units and labels.

Why
---
GPU operators' Grafana dashboards and alerts are written against dcgm-exporter's
metrics. gpulet reads the same NVML fields, so it can serve them under the same
names, and an existing dashboard works unchanged (``tests/fixtures`` keeps
dcgm-exporter's dashboard queries; a test runs each against a real Prometheus).

Names, types and units are dcgm-exporter's (``etc/default-counters.csv`` and
``etc/dcp-metrics-included.csv`` of NVIDIA/dcgm-exporter): framebuffer in MiB,
power in W, energy in mJ, clocks in MHz, utilisation in %, ``DCGM_FI_PROF_*``
activities as 0..1 ratios. docs/metrics.md maps each name to its NVML call.

Why its own text rendering
--------------------------
OpenTelemetry's Prometheus exporter adds unit suffixes and ``_total``, and
``prometheus_client`` renames a counter family to ``<name>_total``; dcgm-exporter's
names carry neither. So this module writes the exposition text itself, exactly as
dcgm-exporter does (``# HELP``, ``# TYPE``, one sample line per GPU), and the
``/metrics`` endpoint appends it (:func:`gpulet_common.telemetry.add_exposition`).

Labels
------
``gpu`` (NVML index), ``UUID``, ``pci_bus_id``, ``device`` (``nvidia<minor>``),
``modelName``, ``Hostname`` (the node), ``DCGM_FI_DRIVER_VERSION``; and, for a GPU a
container holds, ``container``, ``namespace`` and ``pod`` -- one series per holder,
so a GPU shared by two pods appears twice, as in dcgm-exporter.

MIG (issue 27): a MIG-enabled GPU also has, for ``DCGM_FI_DEV_FB_FREE`` and
``DCGM_FI_DEV_FB_USED``, one series per GPU instance, with dcgm-exporter's labels
``GPU_I_PROFILE`` (the GPU instance's profile, ``3g.20gb``) and ``GPU_I_ID`` (its id)
beside its GPU's, and the pod labels of the containers holding its MIG devices. The
value is the first MIG device's ``nvmlDeviceGetMemoryInfo`` (the compute instances of
one GPU instance share its memory).

Values come from the latest :class:`SampleBatch` (rendering costs nothing between
scrapes). ``DCGM_FI_DEV_XID_ERRORS`` is the last XID of the GPU, learnt from the
health service's events on the bus (NVML has no "last XID" call), 0 until one comes.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final, Literal

import msgspec

from gpulet_common.messages import (
    GpuInfo,
    GpuSample,
    Inventory,
    MigDevice,
    MigSample,
    SampleBatch,
)

Kind = Literal["gauge", "counter"]
MIB: Final = 1024 * 1024
# A compute-instance profile's prefix (``1c.`` of ``1c.3g.20gb``).
_CI_PREFIX: Final = re.compile(r"^\d+c\.")


class PodLabels(msgspec.Struct, frozen=True, kw_only=True):
    """Who holds a GPU: one container of one pod."""

    pod: str
    namespace: str
    container: str


class DcgmField(msgspec.Struct, frozen=True):
    name: str
    kind: Kind
    help: str
    read: Callable[[GpuSample], float | int | None]
    # The same field of one GPU instance (MIG), where dcgm-exporter has one.
    read_mig: Callable[[MigSample], float | int | None] | None = None


def _div(value: int | None, by: float) -> float | None:
    return None if value is None else value / by


def _int(value: bool | None) -> int | None:
    return None if value is None else int(value)


def _mib(value: int | None) -> int | None:
    return None if value is None else value // MIB


# The order is dcgm-exporter's default-counters.csv, then the fields it has commented
# out there (gpulet reads them anyway), then the DCP (profiling) fields.
FIELDS: Final[tuple[DcgmField, ...]] = (
    DcgmField(
        "DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", lambda s: s.sm_clock_mhz
    ),
    DcgmField(
        "DCGM_FI_DEV_MEM_CLOCK",
        "gauge",
        "Memory clock frequency (in MHz).",
        lambda s: s.mem_clock_mhz,
    ),
    DcgmField(
        "DCGM_FI_DEV_MEMORY_TEMP",
        "gauge",
        "Memory temperature (in C).",
        lambda s: s.memory_temperature_c,
    ),
    DcgmField(
        "DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda s: s.temperature_c
    ),
    DcgmField(
        "DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda s: _div(s.power_mw, 1000)
    ),
    DcgmField(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption since boot (in mJ).",
        lambda s: s.energy_mj,
    ),
    DcgmField(
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "counter",
        "Total number of PCIe retries.",
        lambda s: s.pcie_replay_count,
    ),
    DcgmField("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda s: s.gpu_util_pct),
    DcgmField(
        "DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", lambda s: s.mem_util_pct
    ),
    # DCGM_FI_DEV_XID_ERRORS is added from the health events, see DcgmExporter.
    DcgmField(
        "DCGM_FI_DEV_FB_FREE",
        "gauge",
        "Framebuffer memory free (in MiB).",
        lambda s: _mib(s.memory_free_bytes),
        lambda m: _mib(m.memory_free_bytes),
    ),
    DcgmField(
        "DCGM_FI_DEV_FB_USED",
        "gauge",
        "Framebuffer memory used (in MiB).",
        lambda s: _mib(s.memory_used_bytes),
        lambda m: _mib(m.memory_used_bytes),
    ),
    DcgmField(
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "counter",
        "Total number of single-bit volatile ECC errors.",
        lambda s: s.ecc_volatile_corrected,
    ),
    DcgmField(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "counter",
        "Total number of double-bit volatile ECC errors.",
        lambda s: s.ecc_volatile_uncorrected,
    ),
    DcgmField(
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "counter",
        "Total number of single-bit persistent ECC errors.",
        lambda s: s.ecc_aggregate_corrected,
    ),
    DcgmField(
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "counter",
        "Total number of double-bit persistent ECC errors.",
        lambda s: s.ecc_aggregate_uncorrected,
    ),
    DcgmField(
        "DCGM_FI_DEV_RETIRED_PENDING",
        "counter",
        "Total number of pages pending retirement.",
        lambda s: _int(s.retired_pages_pending),
    ),
    DcgmField(
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink flow-control CRC errors.",
        lambda s: s.nvlink_crc_flit_errors,
    ),
    DcgmField(
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink data CRC errors.",
        lambda s: s.nvlink_crc_data_errors,
    ),
    DcgmField(
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink retries.",
        lambda s: s.nvlink_replay_errors,
    ),
    DcgmField(
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink recovery errors.",
        lambda s: s.nvlink_recovery_errors,
    ),
    DcgmField(
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "counter",
        "Total number of NVLink bandwidth counters for all lanes.",
        lambda s: s.nvlink_bandwidth_total,
    ),
    DcgmField(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors",
        lambda s: s.remapped_rows_uncorrectable,
    ),
    DcgmField(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for correctable errors",
        lambda s: s.remapped_rows_correctable,
    ),
    DcgmField(
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "gauge",
        "Whether remapping of rows has failed",
        lambda s: _int(s.remapped_rows_failed),
    ),
    DcgmField(
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "gauge",
        "Whether remapping of rows is pending",
        lambda s: _int(s.remapped_rows_pending),
    ),
    DcgmField(
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        "gauge",
        "Current clock throttle reasons (bitmask of DCGM_CLOCKS_THROTTLE_REASON_*).",
        lambda s: s.throttle_reasons,
    ),
    DcgmField(
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "gauge",
        "Ratio of time the graphics engine is active.",
        lambda s: s.gr_engine_active,
    ),
    DcgmField(
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "gauge",
        "Ratio of cycles the tensor (HMMA) pipe is active.",
        lambda s: s.tensor_active,
    ),
    DcgmField(
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "gauge",
        "Ratio of cycles the device memory interface is active sending or receiving data.",
        lambda s: s.dram_active,
    ),
)
XID_FIELD: Final = DcgmField(
    "DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", lambda s: None
)
# Every name exported, in output order (docs/metrics.md lists the same).
NAMES: Final = (*(f.name for f in FIELDS), XID_FIELD.name)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    return ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)


def _with_pods(base: str, pods: Sequence[PodLabels]) -> list[str]:
    """One series per holder (dcgm-exporter's pod labels), or the bare one."""
    if not pods:
        return [base]
    return [
        f'{base},container="{_escape(p.container)}",namespace="{_escape(p.namespace)}",'
        f'pod="{_escape(p.pod)}"'
        for p in pods
    ]


class GpuInstance(msgspec.Struct, frozen=True):
    """A GPU instance of a MIG-enabled GPU: its id, its MIG devices (UUIDs, by compute
    instance), its series' labels."""

    gi: int
    migs: tuple[str, ...]
    labels: str


def gpu_instances(gpu: GpuInfo) -> list[tuple[int, str, tuple[str, ...]]]:
    """(GPU-instance id, its profile, its MIG devices) of a GPU, by id. The profile is
    the GPU instance's, as dcgm-exporter's ``GPU_I_PROFILE`` names it: a compute
    instance's ``1c.3g.20gb`` is GPU instance ``3g.20gb``."""
    members: dict[int, list[MigDevice]] = {}
    for device in gpu.mig_devices:
        members.setdefault(device.gpu_instance_id, []).append(device)
    out = []
    for gi in sorted(members):
        migs = sorted(members[gi], key=lambda d: d.compute_instance_id)
        profile = next((d.profile for d in migs if d.profile), "")
        out.append((gi, _CI_PREFIX.sub("", profile), tuple(d.uuid for d in migs)))
    return out


def _number(value: float | int) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class DcgmExporter:
    """Holds the latest inventory, samples, XIDs and holders; renders the text."""

    def __init__(self, node: str) -> None:
        self._node = node
        self._lock = threading.Lock()
        self._inventory: Inventory | None = None
        self._batch: SampleBatch | None = None
        self._labels: dict[str, str] = {}
        self._last_xid: dict[str, int] = {}
        self._holders: dict[str, tuple[PodLabels, ...]] = {}
        # GPU UUID -> its GPU instances (MIG), each with its labels.
        self._instances: dict[str, list[GpuInstance]] = {}

    # --- inputs ---------------------------------------------------------------------

    def update_inventory(self, inventory: Inventory) -> None:
        driver = inventory.driver_version or ""
        labels: dict[str, str] = {}
        instances: dict[str, list[GpuInstance]] = {}
        for gpu in inventory.gpus:
            device = f"nvidia{gpu.minor}" if gpu.minor is not None else f"nvidia{gpu.index}"
            head = (
                ("gpu", str(gpu.index)),
                ("UUID", gpu.uuid),
                ("pci_bus_id", gpu.pci_bus_id),
                ("device", device),
                ("modelName", gpu.name),
            )
            tail = (("Hostname", inventory.node or self._node), ("DCGM_FI_DRIVER_VERSION", driver))
            labels[gpu.uuid] = _labels((*head, *tail))
            if gpu.mig_mode == "enabled":
                instances[gpu.uuid] = [
                    GpuInstance(
                        gi,
                        migs,
                        _labels((*head, ("GPU_I_PROFILE", profile), ("GPU_I_ID", str(gi)), *tail)),
                    )
                    for gi, profile, migs in gpu_instances(gpu)
                ]
        with self._lock:
            self._inventory = inventory
            self._labels = labels
            self._instances = instances

    def update_samples(self, batch: SampleBatch) -> None:
        self._batch = batch

    def record_xid(self, gpu_uuid: str, xid: int) -> None:
        with self._lock:
            self._last_xid[gpu_uuid] = xid

    def update_holders(self, holders: Mapping[str, Sequence[PodLabels]]) -> None:
        """GPU UUID -> the containers holding it (replaces the previous map)."""
        with self._lock:
            self._holders = {uuid: tuple(pods) for uuid, pods in holders.items() if pods}

    def holders(self) -> dict[str, tuple[PodLabels, ...]]:
        with self._lock:
            return dict(self._holders)

    # --- output ---------------------------------------------------------------------

    def _series_labels(self, sample: GpuSample) -> list[str]:
        base = self._labels.get(sample.uuid)
        if base is None:
            base = (
                f'gpu="{sample.index}",UUID="{_escape(sample.uuid)}",'
                f'Hostname="{_escape(self._node)}"'
            )
        return _with_pods(base, self._holders.get(sample.uuid, ()))

    def _instance_series(self, sample: GpuSample) -> list[tuple[MigSample, list[str]]]:
        """Each GPU instance of a MIG-enabled GPU: the reading of its first MIG device
        (its compute instances share its memory) and its series' labels, one per holder
        of any of its MIG devices."""
        by_uuid = {m.uuid: m for m in sample.mig}
        out: list[tuple[MigSample, list[str]]] = []
        for instance in self._instances.get(sample.uuid, ()):
            read = next((by_uuid[u] for u in instance.migs if u in by_uuid), None)
            if read is None:
                continue
            pods = sorted(
                {p for u in instance.migs for p in self._holders.get(u, ())},
                key=lambda p: (p.namespace, p.pod, p.container),
            )
            out.append((read, _with_pods(instance.labels, pods)))
        return out

    def render(self) -> bytes:
        """The exposition text of every DCGM_FI_* metric (empty before the first sample)."""
        batch = self._batch
        if batch is None:
            return b""
        with self._lock:
            readable = [s for s in batch.samples if not s.error]
            series = {s.uuid: self._series_labels(s) for s in readable}
            instances = [i for s in readable for i in self._instance_series(s)]
            xids = dict(self._last_xid)
        lines: list[str] = []
        for field in FIELDS:
            mig = field.read_mig
            extra = [(labels, mig(m)) for m, labels in instances] if mig is not None else []
            self._family(lines, field, ((s, field.read(s)) for s in readable), series, extra)
        self._family(lines, XID_FIELD, ((s, xids.get(s.uuid, 0)) for s in readable), series)
        return ("\n".join(lines) + "\n").encode() if lines else b""

    @staticmethod
    def _family(
        lines: list[str],
        field: DcgmField,
        values: Iterable[tuple[GpuSample, float | int | None]],
        series: Mapping[str, list[str]],
        instances: Sequence[tuple[list[str], float | int | None]] = (),
    ) -> None:
        body = [
            f"{field.name}{{{labels}}} {_number(value)}"
            for sample, value in values
            if value is not None
            for labels in series[sample.uuid]
        ]
        body += [
            f"{field.name}{{{labels}}} {_number(value)}"
            for many, value in instances
            if value is not None
            for labels in many
        ]
        if body:
            lines.append(f"# HELP {field.name} {field.help}")
            lines.append(f"# TYPE {field.name} {field.kind}")
            lines.extend(body)
