"""The allocator contract: what the device plugin and the allocator both speak.

Neutral ground: the decision core (:mod:`gpulet_allocator.decide`) and the kubelet
adapters (:mod:`gpulet_allocator.kubelet`) both import this module, and it imports
neither of them (only the Koordinator resource names, :mod:`~gpulet_allocator.decide.koordinator`).
It holds

* the share units (:data:`CORES_PER_GPU` core units per card, memory units of
  :data:`MEMORY_UNIT_BYTES`) and the device IDs kubelet is given for them
  (:func:`parse_device_id`), with the resources they belong to (:func:`resource_specs`);
  time-slicing replicas' IDs ``<uuid>::<n>`` (:func:`replica_device_id`);
* what a container gets (:class:`ContainerAllocation`);
* the NATS API below, and its errors.

NATS API
--------
The allocator is a ``nats.micro`` service named :data:`SERVICE_NAME`; its endpoints
for node ``N`` are ``gpulet.allocator.<token(N)>.<endpoint>`` (see
:func:`gpulet_common.subjects.allocator_endpoint`):

========== ============================ =============================================
endpoint   request                      reply
========== ============================ =============================================
allocate   :class:`AllocateRequest`     :class:`AllocateReply`
allocate-  :class:`AllocateBatchRequest` :class:`AllocateBatchReply`
batch
preferred  :class:`PreferredAllocation  :class:`PreferredAllocationReply`
           Request`
release    :class:`ReleaseRequest`      :class:`ReleaseReply`
state      :class:`StateRequest`        :class:`StateReply`
reset      :class:`ResetRequest`        :class:`ResetReply`
withheld   :class:`WithheldRequest`     :class:`WithheldReply`
reserve-   :class:`ReserveClaimRequest` :class:`ReserveClaimReply`
claim
release-   :class:`ReleaseClaimRequest` :class:`ReleaseClaimReply`
claim
held       :class:`~gpulet_common.       :class:`~gpulet_common.messages.HeldReply`
           messages.HeldRequest`
pods       :class:`~gpulet_common.       :class:`~gpulet_common.messages.PodsReply`
           messages.HeldRequest`
========== ============================ =============================================

``reserve-claim`` and ``release-claim`` are the DRA kubelet plugin's
(:mod:`gpulet_allocator.kubelet.dra`): a ResourceClaim's devices reserved under the
claim's UID in the same ledger as the device plugin's allocations, so a GPU never has
two owners whichever adapter asked (rules: :mod:`gpulet_allocator.decide.claims`).
Both are idempotent and answered once the change is durable. ``held`` is the
reporter's (``dra.mode`` both): the GPUs the device plugin's allocations hold, a long
poll like ``withheld``, so the ResourceSlice publisher taints them ``NoSchedule``; its
types are in :mod:`gpulet_common.messages`, since the reporter may not import this.
``pods`` is the collector's, the same kind of long poll: which container holds which
GPU, MIG device, share or time-slicing replica, as the allocator's PodResources pass
read it (the allocator is kubelet's one PodResources reader on the node; the collector
labels its DCGM_FI_* metrics with the answer).

``allocate-batch`` carries several kubelet calls in one message: the device plugin
coalesces the Allocate calls that arrive while one of its requests is in flight
(:mod:`gpulet_allocator.kubelet.deviceplugin.nats_backend`). Each call is decided on
its own, in order, exactly as if it had come alone; the answer lists one
:class:`AllocateOutcome` per call (containers, or the refusal), and leaves once all
of them are durable.

``withheld`` tells the device plugin which cards kubelet must not count as whole GPUs
(they hold shares), so that its whole-GPU ``ListAndWatch`` lists them ``Unhealthy``.
It is a long poll: a request that names the current ``epoch`` and ``version`` is
answered when the set changes, or after ``wait_s`` (at most :data:`MAX_WITHHELD_WAIT_S`).

``reset`` is the operator's: after a corrupt checkpoint the allocator refuses to
allocate (``checkpoint_lost``) until PodResources rebuilt its record or an operator
accepts the loss (``gpulet allocator reset --confirm``, which sends ``confirm``).

All bodies are JSON, versioned by ``schema_version`` and evolved by adding fields with
defaults only (like :mod:`gpulet_common.messages`). Each type has one codec here.

Errors
------
gpulet's one convention (:mod:`gpulet_common.refusal`): the engine and the core raise
:class:`~gpulet_common.refusal.Refused`; the service answers it with an
:class:`~gpulet_common.messages.ErrorReply` body and nats.micro's
``Nats-Service-Error`` / ``Nats-Service-Error-Code`` headers; the caller's
:meth:`~gpulet_common.bus.Bus.request` raises the same ``Refused`` again, and the device
plugin gives kubelet the gRPC status of its code. The codes, their wire statuses and
their gRPC codes are one table, :data:`gpulet_common.refusal.STATUS`. Clients ask with
:meth:`~gpulet_common.bus.Bus.request` (trace context, bounded, decoded totally).
"""

