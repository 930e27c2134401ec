"""Settings of the health service."""

from __future__ import annotations

import msgspec


class HealthSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    enabled: bool = True
