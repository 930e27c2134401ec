"""Which NVML the services talk to."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class NvmlSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # auto: the real library when it loads, otherwise run degraded and say so.
    # mock: the in-repo mock NVML, driven by `scenario`.
    backend: Literal["auto", "nvml", "mock"] = "auto"
    # Scenario name (see `gpulet mock scenarios`) or path to a scenario TOML file.
    scenario: str = "dgx-h100"
    # The NVML library the real backend loads: a name the dynamic linker searches for
    # (the driver's default) or an absolute path. A path that does not exist makes a
    # host look driverless, which is how tests create "no NVML" on a GPU machine.
    library: Annotated[str, msgspec.Meta(min_length=1)] = "libnvidia-ml.so.1"
    # A single NVML call taking longer than this marks the GPU as hung for the period.
    call_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    # NVML that cannot start (no driver loaded yet) is tried again after this long,
    # the wait doubling up to retry_max_s; the services run meanwhile, saying why.
    retry_min_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # The longest wait between two tries to start NVML.
    retry_max_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    # Mock only: per-call NVML latency. "scenario": the scenario's [system]
    # latency_profile; "none": answer at once; "h100": spend (as CPU, like the driver)
    # what each call cost on a real H100 (first read of a field 1.5-3.6 ms, then
    # 0.01-0.09 ms; thresholds, ECC mode, energy, field values dear every time).
    mock_latency: Literal["scenario", "none", "h100"] = "scenario"
