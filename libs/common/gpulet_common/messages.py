"""Wire messages exchanged over NATS.

Design
------
Every message is a frozen msgspec Struct that carries ``schema_version``. Schemas
evolve only by *adding* fields with defaults, so an old consumer keeps decoding a
newer producer's messages (unknown fields are ignored) and a new consumer decodes an
old producer's messages (missing fields take their default).

Per-GPU structs use ``omit_defaults=True``: this keeps payloads small and makes an NVML
field that the GPU does not support (NVML ``NOT_SUPPORTED``) *absent* on the wire
rather than ``null``.

The codecs for these types live in :mod:`gpulet_common.codec`; the subjects they
travel on live in :mod:`gpulet_common.subjects`.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal, get_args

import msgspec

SCHEMA_VERSION = 1

# Wire-level ranges, checked by msgspec while decoding (cross-field facts -- node,
# unique UUIDs, clock skew -- are checked by gpulet_common.validate).
# A producer keeps its values inside them (gpulet_common.nvml.adapter does): one value
# out of range makes every consumer refuse the whole message.
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PERCENT_RANGE = (0, 100)
Percent = Annotated[int, msgspec.Meta(ge=PERCENT_RANGE[0], le=PERCENT_RANGE[1])]
# Degrees Celsius as NVML reports them (unsigned), with room for any sensor.
CELSIUS_RANGE = (-273, 1000)
Celsius = Annotated[int, msgspec.Meta(ge=CELSIUS_RANGE[0], le=CELSIUS_RANGE[1])]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
# An NVLink link id and a GPU's list of them (NVML numbers links from 0 and has at most
# NVML_NVLINK_MAX_LINKS = 36 per GPU; the wire leaves room and bounds the list).
NvLinkId = Annotated[int, msgspec.Meta(ge=0, lt=64)]
NvLinkIds = Annotated[list[NvLinkId], msgspec.Meta(max_length=64)]


class _Message(msgspec.Struct, frozen=True, kw_only=True):
    # Top-level messages always carry every field, schema_version included, so a
    # consumer in any language can check the version. Nested per-GPU structs omit
    # absent (unsupported) fields instead.
    schema_version: int = SCHEMA_VERSION


# --- inventory ---------------------------------------------------------------------


class PeerLink(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """How this GPU reaches one other GPU of the node."""

    peer_uuid: str
    peer_index: NonNegative
    # NVML common-ancestor level: 0 INTERNAL, 10 SINGLE (PIX), 20 MULTIPLE (PXB),
    # 30 HOSTBRIDGE (PHB), 40 NODE, 50 SYSTEM (SYS). None when NVML cannot tell.
    level: NonNegative | None = None
    # Active NVLinks to this peer (direct, or through the NVSwitch fabric). A link that
    # went down is not counted here (so a consumer that reads only ``nvlinks`` stops
    # counting it) but in ``nvlinks_down``; added after schema version 1.
    nvlinks: NonNegative = 0
    nvlinks_down: NonNegative = 0


class MigDevice(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """One MIG device of a MIG-enabled GPU: a compute instance of a GPU instance.

    ``profile`` is named as NVML's tools name it (``1g.10gb``, ``1c.2g.20gb``,
    ``1g.10gb+me``); the counts are NVML's device attributes. Added after schema
    version 1.
    """

    uuid: str
    # Its slot among the parent's MIG devices (nvmlDeviceGetMigDeviceHandleByIndex).
    index: NonNegative
    gpu_instance_id: NonNegative
    compute_instance_id: NonNegative
    profile: str = ""
    memory_total_bytes: NonNegative = 0
    multiprocessors: NonNegative = 0
    slices_gi: NonNegative = 0
    slices_ci: NonNegative = 0
    copy_engines: NonNegative = 0
    decoders: NonNegative = 0
    encoders: NonNegative = 0
    jpegs: NonNegative = 0
    ofas: NonNegative = 0


MigDevices = Annotated[list[MigDevice], msgspec.Meta(max_length=64)]
MigMode = Literal["enabled", "disabled"]


class GpuInfo(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    uuid: str
    index: NonNegative
    minor: NonNegative | None = None
    name: str = ""
    memory_total_bytes: NonNegative = 0
    pci_bus_id: str = ""
    numa_node: NonNegative | None = None
    cpu_affinity: list[NonNegative] = []
    topology: list[PeerLink] = []
    serial: str | None = None
    board_id: int | None = None
    compute_capability: tuple[int, int] | None = None
    ecc_enabled: bool | None = None
    # Temperature thresholds reported by NVML (degrees C); absent when unsupported.
    temp_shutdown_c: Celsius | None = None
    temp_slowdown_c: Celsius | None = None
    temp_gpu_max_c: Celsius | None = None
    temp_mem_max_c: Celsius | None = None
    # Which NVML event types the GPU accepts (bit mask), for the health service.
    supported_events: NonNegative | None = None
    # Physical module (SXM slot) id, nvmlDeviceGetModuleId; absent when unsupported.
    module_id: NonNegative | None = None
    # NVLink link ids (nvmlDeviceGetNvLinkState, per link) active at the last read, and
    # those this collector saw active before that are inactive now (down). A link never
    # seen active (no cable, no bridge, or down since before the collector started) is
    # in neither list. Re-read every ``collector.slow_period_s``; the inventory is
    # republished when they change. Added after schema version 1.
    nvlinks_up: NvLinkIds = []
    nvlinks_down: NvLinkIds = []
    # MIG (added after schema version 1): nvmlDeviceGetMaxMigDeviceCount (0: not
    # MIG-capable; absent: not known, e.g. a driver without the call), the current and
    # the pending MIG mode (absent: the GPU has no MIG; a pending change applies at
    # the next GPU reset), and the MIG devices while MIG is enabled.
    mig_max_devices: NonNegative | None = None
    mig_mode: MigMode | None = None
    mig_mode_pending: MigMode | None = None
    mig_devices: MigDevices = []

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_max_devices)


class UnreadableGpu(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """A GPU that NVML counts but whose identity could not be read (lost, or failing).

    Real NVML keeps a GPU that fell into GPU_IS_LOST in ``nvmlDeviceGetCount``; its
    handle or its calls fail. It is reported by its NVML index with whatever identity
    could still be read. Added after schema version 1.
    """

    index: NonNegative
    uuid: str | None = None
    pci_bus_id: str | None = None
    name: str | None = None
    # True when NVML said GPU_IS_LOST; False for another failure.
    lost: bool = False
    reason: str = ""


UnreadableGpus = Annotated[list[UnreadableGpu], msgspec.Meta(max_length=64)]


class Inventory(_Message, frozen=True, kw_only=True):
    """Everything a consumer needs to know about a node's GPUs."""

    node: str
    generation: NonNegative = 0
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    nvml_version: str | None = None
    gpus: list[GpuInfo] = []
    # Set when NVML cannot be used: the service runs but has nothing to report.
    degraded_reason: str | None = None
    nvml_backend: Literal["nvml", "mock", "none"] = "nvml"
    published_at: float = 0.0
    # The collector's own order (see gpulet_common.ordering): ``seq`` counts its
    # messages from 1, ``boot_id`` names the collector process. Consumers order by
    # these, never by ``published_at``; 0 / "" is a sender that does not sequence.
    seq: NonNegative = 0
    boot_id: str = ""
    # NVML's GPU count (``nvmlDeviceGetCount``) when the inventory was built, and the
    # GPUs it counts that could not be listed in ``gpus``; None / [] from a collector
    # that does not say. Added after schema version 1.
    nvml_count: NonNegative | None = None
    unreadable: UnreadableGpus = []


