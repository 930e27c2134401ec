from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulet_common import subjects


def test_node_name_with_dots_is_one_token() -> None:
    subject = subjects.health("gpu-node-1.us-east-1.compute.internal")
    assert subject == "gpu.health.gpu-node-1_us-east-1_compute_internal"
    assert len(subject.split(".")) == 3


@pytest.mark.parametrize("name", ["node*", "node>", "a b", "x\ty", "dots.and*stars>", "_", "~"])
def test_wildcards_and_whitespace_never_reach_a_subject(name: str) -> None:
    tok = subjects.token(name)
    assert not set(tok) & set("*> \t\r\n.")
    assert subjects.untoken(tok) == name


def test_health_subjects_match_the_alerting_wildcard() -> None:
    for node in ["n1", "a.b.c", "weird*name>"]:
        tokens = subjects.health(node).split(".")
        assert tokens[:2] == ["gpu", "health"]
        assert len(tokens) == 3  # exactly what `gpu.health.*` matches


def test_empty_token_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        subjects.token("")


@given(st.text(min_size=1, max_size=64))
def test_token_is_injective_and_safe(name: str) -> None:
    tok = subjects.token(name)
    assert all(c.isascii() and (c.isalnum() or c in "-_~") for c in tok)
    assert subjects.untoken(tok) == name


def test_distinct_nodes_get_distinct_subjects() -> None:
    assert subjects.health("a.b") != subjects.health("a_b")
