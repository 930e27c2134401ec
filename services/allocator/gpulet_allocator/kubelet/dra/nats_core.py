"""The DRA kubelet plugin's :class:`~.contract.DecisionCore` over NATS.

Like the device plugin's :mod:`~gpulet_allocator.kubelet.deviceplugin.nats_backend`:
each call is one request on the :class:`~gpulet_common.bus.Bus` to the allocator
service's ``reserve-claim`` / ``release-claim`` endpoints
(``gpulet.allocator.<node>.<endpoint>``, contract: :mod:`gpulet_allocator.protocol`),
so it carries the trace context, is bounded by ``timeout_s`` and its reply is decoded
totally. Outcomes stay in the one exception tree (:mod:`gpulet_common.refusal`): a
refusal is the allocator's :class:`~gpulet_common.refusal.Refused` (its code and
message reach the claim's ``error`` entry verbatim), no answer a
:class:`~gpulet_common.refusal.RequestTimeout`.

A reply is checked against the question: it must name the claim asked about, and
each device it reserves must be one the claim asked for; anything else is
``malformed_reply`` (the plugin then reserves nothing it cannot account for).
"""

from __future__ import annotations

from collections.abc import Sequence

from gpulet_allocator import protocol as p
from gpulet_allocator.kubelet.dra.contract import ClaimDevice, Reservation
from gpulet_allocator.kubelet.dra.terms import claim_requests, reservation
from gpulet_common import subjects
from gpulet_common.bus import Bus
from gpulet_common.refusal import Refused


class NatsDecisionCore:
    def __init__(self, bus: Bus, node: str, *, timeout_s: float) -> None:
        self._bus = bus
        self._node = node
        self._timeout_s = timeout_s

    async def reserve_claim(
        self,
        claim_uid: str,
        devices: Sequence[ClaimDevice],
        *,
        namespace: str = "",
        name: str = "",
    ) -> Reservation:
        request = p.ReserveClaimRequest(
            claim_uid=claim_uid,
            devices=claim_requests(devices),
            namespace=namespace,
            name=name,
        )
        reply = await self._bus.request(
            subjects.allocator_endpoint(self._node, p.ENDPOINT_RESERVE_CLAIM),
            request,
            p.RESERVE_CLAIM_REQUEST,
            p.RESERVE_CLAIM_REPLY,
            timeout_s=self._timeout_s,
        )
        asked = {d.device for d in devices}
        got = [d.device for d in reply.devices]
        if reply.claim_uid != claim_uid or len(set(got)) != len(got) or not set(got) <= asked:
            raise Refused(
                "malformed_reply",
                f"reserve-claim answered for {reply.claim_uid[:64]!r} with devices "
                f"{sorted(got)[:8]}, not for claim {claim_uid}",
            )
        return reservation(claim_uid, reply.allocation, reply.devices)

    async def release_claim(self, claim_uid: str) -> bool:
        reply = await self._bus.request(
            subjects.allocator_endpoint(self._node, p.ENDPOINT_RELEASE_CLAIM),
            p.ReleaseClaimRequest(claim_uid=claim_uid),
            p.RELEASE_CLAIM_REQUEST,
            p.RELEASE_CLAIM_REPLY,
            timeout_s=self._timeout_s,
        )
        return reply.released
