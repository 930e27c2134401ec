"""How long one inventory takes to process, from bytes to every consumer, by GPU count.

Run: ``python bench/inventory_scale.py`` (``--repeat N`` timed runs per size, best kept)

What is measured
----------------
For 8, 64, 256 and 1024 GPUs (1024 is the default ``limits.max_gpus``), one inventory
payload as the collector publishes it, through each consumer's own code, in process:

* **decode+validate**: :meth:`gpulet_common.codec.Codec.decode` with the subject, the
  consumer's node and the clock: size and nesting bounds, msgspec, the claim checks.
* **allocator**: :meth:`AllocatorCore.update_inventory` (the ledger and the topology
  the selection uses) plus the device plugin's GPU list
  (:func:`plugin_gpus_from_inventory` into a :class:`DeviceList`).
* **reporter**: :meth:`ReporterCore.on_inventory`, which renders the Device intent.
* **health**: the GPU labels and the comparison the health service does.

The last row is a payload with ``max_gpus + 1`` GPUs, which must be refused, and how
long the refusal takes.

Shape of the synthetic inventories: the GPUs form NVLink islands of 8 (each lists its 7
island peers with 18 NVLinks, as an HGX board reports them), two NUMA nodes with a
56-CPU affinity list each, every field a real H100 reports. No NVML is involved (the
inventory is built directly, as the mock NVML would report it); no NATS either: the
bytes are handed to the decoder as a subscription would.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import table

from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.kubelet.deviceplugin.devicelist import DeviceList
from gpulet_allocator.kubelet.deviceplugin.resources import plugin_gpus_from_inventory
from gpulet_common import codec, subjects
from gpulet_common.codec import MalformedMessage
from gpulet_common.messages import GpuInfo, Inventory, PeerLink
from gpulet_common.settings import Settings
from gpulet_common.validate import RejectedMessage
from gpulet_reporter.core import ReporterCore

NODE = "bench-node"
SIZES = (8, 64, 256, 1024)
ISLAND = 8
BUDGET_MS = 50.0


def _uuid(i: int) -> str:
    return f"GPU-{i:08x}-4389-4e0d-9316-d023b4b2bd23"


def inventory(n: int) -> Inventory:
    gpus = []
    for i in range(n):
        island = i // ISLAND * ISLAND
        numa = (i % ISLAND) // (ISLAND // 2)
        peers = [
            PeerLink(
                peer_uuid=_uuid(j),
                peer_index=j,
                level=40 if (j % ISLAND) // 4 == numa else 50,
                nvlinks=18,
            )
            for j in range(island, min(island + ISLAND, n))
            if j != i
        ]
        gpus.append(
            GpuInfo(
                uuid=_uuid(i),
                index=i,
                minor=i,
                name="NVIDIA H100 80GB HBM3",
                memory_total_bytes=85_520_809_984,
                pci_bus_id=f"0000{i // 256:04x}:{i % 256:02x}:00.0",
                numa_node=numa,
                cpu_affinity=list(range(numa * 56, numa * 56 + 56)),
                topology=peers,
                serial=f"{1652059426780 + i}",
                board_id=6144 + i,
                compute_capability=(9, 0),
                ecc_enabled=True,
                temp_shutdown_c=92,
                temp_slowdown_c=89,
                temp_gpu_max_c=87,
                temp_mem_max_c=95,
                supported_events=0x1F,
            )
        )
    return Inventory(
        node=NODE,
        generation=1,
        driver_version="550.54.15",
        cuda_driver_version="12.4",
        nvml_version="12.550.54.15",
        gpus=gpus,
        nvml_backend="mock",
        published_at=time.time(),
    )


def _best_ms(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def measure(n: int, settings: Settings, repeat: int) -> tuple[int, float, float, float, float]:
    payload = codec.INVENTORY.encode(inventory(n))
    subject = subjects.inventory(NODE)

    def decode() -> Inventory:
        return codec.INVENTORY.decode(
            payload, limits=settings.limits, subject=subject, node=NODE, now=time.time()
        )

    decoded = decode()
    plugin = settings.allocator.plugin

    def allocator() -> None:
        # A fresh allocator each time: the first inventory builds everything.
        core = AllocatorCore(node=NODE, names=plugin.resources, shares=plugin.shares)
        core.update_inventory(decoded)
        DeviceList().publish(plugin_gpus_from_inventory(decoded.gpus, ()))

    def reporter() -> None:
        ReporterCore(NODE, settings.reporter).on_inventory(decoded)

    def health() -> None:
        labels = {g.uuid: {"gpu": str(g.index), "UUID": g.uuid} for g in decoded.gpus}
        theirs = {(g.index, g.uuid) for g in decoded.gpus}
        assert len(labels) == len(theirs) == n

    return (
        len(payload),
        _best_ms(decode, repeat),
        _best_ms(allocator, repeat),
        _best_ms(reporter, repeat),
        _best_ms(health, repeat),
    )


def refusal(settings: Settings, repeat: int) -> tuple[int, int, float, str]:
    n = settings.limits.max_gpus + 1
    payload = codec.INVENTORY.encode(inventory(n))
    subject = subjects.inventory(NODE)
    reason = ""

    def decode() -> None:
        nonlocal reason
        try:
            codec.INVENTORY.decode(
                payload, limits=settings.limits, subject=subject, node=NODE, now=time.time()
            )
        except (MalformedMessage, RejectedMessage) as exc:
            reason = exc.reason
        else:
            raise AssertionError("an oversize inventory was accepted")

    return n, len(payload), _best_ms(decode, repeat), reason


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per size (best kept)")
    args = parser.parse_args()
    settings = Settings(node_name=NODE)
    rows = []
    worst_total = 0.0
    for n in SIZES:
        size, dec, alloc, rep, hlth = measure(n, settings, args.repeat)
        total = dec + alloc + rep + hlth
        if n == settings.limits.max_gpus:
            worst_total = total
        rows.append(
            [
                n,
                f"{size / 1024:.0f} KiB",
                f"{dec:.2f}",
                f"{alloc:.2f}",
                f"{rep:.2f}",
                f"{hlth:.2f}",
                f"{total:.2f}",
            ]
        )
    n, size, ms, reason = refusal(settings, args.repeat)
    rows.append(
        [
            f"{n} (refused)",
            f"{size / 1024:.0f} KiB",
            f"{ms:.2f}",
            "-",
            "-",
            "-",
            f"{ms:.2f} ({reason})",
        ]
    )
    print(
        table(
            "One inventory through every consumer (ms, best of "
            f"{args.repeat}; mock-shaped inventory, no NVML, no NATS)",
            ["GPUs", "payload", "decode+validate", "allocator", "reporter", "health", "total"],
            rows,
        )
    )
    verdict = "within" if worst_total <= BUDGET_MS else "OVER"
    print(
        f"\nmax_gpus={settings.limits.max_gpus}: {worst_total:.1f} ms in all, "
        f"{verdict} the {BUDGET_MS:g} ms budget"
    )
    return 0 if worst_total <= BUDGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
