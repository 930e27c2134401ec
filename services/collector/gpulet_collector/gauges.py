"""GPU gauges for Prometheus, in the spirit of dcgm-exporter's, read from the last samples.

Observable gauges are evaluated at scrape time from the latest :class:`SampleBatch`,
so exporting costs nothing between scrapes. Labels follow dcgm-exporter (``gpu``,
``UUID``, ``pci_bus_id``, ``modelName``, ``Hostname``). dcgm-exporter's own metric
names (``DCGM_FI_*``), for dashboards that need no change at all, are served by
:mod:`.dcgm`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from gpulet_common.messages import GpuInfo, GpuSample, Inventory, SampleBatch


class GpuGauges:
    def __init__(self, meter: metrics.Meter) -> None:
        self._inventory: Inventory | None = None
        self._batch: SampleBatch | None = None
        self._labels: dict[str, dict[str, str]] = {}

        def gauge(
            name: str, unit: str, description: str, read: Callable[[GpuSample], float | None]
        ) -> None:
            def callback(_options: CallbackOptions) -> Iterable[Observation]:
                return self._observe(read)

            meter.create_observable_gauge(name, [callback], unit=unit, description=description)

        gauge("gpulet.gpu.temperature", "Cel", "GPU temperature", lambda s: s.temperature_c)
        gauge(
            "gpulet.gpu.power",
            "W",
            "Power draw",
            lambda s: None if s.power_mw is None else s.power_mw / 1000,
        )
        gauge(
            "gpulet.gpu.utilization",
            "1",
            "GPU utilisation ratio",
            lambda s: None if s.gpu_util_pct is None else s.gpu_util_pct / 100,
        )
        gauge(
            "gpulet.gpu.memory.utilization",
            "1",
            "Memory controller utilisation ratio",
            lambda s: None if s.mem_util_pct is None else s.mem_util_pct / 100,
        )
        gauge("gpulet.gpu.memory.used", "By", "Frame buffer used", lambda s: s.memory_used_bytes)
        gauge("gpulet.gpu.memory.free", "By", "Frame buffer free", lambda s: s.memory_free_bytes)
        gauge("gpulet.gpu.sm_clock_mhz", "", "SM clock in MHz", lambda s: s.sm_clock_mhz)
        gauge("gpulet.gpu.mem_clock_mhz", "", "Memory clock in MHz", lambda s: s.mem_clock_mhz)
        gauge(
            "gpulet.gpu.ecc.volatile_corrected",
            "1",
            "Volatile corrected ECC errors",
            lambda s: s.ecc_volatile_corrected,
        )
        gauge(
            "gpulet.gpu.ecc.volatile_uncorrected",
            "1",
            "Volatile uncorrected ECC errors",
            lambda s: s.ecc_volatile_uncorrected,
        )
        gauge(
            "gpulet.gpu.remapped_rows.pending",
            "1",
            "1 when a row remap is pending",
            lambda s: None if s.remapped_rows_pending is None else float(s.remapped_rows_pending),
        )
        gauge(
            "gpulet.gpu.throttle_reasons",
            "1",
            "NVML clock event reasons bit mask",
            lambda s: s.throttle_reasons,
        )
        gauge(
            "gpulet.gpu.readable",
            "1",
            "1 when the last sample of the GPU succeeded",
            lambda s: 0.0 if s.error else 1.0,
        )

        # NVLink state, from the inventory (re-read on the slow period, see service.py).
        def links(read: Callable[[GpuInfo], int]) -> Callable[[CallbackOptions], list[Observation]]:
            def callback(_options: CallbackOptions) -> list[Observation]:
                inventory = self._inventory
                if inventory is None:
                    return []
                return [
                    Observation(float(read(g)), self._labels.get(g.uuid, {"UUID": g.uuid}))
                    for g in inventory.gpus
                    if g.nvlinks_up or g.nvlinks_down
                ]

            return callback

        meter.create_observable_gauge(
            "gpulet.gpu.nvlinks.up",
            [links(lambda g: len(g.nvlinks_up))],
            unit="1",
            description="NVLinks of the GPU that are up",
        )
        meter.create_observable_gauge(
            "gpulet.gpu.nvlinks.down",
            [links(lambda g: len(g.nvlinks_down))],
            unit="1",
            description="NVLinks of the GPU seen up before that are down now",
        )

    def update_inventory(self, inventory: Inventory) -> None:
        self._inventory = inventory
        self._labels = {
            gpu.uuid: {
                "gpu": str(gpu.index),
                "UUID": gpu.uuid,
                "pci_bus_id": gpu.pci_bus_id,
                "modelName": gpu.name,
                "Hostname": inventory.node,
            }
            for gpu in inventory.gpus
        }

    def update_samples(self, batch: SampleBatch) -> None:
        self._batch = batch

    def _observe(self, read: Callable[[GpuSample], float | None]) -> Iterable[Observation]:
        batch = self._batch
        if batch is None:
            return []
        out = []
        for sample in batch.samples:
            value = read(sample)
            if value is None:
                continue
            labels = self._labels.get(sample.uuid) or {
                "gpu": str(sample.index),
                "UUID": sample.uuid,
            }
            out.append(Observation(float(value), labels))
        return out
