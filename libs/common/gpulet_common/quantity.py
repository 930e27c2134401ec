"""Kubernetes quantities, one copy: the suffix table, a whole-number parser and the
binary form the API server writes back.

:func:`binary` writes ``80Gi``, ``81559Mi``, ``1536Ki`` or plain digits (the largest
binary suffix that keeps the value whole: the API server's canonical form of such a
value, so a written object compares equal to what it reads back).
:func:`parse_whole` reads a whole-number quantity (``20Gi``, ``30``, ``1k``) and gives
None for anything else (fractions, ``m``, junk); the Koordinator decision parser,
which must round fractions up, keeps its own rules on top of :data:`SUFFIX`.
"""

from __future__ import annotations

import re
from typing import Any, Final

SUFFIX: Final[dict[str | None, int]] = {
    None: 1,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_BINARY: Final = ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki")
_WHOLE = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def binary(value: int) -> str:
    """An integer as the largest binary suffix that keeps it whole, else plain digits."""
    if value > 0:
        for suffix in _BINARY:
            if value % SUFFIX[suffix] == 0:
                return f"{value // SUFFIX[suffix]}{suffix}"
    return str(value)


def parse_whole(text: Any) -> int | None:
    """A whole-number quantity's value (None for anything else: fractions, junk)."""
    if isinstance(text, bool) or not isinstance(text, str | int):
        return None
    if isinstance(text, int):
        return text
    match = _WHOLE.fullmatch(text.strip())
    if match is None:
        return None
    return int(match[1]) * SUFFIX[match[2]]
