"""Settings of the health service and of ``gpulet alerts``.

Every rule of the health service has its knobs here, each with its default and where
that default comes from. They load from the config file (``[health]``,
``[health.thermal]``, ...), from ``GPULET_HEALTH__<KEY>`` /
``GPULET_HEALTH__<SECTION>__<KEY>`` environment variables and from
``--set health.<section>.<key>=value``.

Example::

    [health]
    app_xids = [13, 31, 43, 45, 68]      # treat XID 109 as a GPU fault (NVSentinel)
    dedup_window_s = 60

    [health.xid_overrides.74]            # NVLink errors: report, do not drain
    severity = "warning"
    action = "operator_check"

    [health.thermal]
    threshold_c = 90
    recover_samples = 5
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from gpulet_common.messages import Action, Severity

NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]

# The XIDs NVIDIA's k8s-device-plugin skips (its `applicationErrorXids`), and with it
# koordlet and HAMi: errors of the application, not of the GPU.
DEFAULT_APP_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 109)


class XidRule(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one XID is classified: replaces the built-in catalogue entry."""

    # info / warning: reported, the GPU stays healthy; critical / fatal: the GPU is
    # unhealthy until cleared or reset (unless the XID is in app_xids).
    severity: Severity = "critical"
    # The recommended action carried by the event.
    action: Action = "operator_check"
    # What the XID means (empty: the built-in description, if any).
    description: str = ""


class ThermalSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Above this GPU temperature (C) the GPU is unhealthy. Koordinator's best-practice
    # alert for GPU temperature is 95 C.
    threshold_c: float = 95.0
    # A thermal condition clears only once the temperature is below its threshold minus
    # this margin (C), so a GPU hovering at the threshold does not flap.
    hysteresis_c: NonNegFloat = 5.0
    # A thermal condition clears only after this many consecutive samples below its
    # threshold minus hysteresis_c (3 samples at the collector's default 1 s period:
    # a fan spin-up, not a single lucky reading).
    recover_samples: PosInt = 3
    # Also report against the GPU's own NVML thresholds where it has them: SLOWDOWN
    # (warning, GPUd marks the GPU Degraded near it) and SHUTDOWN (unhealthy).
    use_nvml_thresholds: bool = True


class EccSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Correctable (single-bit) ECC errors per hour above which a warning is raised. A
    # gpulet choice: correctable errors are expected now and then (NVIDIA's device
    # plugin ignores them entirely); a sustained 100/h is far above that background
    # and is what precedes the driver's own XID 92 "high single-bit ECC rate".
    sbe_rate_per_hour: PosFloat = 100.0
    # The sliding window over which the rate is measured (s).
    sbe_window_s: PosFloat = 3600.0


class LinkErrorSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Rates of the PCIe and NVLink error counters (read with the collector's slow
    fields, every collector.slow_period_s). Above its limit a rate raises a warning,
    cleared once it is down to half the limit (for a limit of 0: a window without errors).
    """

    # The sliding window over which the rates are measured (s): ten slow reads at the
    # default 30 s slow period (a gpulet choice).
    window_s: PosFloat = 300.0
    # PCIe replays per minute: DCGM's health-watch limit (DCGM_LIMIT_MAX_PCIREPLAY_RATE,
    # "8 replays per minute is the maximum recommended by RM").
    pcie_replay_per_min: NonNegFloat = 8.0
    # NVLink CRC errors (flit and data, all links) per minute: DCGM's limit of 100 a
    # second (DCGM_LIMIT_MAX_LWLINK_CRC_ERROR: "CRC errors only matter at rates of 100+
    # per second").
    nvlink_crc_per_min: NonNegFloat = 6000.0
    # NVLink replay errors per minute: 0, any raises, as in DCGM's health watch
    # (DCGM_LIMIT_MAX_LWLINK_ERROR = 1 in a watch period).
    nvlink_replay_per_min: NonNegFloat = 0.0
    # NVLink recovery errors per minute: 0, any raises (DCGM, as for replays).
    nvlink_recovery_per_min: NonNegFloat = 0.0


class StreamSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # How long the JetStream stream GPU_HEALTH keeps events (s). 7 days: an alerting
    # consumer down over a long weekend still gets what it missed.
    max_age_s: PosFloat = 7 * 24 * 3600.0
    # How much space the stream may take (bytes); the oldest events go first.
    max_bytes: PosInt = 256 * 1024 * 1024
    # Window in which the server drops a re-published event with the same event id
    # (Nats-Msg-Id). Longer than JetStream's 2 min default, so a publish whose ack was
    # lost in an outage and that is re-sent from the disk buffer is still recognised.
    duplicate_window_s: PosFloat = 600.0
    # How long one publish waits for the stream's ack before the event goes to disk.
    publish_timeout_s: PosFloat = 1.0
    # Versions kept per key in the gpu_health KV bucket (1: the current state only).
    kv_history: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # At start, how long to keep trying to read the state a previous run left in the
    # gpu_health bucket (s), e.g. while a restarted nats-server recovers JetStream from
    # disk. Starting without it would forget sticky conditions (a fatal XID).
    restore_timeout_s: PosFloat = 30.0


class BufferSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Most bytes the on-disk buffer (events NATS could not take, kept under
    # <state_dir>/health-buffer) may hold. Beyond this or max_events, further events
    # are dropped, counted, logged and reported as a buffer_overflow event.
    max_bytes: PosInt = 64 * 1024 * 1024
    # Most events the on-disk buffer may hold (see max_bytes).
    max_events: PosInt = 100_000
    # Size at which a buffer segment file is closed and a new one started.
    segment_bytes: PosInt = 1024 * 1024
    # Directory override (empty: <state_dir>/health-buffer).
    directory: str = ""


class AlertSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``gpulet alerts``: a durable consumer of the health stream."""

    # Durable consumer name: a restarted `gpulet alerts` resumes where it stopped.
    durable: str = "gpulet-alerts"
    # Subject filter within the stream (one node: gpu.health.<node>).
    subject: str = "gpu.health.*"
    # Where a *new* durable consumer starts: "new" events only (the current state is
    # brought in from the KV bucket, see reconcile_from_kv), or "all" the stream holds
    # (up to stream.max_age_s of history). An existing durable always resumes where
    # it stopped, so events missed while it was down are delivered either way.
    start_at: Literal["new", "all"] = "new"
    # Print every event as one JSON line on stdout.
    stdout: bool = True
    # URLs that receive each event as JSON (POST).
    webhooks: list[str] = []
    # Alertmanager base URLs (http://host:9093); alerts go to <url>/api/v2/alerts.
    alertmanager_urls: list[str] = []
    # Firing alerts are re-sent this often (s), like Prometheus does, and carry
    # endsAt = now + 4 x this, so they stay active while gpulet alerts runs.
    resend_interval_s: PosFloat = 60.0
    # One-off reports (an application XID, a hot-added GPU) are sent as alerts that
    # end after this many seconds.
    transient_alert_s: PosFloat = 300.0
    # On start, post the current conditions found in the gpu_health KV bucket, so an
    # Alertmanager that lost its state (or a fresh consumer) is brought up to date.
    reconcile_from_kv: bool = True
    # Timeout of one webhook or Alertmanager request (s).
    http_timeout_s: PosFloat = 5.0
    # First delay before a failed delivery is retried (s); it doubles on each failure.
    retry_initial_s: PosFloat = 0.5
    # Longest delay between two retries of a failed delivery (s).
    retry_max_s: PosFloat = 30.0
    # JetStream ack wait (s); a message not acked in time is redelivered.
    ack_wait_s: PosFloat = 60.0


class KmsgSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Read XIDs from the kernel log too (NVRM: Xid lines), including the ring buffer's
    # XIDs from while the agent was down. Without access the check runs degraded.
    enabled: bool = True
    # The kernel log to read (a plain file is read line by line). Empty: /dev/kmsg with
    # the real NVML, none with the mock NVML (the host's kernel log does not describe
    # mock GPUs).
    path: str = ""
    # How often to look for new records once the log is read to its end (s).
    poll_s: PosFloat = 0.5
    # The same XID on the same GPU from NVML and the kernel log within this window (s)
    # is one fault: the second copy is dropped.
    dedup_window_s: PosFloat = 30.0


class HealthSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Run the health service (false: `gpulet run` starts it idle).
    enabled: bool = True
    # XIDs reported (severity and action from the catalogue) that never make the GPU
    # unhealthy. Default: NVIDIA's device plugin skip list.
    app_xids: list[int] = msgspec.field(default_factory=lambda: list(DEFAULT_APP_XIDS))
    # Per-XID classification replacing the built-in catalogue's severity and action (and
    # description, if given) for that code; `gpulet health xid N` shows the result
    # (TOML: [health.xid_overrides.74]; JSON: {"74": {"severity": "warning"}}).
    xid_overrides: dict[int, XidRule] = {}
    # XIDs in neither the catalogue nor the overrides: like NVIDIA's device plugin,
    # which treats every XID outside its skip list as fatal for the GPU.
    unknown_xid: XidRule = msgspec.field(default_factory=XidRule)
    # Repeats of the same fault on the same GPU within this window (s) are folded into
    # one event with a count (GPUd de-duplicates per minute). 0 publishes every repeat.
    # For XIDs from the kernel log the message counts too (pid and process name taken
    # out): a new message is published at once.
    dedup_window_s: NonNegFloat = 60.0
    # XID 45 (preemptive cleanup), and XID 43 (GPU stopped processing), within this many
    # seconds after another XID on the same GPU, or while an XID condition of the GPU is
    # active, are by-products: counted as evidence for that fault (evidence_count),
    # never reported as faults of their own. NVIDIA's catalogue: when another XID comes
    # with a 45, act on the other one. Alone, 45 is informational (its catalogue entry).
    xid_byproduct_window_s: NonNegFloat = 60.0
    # The repeat rule: the same XID on the same GPU in this many separate bursts (a
    # burst: a de-duplication window) within xid_repeat_window_s raises the sticky
    # `xid_repeated:<code>` (critical, operator_check). Only XIDs that do not already
    # make the GPU unhealthy count; 45 and the app_xids never do (NVSentinel's
    # RepeatedXIDErrorOnSameGPU, 5 in 24 h, which raised 672 fatal events in 3 h from
    # XID 45 before it skipped it). 0 turns the rule off.
    xid_repeat_count: Annotated[int, msgspec.Meta(ge=0)] = 5
    # The window of the repeat rule (s): 24 h, as NVSentinel's.
    xid_repeat_window_s: PosFloat = 24 * 3600.0
    # The NVML event wait's timeout (ms): bounds how long shutdown waits for the
    # waiting thread. Events themselves are delivered as soon as they happen.
    event_wait_timeout_ms: Annotated[int, msgspec.Meta(ge=10, le=5000)] = 200
    # How often the event thread checks the GPU count (s), to see removals and
    # hot-adds without waiting for the collector.
    device_poll_s: PosFloat = 1.0
    # Period of the housekeeping tick (de-duplication summaries, SBE window) (s).
    tick_s: PosFloat = 0.5
    thermal: ThermalSettings = msgspec.field(default_factory=ThermalSettings)
    ecc: EccSettings = msgspec.field(default_factory=EccSettings)
    link_errors: LinkErrorSettings = msgspec.field(default_factory=LinkErrorSettings)
    stream: StreamSettings = msgspec.field(default_factory=StreamSettings)
    buffer: BufferSettings = msgspec.field(default_factory=BufferSettings)
    alerts: AlertSettings = msgspec.field(default_factory=AlertSettings)
    kmsg: KmsgSettings = msgspec.field(default_factory=KmsgSettings)

    def __post_init__(self) -> None:
        negative = sorted(code for code in self.xid_overrides if code < 0)
        if negative:
            raise ValueError(f"xid_overrides: XID numbers are 0 or more, not {negative[0]}")
