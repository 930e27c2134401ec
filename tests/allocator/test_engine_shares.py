"""gpu-manager units and best-fit share packing (pure functions)."""

from __future__ import annotations

import pytest

from gpulet_allocator.decide.engine.shares import CardFree, classify_cores, format_units, pick_share
from gpulet_allocator.protocol import MEMORY_UNIT_BYTES, memory_units
from gpulet_common.refusal import Refused


def card(uuid: str, index: int, cores: int = 100, mem: int = 64, total: int = 64) -> CardFree:
    return CardFree(uuid=uuid, index=index, cores_free=cores, memory_free=mem, memory_total=total)


def test_memory_units_are_256_mib() -> None:
    assert MEMORY_UNIT_BYTES == 256 * 1024 * 1024
    assert memory_units(16 * 1024**3) == 64
    assert memory_units(80 * 1024**3) == 320
    assert memory_units(MEMORY_UNIT_BYTES - 1) == 0
    assert format_units(40) == "40 units (10 GiB)"


@pytest.mark.parametrize(
    ("cores", "kind", "count"),
    [
        (1, "share", 1),
        (50, "share", 1),
        (99, "share", 1),
        (100, "whole", 1),
        (200, "whole", 2),
        (800, "whole", 8),
    ],
)
def test_classify_cores(cores: int, kind: str, count: int) -> None:
    req = classify_cores(cores)
    assert (req.kind, req.count) == (kind, count)


def test_classify_refuses_150_with_the_exact_message() -> None:
    with pytest.raises(Refused) as err:
        classify_cores(150)
    assert err.value.code == "invalid_core_units"
    assert err.value.message == (
        "core units must be below 100 (a share) or a multiple of 100 (whole cards), got 150"
    )


@pytest.mark.parametrize("cores", [0, -1, -100])
def test_classify_refuses_non_positive(cores: int) -> None:
    with pytest.raises(Refused) as err:
        classify_cores(cores)
    assert err.value.code == "invalid_core_units"
    assert str(cores) in err.value.message


def test_best_fit_takes_the_card_with_the_fewest_free_cores() -> None:
    cards = [card("a", 0, cores=100), card("b", 1, cores=60), card("c", 2, cores=30)]
    assert pick_share(cards, 20, 4).uuid == "c"
    assert pick_share(cards, 40, 4).uuid == "b"
    assert pick_share(cards, 70, 4).uuid == "a"


def test_best_fit_needs_both_cores_and_memory() -> None:
    cards = [card("a", 0, cores=30, mem=2), card("b", 1, cores=50, mem=40)]
    assert pick_share(cards, 20, 4).uuid == "b"


def test_best_fit_ties_break_on_memory_then_index() -> None:
    cards = [
        card("a", 0, cores=50, mem=40),
        card("b", 1, cores=50, mem=10),
        card("c", 2, cores=50, mem=10),
    ]
    assert pick_share(cards, 10, 8).uuid == "b"


def test_rank_orders_untouched_cards_only() -> None:
    cards = [card("a", 0), card("b", 1), card("c", 2, cores=90)]
    assert pick_share(cards, 10, 1).uuid == "c"  # a touched card always first
    assert pick_share(cards, 95, 1, rank={"b": 0, "a": 1}).uuid == "b"
    assert pick_share(cards, 95, 1).uuid == "a"


def test_a_card_never_goes_past_100_cores_or_its_memory() -> None:
    with pytest.raises(Refused) as err:
        pick_share([card("a", 0, cores=40, mem=64)], 50, 1)
    assert err.value.code == "insufficient_capacity"
    assert "50 core units" in err.value.message
    with pytest.raises(Refused) as err:
        pick_share([card("a", 0, cores=100, mem=3)], 50, 4)
    assert err.value.code == "insufficient_capacity"


def test_share_errors() -> None:
    cards = [card("GPU-a", 0, total=64), card("GPU-b", 1, total=96, mem=96)]
    with pytest.raises(Refused) as err:
        pick_share(cards, 120, 1)
    assert err.value.code == "too_many_units"
    assert "120 core units" in err.value.message

    with pytest.raises(Refused) as err:
        pick_share(cards, 50, 97)
    assert err.value.code == "memory_exceeds_card"
    assert err.value.message == (
        "the share asks for 97 units (24.25 GiB) of memory but the largest card, GPU-b, "
        "has 96 units (24 GiB)"
    )

    with pytest.raises(Refused) as err:
        pick_share(cards, 50, 0)
    assert err.value.code == "invalid_request"

    with pytest.raises(Refused) as err:
        pick_share(cards, 0, 1)
    assert err.value.code == "invalid_core_units"

    with pytest.raises(Refused) as err:
        pick_share([], 10, 1)
    assert err.value.code == "insufficient_capacity"
