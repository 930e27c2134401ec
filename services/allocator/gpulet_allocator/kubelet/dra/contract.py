"""What the DRA kubelet plugin needs from the rest of gpulet: two small typed Protocols.

The plugin is an adapter, like the device plugin: kubelet's calls enter here, the
decisions are made in the allocator's decision core, state is kept in its ledger. In
production :class:`DecisionCore` is :class:`~.nats_core.NatsDecisionCore`, the
allocator service's ``reserve-claim`` / ``release-claim`` over NATS (rules:
:mod:`gpulet_allocator.decide.claims`); the plugin's unit tests bind it to an
in-memory core.

:class:`DecisionCore` -- reserve and release a claim's devices in **the same ledger**
as the device plugin, so a GPU never has two owners, whichever adapter asked:

* :meth:`~DecisionCore.reserve_claim` is idempotent: the same claim UID with the same
  devices returns the reservation it already holds. A device held by another claim or
  by a device-plugin allocation, unknown, or unhealthy is refused with
  :class:`~gpulet_common.refusal.Refused` (codes of the one table:
  ``insufficient_capacity``, ``unknown_device``, ``unhealthy_device``...); no answer
  is :class:`~gpulet_common.refusal.RequestTimeout`. A refusal leaves nothing reserved.
* :meth:`~DecisionCore.release_claim` releases whatever the claim holds; releasing a
  claim that holds nothing is not an error (False).
* A device that allows multiple allocations is always allocated with a
  ``consumedCapacity`` (the request policy's default when the claim names none, i.e.
  all of it): a :class:`ClaimDevice` that consumes all of the device's cores is a
  whole GPU to the core (no other share can fit beside it), and is recorded as one.

:class:`ClaimReader` -- ``GET`` one ResourceClaim (the raw JSON object, decoded by
:mod:`.claims`, never trusted): None when it does not exist; raises
:class:`ClaimReadError` when it cannot be read now.

:class:`HealthSource` -- each device's health for ``DRAResourceHealth``: the node
read model in production.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

JsonObj = dict[str, Any]
Health = Literal["healthy", "unhealthy", "unknown"]


@dataclass(frozen=True)
class ClaimDevice:
    """One allocation result of our driver, as the scheduler wrote it in the claim."""

    pool: str
    device: str  # gpu-<minor>
    requests: tuple[str, ...]  # request names, sub-request suffixes stripped
    # Consumed capacity of a shared device (allowMultipleAllocations): cores in
    # percent and memory in bytes; None when the claim takes the whole device.
    cores: int | None = None
    memory_bytes: int | None = None
    share_id: str = ""
    # adminAccess: the device is given to the claim's containers without being owned
    # (never reserved in the ledger, never refused for being held).
    admin: bool = False


@dataclass(frozen=True)
class ReservedDevice:
    device: str
    uuid: str
    minor: int
    cores: int | None = None
    memory_mib: int | None = None


@dataclass(frozen=True)
class Reservation:
    """What the core holds for one claim: the ledger's allocation ID and the devices."""

    claim_uid: str
    allocation: str
    devices: tuple[ReservedDevice, ...]


class DecisionCore(Protocol):
    async def reserve_claim(
        self,
        claim_uid: str,
        devices: Sequence[ClaimDevice],
        *,
        namespace: str = "",
        name: str = "",
    ) -> Reservation:
        """Reserve ``devices`` for the claim (idempotent); raises Refused. The claim's
        ``namespace`` and ``name`` go into the ledger's record (who holds a GPU)."""
        ...

    async def release_claim(self, claim_uid: str) -> bool:
        """Release what the claim holds; False when it held nothing."""
        ...


class ClaimReadError(Exception):
    """The claim could not be read now (API unreachable, throttled): try again later."""


class ClaimReader(Protocol):
    async def get_claim(self, namespace: str, name: str, uid: str = "") -> JsonObj | None:
        """The claim, None when it does not exist. ``uid``: the one kubelet named (a
        reader that caches answers from its cache only with a claim of that UID)."""
        ...


@dataclass(frozen=True)
class DeviceHealth:
    pool: str
    device: str
    health: Health
    since: float = 0.0
    message: str = ""


class MpsDaemons(Protocol):
    """The allocator's MPS control daemons (``gpulet_allocator.service.mps``), as the
    DRA plugin sees them when it runs in the allocator's process."""

    @property
    def faults(self) -> Mapping[str, str]:
        """GPU UUID -> why its daemon does not serve its shares."""
        ...

    def also_want(self, source: Callable[[], Mapping[str, tuple[int, int]]]) -> None:
        """Daemons for these GPUs too (UUID -> cores %, memory MiB): whole GPUs that a
        claim configured for MPS, which the ledger does not hold as shares."""
        ...

    def changed(self) -> None: ...


class HealthSource(Protocol):
    def device_health(self) -> Sequence[DeviceHealth]:
        """Every device of the driver's pool, now (never blocks)."""
        ...

    async def wait_changed(self, version: int) -> int:
        """Return when the health changed after ``version`` (the new version);
        ``version`` -1 returns the current one at once."""
        ...
