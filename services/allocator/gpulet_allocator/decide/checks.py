"""What a request must be before anything is decided: its device IDs, checked whole.

Kubelet's IDs are hostile input like any other: each container's IDs must be of the
call's resource, of this node, not repeated; and a device goes to one container, so a
request naming one in two containers is refused (issue 23: one grant key would have
answered both). A share's preference is checked the way the engine checks a whole one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from gpulet_allocator.decide.books import Books
from gpulet_allocator.protocol import (
    CORES_PER_GPU,
    PreferredRequest,
    ResourceKind,
    memory_units,
    parse_device_id,
)
from gpulet_allocator.state.records import GrantKind
from gpulet_common.refusal import Refused


def check_across(containers: Sequence[Sequence[str]]) -> None:
    """Kubelet gives a device to one container: a request naming one in two is refused
    (checked per container, a repeated set would read as a retry of the first)."""
    seen: dict[str, int] = {}
    for n, ids in enumerate(containers):
        for device_id in ids:
            first = seen.setdefault(device_id, n)
            if first != n:
                raise Refused(
                    "invalid_request",
                    f"device {device_id[:100]!r} is named by containers {first} and {n} of "
                    "one request; a device goes to one container",
                )


def check_ids(books: Books, resource: str, kind: GrantKind, ids: list[str], n: int) -> None:
    """One container's IDs: present, unique, of ``resource`` and of this node."""
    if not ids:
        raise Refused("invalid_request", f"container {n} asks for no {resource} device")
    if len(set(ids)) != len(ids):
        # Counted in one pass: ids.count() per ID was quadratic, so one hostile
        # request of 20,000 IDs held the event loop (every endpoint) for seconds.
        dupes = sorted(i for i, count in Counter(ids).items() if count > 1)
        raise Refused("invalid_request", f"duplicate device IDs: {', '.join(dupes[:5])}")
    bad: list[str] = []
    unknown_gpus: set[str] = set()
    expected = ResourceKind(kind)
    for device_id in ids:
        try:
            parsed = parse_device_id(device_id)
        except ValueError:
            bad.append(device_id)
            continue
        if parsed.kind is ResourceKind.REPLICA and expected is ResourceKind.WHOLE:
            # A time-slicing replica: known only while offered or held.
            if not books.known_gpu(device_id):
                bad.append(device_id)
            continue
        if parsed.kind is not expected:
            bad.append(device_id)
            continue
        if not books.known_gpu(parsed.gpu_uuid):
            unknown_gpus.add(parsed.gpu_uuid)
        elif parsed.unit is not None and not _unit_exists(
            books, parsed.gpu_uuid, kind, parsed.unit
        ):
            bad.append(device_id)
    if bad:
        shown = ", ".join(repr(b) for b in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise Refused("unknown_device", f"not {resource} device IDs of this node: {shown}{more}")
    if unknown_gpus:
        raise Refused("unknown_device", f"unknown GPU IDs: {', '.join(sorted(unknown_gpus))}")


def _unit_exists(books: Books, uuid: str, kind: GrantKind, unit: int) -> bool:
    if kind in ("core", "ratio"):
        return unit < CORES_PER_GPU
    info = books.gpus.get(uuid)
    # A lost GPU's size is unknown; kubelet no longer lists its units anyway.
    return info is None or unit < memory_units(info.memory_total_bytes)


def preferred_share(request: PreferredRequest) -> list[str]:
    """Shares are placed by Allocate itself, so any IDs will do, but the answer must be
    one kubelet can use: exactly ``size`` of the offered IDs, must-include among them.
    Slicing alone answered a size of -1 with all IDs but the last and a must-include that
    was never offered with itself, so a malformed request is refused like a whole-GPU
    one (the same checks and messages as the engine's ``whole._validate``)."""
    available = list(dict.fromkeys(request.available))
    must = list(dict.fromkeys(request.must_include))
    if request.size <= 0:
        raise Refused("invalid_request", f"the request size must be positive, got {request.size}")
    offered = set(available)
    missing = [i for i in must if i not in offered]
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise Refused("invalid_request", f"must-include IDs are not available: {shown}")
    if len(must) > request.size:
        raise Refused(
            "invalid_request",
            f"must-include lists {len(must)} IDs but the request is for {request.size}",
        )
    if request.size > len(available):
        raise Refused(
            "too_many_units",
            f"asks {request.size} units but only {len(available)} are available",
        )
    return list(dict.fromkeys([*must, *available]))[: request.size]
