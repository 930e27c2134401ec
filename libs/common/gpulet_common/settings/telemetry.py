"""Metrics, traces, logs and the health endpoints."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class TelemetrySettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # /metrics, /healthz and /readyz. Port 5678 is gpu-manager's; 0 disables the server.
    http_host: str = "0.0.0.0"
    http_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 5678
    # OTLP/HTTP endpoint, e.g. http://otel-collector:4318. Empty disables OTLP export.
    otlp_endpoint: str = ""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
