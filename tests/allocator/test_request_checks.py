"""Checks that hold across a request, not only within one container (issue 23, finding 7).

Kubelet gives a device to one container at a time. One Allocate naming a GPU in two
containers, and a repeated device-ID set that the pod watch says belongs to another
pod, are refused by the allocator's record -- kubelet does not send these today.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpulet_allocator.decide.core import AllocatorCore
from gpulet_allocator.decide.koordinator import (
    ANNOTATION_DEVICE_ALLOCATED,
    PodBook,
    PodKey,
    watched_pod,
)
from gpulet_common.messages import Inventory
from gpulet_common.refusal import Refused
from gpulet_common.settings.allocator import ResourceNames
from support import reference

GPU, CORE = "nvidia.com/gpu", "gpulet.io/gpu-core"
GIB = 1024**3


def two_cards() -> Inventory:
    return reference.inventory_from_matrix("n", [[0, 10], [10, 0]], memory_bytes=16 * GIB)


def make_core(book: PodBook | None = None) -> tuple[AllocatorCore, list[tuple[PodKey, str]]]:
    refusals: list[tuple[PodKey, str]] = []
    core = AllocatorCore(
        node="n",
        names=ResourceNames(),
        book=book,
        on_refusal=lambda pod, message: refusals.append((pod, message)),
    )
    core.update_inventory(two_cards())
    return core, refusals


def uuids(core: AllocatorCore) -> list[str]:
    return [d.uuid for d in core.ledger.devices()]


@pytest.mark.parametrize(
    "containers",
    [
        lambda u: [[u[0]], [u[0]]],
        lambda u: [[u[0], u[1]], [u[1], u[0]]],
        lambda u: [[u[0]], [u[1], u[0]]],
    ],
)
def test_one_request_naming_a_gpu_in_two_containers_is_refused(containers: Any) -> None:
    core, _ = make_core()
    with pytest.raises(Refused) as err:
        core.allocate(GPU, containers(uuids(core)))
    assert err.value.code == "invalid_request"
    assert "containers 0 and 1" in err.value.message
    assert core.ledger.count() == 0
    assert core.allocation_views() == []


def test_one_request_naming_a_share_unit_in_two_containers_is_refused() -> None:
    core, _ = make_core()
    u = uuids(core)[0]
    first = [f"{u}::core-{n}" for n in range(10)]
    second = [f"{u}::core-{n}" for n in range(5, 15)]
    with pytest.raises(Refused) as err:
        core.allocate(CORE, [first, second])
    assert err.value.code == "invalid_request"
    assert core.ledger.count() == 0


def pending_pod(name: str, second: int, minor: int) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": f"uid-{name}",
            "annotations": {ANNOTATION_DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": minor}]})},
        },
        "spec": {
            "nodeName": "n",
            "containers": [{"name": "main", "resources": {"limits": {GPU: "1"}}}],
        },
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "lastTransitionTime": f"2026-01-01T00:00:{second:02d}Z"}
            ],
        },
    }


def test_a_repeated_set_for_another_pod_is_already_held_not_a_retry() -> None:
    book = PodBook("n")
    core, refusals = make_core(book)
    u = uuids(core)
    minor0 = next(g.minor if g.minor is not None else g.index for g in two_cards().gpus)
    first = watched_pod(pending_pod("first", 1, minor0))
    assert first is not None
    book.upsert(first)
    [answer], _ = core.allocate(GPU, [[u[0]]])
    # Kubelet's retry of the same call gets the same answer.
    [again], _ = core.allocate(GPU, [[u[0]]])
    assert again == answer
    assert refusals == []

    # Another pod the scheduler (wrongly) decided the same card for: kubelet's same
    # IDs are not a retry of the first pod's call.
    second = watched_pod(pending_pod("second", 2, minor0))
    assert second is not None
    book.upsert(second)
    with pytest.raises(Refused) as err:
        core.allocate(GPU, [[u[0]]])
    assert err.value.code == "scheduler_decision"
    assert "already held" in err.value.message
    assert "ml/first" in err.value.message
    assert [str(pod) for pod, _ in refusals] == ["ml/second"]
    [view] = core.allocation_views()
    assert [g.pod for g in view.grants] == ["ml/first"]
