"""Topology of a mock node: PCIe levels and NVLinks between the scenario's GPUs.

The ``[topology]`` table of a scenario (:class:`TopologySpec`) and its resolution into
what NVML answers: the common-ancestor level of every pair (:func:`level_matrix`) and
the direct NVLinks of every pair (:func:`nvlink_matrix`). Level names are NVML's and
``nvidia-smi topo``'s (``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``).
"""

from __future__ import annotations

from typing import Final

import msgspec

# NVML's NVML_NVLINK_MAX_LINKS (nvidia-ml-py 13): no GPU can have more links.
NVLINK_MAX_LINKS: Final = 36

LEVELS: Final[dict[str, int]] = {
    "INTERNAL": 0,
    "SINGLE": 10,
    "PIX": 10,
    "MULTIPLE": 20,
    "PXB": 20,
    "HOSTBRIDGE": 30,
    "PHB": 30,
    "NODE": 40,
    "CPU": 40,
    "SYSTEM": 50,
    "SYS": 50,
}
_LEVEL_VALUES: Final = frozenset(LEVELS.values())


class LevelGroup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    level: int | str
    gpus: list[int]


class PairLevel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    gpus: tuple[int, int]
    level: int | str


class NvLinkPair(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    gpus: tuple[int, int]
    links: int


class TopologySpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """PCIe levels and NVLinks between GPUs (scenario indices).

    The level of a pair is, by precedence: ``matrix`` (full table, "X" on the
    diagonal), ``pairs``, the closest of the ``groups`` holding both GPUs, then
    ``default_level``. NVLinks: ``nvlinks`` entries, else ``nvlinks_default``, plus the
    NVSwitch fabric (``nvswitch_links`` of the GPUs).
    """

    default_level: int | str = "SYSTEM"
    groups: list[LevelGroup] = []
    pairs: list[PairLevel] = []
    matrix: list[list[int | str]] | None = None
    nvlinks_default: int = 0
    nvlinks: list[NvLinkPair] = []


def parse_level(value: int | str) -> int:
    """A topology level name ("PIX", "NODE", ...) or NVML value to the NVML value."""
    if isinstance(value, int):
        if value in _LEVEL_VALUES:
            return value
        raise ValueError(f"level {value} is not an NVML topology level {sorted(_LEVEL_VALUES)}")
    level = LEVELS.get(value.strip().upper())
    if level is None:
        raise ValueError(f"unknown topology level {value!r} (known: {', '.join(LEVELS)})")
    return level


def level_matrix(topology: TopologySpec, count: int) -> list[list[int]]:
    """NVML common-ancestor level of every pair of scenario GPUs (diagonal INTERNAL)."""
    default = parse_level(topology.default_level)
    levels = [[default] * count for _ in range(count)]
    for group in topology.groups:
        level = parse_level(group.level)
        for a in group.gpus:
            for b in group.gpus:
                if a != b and level < levels[a][b]:
                    levels[a][b] = level
    for pair in topology.pairs:
        a, b = pair.gpus
        levels[a][b] = levels[b][a] = parse_level(pair.level)
    if topology.matrix is not None:
        for a, row in enumerate(topology.matrix):
            for b, cell in enumerate(row):
                if a != b:
                    levels[a][b] = parse_level(cell)
    for i in range(count):
        levels[i][i] = LEVELS["INTERNAL"]
    return levels


def nvlink_matrix(topology: TopologySpec, count: int) -> list[list[int]]:
    """Direct NVLinks between every pair of scenario GPUs (NVSwitch links excluded)."""
    links = [
        [topology.nvlinks_default if a != b else 0 for b in range(count)] for a in range(count)
    ]
    for pair in topology.nvlinks:
        a, b = pair.gpus
        links[a][b] = links[b][a] = pair.links
    return links
