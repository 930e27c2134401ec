"""Settings of the allocator service."""

from __future__ import annotations

import msgspec


class AllocatorSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    enabled: bool = True
