"""The DRA plugin's terms (:mod:`.contract`) in the allocator's (:mod:`gpulet_allocator.protocol`).

One translation for both decision cores, the NATS one (:mod:`.nats_core`) and the
allocator's in-process one (:class:`gpulet_allocator.service.claims.LocalClaimCore`):
a claim's devices as the ledger is asked for them, and what it reserved as the plugin
reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpulet_allocator import protocol as p
from gpulet_allocator.kubelet.dra.contract import ClaimDevice, Reservation, ReservedDevice


def claim_requests(devices: Sequence[ClaimDevice]) -> list[p.ClaimDeviceRequest]:
    return [
        p.ClaimDeviceRequest(device=d.device, cores=d.cores, memory_bytes=d.memory_bytes)
        for d in devices
    ]


def reservation(
    claim_uid: str, allocation: str, devices: Sequence[p.ReservedClaimDevice]
) -> Reservation:
    return Reservation(
        claim_uid=claim_uid,
        allocation=allocation,
        devices=tuple(
            ReservedDevice(d.device, d.uuid, d.minor, d.cores, d.memory_mib) for d in devices
        ),
    )
