"""Settings of the reporter service."""

from __future__ import annotations

import msgspec


class ReporterSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    enabled: bool = True
