"""A ResourceClaim from the API server decoded totally: only ClaimError, whatever comes."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulet_allocator.kubelet.dra.claims import ClaimError, devices_of

UID = "0b7c3f52-8d7e-4d7c-9c55-3c2f7d9b1a00"
KW: dict[str, str] = {
    "uid": UID,
    "namespace": "ns",
    "name": "c",
    "driver": "gpu.gpulet.io",
    "pool": "node-a",
}


def claim(*results: Any, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"uid": UID, "namespace": "ns", "name": "c", **meta},
        "status": {"allocation": {"devices": {"results": list(results)}}},
    }


def ours(device: str = "gpu-0", **extra: Any) -> dict[str, Any]:
    return {"request": "r", "driver": "gpu.gpulet.io", "pool": "node-a", "device": device, **extra}


def test_the_same_device_for_two_requests_is_one_device() -> None:
    got = devices_of(claim(ours(request="a"), ours(request="b/sub")), **KW)
    assert [(d.device, d.requests) for d in got] == [("gpu-0", ("a", "b"))]


def test_shares_carry_cores_and_memory() -> None:
    (got,) = devices_of(
        claim(ours(shareID="s", consumedCapacity={"cores": "30", "memory": "20Gi"})), **KW
    )
    assert (got.cores, got.memory_bytes, got.share_id) == (30, 20 * 1024**3, "s")


@pytest.mark.parametrize(
    ("result", "needle"),
    [
        (ours(device="GPU_0"), "no valid device"),
        (ours(request=""), "no request"),
        (ours(consumedCapacity={"cores": "101"}), "cores"),
        (ours(consumedCapacity={"cores": "1.5"}), "cores"),
        (ours(consumedCapacity={"memory": "-1"}), "memory"),
        (ours(consumedCapacity=[]), "consumedCapacity"),
        ({**ours(), "pool": "node-b"}, "pool"),
        ("nope", "not an object"),
    ],
)
def test_each_bad_result_is_named(result: Any, needle: str) -> None:
    with pytest.raises(ClaimError, match=needle):
        devices_of(claim(result), **KW)


def test_a_claim_of_another_uid_or_name_is_refused() -> None:
    with pytest.raises(ClaimError, match="has UID"):
        devices_of(claim(ours(), uid="other"), **KW)
    with pytest.raises(ClaimError, match="another claim"):
        devices_of(claim(ours(), name="other"), **KW)
    with pytest.raises(ClaimError, match="not allocated"):
        devices_of({"metadata": {"uid": UID, "namespace": "ns", "name": "c"}}, **KW)
    with pytest.raises(ClaimError, match="malformed"):
        devices_of(claim(*[ours(f"gpu-{i}") for i in range(129)]), **KW)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(JSON)
@settings(max_examples=200, deadline=None)
def test_any_json_is_a_claim_error_at_worst(body: Any) -> None:
    with contextlib.suppress(ClaimError):
        devices_of(body, **KW)


@given(
    st.dictionaries(
        st.sampled_from(["request", "driver", "pool", "device", "shareID", "consumedCapacity"]),
        JSON,
    )
)
@settings(max_examples=200, deadline=None)
def test_any_result_is_a_claim_error_at_worst(result: dict[str, Any]) -> None:
    with contextlib.suppress(ClaimError):
        devices_of(claim({**ours(), **result}), **KW)
