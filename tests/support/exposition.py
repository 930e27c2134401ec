"""Reading the DCGM_FI_* part of a Prometheus text exposition in tests."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)\{(.*)\} (\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """(TYPE of each family, samples) of the DCGM_FI_* lines of an exposition."""
    types: dict[str, str] = {}
    samples: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if line.startswith("# TYPE DCGM_"):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line.startswith("DCGM_"):
            match = _SAMPLE.match(line)
            assert match is not None, line
            labels = dict(_LABEL.findall(match.group(2)))
            samples.append((match.group(1), labels, float(match.group(3))))
    return types, samples
