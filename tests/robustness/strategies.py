"""Hostile input for decoders: hypothesis picks the seeds, a fast mutator fans them out.

Drawing a recursive JSON value through hypothesis costs about a millisecond; decoding
costs microseconds. To try 10,000+ inputs per message type in seconds, each hypothesis
example draws a base (a valid message of the type, an arbitrary JSON value, a
near-valid object using the type's field names, or raw bytes) and a seed, and
:func:`mutants` derives a batch of variants from it deterministically: bit flips, byte
insertions and deletions, truncations, and field values swapped for values of another
JSON type. Failures still shrink to a (base, seed) pair that reproduces them.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

_encoder = msgspec.json.Encoder()

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
)

json_values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=10), children, max_size=4),
    ),
    max_leaves=12,
)

_ODD_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    2**64,
    1e308,
    -0.0,
    "",
    "x" * 300,
    [],
    {},
    [None],
    {"": None},
    "GPU-\x00",
    "\ud7ff",
    3.5,
    "1",
    "true",
]


def _example(info: mi.Type) -> Any:
    """A valid JSON-ready value for a msgspec type description."""
    if isinstance(info, mi.StructType):
        return {f.encode_name: _example(f.type) for f in info.fields}
    if isinstance(info, mi.UnionType):
        choices = [t for t in info.types if not isinstance(t, mi.NoneType)]
        return _example(choices[0]) if choices else None
    if isinstance(info, mi.LiteralType):
        return info.values[0]
    if isinstance(info, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        return [_example(info.item_type)]
    if isinstance(info, mi.TupleType):
        return [_example(t) for t in info.item_types]
    if isinstance(info, mi.DictType):
        return {"k": _example(info.value_type)}
    if isinstance(info, mi.IntType):
        return max(1, info.ge or 0)
    if isinstance(info, mi.FloatType):
        return float(max(1.0, info.ge or 0.0, (info.gt or 0.0) + 1.0))
    if isinstance(info, mi.BoolType):
        return True
    if isinstance(info, mi.StrType):
        return "x" * max(1, info.min_length or 0)
    return None


def valid_example(struct_type: type[msgspec.Struct]) -> dict[str, Any]:
    value = _example(mi.type_info(struct_type))
    assert isinstance(value, dict)
    return value


def field_names(struct_type: type[msgspec.Struct]) -> list[str]:
    return [f.name for f in msgspec.structs.fields(struct_type)] or ["x"]


def bases(struct_type: type[msgspec.Struct]) -> st.SearchStrategy[bytes]:
    names = field_names(struct_type)
    near_valid = st.dictionaries(
        st.one_of(st.sampled_from(names), st.text(max_size=10)),
        json_values,
        max_size=len(names) + 2,
    )
    example = valid_example(struct_type)
    tweaked = st.tuples(st.sampled_from(sorted(example)), json_values).map(
        lambda kv: _encoder.encode({**example, kv[0]: kv[1]})
    )
    return st.one_of(
        st.just(_encoder.encode(example)),
        tweaked,
        near_valid.map(_encoder.encode),
        json_values.map(_encoder.encode),
        st.binary(max_size=200),
    )


def mutants(base: bytes, seed: int, count: int) -> list[bytes]:
    """``count`` deterministic variants of ``base`` (the base itself first)."""
    rng = random.Random(seed)
    out = [base]
    try:
        tree = msgspec.json.decode(base)
    except msgspec.DecodeError:
        tree = None
    while len(out) < count:
        data = bytearray(out[rng.randrange(len(out))])
        op = rng.randrange(6)
        if op == 0 and data:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            data.insert(rng.randrange(len(data) + 1), rng.choice(b'{}[]",:0-e.\\ \x00\xff'))
        elif op == 2 and data:
            del data[rng.randrange(len(data))]
        elif op == 3 and data:
            data = data[: rng.randrange(len(data))]
        elif op == 4 and isinstance(tree, dict) and tree:
            key = rng.choice(sorted(tree))
            data = bytearray(_encoder.encode({**tree, key: rng.choice(_ODD_VALUES)}))
        else:
            data = bytearray(_encoder.encode(rng.choice(_ODD_VALUES)))
        out.append(bytes(data))
    return out