from __future__ import annotations

import enum
from typing import Final, Literal

import msgspec

from gpulet_allocator.decide.koordinator import RES_GPU_CORE, RES_GPU_MEMORY_RATIO
from gpulet_common import subjects
from gpulet_common.codec import Codec
from gpulet_common.messages import ErrorReply
from gpulet_common.podresources import SHARE_SEPARATOR
from gpulet_common.remediation import ENDPOINT_REMEDIATION as ENDPOINT_REMEDIATION_COMMON
from gpulet_common.settings.allocator import ResourceNames

# --- units and device IDs -----------------------------------------------------------------

# Core units per card: below it a share of one card, a multiple of it whole cards.
CORES_PER_GPU: Final = 100
MEMORY_UNIT_MIB: Final = 256
MEMORY_UNIT_BYTES: Final = MEMORY_UNIT_MIB * 1024 * 1024
_CORE_TAG: Final = "core"
_MEM_TAG: Final = "mem"
_RATIO_TAG: Final = "ratio"
RATIO_UNITS_PER_GPU: Final = 100
_SEPARATOR: Final = SHARE_SEPARATOR


class ResourceKind(enum.StrEnum):
    WHOLE = "whole"
    CORE = "core"
    MEMORY = "memory"
    RATIO = "ratio"
    # A MIG resource of the mixed strategy (nvidia.com/mig-<profile>): the device
    # plugin's only; its IDs are MIG UUIDs, whole-kind IDs to the allocator.
    MIG = "mig"
    # A time-slicing replica ``<uuid>::<n>`` (gpulet_allocator.timeslicing): listed under
    # the whole-GPU resource instead of its GPU, taken by one container at most.
    REPLICA = "replica"


class ResourceSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One resource the plugin serves."""

    name: str
    kind: ResourceKind
    # Kubelet asks GetPreferredAllocation only when this is advertised. Shares get
    # their physical GPU picked by the allocator in Allocate, so a hint is useless.
    preferred_allocation: bool = False


class ParsedDeviceId(msgspec.Struct, frozen=True, kw_only=True):
    gpu_uuid: str
    kind: ResourceKind
    unit: int | None = None


def resource_specs(
    names: ResourceNames, *, shares: bool = True, profile: str = "gpulet"
) -> list[ResourceSpec]:
    """The resources to serve: whole GPUs always, shares unless disabled (gpulet's
    core/memory, or Koordinator's core/memory-ratio under the koordinator profile)."""
    specs = [ResourceSpec(name=names.gpu, kind=ResourceKind.WHOLE, preferred_allocation=True)]
    if shares and profile == "koordinator":
        specs.append(ResourceSpec(name=RES_GPU_CORE, kind=ResourceKind.CORE))
        specs.append(ResourceSpec(name=RES_GPU_MEMORY_RATIO, kind=ResourceKind.RATIO))
    elif shares:
        specs.append(ResourceSpec(name=names.core, kind=ResourceKind.CORE))
        specs.append(ResourceSpec(name=names.memory, kind=ResourceKind.MEMORY))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"resource names must be distinct: {[s.name for s in specs]}")
    return specs


def core_device_id(gpu_uuid: str, unit: int) -> str:
    # A UUID is 40 characters, so "<uuid>::core-99" stays under kubelet's 63.
    return f"{gpu_uuid}{_SEPARATOR}{_CORE_TAG}-{unit}"


