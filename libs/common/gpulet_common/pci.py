"""PCI bus ids in the two forms gpulet writes, from one parser.

NVML reports ``00000000:3B:00.0`` (an 8-digit domain, upper case); sysfs, koordlet and
Kubernetes' standard ``resource.kubernetes.io/pciBusID`` attribute write
``0000:3b:00.0`` (4 digits, lower case). Some tools leave the domain out
(``3b:00.0``: domain 0). :func:`split_bus_id` reads any of them; :func:`nvml_bus_id`
and :func:`sysfs_bus_id` write each form. Anything else is not a bus id (None), and
each caller says what it does then.
"""

from __future__ import annotations


def split_bus_id(bus_id: str) -> tuple[int, str] | None:
    """(domain, ``bus:device.function`` in lower case), or None when it is not a bus id."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 2:
        domain, rest = "0", ":".join(parts)
    elif len(parts) == 3:
        domain, rest = parts[0], f"{parts[1]}:{parts[2]}"
    else:
        return None
    try:
        return int(domain, 16), rest
    except ValueError:
        return None


def nvml_bus_id(bus_id: str) -> str | None:
    """NVML's canonical form ``00000000:3B:00.0``, or None."""
    parsed = split_bus_id(bus_id)
    return f"{parsed[0]:08X}:{parsed[1].upper()}" if parsed is not None else None


def sysfs_bus_id(bus_id: str) -> str | None:
    """The form sysfs and Kubernetes write, ``0000:3b:00.0``, or None."""
    parsed = split_bus_id(bus_id)
    return f"{parsed[0]:04x}:{parsed[1]}" if parsed is not None else None