# --- samples -----------------------------------------------------------------------


class MigSample(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """One reading of one MIG device: its memory (its GPU instance's, which the
    compute instances of one GPU instance share). Added after schema version 1."""

    uuid: str
    gpu_instance_id: NonNegative
    compute_instance_id: NonNegative
    memory_used_bytes: NonNegative | None = None
    memory_free_bytes: NonNegative | None = None


MigSamples = Annotated[list[MigSample], msgspec.Meta(max_length=64)]


class GpuSample(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """One reading of one GPU. A None field was not supported by the GPU."""

    uuid: str
    index: NonNegative
    timestamp: float
    gpu_util_pct: Percent | None = None
    mem_util_pct: Percent | None = None
    memory_used_bytes: NonNegative | None = None
    memory_free_bytes: NonNegative | None = None
    temperature_c: Celsius | None = None
    power_mw: NonNegative | None = None
    sm_clock_mhz: NonNegative | None = None
    mem_clock_mhz: NonNegative | None = None
    ecc_volatile_corrected: NonNegative | None = None
    ecc_volatile_uncorrected: NonNegative | None = None
    ecc_aggregate_corrected: NonNegative | None = None
    ecc_aggregate_uncorrected: NonNegative | None = None
    remapped_rows_correctable: NonNegative | None = None
    remapped_rows_uncorrectable: NonNegative | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    retired_pages_pending: bool | None = None
    throttle_reasons: NonNegative | None = None
    # Set when the GPU could not be read this period: "lost", "timeout", "error: ...".
    error: str | None = None
    # --- slow fields (issue 15): read every ``collector.slow_period_s``, not every period,
    # because on a real GPU each read costs milliseconds (one nvmlDeviceGetFieldValues
    # batch, GPM). Between two slow reads a sample repeats the last values;
    # ``slow_fields_at`` says when they were read. ecc_aggregate_* above are read on
    # this cadence too.
    slow_fields_at: float | None = None
    memory_temperature_c: int | None = None
    # Energy since the driver loaded, in millijoules (a counter).
    energy_mj: int | None = None
    pcie_replay_count: int | None = None
    # NVLink error counters, summed over the GPU's links (counters).
    nvlink_crc_flit_errors: int | None = None
    nvlink_crc_data_errors: int | None = None
    nvlink_replay_errors: int | None = None
    nvlink_recovery_errors: int | None = None
    # NVLink bandwidth counter set 0, all links (a counter, in the counter's units).
    nvlink_bandwidth_total: int | None = None
    # GPM (Hopper and later): activity ratios 0..1 over the last slow period.
    gr_engine_active: float | None = None
    tensor_active: float | None = None
    dram_active: float | None = None
    # Its MIG devices' memory, every period, while MIG is enabled (issue 27; added after
    # schema version 1).
    mig: MigSamples = []


class SampleBatch(_Message, frozen=True, kw_only=True):
    """The samples of all GPUs of one node taken in one period."""

    node: str
    timestamp: float
    samples: list[GpuSample] = []
    inventory_generation: NonNegative = 0
    # As on Inventory: the collector's sequence and process, never ``timestamp``,
    # order batches (a batch older than the newest seen is dropped).
    seq: NonNegative = 0
    boot_id: str = ""


class InventoryRequest(_Message, frozen=True, kw_only=True):
    """Ask the collector to republish (and return) the inventory."""

    reason: str = "request"


# --- health ------------------------------------------------------------------------

Severity = Literal["info", "warning", "critical", "fatal"]
# The one ranking of severities (worse ranks higher), and those that make a GPU unhealthy.
SEVERITY_RANK: Final[dict[str, int]] = {s: rank for rank, s in enumerate(get_args(Severity))}
UNHEALTHY_SEVERITIES: Final = frozenset(
    s for s, r in SEVERITY_RANK.items() if r >= SEVERITY_RANK["critical"]
)
Action = Literal[
    "none",
    "restart_app",
    "reset_gpu",
    "reboot",
    "hardware_inspection",
    "operator_check",
]
HealthKind = Literal[
    "xid",
    "ecc_uncorrectable",
    "ecc_correctable_rate",
    "remap_pending",
    "remap_failure",
    "thermal",
    "thermal_slowdown",
    "thermal_shutdown",
    "gpu_lost",
    "gpu_removed",
    # A GPU the node had before (health service's memory) is not there at start.
    # Added to the schema after version 1 (a new value: old consumers that check
    # kinds strictly see an unknown kind).
    "gpu_missing",
    "gpu_added",
    "recovered",
    "cleared",
    "nvml_unavailable",
    "buffer_overflow",
    # The hardware holds the clocks down (HW slowdown, power brake); added after
    # schema version 1, like gpu_missing.
    "clock_slowdown",
    # PCIe replay and NVLink error counters rising fast; added after schema version 1.
    "pcie_replay_rate",
    "nvlink_error_rate",
    # An NVLink that was up went down (a warning; ``recovered`` when it is up again).
    # Added after schema version 1, like gpu_missing.
    "nvlink_down",
    # Remediation by reset holds the GPU out of service (quarantined, escalated,
    # retired): never written by the health service, overlaid by the node view from
    # the gpulet_heal KV (gpulet_common.heal). Added after schema version 1.
    "remediation",
]


class HealthEvent(_Message, frozen=True, kw_only=True):
    """One health fact about one GPU, published on ``gpu.health.<node>``."""

    event_id: str
    node: str
    gpu_uuid: str
    gpu_index: NonNegative | None = None
    kind: HealthKind
    severity: Severity
    healthy: bool
    reason: str
    message: str = ""
    action: Action = "none"
    observed_value: float | None = None
    threshold: float | None = None
    xid: NonNegative | None = None
    # The condition this event raises or clears, e.g. "xid:79" or "thermal".
    condition: str = ""
    # How many identical faults were folded into this event by de-duplication.
    repeat_count: Annotated[int, msgspec.Meta(ge=1)] = 1
    observed_at: float
    # By-product XIDs (45, and 43 after another fault) counted as evidence for this
    # event's fault, never published as faults of their own. Added after schema version 1.
    evidence_count: NonNegative = 0
    # The GPU's recovery action as the driver last reported it (NVML field 230, R570+):
    # none, gpu_reset, node_reboot, drain_p2p, drain_and_reset, recover_imex_domain,
    # bus_reset, system_reboot or unknown_<n>; empty where it was never read or the
    # driver does not report it. Added after schema version 1.
    recovery_action: str = ""
    published_at: float = 0.0
    # The node's boot ID (/proc/sys/kernel/random/boot_id) when the event was made: which
    # boot of the kernel the fact belongs to (not the ``boot_id`` of the ordering
    # messages, which names a process). "unknown" where it could not be read; empty
    # from older health services. Added after schema version 1.
    node_boot_id: str = ""
    # When the condition this event raises, repeats or ends began. On recovered and
    # cleared events also the kind and severity the condition had, so a consumer that
    # raised an alert from the raise event can resolve exactly that alert.
    condition_since: float | None = None
    condition_kind: HealthKind | None = None
    condition_severity: Severity | None = None


class ActiveCondition(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    condition: str
    kind: HealthKind
    severity: Severity
    reason: str
    message: str = ""
    action: Action = "none"
    sticky: bool = False
    since: float = 0.0
    # By-product XIDs counted as evidence for this condition (added after version 1).
    evidence_count: NonNegative = 0
    # The node's boot id when it was raised, for a hold until a reboot (added after
    # version 1; empty for other conditions).
    boot_id: str = ""
    # The MIG device (its UUID) the condition is confined to: a fault that named a GPU
    # and compute instance. Empty: the whole GPU. Added after schema version 1.
    mig_device: str = ""
    # For a hold until a GPU reset (``recovery_action``): a GPU reset was seen since it
    # was raised, so the driver reading NONE again ends it, after a restart too. Added
    # after schema version 1.
    reset_seen: bool = False


class GpuHealth(msgspec.Struct, frozen=True, kw_only=True):
    # Every field is always on the wire (healthy: true included): KV readers in any
    # language must not have to know our defaults.
    gpu_uuid: str
    gpu_index: NonNegative | None = None
    healthy: bool = True
    present: bool = True
    conditions: list[ActiveCondition] = []
    updated_at: float = 0.0
    # The GPU as NVML last described it (no topology), so that a GPU that is not
    # present any more can still be named (the reporter keeps it in the Device).
    # Added after schema version 1; null from older health services.
    info: GpuInfo | None = None
    # MIG devices (UUIDs) an unhealthy condition confined to them marks unhealthy; the
    # GPU itself stays as ``healthy`` says. An unhealthy GPU makes every MIG device on
    # it unhealthy too (consumers apply that). Added after schema version 1.
    unhealthy_mig_devices: list[str] = []
    # The GPU's recovery action as the driver last reported it (NVML field 230), as in
    # HealthEvent.recovery_action, or "unsupported" where the driver does not report
    # it; empty where never read. A restart reads it back (shown; the hold it governs
    # ends only on a reading taken after the restart). Added after schema version 1.
    recovery_action: str = ""


class HealthState(_Message, frozen=True, kw_only=True):
    """Current health of every GPU of a node: the answer to a state query."""

    node: str
    gpus: list[GpuHealth] = []
    updated_at: float = 0.0


class HealthStateRequest(_Message, frozen=True, kw_only=True):
    gpu: str | None = None


class HealthClearRequest(_Message, frozen=True, kw_only=True):
    """Operator's request to clear sticky conditions of one GPU (uuid or index)."""

    gpu: str
    condition: str | None = None
    requested_by: str = "operator"


class HeldRequest(_Message, frozen=True, kw_only=True):
    """The GPUs the device plugin's allocations hold (the allocator's ``held``
    endpoint, for the ResourceSlice publisher in ``dra.mode`` both): wait up to
    ``wait_s`` for a change past ``version`` of ``epoch`` (a long poll). The ``pods``
    endpoint (:class:`PodsReply`) is asked the same way."""

    epoch: str = ""
    version: int = 0
    wait_s: float = 0.0


class HeldReply(_Message, frozen=True, kw_only=True):
    """Each GPU a device-plugin allocation holds (whole or a share), with its holder;
    and the time-slicing replicas each GPU is offered as now (for the reporter's GFD
    labels; a GPU not named is not time-sliced)."""

    epoch: str
    version: int
    held: dict[str, str] = {}
    replicas: dict[str, int] = {}


# The most holders one device may list, and the longest name of each (Kubernetes'
# names are at most 253 characters): a pods reply is bounded, whoever sent it.
MAX_HOLDERS_PER_DEVICE: Final = 256
MAX_DEVICE_IDS_PER_HOLDER: Final = 64
K8sName = Annotated[str, msgspec.Meta(max_length=253)]
DeviceId = Annotated[str, msgspec.Meta(max_length=512)]


class PodHolder(_Message, frozen=True, kw_only=True, omit_defaults=True):
    """One container holding (part of) a device, as kubelet's PodResources lists it:
    ``resource`` and ``device_ids`` say how (a whole GPU's ID is its UUID; a share,
    a time-slicing replica ``<uuid>::N``, a MIG device its own UUID). ``device_count``
    counts them all; ``device_ids`` lists at most :data:`MAX_DEVICE_IDS_PER_HOLDER`
    (a share of 100 core units is 100 IDs), none when the reply would grow too large."""

    namespace: K8sName
    pod: K8sName
    container: K8sName
    resource: K8sName = ""
    device_ids: Annotated[list[DeviceId], msgspec.Meta(max_length=MAX_DEVICE_IDS_PER_HOLDER)] = []
    device_count: Annotated[int, msgspec.Meta(ge=0)] = 0


class PodsReply(_Message, frozen=True, kw_only=True):
    """The allocator's ``pods`` endpoint (a long poll, asked with a
    :class:`HeldRequest`): GPU or MIG device UUID -> the containers holding it, from
    the allocator's PodResources ``List`` (the one reader of it). ``source`` is
    ``"ok"`` while kubelet answers, else why it does not (then ``holders`` is the last
    known answer, or empty when kubelet is absent)."""

    epoch: str
    version: int
    holders: dict[
        Annotated[str, msgspec.Meta(max_length=128)],
        Annotated[list[PodHolder], msgspec.Meta(max_length=MAX_HOLDERS_PER_DEVICE)],
    ] = {}
    source: Annotated[str, msgspec.Meta(max_length=1024)] = ""


# --- control / errors ----------------------------------------------------------------


class ErrorReply(_Message, frozen=True, kw_only=True):
    """Reply of any request/reply endpoint that rejected a request."""

    code: str
    message: str


class MockInjectRequest(_Message, frozen=True, kw_only=True):
    """Inject a fault into the mock NVML of every process serving the node."""

    gpu: NonNegative | None = None
    fault: str
    value: float | None = None
    duration_s: NonNegativeFloat | None = None
    # An XID on one MIG device: its GPU-instance and compute-instance ids (both, or
    # neither: the whole GPU). Added after schema version 1.
    gi: NonNegative | None = None
    ci: NonNegative | None = None


class MockInjectReply(_Message, frozen=True, kw_only=True):
    applied: bool
    detail: str = ""


class Ack(_Message, frozen=True, kw_only=True):
    ok: bool = True
    detail: str = ""


# --- fleet (docs/fleet.md) -------------------------------------------------------------


class NodeStatus(_Message, frozen=True, kw_only=True):
    """A node's summary for the hub's fleet view (``gpu.fleet.<node>``, stored as key
    ``<node>`` of the hub's ``gpulet_fleet`` KV bucket).

    Sent when the set of unhealthy GPUs changes (at most once per
    ``fleet.status_min_interval_s``) and at least every ``fleet.status_heartbeat_s``.
    ``seq`` counts up within one ``boot_id`` (one run of the health service): a reader
    orders by them, never by ``published_at`` (the node's clock, informative only).
    """

    node: str
    boot_id: str
    seq: int
    gpus: int = 0
    unhealthy: list[GpuHealth] = []
    published_at: float = 0.0
