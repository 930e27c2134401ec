"""The mock NVML: a fake ``pynvml`` driven by scenario files, with live fault injection.

Layers: :mod:`.scenario` (TOML files to checked Structs, with :mod:`.topology` and
:mod:`.faultspec`), :mod:`.mock` (the module-shaped fake that plays a scenario and takes
live faults, :meth:`MockNvml.inject`; its pieces are listed there). The NVML adapter uses
a :class:`MockNvml` exactly as it uses ``pynvml``.
"""

from gpulet_common.mock_nvml.faultspec import FAULT_KINDS, FaultSpec
from gpulet_common.mock_nvml.mock import (
    ManualClock,
    MockDeviceHandle,
    MockEventData,
    MockEventSet,
    MockNvml,
)
from gpulet_common.mock_nvml.scenario import (
    SCENARIO_DIR,
    GpuSpec,
    Scenario,
    ScenarioError,
    SystemSpec,
    list_scenarios,
    load_scenario,
    resolve_scenario,
    scenario_from_toml,
)
from gpulet_common.mock_nvml.topology import TopologySpec

__all__ = [
    "FAULT_KINDS",
    "SCENARIO_DIR",
    "FaultSpec",
    "GpuSpec",
    "ManualClock",
    "MockDeviceHandle",
    "MockEventData",
    "MockEventSet",
    "MockNvml",
    "Scenario",
    "ScenarioError",
    "SystemSpec",
    "TopologySpec",
    "list_scenarios",
    "load_scenario",
    "resolve_scenario",
    "scenario_from_toml",
]
