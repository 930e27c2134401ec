"""Metrics, traces, logs and the health endpoints."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class TelemetrySettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Address of /metrics, /healthz and /readyz.
    http_host: str = "0.0.0.0"
    # Port of /metrics, /healthz and /readyz (5678 is gpu-manager's); 0 disables them.
    http_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 5678
    # OTLP/HTTP endpoint for metrics and traces, e.g. http://otel-collector:4318; empty: off.
    otlp_endpoint: str = ""
    # Log level.
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Log format: human-readable text or one JSON object per line.
    log_format: Literal["text", "json"] = "text"
