"""An in-memory decision core and health source for the DRA kubelet plugin's tests.

They implement the plugin's Protocols (gpulet_allocator.kubelet.dra.contract) with
the ledger rules the real core keeps: one owner per whole GPU, a device-plugin
allocation is an owner too, shares of one GPU add up to at most 100 % of its cores
and all of its memory, the same claim again gets the same reservation. They keep the
plugin's own rule tests (per-claim errors, CDI, ordering) fast; the binding to the
real core over NATS is tested in tests/allocator/test_dra_claims_nats.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio

from gpulet_allocator.kubelet.dra.contract import (
    ClaimDevice,
    DeviceHealth,
    Reservation,
    ReservedDevice,
)
from gpulet_common.refusal import Refused

MIB = 1024 * 1024


@dataclass
class Gpu:
    uuid: str
    minor: int
    memory_bytes: int = 80 * 1024 * MIB
    healthy: bool = True


@dataclass
class InMemoryCore:
    gpus: dict[str, Gpu] = field(default_factory=dict)  # device name → GPU
    claims: dict[str, Reservation] = field(default_factory=dict)
    device_plugin: set[str] = field(default_factory=set)  # device names held
    reserve_calls: int = 0

    @classmethod
    def with_gpus(cls, count: int) -> InMemoryCore:
        return cls({f"gpu-{i}": Gpu(f"GPU-{i}", i) for i in range(count)})

    def _owners(self, device: str, *, besides: str) -> list[ReservedDevice]:
        return [
            d
            for uid, r in self.claims.items()
            if uid != besides
            for d in r.devices
            if d.device == device
        ]

    async def reserve_claim(
        self,
        claim_uid: str,
        devices: Sequence[ClaimDevice],
        *,
        namespace: str = "",
        name: str = "",
    ) -> Reservation:
        self.reserve_calls += 1
        held = self.claims.get(claim_uid)
        if held is not None:
            if sorted(d.device for d in held.devices) != sorted(d.device for d in devices):
                raise Refused("invalid_request", f"claim {claim_uid} already holds other devices")
            return held
        reserved: list[ReservedDevice] = []
        for want in devices:
            gpu = self.gpus.get(want.device)
            if gpu is None:
                raise Refused("unknown_device", f"no device {want.device}")
            if not gpu.healthy:
                raise Refused("unhealthy_device", f"{want.device} is unhealthy")
            if want.device in self.device_plugin:
                raise Refused(
                    "insufficient_capacity", f"{want.device} is held by the device plugin"
                )
            others = self._owners(want.device, besides=claim_uid)
            share = want.cores is not None or want.memory_bytes is not None
            memory_mib = want.memory_bytes // MIB if want.memory_bytes else None
            if not share:
                if others:
                    raise Refused(
                        "insufficient_capacity", f"{want.device} is held by another claim"
                    )
            else:
                if any(o.cores is None and o.memory_mib is None for o in others):
                    raise Refused(
                        "insufficient_capacity", f"{want.device} is held whole by another claim"
                    )
                if sum(o.cores or 0 for o in others) + (want.cores or 0) > 100:
                    raise Refused(
                        "insufficient_capacity", f"{want.device} has not that many cores left"
                    )
                used = sum(o.memory_mib or 0 for o in others) + (memory_mib or 0)
                if used * MIB > gpu.memory_bytes:
                    raise Refused(
                        "insufficient_capacity", f"{want.device} has not that much memory left"
                    )
            reserved.append(
                ReservedDevice(want.device, gpu.uuid, gpu.minor, want.cores, memory_mib)
            )
        reservation = Reservation(claim_uid, f"dra-{claim_uid[:8]}", tuple(reserved))
        self.claims[claim_uid] = reservation
        return reservation

    async def release_claim(self, claim_uid: str) -> bool:
        return self.claims.pop(claim_uid, None) is not None


class InMemoryHealth:
    def __init__(self, pool: str, devices: Sequence[str]) -> None:
        self.pool = pool
        self._health = {d: DeviceHealth(pool, d, "healthy", 1.0) for d in devices}
        self.version = 0
        self._changed = anyio.Event()

    def set(self, device: str, health: str, message: str = "") -> None:
        self._health[device] = DeviceHealth(self.pool, device, health, 2.0, message)  # type: ignore[arg-type]
        self.version += 1
        self._changed.set()
        self._changed = anyio.Event()

    def device_health(self) -> list[DeviceHealth]:
        return list(self._health.values())

    async def wait_changed(self, version: int) -> int:
        while version >= 0 and version == self.version:
            await self._changed.wait()
        return self.version
