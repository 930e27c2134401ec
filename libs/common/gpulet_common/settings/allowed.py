"""What a setting allows, read from its declared type, for error messages.

msgspec says ``Invalid enum value 'bogus'`` for a value outside a ``Literal`` or an
``Enum``, without the values it would have taken. :func:`allowed_values` finds the
setting's type from its dotted path (through nested sections, lists, dicts,
``Annotated`` and ``X | None``) and lists them, so :mod:`gpulet_common.config` can say
what is allowed for every such setting in one place, however many there are.
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Any, Literal

import msgspec


def _unwrap(hint: Any) -> list[Any]:
    """``Annotated[X, ...]`` as X, ``X | Y`` as [X, Y]."""
    if typing.get_origin(hint) is typing.Annotated:
        return _unwrap(typing.get_args(hint)[0])
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(hint) for t in _unwrap(arg)]
    return [hint]


def _child(hint: Any, part: str) -> list[Any]:
    """The types that ``part`` of a dotted path can name below ``hint``."""
    found: list[Any] = []
    for option in _unwrap(hint):
        origin = typing.get_origin(option)
        if isinstance(option, type) and issubclass(option, msgspec.Struct):
            found += [f.type for f in msgspec.structs.fields(option) if f.name == part]
        elif origin in (list, tuple, set, frozenset) and part.lstrip("-").isdigit():
            found += [a for a in typing.get_args(option) if a is not Ellipsis]
        elif origin is dict:
            found.append(typing.get_args(option)[1])
    return found


def _values(hint: Any) -> list[str]:
    values: list[str] = []
    for option in _unwrap(hint):
        if typing.get_origin(option) is Literal:
            values += [str(v) for v in typing.get_args(option)]
        elif isinstance(option, type) and issubclass(option, enum.Enum):
            values += [str(member.value) for member in option]
    return values


def allowed_values(root: Any, dotted: str) -> list[str]:
    """The values the setting ``dotted`` of ``root`` (a Struct type) may take, if it is a
    ``Literal`` or an ``Enum``; empty when it is neither or there is no such setting."""
    hints: list[Any] = [root]
    for part in (p for p in dotted.split(".") if p):
        hints = [child for hint in hints for child in _child(hint, part.strip("'\""))]
    return list(dict.fromkeys(v for hint in hints for v in _values(hint)))
