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

from typing import Annotated, Literal

import msgspec

SCHEMA_VERSION = 1

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class _Message(msgspec.Struct, frozen=True, kw_only=True):
    # Top-level messages always carry every field, schema_version included, so a
    # consumer in any language can check the version. Nested per-GPU structs omit
    # absent (unsupported) fields instead.
    schema_version: int = SCHEMA_VERSION


# --- inventory ---------------------------------------------------------------------


class PeerLink(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """How this GPU reaches one other GPU of the node."""

    peer_uuid: str
    peer_index: int
    # NVML common-ancestor level: 0 INTERNAL, 10 SINGLE (PIX), 20 MULTIPLE (PXB),
    # 30 HOSTBRIDGE (PHB), 40 NODE, 50 SYSTEM (SYS). None when NVML cannot tell.
    level: int | None = None
    nvlinks: int = 0


class GpuInfo(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    uuid: str
    index: int
    minor: int | None = None
    name: str = ""
    memory_total_bytes: int = 0
    pci_bus_id: str = ""
    numa_node: int | None = None
    cpu_affinity: list[int] = []
    topology: list[PeerLink] = []
    serial: str | None = None
    board_id: int | None = None
    compute_capability: tuple[int, int] | None = None
    ecc_enabled: bool | None = None
    # Temperature thresholds reported by NVML (degrees C); absent when unsupported.
    temp_shutdown_c: int | None = None
    temp_slowdown_c: int | None = None
    temp_gpu_max_c: int | None = None
    temp_mem_max_c: int | None = None
    # Which NVML event types the GPU accepts (bit mask), for the health service.
    supported_events: int | None = None


class Inventory(_Message, frozen=True, kw_only=True):
    """Everything a consumer needs to know about a node's GPUs."""

    node: str
    generation: int = 0
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    nvml_version: str | None = None
    gpus: list[GpuInfo] = []
    # Set when NVML cannot be used: the service runs but has nothing to report.
    degraded_reason: str | None = None
    nvml_backend: Literal["nvml", "mock", "none"] = "nvml"
    published_at: float = 0.0


# --- samples -----------------------------------------------------------------------


class GpuSample(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """One reading of one GPU. A None field was not supported by the GPU."""

    uuid: str
    index: int
    timestamp: float
    gpu_util_pct: int | None = None
    mem_util_pct: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    temperature_c: int | None = None
    power_mw: int | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    ecc_volatile_corrected: int | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    retired_pages_pending: bool | None = None
    throttle_reasons: int | None = None
    # Set when the GPU could not be read this period: "lost", "timeout", "error: ...".
    error: str | None = None


class SampleBatch(_Message, frozen=True, kw_only=True):
    """The samples of all GPUs of one node taken in one period."""

    node: str
    timestamp: float
    samples: list[GpuSample] = []
    inventory_generation: int = 0


class InventoryRequest(_Message, frozen=True, kw_only=True):
    """Ask the collector to republish (and return) the inventory."""

    reason: str = "request"


# --- health ------------------------------------------------------------------------

Severity = Literal["info", "warning", "critical", "fatal"]
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
    "gpu_added",
    "recovered",
    "cleared",
    "nvml_unavailable",
    "buffer_overflow",
]


class HealthEvent(_Message, frozen=True, kw_only=True):
    """One health fact about one GPU, published on ``gpu.health.<node>``."""

    event_id: str
    node: str
    gpu_uuid: str
    gpu_index: int | None = None
    kind: HealthKind
    severity: Severity
    healthy: bool
    reason: str
    message: str = ""
    action: Action = "none"
    observed_value: float | None = None
    threshold: float | None = None
    xid: int | None = None
    # The condition this event raises or clears, e.g. "xid:79" or "thermal".
    condition: str = ""
    # How many identical faults were folded into this event by de-duplication.
    repeat_count: int = 1
    observed_at: float
    published_at: float = 0.0
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


class GpuHealth(msgspec.Struct, frozen=True, kw_only=True):
    # Every field is always on the wire (healthy: true included): KV readers in any
    # language must not have to know our defaults.
    gpu_uuid: str
    gpu_index: int | None = None
    healthy: bool = True
    present: bool = True
    conditions: list[ActiveCondition] = []
    updated_at: float = 0.0


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


# --- control / errors ----------------------------------------------------------------


class ErrorReply(_Message, frozen=True, kw_only=True):
    """Reply of any request/reply endpoint that rejected a request."""

    code: str
    message: str


class MockInjectRequest(_Message, frozen=True, kw_only=True):
    """Inject a fault into the mock NVML of every process serving the node."""

    gpu: int | None = None
    fault: str
    value: float | None = None
    duration_s: float | None = None


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