def memory_device_id(gpu_uuid: str, unit: int) -> str:
    return f"{gpu_uuid}{_SEPARATOR}{_MEM_TAG}-{unit}"


def ratio_device_id(gpu_uuid: str, unit: int) -> str:
    return f"{gpu_uuid}{_SEPARATOR}{_RATIO_TAG}-{unit}"


def replica_device_id(gpu_uuid: str, replica: int) -> str:
    """NVIDIA's time-slicing replica ID, ``<uuid>::<n>``."""
    return f"{gpu_uuid}{_SEPARATOR}{replica}"


def memory_units(memory_total_bytes: int) -> int:
    """Memory units of a card; a partial last unit is not offered."""
    return max(memory_total_bytes, 0) // MEMORY_UNIT_BYTES


def parse_device_id(device_id: str) -> ParsedDeviceId:
    """Map a device ID of any resource back to its GPU; ValueError if malformed."""
    uuid, sep, suffix = device_id.partition(_SEPARATOR)
    if not uuid:
        raise ValueError(f"malformed device id {device_id!r}")
    if not sep:
        return ParsedDeviceId(gpu_uuid=uuid, kind=ResourceKind.WHOLE)
    if suffix.isdigit() and suffix.isascii() and len(suffix) <= 4:
        return ParsedDeviceId(gpu_uuid=uuid, kind=ResourceKind.REPLICA, unit=int(suffix))
    tag, dash, number = suffix.rpartition("-")
    if not dash or not number.isdigit():
        raise ValueError(f"malformed device id {device_id!r}")
    if tag == _CORE_TAG:
        return ParsedDeviceId(gpu_uuid=uuid, kind=ResourceKind.CORE, unit=int(number))
    if tag == _MEM_TAG:
        return ParsedDeviceId(gpu_uuid=uuid, kind=ResourceKind.MEMORY, unit=int(number))
    if tag == _RATIO_TAG:
        return ParsedDeviceId(gpu_uuid=uuid, kind=ResourceKind.RATIO, unit=int(number))
    raise ValueError(f"malformed device id {device_id!r}")


def card_id(device_id: str) -> str:
    """The ledger card a whole-kind ID names: a time-slicing replica is a card of its
    own (its ID), any other ID its GPU's (or MIG device's) UUID; ValueError if malformed."""
    parsed = parse_device_id(device_id)
    return device_id if parsed.kind is ResourceKind.REPLICA else parsed.gpu_uuid


# --- what a container gets ----------------------------------------------------------------


class Mount(msgspec.Struct, frozen=True, kw_only=True):
    container_path: str
    host_path: str
    read_only: bool = False


class DeviceSpec(msgspec.Struct, frozen=True, kw_only=True):
    container_path: str
    host_path: str
    permissions: str = "rw"


class ContainerAllocation(msgspec.Struct, frozen=True, kw_only=True):
    """What one container gets; maps onto kubelet's ContainerAllocateResponse.

    ``gpus`` lists the UUIDs of the physical GPUs the allocator chose: the plugin turns
    them into ``/dev/nvidiaN`` plus control device specs itself, because only the node
    knows which device files exist. ``devices`` are extra specs; any of them under
    ``/dev`` that does not exist is dropped too.
    """

    gpus: list[str] = []
    envs: dict[str, str] = {}
    mounts: list[Mount] = []
    devices: list[DeviceSpec] = []
    annotations: dict[str, str] = {}
    # Fully qualified CDI names, e.g. "nvidia.com/gpu=GPU-...".
    cdi_devices: list[str] = []


class PreferredRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One container of a GetPreferredAllocation call."""

    available: list[str]
    must_include: list[str] = []
    size: int


# --- the NATS API ---------------------------------------------------------------------

PROTOCOL_VERSION: Final = 1
SERVICE_NAME: Final = "gpulet-allocator"

ENDPOINT_ALLOCATE: Final = "allocate"
ENDPOINT_PREFERRED: Final = "preferred"
ENDPOINT_RELEASE: Final = "release"
ENDPOINT_STATE: Final = "state"
ENDPOINT_ALLOCATE_BATCH: Final = "allocate-batch"
ENDPOINT_RESET: Final = "reset"
ENDPOINT_WITHHELD: Final = "withheld"
ENDPOINT_RESERVE_CLAIM: Final = "reserve-claim"
ENDPOINT_RELEASE_CLAIM: Final = "release-claim"
ENDPOINT_HELD: Final = subjects.ALLOCATOR_HELD_ENDPOINT
# Which container holds which device, from PodResources (the collector's pod labels).
ENDPOINT_PODS: Final = subjects.ALLOCATOR_PODS_ENDPOINT
# What remediation would do now (its types are common: the health CLI asks it).
ENDPOINT_REMEDIATION: Final = ENDPOINT_REMEDIATION_COMMON
ENDPOINTS: Final = (
    ENDPOINT_ALLOCATE,
    ENDPOINT_PREFERRED,
    ENDPOINT_RELEASE,
    ENDPOINT_STATE,
    ENDPOINT_ALLOCATE_BATCH,
    ENDPOINT_RESET,
    ENDPOINT_WITHHELD,
    ENDPOINT_RESERVE_CLAIM,
    ENDPOINT_RELEASE_CLAIM,
    ENDPOINT_HELD,
    ENDPOINT_REMEDIATION,
    ENDPOINT_PODS,
)
# The most devices one claim may reserve (a ResourceClaim holds at most 32 results
# per request; 128 bounds the message, as the kubelet plugin does).
MAX_CLAIM_DEVICES: Final = 128
# The longest a withheld long poll is held open by the allocator.
MAX_WITHHELD_WAIT_S: Final = 30.0
# The most kubelet calls one allocate-batch may carry (the plugin sends fewer).
MAX_BATCH_CALLS: Final = 64


class _Body(msgspec.Struct, frozen=True, kw_only=True):
    schema_version: int = PROTOCOL_VERSION


class AllocateRequest(_Body, frozen=True, kw_only=True):
    """Kubelet's Allocate for one resource: the device IDs of each container."""

    resource: str
    containers: list[list[str]]


class AllocateReply(_Body, frozen=True, kw_only=True):
    containers: list[ContainerAllocation]


class AllocateOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What one call of a batch got: its containers, or the refusal (then ``error``)."""

    containers: list[ContainerAllocation] = []
    error: ErrorReply | None = None


class AllocateBatchRequest(_Body, frozen=True, kw_only=True):
    """Several kubelet Allocate calls, each decided on its own, in order."""

    calls: list[AllocateRequest]


class AllocateBatchReply(_Body, frozen=True, kw_only=True):
    """One outcome per call, in the order of the request."""

    outcomes: list[AllocateOutcome]


class PreferredAllocationRequest(_Body, frozen=True, kw_only=True):
    resource: str
    containers: list[PreferredRequest]


class PreferredAllocationReply(_Body, frozen=True, kw_only=True):
    containers: list[list[str]]


class ReleaseRequest(_Body, frozen=True, kw_only=True):
    """Free allocations explicitly (when kubelet's PodResources API is not there).

    Kubelet's Allocate carries no pod, so an allocation is named by its ID (see the
    ``state`` endpoint and the ``gpulet.io/allocation`` container annotation), by the
    pod ``namespace/name`` once PodResources has told which pod holds it, or by the
    device IDs kubelet gave one container of ``resource``.
    """

    allocation_ids: list[str] = []
    pods: list[str] = []
    resource: str = ""
    device_ids: list[str] = []
    reason: str = "explicit"


class GrantView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One Allocate answered for one container and resource."""

    key: str
    resource: str
    kind: Literal["whole", "core", "memory", "ratio"]
    units: int
    created_at: float
    pod: str = ""
    container: str = ""
    pod_uid: str = ""


class AllocationView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: str
    kind: Literal["whole", "share"]
    gpus: list[str]
    cores: int = 0
    memory_units: int = 0
    grants: list[GrantView] = []


class ReleaseReply(_Body, frozen=True, kw_only=True):
    released: list[AllocationView] = []


class StateRequest(_Body, frozen=True, kw_only=True):
    pass


class GpuView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    uuid: str
    index: int
    healthy: bool
    present: bool
    cores_used: int
    memory_units: int
    memory_used: int
    whole: str = ""
    shares: list[str] = []


