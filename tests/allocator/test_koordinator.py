"""The pure parts of the koord-scheduler handshake: the annotation parser, the pod view
and the rule that finds the pod a kubelet call belongs to (no network)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulet_allocator.decide.koordinator import (
    ANNOTATION_DEVICE_ALLOCATED,
    Decision,
    GpuEntry,
    InvalidDecision,
    PodBook,
    parse_decision,
    parse_quantity,
    watched_pod,
)

GPU = "nvidia.com/gpu"
CORE = "koordinator.sh/gpu-core"
RATIO = "koordinator.sh/gpu-memory-ratio"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("100", 100),
        (30, 30),
        ("81251Mi", 81251 * 2**20),
        ("80Gi", 80 * 2**30),
        ("1.5Gi", 3 * 2**29),
        ("2k", 2000),
        ("500m", 1),
        ("0.5", 1),
        ("lots", None),
        ("", None),
        (True, None),
        (None, None),
        ("1" * 100, None),
    ],
)
def test_quantities_parse_like_kubernetes(text: Any, value: int | None) -> None:
    assert parse_quantity(text) == value


def test_the_documented_decision_parses() -> None:
    text = json.dumps(
        {
            "gpu": [
                {
                    "minor": 1,
                    "resources": {
                        CORE: "100",
                        "koordinator.sh/gpu-memory": "81251Mi",
                        RATIO: "100",
                    },
                }
            ],
            "rdma": [{"minor": 0, "resources": {"koordinator.sh/rdma": "1"}}],
        }
    )
    decision = parse_decision(text)
    assert decision == Decision(
        gpus=(GpuEntry(minor=1, core=100, memory_ratio=100, memory_bytes=81251 * 2**20),)
    )
    share = parse_decision(json.dumps({"gpu": [{"minor": 3, "resources": {CORE: 30, RATIO: 25}}]}))
    assert isinstance(share, Decision)
    [entry] = share.gpus
    assert not entry.whole
    assert entry.memory_of(80 * 2**30) == 20 * 2**30
    assert parse_decision(json.dumps({"rdma": []})) is None
    assert parse_decision(None) is None
    # Present but deciding nothing is not "no decision" (issue 23): it is refused.
    for empty in ('{"gpu": []}', '{"gpu": null}'):
        refused = parse_decision(empty)
        assert isinstance(refused, InvalidDecision)
        assert "decides no GPU" in refused.problem


@given(st.one_of(st.text(max_size=200), st.binary(max_size=200).map(repr)))
@settings(max_examples=300, deadline=None)
def test_any_text_parses_to_a_decision_or_a_reason(text: str) -> None:
    result = parse_decision(text)
    assert result is None or isinstance(result, Decision | InvalidDecision)
    if isinstance(result, InvalidDecision):
        assert result.problem.startswith(ANNOTATION_DEVICE_ALLOCATED)
        assert len(result.problem) < 300


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(st.dictionaries(st.sampled_from(["gpu", "rdma", "x"]), json_values, max_size=3))
@settings(max_examples=300, deadline=None)
def test_any_json_parses_to_a_decision_or_a_reason(doc: dict[str, Any]) -> None:
    result = parse_decision(json.dumps(doc))
    assert result is None or isinstance(result, Decision | InvalidDecision)


@given(json_values)
@settings(max_examples=300, deadline=None)
def test_any_object_is_a_pod_or_nothing(obj: Any) -> None:
    pod = watched_pod(obj)
    assert pod is None or pod.key.name


def pod(
    name: str,
    at: float,
    counts: dict[str, int],
    annotation: str | None,
    *,
    phase: str = "Pending",
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ml",
        "uid": f"uid-{name}",
        "creationTimestamp": "2026-01-01T00:00:00Z",
    }
    if annotation is not None:
        meta["annotations"] = {ANNOTATION_DEVICE_ALLOCATED: annotation}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:10:00Z"
    stamp = f"2026-01-01T00:00:{int(at):02d}Z"
    return {
        "metadata": meta,
        "spec": {
            "nodeName": "n",
            "containers": [
                {"name": "side", "resources": {}},
                {"name": "main", "resources": {"limits": {k: str(v) for k, v in counts.items()}}},
            ],
        },
        "status": {
            "phase": phase,
            "conditions": [{"type": "PodScheduled", "lastTransitionTime": stamp}],
        },
    }


def book_of(*objects: dict[str, Any]) -> PodBook:
    book = PodBook("n")
    for obj in objects:
        parsed = watched_pod(obj)
        assert parsed is not None
        book.upsert(parsed)
    return book


def minors(text: str) -> str:
    return json.dumps({"gpu": [{"minor": int(m)} for m in text.split(",")]})


def test_the_oldest_binding_with_a_matching_request_is_found() -> None:
    book = book_of(
        pod("newer", 9, {GPU: 1}, minors("7")),
        pod("older", 3, {GPU: 1}, minors("0")),
        pod("two", 1, {GPU: 2}, minors("1,2")),
        pod("running", 0, {GPU: 1}, minors("3"), phase="Running"),
        pod("leaving", 0, {GPU: 1}, minors("4"), deleting=True),
        pod("plain", 0, {GPU: 1}, None),
    )
    claim = book.find(GPU, 1)
    assert claim is not None
    assert str(claim.pod) == "ml/older"
    assert claim.container == "main"
    assert claim.container_index == 1
    assert [e.minor for e in claim.gpus] == [0]
    book.mark(claim, "alloc-1")
    claim = book.find(GPU, 1)
    assert claim is not None
    assert str(claim.pod) == "ml/newer"
    two = book.find(GPU, 2)
    assert two is not None
    assert [e.minor for e in two.gpus] == [1, 2]
    assert book.find(GPU, 3) is None
    # Kubelet's IDs that are exactly a decision name that pod, older ones aside.
    claim = book.find(GPU, 1, minor_of={"GPU-a": 7}, device_ids=["GPU-a"])
    assert claim is not None
    assert str(claim.pod) == "ml/newer"
    book.remove("uid-newer")
    assert book.find(GPU, 1) is None


def test_an_invalid_decision_is_found_with_its_reason() -> None:
    book = book_of(pod("bad", 1, {GPU: 1}, "{oops"))
    claim = book.find(GPU, 1)
    assert claim is not None
    assert "not JSON" in claim.problem
    assert claim.gpus == ()


def test_a_decision_shorter_than_the_request_is_a_problem() -> None:
    book = book_of(pod("short", 1, {GPU: 2}, minors("1")))
    claim = book.find(GPU, 2)
    assert claim is not None
    assert "decides 1 GPUs" in claim.problem


def test_share_containers_take_one_entry_and_know_their_other_half() -> None:
    text = json.dumps({"gpu": [{"minor": 3, "resources": {CORE: "30", RATIO: "25"}}]})
    book = book_of(pod("infer", 1, {CORE: 30, RATIO: 25}, text))
    claim = book.find(RATIO, 25)
    assert claim is not None
    assert [e.minor for e in claim.gpus] == [3]
    assert claim.share_resources == (CORE, RATIO)
    book.mark(claim, "share-1")
    core_claim = book.find(CORE, 30)
    assert core_claim is not None
    assert book.allocation_of(core_claim, RATIO) == "share-1"


def test_replace_all_forgets_pods_and_their_marks() -> None:
    book = book_of(pod("a", 1, {GPU: 1}, minors("0")))
    claim = book.find(GPU, 1)
    assert claim is not None
    book.mark(claim, "x")
    book.replace_all([])
    assert book.synced
    assert book.pods == {}
    assert book.allocated == {}
