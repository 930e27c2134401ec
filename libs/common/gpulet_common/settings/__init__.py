"""The typed settings of gpulet, one module per section.

Each service owns its section's module; :class:`Settings` only composes them. All
sections are msgspec Structs with defaults, so an empty config file is a valid one.
Loading, merging and precedence live in :mod:`gpulet_common.config`.
"""

from __future__ import annotations

import msgspec

from gpulet_common.settings.allocator import AllocatorSettings
from gpulet_common.settings.collector import CollectorSettings
from gpulet_common.settings.dra import DraSettings
from gpulet_common.settings.fleet import FleetSettings
from gpulet_common.settings.health import HealthSettings
from gpulet_common.settings.limits import LimitsSettings
from gpulet_common.settings.nats import NatsSettings
from gpulet_common.settings.nvml import NvmlSettings
from gpulet_common.settings.remediation import RemediationSettings
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_common.settings.sharing import SharingSettings
from gpulet_common.settings.telemetry import TelemetrySettings


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Name of the Kubernetes node; empty means $NODE_NAME, then the host name.
    node_name: str = ""
    # Where services keep state (checkpoints, on-disk buffers, embedded NATS).
    # Empty: /var/lib/gpulet when writable (root, containers), else ~/.local/state/gpulet.
    state_dir: str = ""
    nats: NatsSettings = msgspec.field(default_factory=NatsSettings)
    nvml: NvmlSettings = msgspec.field(default_factory=NvmlSettings)
    telemetry: TelemetrySettings = msgspec.field(default_factory=TelemetrySettings)
    collector: CollectorSettings = msgspec.field(default_factory=CollectorSettings)
    health: HealthSettings = msgspec.field(default_factory=HealthSettings)
    reporter: ReporterSettings = msgspec.field(default_factory=ReporterSettings)
    allocator: AllocatorSettings = msgspec.field(default_factory=AllocatorSettings)
    limits: LimitsSettings = msgspec.field(default_factory=LimitsSettings)
    fleet: FleetSettings = msgspec.field(default_factory=FleetSettings)
    dra: DraSettings = msgspec.field(default_factory=DraSettings)
    remediation: RemediationSettings = msgspec.field(default_factory=RemediationSettings)
    sharing: SharingSettings = msgspec.field(default_factory=SharingSettings)


__all__ = [
    "AllocatorSettings",
    "CollectorSettings",
    "DraSettings",
    "FleetSettings",
    "HealthSettings",
    "LimitsSettings",
    "NatsSettings",
    "NvmlSettings",
    "RemediationSettings",
    "ReporterSettings",
    "Settings",
    "SharingSettings",
    "TelemetrySettings",
]
