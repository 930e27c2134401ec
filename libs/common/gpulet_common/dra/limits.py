"""The API server's rules for what a DRA driver publishes, checked before we publish.

Why
---
A ResourceSlice the API server refuses is a pool the scheduler never sees, and the
refusal arrives late (at the first write) and whole (one bad attribute rejects every
device of the slice). So each rule the server applies to what gpulet renders is
checked here first, with the server's own limits (``kubernetes/api:resource/v1``
types.go and ``kubernetes/kubernetes:pkg/apis/resource/validation``):

* device names are DNS labels (≤ 63), the driver a DNS subdomain (≤ 63), a pool name
  DNS subdomains joined by ``/`` (≤ 252);
* an attribute or capacity name is an identifier (≤ 32, C-identifier) with an optional
  DNS-subdomain domain (≤ 63); a device carries at most 32 of them together;
* a string or version attribute value is at most 64 characters; a version is semver 2.0;
* a taint key is a label name (``prefix/name``), its value a label value (≤ 63);
  a device carries at most 16 taints;
* a slice lists at most 128 devices, 64 when any uses taints or counters.

:func:`device_problems` answers a rendered device (the JSON body) with every broken
rule, so a test or the renderer names the field, never a bare "invalid".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

MAX_DEVICES_PER_SLICE: Final = 128
# With taints, counters (consumesCounters) or list attributes on any device.
MAX_DEVICES_PER_SLICE_TAINTED: Final = 64
MAX_ATTRIBUTES_AND_CAPACITIES: Final = 32
MAX_TAINTS_PER_DEVICE: Final = 16
MAX_ID_LENGTH: Final = 32
MAX_DOMAIN_LENGTH: Final = 63
MAX_STRING_VALUE: Final = 64
MAX_LABEL_VALUE: Final = 63
MAX_DNS_LABEL: Final = 63
MAX_DNS_SUBDOMAIN: Final = 253
MAX_DRIVER_NAME: Final = 63
MAX_POOL_NAME: Final = 252

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# semver.org 2.0.0, as the API server's version attribute check (blang/semver, strict).
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$"
)
TAINT_EFFECTS: Final = ("NoSchedule", "NoExecute", "None")


def is_dns_label(name: str) -> bool:
    return len(name) <= MAX_DNS_LABEL and bool(_DNS_LABEL.fullmatch(name))


def is_dns_subdomain(name: str) -> bool:
    return len(name) <= MAX_DNS_SUBDOMAIN and bool(_DNS_SUBDOMAIN.fullmatch(name))


def is_driver_name(name: str) -> bool:
    return len(name) <= MAX_DRIVER_NAME and is_dns_subdomain(name)


def is_pool_name(name: str) -> bool:
    return 0 < len(name) <= MAX_POOL_NAME and all(
        is_dns_subdomain(part) for part in name.split("/")
    )


def is_semver(value: str) -> bool:
    return len(value) <= MAX_STRING_VALUE and bool(_SEMVER.fullmatch(value))


def is_label_value(value: str) -> bool:
    return len(value) <= MAX_LABEL_VALUE and bool(_LABEL_VALUE.fullmatch(value))


def is_label_name(key: str) -> bool:
    """``[prefix/]name``: prefix a DNS subdomain, name ≤ 63 of ``[-A-Za-z0-9_.]``."""
    prefix, sep, name = key.rpartition("/")
    if sep and not (prefix and is_dns_subdomain(prefix)):
        return False
    return 0 < len(name) <= MAX_LABEL_VALUE and bool(_LABEL_NAME.fullmatch(name))


def is_qualified_name(key: str) -> bool:
    """An attribute or capacity name: ``[domain/]identifier``."""
    domain, sep, ident = key.rpartition("/")
    if sep and not (domain and len(domain) <= MAX_DOMAIN_LENGTH and is_dns_subdomain(domain)):
        return False
    return 0 < len(ident) <= MAX_ID_LENGTH and bool(_C_IDENTIFIER.fullmatch(ident))


_LABEL_UNSAFE = re.compile(r"[^-A-Za-z0-9_.]+")


def label_value(text: str) -> str:
    """``text`` made a valid label value: unsafe runs become ``-``, trimmed to 63,
    starting and ending alphanumeric ("" when nothing usable is left)."""
    cleaned = _LABEL_UNSAFE.sub("-", text)[:MAX_LABEL_VALUE]
    return cleaned.strip("-_.")


def attribute_problems(name: str, value: Any) -> list[str]:
    problems: list[str] = []
    if not is_qualified_name(name):
        problems.append(f"attribute name {name!r} is not [domain/]identifier (≤ 32)")
    if not isinstance(value, Mapping) or len(value) != 1:
        return [*problems, f"attribute {name!r} must hold exactly one of int/bool/string/version"]
    ((kind, inner),) = value.items()
    if kind == "int":
        ok = isinstance(inner, int) and not isinstance(inner, bool)
    elif kind == "bool":
        ok = isinstance(inner, bool)
    elif kind == "string":
        ok = isinstance(inner, str) and len(inner) <= MAX_STRING_VALUE
    elif kind == "version":
        ok = isinstance(inner, str) and is_semver(inner)
    else:
        ok = False
    if not ok:
        problems.append(f"attribute {name!r}: {kind} value {inner!r} is not valid")
    return problems


def taint_problems(taint: Any) -> list[str]:
    if not isinstance(taint, Mapping):
        return ["taint is not an object"]
    problems: list[str] = []
    key, value, effect = taint.get("key"), taint.get("value", ""), taint.get("effect")
    if not isinstance(key, str) or not is_label_name(key):
        problems.append(f"taint key {key!r} is not a label name")
    if not isinstance(value, str) or (value and not is_label_value(value)):
        problems.append(f"taint value {value!r} is not a label value")
    if effect not in TAINT_EFFECTS:
        problems.append(f"taint effect {effect!r} is not one of {TAINT_EFFECTS}")
    return problems


def device_problems(device: Mapping[str, Any]) -> list[str]:
    """Every rule the rendered ``device`` breaks (empty: the server would accept it)."""
    problems: list[str] = []
    name = device.get("name")
    if not isinstance(name, str) or not is_dns_label(name):
        problems.append(f"device name {name!r} is not a DNS label")
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        problems.append(
            f"{len(attributes)} attributes + {len(capacity)} capacities > "
            f"{MAX_ATTRIBUTES_AND_CAPACITIES}"
        )
    for key, value in attributes.items():
        problems += attribute_problems(key, value)
    for key in capacity:
        if not is_qualified_name(key):
            problems.append(f"capacity name {key!r} is not [domain/]identifier (≤ 32)")
    if set(attributes) & set(capacity):
        problems.append("an attribute and a capacity share a name")
    taints = device.get("taints") or []
    if len(taints) > MAX_TAINTS_PER_DEVICE:
        problems.append(f"{len(taints)} taints > {MAX_TAINTS_PER_DEVICE}")
    for taint in taints:
        problems += taint_problems(taint)
    return problems


def slice_limit(devices: Sequence[Mapping[str, Any]]) -> int:
    """How many of these devices one slice may hold."""
    heavy = any(d.get("taints") or d.get("consumesCounters") for d in devices)
    return MAX_DEVICES_PER_SLICE_TAINTED if heavy else MAX_DEVICES_PER_SLICE
