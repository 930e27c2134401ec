"""The collector: inventory and periodic samples."""

from __future__ import annotations

from typing import Annotated

import msgspec


class CollectorSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Seconds between two sample batches (koordlet: 3 s, dcgm-exporter: 30 s).
    sample_period_s: Annotated[float, msgspec.Meta(ge=0.01, le=3600)] = 1.0
    # Threads for NVML calls; one hung GPU holds one thread, never the others.
    worker_threads: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16
    # Seconds between unsolicited inventory republishes, so a consumer that starts late
    # learns the GPUs without asking. 0 disables; changes are always published at once.
    inventory_republish_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
