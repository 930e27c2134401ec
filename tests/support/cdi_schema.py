"""The CDI project's JSON schema (tests/dra/data/cdi-schema, SOURCE.md names the
commits) and what it cannot check itself: :func:`check` validates a CDI spec."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource

SCHEMA_DIR = Path(__file__).parent.parent / "dra" / "data" / "cdi-schema"
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def validator() -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    registry: Registry[Any] = Registry().with_resource(
        "defs.json", Resource.from_contents(defs, default_specification=_draft7())
    )
    return jsonschema.Draft7Validator(schema, registry=registry)


def _draft7() -> Any:
    from referencing.jsonschema import DRAFT7

    return DRAFT7


def check(spec: dict[str, Any]) -> None:
    validator().validate(spec)
    # What the upstream schema cannot check (its env items use "ref", not "$ref").
    edits = [spec.get("containerEdits", {})] + [d["containerEdits"] for d in spec["devices"]]
    for edit in edits:
        for entry in edit.get("env", []):
            assert isinstance(entry, str)
            assert _ENV.match(entry), entry
    names = [d["name"] for d in spec["devices"]]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]*", n) for n in names)
