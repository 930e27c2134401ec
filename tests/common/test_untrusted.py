"""The one door for untrusted documents: size and depth bounded, YAML aliases refused,
and every failure -- ``RecursionError`` and ``MemoryError`` included -- one
:class:`UntrustedDocumentError` (a ``ValueError``) with a reason.

The deep documents are 10,000 levels: far past Python's recursion limit, so a parser
that is reached without the bound raises ``RecursionError``, which no
``except ValueError`` catches.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import msgspec
import pytest

from gpulet_common import untrusted
from gpulet_common.codec import TOO_DEEP
from gpulet_common.untrusted import (
    ALIASES,
    ERROR,
    INVALID,
    TOO_LARGE,
    UntrustedDocumentError,
    json_document,
    json_typed,
    toml_document,
    toml_typed,
    yaml_document,
)

DEEP = 10_000
DEEP_JSON = b"[" * DEEP + b"]" * DEEP
DEEP_OBJECT = b'{"a":' * DEEP + b"1" + b"}" * DEEP
DEEP_TOML = b"x = " + b"[" * DEEP + b"]" * DEEP + b"\n"
DEEP_YAML = b"[" * DEEP + b"]" * DEEP


class Item(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    count: int = 0


class Loose(msgspec.Struct):
    name: str


ITEM = msgspec.json.Decoder(Item)
LOOSE = msgspec.json.Decoder(Loose)


def _reason(call: Any) -> str:
    with pytest.raises(UntrustedDocumentError) as info:
        call()
    assert isinstance(info.value, ValueError)
    assert info.value.detail == str(info.value)
    return info.value.reason


# --- the unbounded parsers do fail on these (so the bound is what saves us) ----------


def test_the_bare_parsers_raise_recursion_error_on_the_deep_documents() -> None:
    import tomllib

    with pytest.raises(RecursionError):
        json.loads(DEEP_JSON)
    with pytest.raises(RecursionError):
        msgspec.json.decode(DEEP_OBJECT)
    with pytest.raises(RecursionError):
        LOOSE.decode(b'{"name": "a", "extra": ' + DEEP_JSON + b"}")
    with pytest.raises(RecursionError):
        tomllib.loads(DEEP_TOML.decode())


# --- JSON ------------------------------------------------------------------------------


def test_json_document_decodes_what_is_sane() -> None:
    assert json_document(b'{"a": [1, {"b": "c"}]}') == {"a": [1, {"b": "c"}]}
    assert json_document('{"s": "[[[["}') == {"s": "[[[["}
    nested = b"[" * untrusted.MAX_DEPTH + b"]" * untrusted.MAX_DEPTH
    assert json_document(nested) is not None


@pytest.mark.parametrize("raw", [DEEP_JSON, DEEP_OBJECT, b'{"x": ' + DEEP_JSON + b"}"])
def test_json_document_refuses_deep_documents(raw: bytes) -> None:
    assert _reason(lambda: json_document(raw, what="w")) == TOO_DEEP
    assert _reason(lambda: json_document(raw.decode())) == TOO_DEEP


def test_json_document_depth_bound_is_exact() -> None:
    ok = b"[" * 5 + b"]" * 5
    assert json_document(ok, max_depth=5) == [[[[[]]]]]
    assert _reason(lambda: json_document(b"[" + ok + b"]", max_depth=5)) == TOO_DEEP


@pytest.mark.parametrize(
    "raw", [b"not json", b"{", b'{"a": 1,}', b"\xff\xfe", b'["unterminated', b"[[]]]"]
)
def test_json_document_maps_every_bad_document_to_invalid(raw: bytes) -> None:
    assert _reason(lambda: json_document(raw)) == INVALID


def test_json_document_size_bound() -> None:
    assert _reason(lambda: json_document(b"[" + b"1," * 100 + b"1]", max_bytes=50)) == TOO_LARGE
    assert json_document(b"[1]", max_bytes=3) == [1]


def test_json_document_maps_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class Exhausted:
        def decode(self, data: bytes) -> Any:
            raise MemoryError

    monkeypatch.setattr(untrusted, "_json", Exhausted())
    assert _reason(lambda: json_document(b"[]")) == ERROR


def test_the_detail_names_what_was_read() -> None:
    with pytest.raises(UntrustedDocumentError, match="watch line: nesting deeper"):
        json_document(DEEP_JSON, what="watch line")


# --- typed JSON ------------------------------------------------------------------------


def test_json_typed_decodes_with_the_files_own_decoder() -> None:
    assert json_typed(b'{"name": "a", "count": 2}', ITEM) == Item("a", 2)
    # Strictness is the decoder's: unknown fields refused by a strict one.
    assert _reason(lambda: json_typed(b'{"name": "a", "zz": 1}', ITEM)) == INVALID
    assert json_typed(b'{"name": "a", "zz": 1}', LOOSE) == Loose("a")
    assert _reason(lambda: json_typed(b'{"name": 3}', ITEM)) == INVALID
    assert _reason(lambda: json_typed(b"{", ITEM)) == INVALID


def test_json_typed_refuses_a_deep_unknown_field_before_msgspec_recurses() -> None:
    raw = b'{"name": "a", "extra": ' + DEEP_JSON + b"}"
    assert _reason(lambda: json_typed(raw, LOOSE)) == TOO_DEEP
    assert _reason(lambda: json_typed(DEEP_OBJECT, ITEM)) == TOO_DEEP
    assert _reason(lambda: json_typed(b"[" * 200 + b"]" * 200, ITEM, max_bytes=10)) == TOO_LARGE


# --- TOML ------------------------------------------------------------------------------


def test_toml_document_decodes_and_maps_failures() -> None:
    assert toml_document(b'a = 1\n[b]\nc = "d"\n') == {"a": 1, "b": {"c": "d"}}
    assert toml_document('a = "\u00e9"') == {"a": "\u00e9"}
    assert _reason(lambda: toml_document(b"a = ")) == INVALID
    assert _reason(lambda: toml_document(b"a = '\xff'")) == ERROR
    assert _reason(lambda: toml_document(b"a = 1\n" * 100, max_bytes=10)) == TOO_LARGE


def test_toml_document_refuses_a_deep_array() -> None:
    assert _reason(lambda: toml_document(DEEP_TOML)) == TOO_DEEP
    deep_tables = b"x = " + b"{a = " * DEEP + b"1" + b"}" * DEEP
    assert _reason(lambda: toml_document(deep_tables)) == TOO_DEEP


def test_toml_typed_converts_as_msgspec_toml_does() -> None:
    class Dated(msgspec.Struct, forbid_unknown_fields=True):
        name: str
        when: datetime.date

    raw = b'name = "a"\nwhen = 2026-01-02\n'
    assert toml_typed(raw, Dated) == msgspec.toml.decode(raw, type=Dated)
    assert toml_typed(b'a = {name = "x"}', dict[str, Item]) == {"a": Item("x")}
    assert _reason(lambda: toml_typed(b'name = "a"\nzz = 1\n', Dated)) == INVALID
    assert _reason(lambda: toml_typed(DEEP_TOML, dict[str, Item])) == TOO_DEEP


# --- YAML ------------------------------------------------------------------------------


def test_yaml_document_decodes_plain_yaml() -> None:
    assert yaml_document(b"a: 1\nb: [x, {c: d}]\n") == {"a": 1, "b": ["x", {"c": "d"}]}


def test_yaml_document_refuses_aliases() -> None:
    bomb = b'a: &a ["x","x"]\nb: &b [*a,*a]\nc: &c [*b,*b]\nd: [*c,*c]\n'
    assert _reason(lambda: yaml_document(bomb)) == ALIASES
    token = b"users:\n- name: u\n  user:\n    token: *t\nx: &t abc\n"
    assert _reason(lambda: yaml_document(token)) in (ALIASES, INVALID)


def test_yaml_document_refuses_deep_documents() -> None:
    assert _reason(lambda: yaml_document(DEEP_YAML, what="kubeconfig")) == TOO_DEEP
    block = "".join("  " * i + "a:\n" for i in range(300)) + "  " * 300 + "b\n"
    assert _reason(lambda: yaml_document(block)) == TOO_DEEP
    assert yaml_document(b"[[[1]]]", max_depth=4) == [[[1]]]
    assert _reason(lambda: yaml_document(b"[[[1]]]", max_depth=2)) == TOO_DEEP


def test_yaml_document_refuses_unsafe_tags_and_bad_yaml() -> None:
    assert _reason(lambda: yaml_document(b"!!python/object/apply:os.system [id]")) == INVALID
    assert _reason(lambda: yaml_document(b"a: [")) == INVALID
    assert _reason(lambda: yaml_document(b"a: 1\n" * 100, max_bytes=10)) == TOO_LARGE
