"""What every stage of the health service reaches, in one place.

The rule-driving stage (:mod:`.inputs`) and the endpoints (:mod:`.endpoints`) act on
the same few objects: the bus, the node's name, the rule engine, the publish stage
(:mod:`.emit`) and the scanner (:mod:`.scan`). :class:`HealthStages` carries them, so
each is wired once, in the service's constructor.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpulet_common.bus import Bus
from gpulet_health.emit import EventStage
from gpulet_health.rules import RuleEngine
from gpulet_health.scan import GpuScanner


@dataclass(frozen=True, slots=True)
class HealthStages:
    bus: Bus
    node: str
    engine: RuleEngine
    stage: EventStage
    scanner: GpuScanner