class StateReply(_Body, frozen=True, kw_only=True):
    node: str
    ready: bool
    gpus: list[GpuView] = []
    allocations: list[AllocationView] = []
    checkpoint: str = ""
    inventory_generation: int = 0
    # Not empty: the record of allocations is lost and Allocate is refused (why, and
    # what ends it).
    lost: str = ""


class ResetRequest(_Body, frozen=True, kw_only=True):
    """Accept the loss of the allocation record; refused unless ``confirm``."""

    confirm: bool = False
    requested_by: str = ""


class ResetReply(_Body, frozen=True, kw_only=True):
    """``accepted``: a loss was accepted (False: there was none). ``detail`` says what."""

    accepted: bool
    detail: str
    # The allocations kept (rebuilt from PodResources before the reset).
    allocations: list[AllocationView] = []


class WithheldRequest(_Body, frozen=True, kw_only=True):
    """Which cards may not go whole; wait up to ``wait_s`` for a change past
    ``version`` of ``epoch`` (an allocator that restarted has a new epoch)."""

    epoch: str = ""
    version: int = 0
    wait_s: float = 0.0


class WithheldReply(_Body, frozen=True, kw_only=True):
    """The cards kubelet must not count as whole GPUs, each with the reason; and the
    time-slicing replicas each GPU is offered as now (``sharing.time_slicing``, the
    node's config; a GPU not named is not time-sliced)."""

    epoch: str
    version: int
    withheld: dict[str, str] = {}
    replicas: dict[str, int] = {}


class ClaimDeviceRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One device of a claim: its DRA name (``gpu-<minor>``) and the consumed share.

    ``cores`` in percent (1-100) and ``memory_bytes``; both None: the whole GPU.
    """

    device: str
    cores: int | None = None
    memory_bytes: int | None = None


class ReserveClaimRequest(_Body, frozen=True, kw_only=True):
    """Reserve a ResourceClaim's devices under its UID (idempotent)."""

    claim_uid: str
    devices: list[ClaimDeviceRequest] = []
    namespace: str = ""
    name: str = ""


class ReservedClaimDevice(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A device reserved: the GPU, and the share's limits (None: the whole GPU). The
    ledger's checkpoint records a claim's devices with this Struct too
    (``state.records.ClaimDeviceRecord``)."""

    device: str
    uuid: str
    minor: int
    cores: int | None = None
    memory_mib: int | None = None


class ReserveClaimReply(_Body, frozen=True, kw_only=True):
    claim_uid: str
    # The ledger's allocation ID: the claim UID.
    allocation: str
    devices: list[ReservedClaimDevice] = []


class ReleaseClaimRequest(_Body, frozen=True, kw_only=True):
    claim_uid: str


class ReleaseClaimReply(_Body, frozen=True, kw_only=True):
    """``released``: the claim held something (False: nothing to release)."""

    released: bool = False


ALLOCATE_REQUEST = Codec(AllocateRequest)
ALLOCATE_REPLY = Codec(AllocateReply)
ALLOCATE_BATCH_REQUEST = Codec(AllocateBatchRequest)
ALLOCATE_BATCH_REPLY = Codec(AllocateBatchReply)
PREFERRED_REQUEST = Codec(PreferredAllocationRequest)
PREFERRED_REPLY = Codec(PreferredAllocationReply)
RELEASE_REQUEST = Codec(ReleaseRequest)
RELEASE_REPLY = Codec(ReleaseReply)
STATE_REQUEST = Codec(StateRequest)
STATE_REPLY = Codec(StateReply)
RESET_REQUEST = Codec(ResetRequest)
RESET_REPLY = Codec(ResetReply)
WITHHELD_REQUEST = Codec(WithheldRequest)
WITHHELD_REPLY = Codec(WithheldReply)
RESERVE_CLAIM_REQUEST = Codec(ReserveClaimRequest)
RESERVE_CLAIM_REPLY = Codec(ReserveClaimReply)
RELEASE_CLAIM_REQUEST = Codec(ReleaseClaimRequest)
RELEASE_CLAIM_REPLY = Codec(ReleaseClaimReply)
